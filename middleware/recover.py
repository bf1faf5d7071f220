"""Recover: an unexpected exception from a middleware fails its message, never the worker."""

from __future__ import annotations

import logging
from typing import Any

from keyedconsumer import Message, RetryLater, SkipMessage

from ._kind import around

__all__ = ["Recover"]

log = logging.getLogger("keyedconsumer.middleware")


class Recover:
    """Turn any ``Exception`` escaping the handlers inside it into ``msg.ack_fail(error)``.

    Place it first (outermost). The message then ends ``FAIL`` and follows the engine's error path
    (``error_handler``, or stop naming the message); the worker goes on either way. Control-flow
    exceptions (``RetryLater``, ``SkipMessage``) and ``BaseException``s that are not ``Exception``
    (``KeyboardInterrupt``, ``SystemExit``) pass through.
    """

    #: It acts on a message's end only, so it can wrap each message of a batch handler's batch.
    outcome_only = True

    def __call__(self, handler: Any) -> Any:
        return around(handler, None, self._after)

    @staticmethod
    def _after(msg: Message, exc: BaseException | None, _state: Any) -> None:
        if exc is None:
            return
        if isinstance(exc, (RetryLater, SkipMessage)) or not isinstance(exc, Exception):
            raise exc
        log.warning("recovered %s from %r", type(exc).__name__, msg)
        msg.ack_fail(exc)
