"""Decoders for :class:`~keyedconsumer.middleware.Typed`: bytes of a key or value in, an object out.

A decoder is any object with ``decode(data, *, msg, field)`` (the :class:`Decoder` protocol). When
the bytes are not valid for it, it raises :class:`UndecodableError`, which ``Typed`` turns into a
:class:`~keyedconsumer.middleware.DecodeError` naming the record; the record is then dead-lettered
(or stops the consumer) and never retried. When what a decoder needs does not answer (a schema
registry), that is not about the record either: it raises
:class:`~keyedconsumer.middleware.unavailable.Unavailable` (made by
:func:`~keyedconsumer.middleware.unavailable.wait_on`) and the record waits, not failed; such a
decoder also has ``unavailable() -> list[str]``, the reasons records wait now (for health). Any other
exception a decoder raises goes the ordinary failure path, so :class:`~keyedconsumer.middleware.Retry`
retries it.

Decoders here: :class:`Json` (JSON into a pydantic model; what ``Typed(Model)`` uses) and
:class:`Text` (UTF-8, for keys). Confluent Schema Registry payloads (Avro, Protobuf, JSON Schema)
are in :mod:`keyedconsumer.middleware.schema_registry` (extra ``keyedconsumer[schema-registry]``).
"""

from __future__ import annotations

from typing import Any, Generic, Literal, Protocol, TypeVar

from pydantic import BaseModel, ValidationError

from keyedconsumer import Message

__all__ = ["Decoder", "Field", "UndecodableError", "Json", "Text", "validation_errors"]

T_co = TypeVar("T_co", covariant=True)
M = TypeVar("M", bound=BaseModel)

#: Which part of the record a decoder is given.
Field = Literal["key", "value"]


class UndecodableError(ValueError):
    """The bytes are not valid for the decoder: a permanent property of the record.

    Parameters
    ----------
    reason:
        One line saying what is wrong (``not Confluent wire format: magic byte 0x7b``).
    errors:
        Structured errors, each a ``dict`` with ``loc`` (a list of path parts), ``msg`` and
        ``type``; defaults to one error made of ``reason``. They reach the dead-letter header
        ``kafka_dlt-validation-errors``.
    """

    def __init__(self, reason: str, errors: list[dict[str, Any]] | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.errors: list[dict[str, Any]] = (
            errors if errors is not None else [{"loc": [], "msg": reason, "type": "undecodable"}]
        )


class Decoder(Protocol[T_co]):
    """Turns the bytes of a record's key or value into an object of type ``T_co``.

    A decoder may also have a ``name`` attribute (``Order``, ``avro``), which error messages show
    (``... as Order: ...``); without one they show its class name.
    """

    def decode(self, data: bytes, *, msg: Message, field: Field) -> T_co:
        """Decode ``data`` (never ``None``: null keys and tombstones are not decoded).

        Raises
        ------
        UndecodableError
            ``data`` is not valid for this decoder.
        """
        ...


def validation_errors(exc: ValidationError) -> list[dict[str, Any]]:
    """pydantic's errors as plain dicts (``loc``, ``msg``, ``type``), without the input itself."""
    return [
        {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
        for e in exc.errors(include_input=False, include_url=False)
    ]


def first_error(errors: list[dict[str, Any]]) -> str:
    """``cents: Input should be a valid integer``: the first error with the field it concerns."""
    if not errors:
        return "invalid"
    loc = ".".join(str(part) for part in errors[0].get("loc", ()))
    msg = str(errors[0].get("msg", ""))
    return f"{loc}: {msg}" if loc else msg


class Json(Generic[M]):
    """JSON bytes into the pydantic model ``model`` (``model.model_validate_json``).

    Parameters
    ----------
    model:
        A pydantic model class.

    Raises
    ------
    TypeError
        ``model`` is not a pydantic model class.
    """

    def __init__(self, model: type[M]) -> None:
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise TypeError(f"Json needs a pydantic model class, got {model!r}")
        self.model = model
        self.name = model.__name__

    def decode(self, data: bytes, *, msg: Message, field: Field) -> M:
        """Raises :class:`UndecodableError` with pydantic's errors (bad JSON, schema violations)."""
        try:
            return self.model.model_validate_json(data)
        except ValidationError as exc:
            errors = validation_errors(exc)
            raise UndecodableError(first_error(errors), errors) from exc


class Text:
    """UTF-8 bytes into ``str`` (for keys).

    Raises :class:`UndecodableError` on bytes that are not UTF-8.
    """

    name = "str"

    def decode(self, data: bytes, *, msg: Message, field: Field) -> str:
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UndecodableError(
                f"not UTF-8: {exc.reason} at byte {exc.start}",
                [
                    {
                        "loc": [],
                        "msg": f"not UTF-8: {exc.reason} at byte {exc.start}",
                        "type": "unicode_decode",
                    }
                ],
            ) from exc
