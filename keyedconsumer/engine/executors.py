"""Where handlers run: a pool of threads for plain functions, worker coroutines for ``async def``.

Both take chunks of ready lane heads from the :class:`~keyedconsumer.engine.dispatcher.Dispatcher`,
run at most ``concurrency`` handlers at once, settle each end (:class:`~.settle.Settler`) and report
the chunk's outcomes with ``Dispatcher.finish_many``. Neither blocks the poll thread.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from ..errors import HandlerContractError, HandlerContractViolation
from ..message import Message
from .delivery import Delivery
from .dispatcher import Dispatcher, Slot
from .outcome import NOT_STARTED, Outcome

__all__ = ["ThreadExecutor", "AsyncExecutor", "Executor", "not_awaited"]

#: ``settle(msg, exception_or_None) -> Outcome`` (:class:`~.settle.Settler`).
Settle = Callable[[Message, "BaseException | None"], Outcome]
clock = time.perf_counter


def new_event_loop(kind: str = "auto") -> asyncio.AbstractEventLoop:
    """A new event loop for the executor's own thread (``ConsumerConfig.event_loop``): uvloop's
    for ``"uvloop"``, and for ``"auto"`` when uvloop is installed (the ``keyedconsumer[uvloop]``
    extra); else asyncio's.

    Raises
    ------
    ImportError
        ``kind="uvloop"`` and uvloop is not installed.
    """
    if kind != "asyncio":
        try:
            import uvloop
        except ImportError:
            if kind == "uvloop":
                raise
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def _cancelling() -> bool:
    """True when the current task itself is being cancelled (Python 3.11+ knows; before, assume so)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return True if cancelling is None else bool(cancelling())


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


class Executor:
    def start(self) -> None: ...
    def join(self, timeout_s: float) -> None: ...


class ThreadExecutor(Executor):
    """Run a plain-function handler on ``concurrency`` threads."""

    def __init__(
        self, d: Dispatcher, handler: Callable[[Message], Any], settle: Settle, concurrency: int
    ) -> None:
        self._d = d
        self._handler = handler
        self._settle = settle
        self._threads = [
            threading.Thread(target=self._work, name=f"keyedconsumer-worker-{i}", daemon=True)
            for i in range(concurrency)
        ]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def join(self, timeout_s: float) -> None:
        """Wait for the threads up to ``timeout_s`` in all (hung handlers' threads are daemons)."""
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def _work(self) -> None:
        d = self._d
        handler = self._handler
        settle = self._settle
        finish_many = d.finish_many
        may_start = d.may_start
        slot = Slot()
        d.register(slot)
        while True:
            chunk = d.wait_chunk()
            if chunk is None:
                return
            while chunk:
                # Run the chunk one message at a time; report it under one dispatcher lock at the
                # end. The slot lets the poll thread take back what this worker has not started
                # and report what it finished if one handler runs long (Dispatcher.rescue).
                slot.load(chunk)
                t0 = clock()
                done: tuple[Delivery, Outcome] | None = None
                while True:
                    dl = slot.next(done)
                    if dl is None:
                        break
                    if not may_start(dl):
                        done = (dl, NOT_STARTED)
                        continue
                    msg = dl.msg
                    try:
                        result = handler(msg)
                    except BaseException as exc:  # a handler's exception concerns its message only
                        done = (dl, settle(msg, exc))
                    else:
                        if result is not None and inspect.isawaitable(result):  # nothing awaits it
                            done = (dl, settle(msg, not_awaited(msg, result)))
                        else:
                            done = (dl, settle(msg, None))
                chunk = finish_many(slot.unload(), clock() - t0)


class AsyncExecutor(Executor):
    """Run an ``async def`` handler as ``concurrency`` worker coroutines on one event loop.

    Parameters
    ----------
    loop:
        The loop to run on (``run_async`` passes the caller's); ``None`` starts a private loop in a
        thread of its own, of the ``event_loop`` kind (:func:`new_event_loop`).
    """

    def __init__(
        self,
        d: Dispatcher,
        handler: Callable[[Message], Awaitable[Any]],
        settle: Settle,
        concurrency: int,
        loop: asyncio.AbstractEventLoop | None = None,
        event_loop: str = "auto",
    ) -> None:
        self._d = d
        self._handler = handler
        self._settle = settle
        self._concurrency = concurrency
        self._own_loop = loop is None
        self._loop = loop or new_event_loop(event_loop)
        self._steps = 0  # chunks run so far by all the workers (see _work)
        self._loop_thread_id: int | None = None
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._wake_pending = False
        self._thread: threading.Thread | None = None
        self._done: Any = None
        d.on_ready(self._wake)

    def start(self) -> None:
        if self._own_loop:
            self._thread = threading.Thread(target=self._run_loop, name="keyedconsumer-asyncio", daemon=True)
            self._thread.start()
        else:
            self._done = asyncio.run_coroutine_threadsafe(self._main(), self._loop)

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
        finally:
            self._loop.close()

    async def _main(self) -> None:
        self._loop_thread_id = threading.get_ident()
        await asyncio.gather(*(self._work() for _ in range(self._concurrency)))

    def join(self, timeout_s: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)
        elif self._done is not None:
            try:
                self._done.result(timeout_s)
            except Exception:  # timed out or cancelled: the loop owner ends it
                pass

    # -- waking (called with d.lock held) ---------------------------------------------------------

    def _wake(self, n: int) -> None:
        if not self._waiters:
            return
        if threading.get_ident() == self._loop_thread_id:
            self._release(self._d.wakes_for(n))
        elif not self._wake_pending:
            self._wake_pending = True
            try:
                self._loop.call_soon_threadsafe(self._wake_from_other_thread)
            except RuntimeError:  # loop closed
                pass

    def _wake_from_other_thread(self) -> None:
        d = self._d
        with d.lock:
            self._wake_pending = False
            self._release(d.wakes_for(d.ready_count()) if not d.is_closed else len(self._waiters))

    def _release(self, n: int) -> None:
        waiters = self._waiters
        while n > 0 and waiters:
            fut = waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                n -= 1

    # -- the worker -------------------------------------------------------------------------------

    async def _work(self) -> None:
        d = self._d
        handler = self._handler
        settle = self._settle
        finish_many = d.finish_many
        may_start = d.may_start
        loop = self._loop
        slot = Slot()
        d.register(slot)
        while True:
            with d.lock:
                if d.has_ready():
                    chunk: list[Delivery] | None = d.take_locked()
                elif d.is_closed:
                    return
                else:
                    chunk = None
                    fut: asyncio.Future[None] = loop.create_future()
                    self._waiters.append(fut)
            if chunk is None:
                await fut
                continue
            while chunk:
                slot.load(chunk)
                t0 = clock()
                steps = self._steps
                done: tuple[Delivery, Outcome] | None = None
                while True:
                    dl = slot.next(done)
                    if dl is None:
                        break
                    if not may_start(dl):
                        done = (dl, NOT_STARTED)
                        continue
                    msg = dl.msg
                    try:
                        result = await handler(msg)
                    except asyncio.CancelledError as exc:
                        if not _cancelling():
                            # the handler raised CancelledError itself (e.g. it awaited something
                            # that was cancelled): a failure of its message like any other
                            done = (dl, settle(msg, exc))
                            continue
                        # this worker is being cancelled (the loop is going away): the message and
                        # the rest of the chunk are not done; they are delivered again later
                        results = slot.abandon((dl, NOT_STARTED))
                        rest = finish_many(results, clock() - t0)
                        while rest:
                            rest = finish_many([(r, NOT_STARTED) for r in rest], 0.0)
                        raise
                    except BaseException as exc:  # a handler's exception concerns its message only
                        done = (dl, settle(msg, exc))
                    else:
                        if result is not None and inspect.isawaitable(result):  # returned, not awaited
                            done = (dl, settle(msg, not_awaited(msg, result)))
                        else:
                            done = (dl, settle(msg, None))
                results = slot.unload()
                chunk = finish_many(results, clock() - t0)
                # Handlers that never await must not starve the loop (the poll wake-ups, the
                # caller's tasks): yield after a chunk (about CHUNK_QUANTUM_S of handler time) unless
                # another worker ran a chunk meanwhile, which it could only do while this one was
                # suspended in an await, when the loop also ran what else was ready.
                self._steps += 1
                if self._steps == steps + 1:
                    await asyncio.sleep(0)
