"""The handler chain: the user's handler wrapped in its middleware, and the handler contract.

:func:`compose` wraps the handler, the first middleware given being the outermost (xkafka's order);
:class:`Contract` checks, right where the user's plain handler returns (inside every middleware),
that it did not return an awaitable nothing would await (a forgotten ``async def``).
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import HandlerContractError, HandlerContractViolation
from ..message import Message

if TYPE_CHECKING:
    from ..config import ConsumerConfig
    from ..kafka import PublisherFactory

__all__ = [
    "Handler",
    "Middleware",
    "ErrorHandler",
    "compose",
    "bind",
    "BIND_HOOK",
    "check_handler",
    "PUBLISHERS_HOOK",
    "check_error_handler",
    "is_async",
    "Contract",
    "not_awaited",
]

#: A handler: ``def handle(msg) -> None`` or ``async def handle(msg) -> None``.
Handler = Callable[[Message], None] | Callable[[Message], Awaitable[None]]
#: A middleware takes a handler and returns a handler of the same kind (sync or async).
Middleware = Callable[[Any], Any]
#: ``error_handler(error, message_or_None)``; returning normally marks the failure handled.
ErrorHandler = Callable[[BaseException, Message | None], Any]


#: The optional middleware hook: ``middleware.bind_settings(settings: ConsumerConfig) -> None``.
BIND_HOOK = "bind_settings"
#: The optional middleware hook ``middleware.bind_publishers(factory: PublisherFactory | None) -> None``:
#: where the middleware's producers come from (``None``: the real ``Publisher``); called before
#: ``bind_settings``.
PUBLISHERS_HOOK = "bind_publishers"


def bind(
    middlewares: Sequence[Middleware], settings: ConsumerConfig, publishers: PublisherFactory | None = None
) -> None:
    """Give each middleware that has a ``bind_publishers`` method the consumer's publisher factory
    (``publishers``; ``None``: the real ``Publisher``), then each that has a ``bind_settings`` method the consumer's
    settings, middleware by middleware, outermost first, before :func:`compose` wraps the handler
    (``KeyedConsumer`` calls it once, when built).

    A middleware uses them to take what it must not ask the user to repeat, e.g. ``DeadLetter()``
    builds its producer with the consumer's factory (the in-memory broker's under
    ``keyedconsumer.testing``) from the consumer's brokers and connection properties. A middleware
    may be bound by several consumers (one instance in several routes of a ``KeyedApp``). Classes
    and non-middleware entries are left to :func:`compose`, which refuses them.

    Raises
    ------
    Exception
        Whatever a hook raises (``DeadLetter``: ``ValueError``, ``PublishError``), unchanged.
    """
    if isinstance(middlewares, (str, bytes)) or not hasattr(middlewares, "__iter__"):
        return  # compose() says what is wrong
    for mw in middlewares:
        if isinstance(mw, type):
            continue
        factory_hook = getattr(mw, PUBLISHERS_HOOK, None)
        if callable(factory_hook):
            factory_hook(publishers)
        hook = getattr(mw, BIND_HOOK, None)
        if callable(hook):
            hook(settings)


def compose(handler: Handler, middlewares: Sequence[Middleware]) -> Handler:
    """Wrap ``handler`` in ``middlewares``; the first given is the outermost (xkafka order).

    Raises
    ------
    TypeError
        ``handler`` is not callable; ``middlewares`` is not a list; one of them is not callable, is
        a class passed instead of an instance (``[Retry]`` for ``[Retry(...)]``; a class whose
        constructor takes the handler is a middleware), or returned something not callable.
    """
    if not callable(handler):
        raise TypeError(f"handler must be callable, got {type(handler).__name__}")
    if isinstance(middlewares, (str, bytes)) or callable(middlewares) or not hasattr(middlewares, "__iter__"):
        raise TypeError(
            f"middlewares must be a list of middleware, e.g. [Retry(...)], got {type(middlewares).__name__}"
        )
    chain = list(middlewares)
    for i, mw in enumerate(chain):
        if isinstance(mw, type) and not _takes_one_argument(mw):
            raise TypeError(_class_given(i, mw))
        if not callable(mw):
            raise TypeError(
                f"middlewares[{i}] is a {type(mw).__name__}, not a middleware: a middleware is a callable "
                "that takes a handler and returns one, e.g. Retry(...)"
            )
    wrapped: Any = handler
    for i in reversed(range(len(chain))):
        mw = chain[i]
        try:
            wrapped = mw(wrapped)
        except TypeError as exc:
            if isinstance(mw, type):  # e.g. Typed, whose constructor wants a model, not the handler
                raise TypeError(_class_given(i, mw)) from exc
            raise
        if not callable(wrapped):
            raise TypeError(f"middleware {mw!r} returned a non-callable {type(wrapped).__name__}")
    return wrapped  # type: ignore[no-any-return]


def _class_given(i: int, cls: type) -> str:
    name = cls.__name__
    return f"middlewares[{i}] is the class {name}: pass an instance, e.g. {name}(...)"


def _takes_one_argument(fn: Any) -> bool:
    """True when ``fn(x)`` binds (or the signature cannot be read)."""
    try:
        inspect.signature(fn).bind(None)
    except TypeError:
        return False
    except ValueError:  # no signature to read
        return True
    return True


def check_handler(handler: Any, *, batch: bool = False) -> None:
    """Raise ``TypeError`` unless ``handler`` can be called as ``handler(message)`` (``batch``:
    ``handler(messages)``, one list): checked when the handler is registered, not at the first
    message. A handler whose signature cannot be read (some builtins) is trusted.

    Every middleware calls the handler it wraps with the one message (the handler contract); a
    middleware that called it with more arguments would break it.
    """
    what, arg = ("batch_handler", "messages") if batch else ("handler", "message")
    if not callable(handler):
        raise TypeError(f"{what} must be callable, got a {type(handler).__name__}")
    try:
        signature = inspect.signature(handler)
    except (TypeError, ValueError):  # no signature to read: trust it
        return
    try:
        signature.bind(None)
    except TypeError:
        name = getattr(handler, "__name__", None) or type(handler).__name__
        shown = signature.replace(return_annotation=inspect.Signature.empty)
        shape = "msgs: list[Message]" if batch else "msg: Message"
        raise TypeError(
            f"{what} {name}{shown} cannot be called as {what}({arg}): it takes the {arg} as its one "
            f"argument, e.g. `def {name if name.isidentifier() else 'handle'}({shape}) -> None` "
            "(or `async def`)"
        ) from None


def check_error_handler(error_handler: Any) -> None:
    """Raise ``TypeError`` unless ``error_handler`` is ``None`` or a plain callable taking
    ``(error, message)``."""
    if error_handler is None:
        return
    if isinstance(error_handler, type):
        name = error_handler.__name__
        raise TypeError(
            f"error_handler is the class {name}: pass an instance, e.g. {name}(...), "
            "or a function `def on_error(error, message) -> None`"
        )
    if not callable(error_handler):
        raise TypeError(
            f"error_handler must be callable as error_handler(error, message), got a {type(error_handler).__name__}"
        )
    if is_async(error_handler):
        raise TypeError(
            "error_handler must be a plain function: the engine calls it and does not await it, so an "
            "async def one would never run (and every failure would count as handled)"
        )
    try:
        signature = inspect.signature(error_handler)
    except (TypeError, ValueError):  # no signature to read (some builtins): trust it
        return
    try:
        signature.bind(None, None)
    except TypeError:
        raise TypeError(
            f"error_handler{signature} cannot be called as error_handler(error, message): write "
            "`def on_error(error: BaseException, message: Message | None) -> None`"
        ) from None


def is_async(fn: Any) -> bool:
    """True for ``async def`` functions and for objects whose ``__call__`` is ``async def``."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


class Contract:
    """The plain handler checked where it returns: an awaitable result is closed, recorded and
    raised as :class:`~keyedconsumer.errors.HandlerContractViolation` (a ``BaseException``, which
    ``Retry``, ``DeadLetter`` and ``Recover`` let through). :meth:`broken` then tells the settling
    step, whatever a middleware made of it."""

    def __init__(self) -> None:
        self._broken: dict[Message, HandlerContractError] = {}
        #: Whether a run broke the contract since the last :meth:`clear` (read on the hot path).
        self.any = False

    def wrap(self, handler: Any) -> Any:
        """``handler`` checked, when it is a plain callable; an ``async def`` one as it is."""
        if not callable(handler) or is_async(handler):
            return handler
        broken = self._broken

        def checked(msg: Message) -> Any:
            result = handler(msg)
            if result is not None and inspect.isawaitable(result):
                violation = not_awaited(msg, result)
                broken[msg] = violation.error
                self.any = True
                raise violation
            return result

        return checked

    def broken(self, msg: Message) -> HandlerContractError | None:
        """The contract error recorded for ``msg``, if any."""
        return self._broken.get(msg) if self._broken else None

    def clear(self) -> None:
        self._broken.clear()
        self.any = False

    def __bool__(self) -> bool:
        """True once a run broke the contract (until :meth:`clear`)."""
        return bool(self._broken)


def not_awaited(msg: Message, result: object) -> HandlerContractViolation:
    """The violation of a handler that returned the awaitable ``result`` for ``msg``; a coroutine
    (or anything with a ``close()``) is closed first, so it never warns "never awaited"."""
    close = getattr(result, "close", None)
    if callable(close):
        try:
            close()
        except Exception:  # closing is a courtesy: the error below is what matters
            pass
    return HandlerContractViolation(
        HandlerContractError(msg.topic, msg.partition, msg.offset, type(result).__name__)
    )
