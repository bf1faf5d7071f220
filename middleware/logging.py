"""Logging: one structured record per message through the standard ``logging`` module."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from keyedconsumer import Message, RetryLater, SkipMessage

from ._kind import around

__all__ = ["Logging", "outcome_of"]


def outcome_of(msg: Message, exc: BaseException | None) -> str:
    """``SUCCESS``, ``SKIP``, ``FAIL``, ``RETRY``, ``DEAD_LETTERED`` or ``CANCELLED`` (the engine
    cancelled the run: its event loop is going away; the message runs again) for a handler that
    ended."""
    if exc is None:
        if msg.state.get("dead_lettered"):
            return "DEAD_LETTERED"
        return "SUCCESS" if msg.status.value == "PENDING" else msg.status.value
    if isinstance(exc, RetryLater):
        return "RETRY"
    if isinstance(exc, SkipMessage):
        return "SKIP"
    if isinstance(exc, asyncio.CancelledError):
        return "CANCELLED"
    return "FAIL"


def _key_text(key: bytes | None, limit: int = 64) -> str | None:
    if key is None:
        return None
    text = key[:limit].decode("utf-8", "backslashreplace")
    return text + "..." if len(key) > limit else text


class Logging:
    """Log one record per message: key, topic, partition, offset, attempt, duration, outcome.

    The fields are in the message text (``key=value``) and, for JSON formatters, in the record's
    ``keyedconsumer`` attribute (a dict). Values and headers are never logged, nor is any
    configuration, so no secret reaches the log. Keys are shown as text, invalid UTF-8 escaped,
    at most 64 bytes.

    Parameters
    ----------
    logger:
        Where to log (default ``logging.getLogger("keyedconsumer.messages")``).
    level, failure_level:
        Levels for successful outcomes and for ``FAIL`` / ``RETRY`` / ``DEAD_LETTERED``.
    """

    def __init__(
        self,
        *,
        logger: logging.Logger | None = None,
        level: int = logging.INFO,
        failure_level: int = logging.WARNING,
    ) -> None:
        self.logger = logger or logging.getLogger("keyedconsumer.messages")
        self.level = level
        self.failure_level = failure_level

    def _log(self, msg: Message, exc: BaseException | None, t0: float) -> None:
        outcome = outcome_of(msg, exc)
        level = self.level if outcome in ("SUCCESS", "SKIP") else self.failure_level
        if not self.logger.isEnabledFor(level):
            return
        fields = {
            "key": _key_text(msg.key),
            "topic": msg.topic,
            "partition": msg.partition,
            "offset": msg.offset,
            "attempt": msg.attempt,
            "duration_ms": round((time.perf_counter() - t0) * 1000, 3),
            "outcome": outcome,
        }
        if exc is not None and outcome != "SKIP":
            cause = exc.__cause__ if isinstance(exc, RetryLater) and exc.__cause__ is not None else exc
            fields["error"] = f"{type(cause).__name__}: {cause}"[:500]
            if isinstance(exc, RetryLater):
                fields["retry_in_s"] = round(exc.delay_s, 3)
        text = " ".join(f"{k}={v}" for k, v in fields.items())
        self.logger.log(level, "message %s", text, extra={"keyedconsumer": fields})

    def __call__(self, handler: Any) -> Any:
        return around(handler, lambda _msg: time.perf_counter(), self._after)

    def _after(self, msg: Message, exc: BaseException | None, t0: float) -> None:
        self._log(msg, exc, t0)
        if exc is not None:
            raise exc
