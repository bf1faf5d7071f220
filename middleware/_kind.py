"""Sync or async: a middleware returns a handler of the same kind as the one it wraps.

Most middleware is a pair of hooks around the handler; :func:`around` builds the sync or the async
wrapper from them, so each middleware is written once for both kinds.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

from keyedconsumer import Message, RetryLater, SkipMessage, Status

__all__ = ["is_async", "around", "failure_of"]

#: ``before(msg) -> state``, called before the handler.
Before = Callable[[Message], Any]
#: ``after(msg, exc_or_None, state)``, called after it. Returning normally means the message's
#: outcome is settled (``exc`` handled); raising replaces or re-raises the handler's exception.
After = Callable[[Message, "BaseException | None", Any], None]


def is_async(handler: Any) -> bool:
    """True for ``async def`` handlers (functions or objects with an ``async def __call__``)."""
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(type(handler).__call__)


def around(handler: Any, before: Before | None, after: After, *, blocking_after: bool = False) -> Any:
    """Wrap ``handler`` in ``before`` / ``after`` hooks, keeping its kind (sync or async).

    ``blocking_after``: ``after`` may block (network I/O); for async handlers it then runs in a
    worker thread (``asyncio.to_thread``) so the event loop is not held.
    """
    if is_async(handler):

        async def wrapped_async(msg: Message) -> None:
            state = before(msg) if before is not None else None
            try:
                await handler(msg)
            except BaseException as exc:
                error: BaseException | None = exc
            else:
                error = None
            if blocking_after:
                await asyncio.to_thread(after, msg, error, state)
            else:
                after(msg, error, state)

        return wrapped_async

    def wrapped(msg: Message) -> None:
        state = before(msg) if before is not None else None
        try:
            handler(msg)
        except BaseException as exc:
            error: BaseException | None = exc
        else:
            error = None
        after(msg, error, state)

    return wrapped


def failure_of(msg: Message, exc: BaseException | None) -> Exception | None:
    """The failure a handler ended with: ``exc``, or the error given to ``msg.ack_fail``; ``None``
    when it did not fail. Control flow (``RetryLater``, ``SkipMessage``) and ``BaseException``s
    that are not ``Exception`` (``SystemExit``, ``KeyboardInterrupt``) are re-raised untouched."""
    if exc is None:
        if msg.status is not Status.FAIL or msg.error is None:
            return None
        exc = msg.error
    if isinstance(exc, (RetryLater, SkipMessage)) or not isinstance(exc, Exception):
        raise exc
    return exc
