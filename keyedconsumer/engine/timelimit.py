"""Per-message time limits of the user's handler (``handler_timeout_s``), and cancellations the
framework causes.

How an attempt past its limit ends, however it ends (returned, raised, swallowed the cancellation):

- ``async def`` handlers are **cancelled** at the limit. The attempt then fails with
  :class:`~keyedconsumer.errors.HandlerTimeoutError` (counted in :attr:`TimeLimit.overruns`), also
  when the handler turned the cancellation into another exception or swallowed it; retry and
  dead-letter middleware handle it like any failure (the limit wraps the user's handler, inside
  every middleware).
- Plain handlers **cannot be interrupted** (Python has no safe way to stop a thread): one watchdog
  thread notices a run past its limit, logs it once and counts it in :attr:`TimeLimit.overrunning`
  (health turns not-ready while one overruns); when the handler returns or raises at last, its
  attempt fails with ``HandlerTimeoutError`` all the same. Make such handlers bound their own I/O.
- A batch call past its limit fails every message of the batch with ``HandlerTimeoutError``, even
  one it acknowledged or named in :class:`~keyedconsumer.BatchFailed`.

**No overlap with the key's next run.** A key's next run (its retry, or its next message) starts
only after the attempt's end is settled, so it waits for the attempt's real end: a plain handler's
worker is in it until it returns; an ``async def`` attempt's end is settled only after the threads
it started through the event loop's default executor (``asyncio.to_thread``,
``loop.run_in_executor(None, ...)``) have ended (the engine's loop tracks them:
:class:`TrackingExecutor`). Threads a handler starts otherwise (its own executor or thread) are
its own to bound.

**A cancellation the framework caused** (the time limit, or the workers' event loop going away at a
stop) that the handler turns into another exception (``except CancelledError: raise
RuntimeError(...)``) is not the message's failure: the limit's becomes ``HandlerTimeoutError``; any
other is re-raised as ``CancelledError``, which retry and dead-letter middleware let through and the
engine counts as not started (the message runs again; its offset is not stored).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..errors import HandlerTimeoutError
from ..message import Message
from .handler import is_async

__all__ = ["TimeLimit", "TrackingExecutor", "Attempt"]

log = logging.getLogger("keyedconsumer")


class Attempt:
    """The threads an ``async def`` attempt started through the event loop's default executor."""

    __slots__ = ("_lock", "_running", "_idle")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        self._idle: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def started(self) -> None:
        with self._lock:
            self._running += 1

    def ended(self, _: object = None) -> None:
        """(A pool thread.) One of its threads ended."""
        with self._lock:
            self._running -= 1
            waiters = self._idle if self._running == 0 else []
            if waiters:
                self._idle = []
        for loop, fut in waiters:
            loop.call_soon_threadsafe(_resolve, fut)

    async def threads_ended(self) -> None:
        """Wait until none of its threads runs."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._running == 0:
                return
            fut: asyncio.Future[None] = loop.create_future()
            self._idle.append((loop, fut))
        await fut


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


#: The attempt a task runs now (set by the time limit around an ``async def`` handler's call).
_ATTEMPT: contextvars.ContextVar[Attempt | None] = contextvars.ContextVar(
    "keyedconsumer_attempt", default=None
)


class TrackingExecutor(ThreadPoolExecutor):
    """The default executor of the workers' event loop: a ``ThreadPoolExecutor`` that counts, per
    handler attempt, the threads the attempt started (``asyncio.to_thread`` and
    ``run_in_executor(None, ...)`` submit from the attempt's task, whose context names it)."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        attempt = _ATTEMPT.get()
        fut = super().submit(fn, *args, **kwargs)
        if attempt is not None:
            attempt.started()
            fut.add_done_callback(attempt.ended)
        return fut


def install_tracking_executor(loop: asyncio.AbstractEventLoop) -> None:
    """Make a :class:`TrackingExecutor` the default executor of ``loop``, unless one was set (the
    caller's own loop keeps its own: threads its attempts start are then not waited for)."""
    if getattr(loop, "_default_executor", None) is None:
        loop.set_default_executor(TrackingExecutor(thread_name_prefix="keyedconsumer-to-thread"))


class TimeLimit:
    """The time limit of each handler run, and what overran it.

    Parameters
    ----------
    limit_s:
        Seconds a handler run may take (> 0), or ``None``: no limit (plain handlers are returned
        unchanged; ``async def`` ones still get the cancellation guard, see the module docstring).
    """

    def __init__(self, limit_s: float | None) -> None:
        self.limit_s = limit_s
        #: Runs that exceeded the limit so far (cancelled, overran, however they ended).
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
        limit is of one call, the whole batch; past it every message of the batch fails with
        ``HandlerTimeoutError``."""
        return self._wrap(handler, _batch)

    def _count(self) -> None:
        with self._lock:
            self.overruns += 1

    def _wrap(self, handler: Any, what: Callable[[Any], str]) -> Any:
        limit = self.limit_s
        if is_async(handler):
            return self._wrap_async(handler, what)
        if limit is None:
            return handler

        def limited(arg: Any) -> Any:
            token = id(arg)
            start = time.monotonic()
            with self._lock:
                self._running[token] = (start + limit, arg, what)
                self._ensure_watchdog()
            try:
                result = handler(arg)
            except BaseException as exc:
                took = time.monotonic() - start
                if took > limit:  # however it ended: past its limit
                    self._count()
                    raise HandlerTimeoutError(_overran(what(arg), took, limit)) from exc
                raise
            finally:
                with self._lock:
                    self._running.pop(token, None)
                    self._reported.discard(token)
            took = time.monotonic() - start
            if took > limit:
                self._count()
                raise HandlerTimeoutError(_overran(what(arg), took, limit))
            return result

        return limited

    def _wrap_async(self, handler: Any, what: Callable[[Any], str]) -> Any:
        limit = self.limit_s
        if limit is None:

            async def cancellable(arg: Any) -> Any:
                try:
                    return await handler(arg)
                except BaseException as exc:
                    if not isinstance(exc, asyncio.CancelledError) and _cancelling(asyncio.current_task()):
                        raise asyncio.CancelledError() from exc  # see the module docstring
                    raise

            return cancellable

        async def guarded(arg: Any) -> Any:
            task = asyncio.current_task()
            loop = asyncio.get_running_loop()
            expired = False

            def expire() -> None:
                nonlocal expired
                expired = True
                if task is not None:
                    task.cancel()

            timer = loop.call_later(limit, expire)
            attempt = Attempt()
            token = _ATTEMPT.set(attempt)
            start = time.monotonic()
            try:
                result = await handler(arg)
            except BaseException as exc:
                if expired:
                    await self._timed_out(task, attempt)
                    raise HandlerTimeoutError(
                        f"{what(arg)} ran past handler_timeout_s={limit:g} s: cancelled"
                    ) from exc
                if not isinstance(exc, asyncio.CancelledError) and _cancelling(task):
                    # the framework cancels this attempt (its event loop is going away): whatever
                    # the handler made of the cancellation, it is not the message's failure
                    raise asyncio.CancelledError() from exc
                raise
            finally:
                timer.cancel()
                _ATTEMPT.reset(token)
            if expired or time.monotonic() - start > limit:
                # it swallowed the cancellation and returned, or it ran past the limit anyway
                await self._timed_out(task, attempt if expired else None)
                raise HandlerTimeoutError(
                    f"{what(arg)} ran {time.monotonic() - start:.3f} s, past handler_timeout_s={limit:g} s "
                    "(it did not end when cancelled)"
                )
            return result

        return guarded

    async def _timed_out(self, task: asyncio.Task[Any] | None, attempt: Attempt | None) -> None:
        """The limit cancelled ``task``'s attempt: the cancellation is taken back (the task goes on)
        and the attempt's threads are waited for, so its end is settled only after its real end."""
        self._count()
        uncancel = getattr(task, "uncancel", None)
        if uncancel is not None and _cancelling(task):
            uncancel()
        if attempt is not None:
            await attempt.threads_ended()

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


def _cancelling(task: asyncio.Task[Any] | None) -> bool:
    """Whether ``task`` is being cancelled (Python 3.11+ knows; before: assume not)."""
    cancelling = getattr(task, "cancelling", None)
    return bool(cancelling()) if cancelling is not None else False


def _overran(name: str, took: float, limit: float) -> str:
    return (
        f"{name} ran {took:.3f} s, past handler_timeout_s={limit:g} s (a plain handler is not "
        "interrupted; its run counts as failed)"
    )


def _one(msg: Message) -> str:
    return f"handler of {msg.topic}[{msg.partition}]@{msg.offset}"


def _batch(msgs: list[Message]) -> str:
    first = msgs[0] if msgs else None
    where = f" (first {first.topic}[{first.partition}]@{first.offset})" if first is not None else ""
    return f"batch handler of {len(msgs)} message(s){where}"
