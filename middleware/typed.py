"""Typed payloads: decode each value into a pydantic model before the handler runs."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ValidationError

from keyedconsumer import Message, PermanentError

from ._kind import is_async

__all__ = ["Typed", "DecodeError"]

M = TypeVar("M", bound=BaseModel)


class DecodeError(PermanentError):
    """The value is not valid for the model (undecodable bytes, bad JSON, a schema violation).

    A :class:`~keyedconsumer.PermanentError`: never retried. ``validation_errors`` lists pydantic's
    errors (``loc``, ``msg``, ``type``; the input itself is left out). The message names the record
    (topic, partition, offset) and the first error with the field it concerns (``cents: Input
    should be a valid integer``), so the error that stops a consumer says which field was wrong.
    """

    def __init__(self, msg: Message, model: type[BaseModel], errors: list[dict[str, Any]]) -> None:
        self.validation_errors = errors
        first = "invalid"
        if errors:
            loc = ".".join(str(part) for part in errors[0]["loc"])
            first = f"{loc}: {errors[0]['msg']}" if loc else str(errors[0]["msg"])
        super().__init__(
            f"cannot decode topic={msg.topic} partition={msg.partition} offset={msg.offset} as "
            f"{model.__name__}: {len(errors)} error(s), first: {first}"
        )


class Typed(Generic[M]):
    """Decode ``msg.value`` (JSON) into ``model`` and put it in ``msg.payload``.

    A tombstone (``value=None``) reaches the handler with ``msg.payload = None``. Keys are never
    decoded, so a key that is not UTF-8 cannot fail here. A value that does not decode raises
    :class:`DecodeError` (not retried): with :class:`~keyedconsumer.middleware.DeadLetter` outside
    it, the record goes to the dead-letter topic with the validation errors in a header; without it
    the consumer stops, naming the topic, partition and offset.

    Parameters
    ----------
    model:
        A pydantic model class.
    """

    def __init__(self, model: type[M]) -> None:
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise TypeError(f"Typed needs a pydantic model class, got {model!r}")
        self.model = model

    def decode(self, msg: Message) -> M | None:
        """Decode one message's value. Raises :class:`DecodeError`."""
        if msg.value is None:
            return None
        try:
            return self.model.model_validate_json(msg.value)
        except ValidationError as exc:
            errors = [
                {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
                for e in exc.errors(include_input=False, include_url=False)
            ]
            raise DecodeError(msg, self.model, errors) from exc

    def __call__(self, handler: Any) -> Any:
        if is_async(handler):

            async def typed_async(msg: Message) -> None:
                msg.payload = self.decode(msg)
                await handler(msg)

            return typed_async

        def typed(msg: Message) -> None:
            msg.payload = self.decode(msg)
            handler(msg)

        return typed
