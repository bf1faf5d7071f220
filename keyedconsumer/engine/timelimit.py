"""Per-message time limits of the user's handler (``handler_timeout_s``).

- ``async def`` handlers are **cancelled** at the limit (``asyncio.wait_for``): the attempt fails
  with :class:`~keyedconsumer.errors.HandlerTimeoutError`, which retry and dead-letter middleware
  handle like any failure (the limit wraps the user's handler, inside every middleware).
- Plain handlers **cannot be interrupted** (Python has no safe way to stop a thread): one watchdog
  thread notices a run past its limit, logs it once and counts it in :attr:`TimeLimit.overrunning`
  (health turns not-ready while one overruns); when the handler returns at last, its attempt fails
  with ``HandlerTimeoutError`` all the same, whatever it did meanwhile. Make such handlers bound
  their own I/O (socket and client timeouts).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import HandlerTimeoutError
from ..message import Message
from .handler import is_async

__all__ = ["TimeLimit"]

log = logging.getLogger("keyedconsumer")


class TimeLimit:
    """The time limit of each handler run, and what overran it.

    Parameters
    ----------
    limit_s:
        Seconds a handler run may take (> 0), or ``None``: no limit (:meth:`wrap` returns the
        handler unchanged).
    """

    def __init__(self, limit_s: float | None) -> None:
        self.limit_s = limit_s
        #: Runs that exceeded the limit so far (cancelled or reported).
        self.overruns = 0
        self._lock = threading.Lock()
        # plain runs: id -> (deadline, message or batch, how to name it)
        self._running: dict[int, tuple[float, Any, Callable[[Any], str]]] = {}
        self._reported: set[int] = set()  # plain runs past their deadline, still running
        self._watchdog: threading.Thread | None = None

    @property
    def overrunning(self) -> int:
        """Plain handler runs past their limit that are still running now."""
        return len(self._reported)

    def wrap(self, handler: Any) -> Any:
        """``handler`` under the limit, of the same kind (sync or ``async def``)."""
        return self._wrap(handler, _one)

    def wrap_batch(self, handler: Any) -> Any:
        """A batch handler (``handler(msgs: list[Message])``) under the limit, of the same kind: the
        limit is of one call, the whole batch; at it every message of the batch fails with
        ``HandlerTimeoutError``."""
        return self._wrap(handler, _batch)

    def _wrap(self, handler: Any, what: Callable[[Any], str]) -> Any:
        limit = self.limit_s
        if limit is None:
            return handler
        if is_async(handler):

            async def limited_async(arg: Any) -> Any:
                try:
                    return await asyncio.wait_for(handler(arg), limit)
                except asyncio.TimeoutError:  # the builtin TimeoutError on Python 3.11+
                    with self._lock:
                        self.overruns += 1
                    raise HandlerTimeoutError(
                        f"{what(arg)} ran past handler_timeout_s={limit:g} s: cancelled"
                    ) from None

            return limited_async

        def limited(arg: Any) -> Any:
            token = id(arg)
            start = time.monotonic()
            with self._lock:
                self._running[token] = (start + limit, arg, what)
                self._ensure_watchdog()
            try:
                result = handler(arg)
            finally:
                with self._lock:
                    self._running.pop(token, None)
                    self._reported.discard(token)
            took = time.monotonic() - start
            if took > limit:
                with self._lock:
                    self.overruns += 1
                raise HandlerTimeoutError(
                    f"{what(arg)} ran {took:.3f} s, past "
                    f"handler_timeout_s={limit:g} s (a plain handler is not interrupted; its run counts as failed)"
                )
            return result

        return limited

    def _ensure_watchdog(self) -> None:
        if self._watchdog is None or not self._watchdog.is_alive():
            self._watchdog = threading.Thread(
                target=self._watch, name="keyedconsumer-time-limit", daemon=True
            )
            self._watchdog.start()

    def _watch(self) -> None:
        assert self.limit_s is not None
        tick = max(0.01, min(1.0, self.limit_s / 4))
        while True:
            with self._lock:
                if not self._running:
                    self._watchdog = None
                    return
                now = time.monotonic()
                late = [
                    (t, what(arg))
                    for t, (deadline, arg, what) in self._running.items()
                    if deadline <= now and t not in self._reported
                ]
                self._reported.update(t for t, _ in late)
            for _, name in late:
                log.warning(
                    "%s runs past handler_timeout_s=%g s (plain handlers cannot be interrupted; "
                    "health is not ready while it runs)",
                    name,
                    self.limit_s,
                )
            time.sleep(tick)


def _one(msg: Message) -> str:
    return f"handler of {msg.topic}[{msg.partition}]@{msg.offset}"


def _batch(msgs: list[Message]) -> str:
    first = msgs[0] if msgs else None
    where = f" (first {first.topic}[{first.partition}]@{first.offset})" if first is not None else ""
    return f"batch handler of {len(msgs)} message(s){where}"
