"""Typed payloads: decode each value (and, optionally, key) before the handler runs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

from pydantic import BaseModel

from keyedconsumer import Message, PermanentError

from ._kind import is_async
from .decoders import Decoder, Field, Json, UndecodableError, first_error

__all__ = ["Typed", "DecodeError"]

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")
if TYPE_CHECKING:
    from typing_extensions import TypeVar as _TypeVar

    V = _TypeVar("V", default=Any)
else:
    V = TypeVar("V")


class DecodeError(PermanentError):
    """The key or value is not valid for its decoder (undecodable bytes, bad JSON, a schema
    violation, a record not in Confluent wire format, a schema id the registry does not know).

    A :class:`~keyedconsumer.PermanentError`: never retried. ``validation_errors`` lists the errors
    (``loc``, ``msg``, ``type``; the input itself is left out), ``field`` is ``"value"`` or
    ``"key"``. The message names the record (topic, partition, offset) and the first error with the
    field it concerns (``cents: Input should be a valid integer``), so the error that stops a
    consumer says which field was wrong.

    Parameters
    ----------
    msg:
        The record.
    model:
        What it was decoded as: a class (its ``__name__`` is shown) or a name.
    errors:
        The errors, as above.
    field:
        ``"value"`` (the default) or ``"key"``.
    """

    def __init__(
        self, msg: Message, model: type[Any] | str, errors: list[dict[str, Any]], *, field: Field = "value"
    ) -> None:
        self.validation_errors = errors
        self.field: Field = field
        name = model if isinstance(model, str) else model.__name__
        what = "the key of " if field == "key" else ""
        super().__init__(
            f"cannot decode {what}topic={msg.topic} partition={msg.partition} offset={msg.offset} as "
            f"{name}: {len(errors)} error(s), first: {first_error(errors)}"
        )


def _decoder(spec: Any, role: str) -> Decoder[Any]:
    if isinstance(spec, type) and issubclass(spec, BaseModel):
        return Json(spec)
    if callable(getattr(spec, "decode", None)) and not isinstance(spec, type):
        return spec  # type: ignore[no-any-return]
    raise TypeError(
        f"Typed needs a pydantic model class or a decoder (an object with decode(data, *, msg, field)) "
        f"for the {role}, got {spec!r}"
    )


class Typed(Generic[V]):
    """Decode ``msg.value`` into ``msg.payload`` (and ``msg.key`` into ``msg.key_payload``).

    ``Typed(Order)`` decodes JSON into the pydantic model ``Order``; ``Typed(decoder)`` uses any
    :class:`~keyedconsumer.middleware.decoders.Decoder`, such as the schema-registry ones
    (``Typed(Avro(registry, model=Order))``, see :mod:`keyedconsumer.middleware.schema_registry`).
    The handler behind it may be annotated ``def handle(msg: Message[Order]) -> None``.

    A tombstone (``value=None``) reaches the handler with ``msg.payload = None``, and a null key
    with ``msg.key_payload = None``. Keys are decoded only when ``key`` is given (so by default a
    key that is not UTF-8 cannot fail here). A key or value that does not decode raises
    :class:`DecodeError` (not retried): with :class:`~keyedconsumer.middleware.DeadLetter` outside
    it, the record goes to the dead-letter topic with the errors in a header; without it the
    consumer stops, naming the topic, partition and offset. A decoder that cannot ask what it needs
    (a schema registry that does not answer) raises
    :class:`~keyedconsumer.middleware.unavailable.Unavailable`: the record waits, not failed (see
    :meth:`unavailable`); any other error of a decoder fails the message the ordinary way.

    Parameters
    ----------
    value:
        A pydantic model class (JSON) or a decoder for the value.
    key:
        ``None`` (keys are not decoded; the default), a pydantic model class (JSON), or a decoder,
        e.g. :class:`~keyedconsumer.middleware.decoders.Text` for UTF-8 keys.

    Raises
    ------
    TypeError
        ``value`` or ``key`` is neither a pydantic model class nor a decoder.
    """

    @overload
    def __init__(
        self: Typed[M], value: type[M], *, key: type[BaseModel] | Decoder[Any] | None = None
    ) -> None: ...

    @overload
    def __init__(
        self: Typed[V], value: Decoder[V], *, key: type[BaseModel] | Decoder[Any] | None = None
    ) -> None: ...

    def __init__(self, value: Any, *, key: Any = None) -> None:
        self.decoder: Decoder[V] = _decoder(value, "value")
        self.key_decoder: Decoder[Any] | None = None if key is None else _decoder(key, "key")
        #: the model class given, or ``None`` when a decoder was given
        self.model: type[BaseModel] | None = value if isinstance(value, type) else None

    def decode(self, msg: Message) -> V | None:
        """Decode one message's value (``None`` for a tombstone). Raises :class:`DecodeError`."""
        if msg.value is None:
            return None
        return self._run(self.decoder, msg.value, msg, "value")

    def decode_key(self, msg: Message) -> Any:
        """Decode one message's key (``None`` for a null key or without a key decoder).
        Raises :class:`DecodeError`."""
        if msg.key is None or self.key_decoder is None:
            return None
        return self._run(self.key_decoder, msg.key, msg, "key")

    def unavailable(self) -> list[str]:
        """Why records wait now for what the decoders need (a schema registry that does not
        answer), one reason each; ``[]`` when none waits. ``Health(consumer, dependencies=[typed])``
        is not ready while it is not empty."""
        reasons: list[str] = []
        for decoder in (self.decoder, self.key_decoder):
            ask = getattr(decoder, "unavailable", None)
            if callable(ask):
                reasons.extend(ask())
        return list(dict.fromkeys(reasons))  # a key and a value decoder of one registry: once

    @staticmethod
    def _run(decoder: Decoder[T], data: bytes, msg: Message, field: Field) -> T:
        try:
            return decoder.decode(data, msg=msg, field=field)
        except UndecodableError as exc:
            name = getattr(decoder, "name", None) or type(decoder).__name__
            raise DecodeError(msg, str(name), exc.errors, field=field) from exc

    def __call__(self, handler: Any) -> Any:
        if is_async(handler):

            async def typed_async(msg: Message) -> None:
                msg.key_payload = self.decode_key(msg)
                msg.payload = self.decode(msg)
                await handler(msg)

            return typed_async

        def typed(msg: Message) -> None:
            msg.key_payload = self.decode_key(msg)
            msg.payload = self.decode(msg)
            handler(msg)

        return typed
