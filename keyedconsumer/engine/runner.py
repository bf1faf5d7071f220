"""Running a unit of work: one way for every handler, plain or ``async def``, per message or batch.

A worker (:mod:`.workers`) hands a unit to its runner: a *chunk* of lane heads for a per-message
handler, run one after the other, or a *batch* for a batch handler (:mod:`.batch`), one call. Each
message is checked just before it starts (``may_start``: not stopping past the highest finished
offset, its partition still assigned, its key's lease still held) and each end is settled into an
outcome (:class:`~.settle.Settler`). A handler that *returns* an awaitable breaks the handler
contract (:func:`~.handler.not_awaited`), checked here in one place for all four faces.

:class:`Runner` and :class:`AsyncRunner` are the two thin faces of the same steps (httpx's
``Client`` and ``AsyncClient``): they differ only in awaiting the handler.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

from ..message import Message
from .batch import BatchRun, Settle, alone
from .delivery import Delivery
from .handler import not_awaited
from .outcome import NOT_STARTED, Outcome
from .workers import Results, Slot, Unit

__all__ = ["Runner", "AsyncRunner", "Settle"]

clock = time.perf_counter


def _returned(msg: Message, result: Any) -> BaseException | None:
    """What a handler's return value means: nothing (``None``), or the broken contract of a plain
    handler that returned an awaitable nothing would await."""
    if result is not None and inspect.isawaitable(result):
        return not_awaited(msg, result)
    return None


def _split(batch: Unit, may_start: Callable[[Delivery], bool]) -> tuple[list[Delivery], Results]:
    """The messages of ``batch`` that may start now, and the others as not started."""
    started: list[Delivery] = []
    not_started: Results = []
    for dl in batch:
        if may_start(dl):
            started.append(dl)
        else:
            not_started.append((dl, NOT_STARTED))
    return started, not_started


def _cancelling() -> bool:
    """True when the current task itself is being cancelled (Python 3.11+ knows; before, assume so)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return True if cancelling is None else bool(cancelling())


class Runner:
    """Runs units on a worker thread.

    Parameters
    ----------
    handler:
        The composed handler chain (``handler(msg)``), or with ``batch`` the batch handler.
    settle:
        ``settle(msg, exc) -> Outcome``.
    may_start:
        ``may_start(delivery) -> bool``, just before a message starts (the engine's, read only).
    batch:
        The batch handler's run (its per-message ends), or ``None`` for a per-message handler.
    """

    def __init__(
        self,
        handler: Callable[[Any], Any],
        settle: Settle,
        may_start: Callable[[Delivery], bool],
        batch: BatchRun | None = None,
    ) -> None:
        self._handler = handler
        self._settle = settle
        self._may_start = may_start
        self._batch = batch
        self.run = self._run_batch if batch is not None else self._run_chunk

    def _run_chunk(self, slot: Slot, chunk: Unit) -> tuple[Results, float]:
        handler, settle, may_start = self._handler, self._settle, self._may_start
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
                done = (dl, settle(msg, None if result is None else _returned(msg, result)))
        return slot.unload(), clock() - t0

    def _run_batch(self, slot: Slot, batch: Unit) -> tuple[Results, float]:
        run = self._batch
        assert run is not None
        started, results = _split(batch, self._may_start)
        if started:
            msgs = [dl.msg for dl in started]
            error: BaseException | None = None
            try:
                result = self._handler(msgs)
            except BaseException as exc:  # the batch's exception: its messages' ends
                error = exc
            else:
                error = _returned(msgs[0], result)
            together = run.ends(msgs, error)
            results.extend(alone(run.settle_sync(started, self._settle), together))
        return results, 0.0


class AsyncRunner:
    """Runs units on a worker coroutine (parameters as :class:`Runner`)."""

    def __init__(
        self,
        handler: Callable[[Any], Any],
        settle: Settle,
        may_start: Callable[[Delivery], bool],
        batch: BatchRun | None = None,
    ) -> None:
        self._handler = handler
        self._settle = settle
        self._may_start = may_start
        self._batch = batch
        self.run = self._run_batch if batch is not None else self._run_chunk

    async def _run_chunk(self, slot: Slot, chunk: Unit) -> tuple[Results, float]:
        handler, settle, may_start = self._handler, self._settle, self._may_start
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
                result = await handler(msg)
            except asyncio.CancelledError as exc:
                if not _cancelling():
                    # the handler raised CancelledError itself (e.g. it awaited something that was
                    # cancelled): a failure of its message like any other
                    done = (dl, settle(msg, exc))
                    continue
                slot.cancelled([(dl, NOT_STARTED)])  # the worker is cancelled: not done
                raise
            except BaseException as exc:  # a handler's exception concerns its message only
                done = (dl, settle(msg, exc))
            else:
                done = (dl, settle(msg, None if result is None else _returned(msg, result)))
        return slot.unload(), clock() - t0

    async def _run_batch(self, slot: Slot, batch: Unit) -> tuple[Results, float]:
        run = self._batch
        assert run is not None
        started, results = _split(batch, self._may_start)
        if started:
            msgs = [dl.msg for dl in started]
            error: BaseException | None = None
            try:
                await self._handler(msgs)
            except asyncio.CancelledError as exc:
                if _cancelling():
                    # the worker is cancelled (the loop is going away): nothing of the batch is done
                    slot.cancelled([*results, *((dl, NOT_STARTED) for dl in started)])
                    raise
                error = exc  # the handler raised it itself: a failure of its messages
            except BaseException as exc:  # the batch's exception: its messages' ends
                error = exc
            together = run.ends(msgs, error)
            results.extend(alone(await run.settle_async(started, self._settle), together))
        return results, 0.0
