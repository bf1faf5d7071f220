"""Workers and the owner's mailbox: how work leaves the owner thread and how its outcomes come back.

The owner (:mod:`.run`) hands *units* (a chunk of lane heads run one after the other, or one batch
handler call) to a pool of workers: threads for a plain handler (:class:`ThreadWorkers`, on one
shared queue of units), coroutines on an event loop for an ``async def`` one
(:class:`AsyncWorkers`, fed with one ``call_soon_threadsafe`` per hand-over). A worker runs a unit
(:mod:`.runner`) and posts its outcomes to the owner's :class:`Mailbox`, which the owner drains in
bulk. No worker touches the engine's state: outcomes travel one way, work the other (Confluent
Parallel Consumer's control loop and its ``workMailBox``; dramatiq's consumer thread and its acks
queue).

A chunk is loaded into the worker's :class:`Slot`, the one place a worker and the owner both reach:
if a handler runs long, the owner takes back the unstarted rest of the chunk and the outcomes not
reported yet (:meth:`Slot.take_back`), so a slow handler never holds other keys' messages or
finished offsets hostage. Each message and each outcome leaves its deque by one ``popleft``
(atomic in CPython), taken by the worker or by the owner, never by both.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from .delivery import Delivery
from .mailbox import Mailbox
from .outcome import NOT_STARTED, Done, Outcome
from .timelimit import install_tracking_executor

__all__ = [
    "Mailbox",
    "Slot",
    "ThreadWorkers",
    "AsyncWorkers",
    "Workers",
    "Unit",
    "Results",
    "RESCUE_AFTER_S",
    "new_event_loop",
]

_T = TypeVar("_T")

#: One piece of work: a chunk (run one message after the other) or a batch (one handler call).
Unit = list[Delivery]
#: What a unit ended with: ``[(delivery, outcome)]``.
Results = list[tuple[Delivery, Outcome]]
#: A worker in one handler for longer than this (seconds) gets its chunk's unstarted messages
#: taken back and its finished ones reported by the owner (:meth:`Slot.take_back`).
RESCUE_AFTER_S = 0.01


def _drain(q: deque[_T]) -> list[_T]:
    """Everything in ``q`` now, oldest first, each element by one atomic ``popleft`` (another
    thread may pop meanwhile: what it took is not here)."""
    out: list[_T] = []
    while q:
        try:
            out.append(q.popleft())
        except IndexError:
            break
    return out


class Slot:
    """What one worker holds of its chunk: the unstarted rest and the outcomes not reported yet.

    A chunk may carry a lane's run (:meth:`.engine.Engine.take`): a message taken along behind
    another (its :attr:`~.delivery.Delivery.follower`) runs only if that one ended done; else it is
    skipped, with no outcome (the owner, seeing the outcome that was not done, queues the run on its
    lane again), and so is the rest of the run."""

    __slots__ = ("todo", "results", "started_s", "_skip")

    def __init__(self) -> None:
        self.todo: deque[Delivery] = deque()
        self.results: deque[tuple[Delivery, Outcome]] = deque()
        self.started_s = 0.0  # when the running handler (or the chunk) started (monotonic seconds)
        self._skip: set[Delivery] = set()  # messages taken along behind one that did not end done

    def load(self, chunk: Unit) -> None:
        self.started_s = time.monotonic()
        self._skip.clear()
        self.todo.extend(chunk)

    def _record(self, done: tuple[Delivery, Outcome]) -> None:
        # the follower is read before the outcome is visible to the owner, which may then unlink it
        f = done[0].follower
        self.results.append(done)
        if f is not None and type(done[1]) is not Done:
            self._skip.add(f)

    def next(self, done: tuple[Delivery, Outcome] | None) -> Delivery | None:
        """Record the last message's outcome (if any) and take the next one, or ``None`` at the end
        of the chunk (or when the owner took the rest back)."""
        if done is not None:
            self._record(done)
        todo, skip = self.todo, self._skip
        while True:
            if not todo:
                return None
            try:
                d = todo.popleft()
            except IndexError:  # the owner took the rest meanwhile
                return None
            if skip and d in skip:  # the one before it in its lane did not end done
                skip.discard(d)
                if d.follower is not None:
                    skip.add(d.follower)
                continue
            self.started_s = time.monotonic()
            return d

    def cancelled(self, results: Results) -> None:
        """The worker is being cancelled: ``results`` (its messages not done) go with the outcomes
        :meth:`abandon` returns."""
        for done in results:
            self._record(done)

    def abandon(self) -> Results:
        """End the unit early (the worker is cancelled): the outcomes so far, and every unstarted
        message as not started (but those skipped, see the class docstring)."""
        results = _drain(self.results)
        skip = self._skip
        for d in _drain(self.todo):
            if d in skip:
                skip.discard(d)
            else:
                results.append((d, NOT_STARTED))
            if d.follower is not None:
                skip.add(d.follower)
        return results

    def unload(self) -> Results:
        """End the chunk: the outcomes not reported yet."""
        self._skip.clear()
        return _drain(self.results)

    def take_back(self, force: bool, now: float) -> tuple[list[Delivery], Results]:
        """(The owner.) The unstarted rest of a chunk stuck in one handler for more than
        ``RESCUE_AFTER_S`` (or any chunk with ``force``), and the outcomes not reported yet."""
        if not self.todo and not self.results:
            return [], []
        if not (force or now - self.started_s > RESCUE_AFTER_S):
            return [], []
        return _drain(self.todo), _drain(self.results)


#: ``run(slot, unit) -> (results, handler seconds)``: a worker thread runs a unit (:mod:`.runner`).
RunUnit = Callable[[Slot, Unit], tuple[Results, float]]
#: ``await run(slot, unit) -> (results, handler seconds)``: a worker coroutine runs a unit.
RunUnitAsync = Callable[[Slot, Unit], Awaitable[tuple[Results, float]]]
#: ``report((results, handler seconds))``, run in the owner thread (posted to its mailbox).
Report = Callable[[tuple[Results, float]], None]


class Workers:
    """What the owner needs of a pool (threads or coroutines)."""

    concurrency: int
    slots: list[Slot]
    _low: int = 0

    def start(self) -> None: ...
    def submit(self, units: list[Unit]) -> None: ...
    def take_queued(self) -> list[Unit]:
        """(The owner.) The units handed over that no worker has taken yet, oldest first: they
        are the owner's again."""
        raise NotImplementedError

    def close(self) -> None: ...
    def join(self, timeout_s: float) -> None: ...

    def set_reserve(self, units: int) -> None:
        """(The owner.) It keeps about ``units`` units queued ahead of the workers
        (:meth:`~.handout.HandOut.turn`): a worker that ends a unit rings the owner's bell when
        :func:`low_water` of them or fewer are left."""
        self._low = low_water(units)


def low_water(reserve: int) -> int:
    """A worker that ends a unit rings the owner's bell when no more than this many of the
    ``reserve`` units queued ahead of the workers are left (:class:`Mailbox`): a quarter, enough
    that the others keep busy while the owner wakes, drains and hands out more."""
    return reserve // 4


class ThreadWorkers(Workers):
    """``concurrency`` threads taking units from one shared queue, oldest handed over first.

    The units wait in a deque; a ``SimpleQueue`` of tokens (one a unit) wakes a waiting thread. A
    unit belongs to whoever pops it from the deque (``popleft`` is atomic): a thread, or the owner
    taking it back (:meth:`take_queued`); a thread woken by a token whose unit was taken back waits
    again."""

    def __init__(self, run: RunUnit, mailbox: Mailbox, report: Report, concurrency: int) -> None:
        self.concurrency = concurrency
        self.slots = [Slot() for _ in range(concurrency)]
        self._run = run
        self._mailbox = mailbox
        self._report = report
        self._low = low_water(concurrency)
        self._units: deque[Unit | None] = deque()
        self._tokens: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, args=(slot,), name=f"keyedconsumer-worker-{i}", daemon=True)
            for i, slot in enumerate(self.slots)
        ]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def submit(self, units: list[Unit]) -> None:
        self._units.extend(units)
        put = self._tokens.put
        for _ in units:
            put(None)

    def take_queued(self) -> list[Unit]:
        out = _drain(self._units)
        closes = [u for u in out if u is None]  # a close stays (its token is still queued)
        self._units.extend(closes)
        return [u for u in out if u is not None]

    def close(self) -> None:
        """Let every thread exit once the units handed over are done."""
        for _ in self._threads:
            self._units.append(None)
            self._tokens.put(None)

    def join(self, timeout_s: float) -> None:
        """Wait for the threads up to ``timeout_s`` in all (hung handlers' threads are daemons)."""
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            if t.ident is not None:
                t.join(max(0.0, deadline - time.monotonic()))

    def _work(self, slot: Slot) -> None:
        wait, units, run, report = self._tokens.get, self._units, self._run, self._report
        mailbox, take = self._mailbox, self._tokens.get_nowait
        post, ring = mailbox.post_quiet, mailbox.ring
        quiet = False  # this worker's last outcome was posted without ringing
        while True:
            if quiet:
                try:
                    take()
                except queue.Empty:  # about to wait: the owner must hear of that outcome first
                    ring()
                    quiet = False
                    wait()
            else:
                wait()
            try:
                unit = units.popleft()
            except IndexError:  # the owner took it back
                continue
            quiet = False
            if unit is None:
                return
            post(report, run(slot, unit))
            if len(units) <= self._low or mailbox.eager:
                ring()
            else:
                quiet = True


class AsyncWorkers(Workers):
    """``concurrency`` worker coroutines on one event loop.

    Parameters
    ----------
    loop:
        The loop to run on (``run_async`` passes the caller's); ``None`` starts a private loop in a
        thread of its own, of the ``event_loop`` kind (:func:`new_event_loop`).
    """

    def __init__(
        self,
        run: RunUnitAsync,
        mailbox: Mailbox,
        report: Report,
        concurrency: int,
        loop: asyncio.AbstractEventLoop | None = None,
        event_loop: str = "auto",
    ) -> None:
        self.concurrency = concurrency
        self.slots = [Slot() for _ in range(concurrency)]
        self._run = run
        self._mailbox = mailbox
        self._report = report
        self._low = low_water(concurrency)
        self._own_loop = loop is None
        self._loop = loop or new_event_loop(event_loop)
        # units handed over (filled by the loop thread; a unit is whoever's pops it: a worker, or
        # the owner taking it back, see take_queued), and the idle workers' wake-ups (the loop's)
        self._units: deque[Unit] = deque()
        self._idle: deque[asyncio.Future[None]] = deque()
        self._closing = False
        self._steps = 0  # units run so far by all the workers (see _work)
        self._thread: threading.Thread | None = None
        self._done: Any = None

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
        # threads a timed-out attempt started (asyncio.to_thread) are waited for: see timelimit.py
        install_tracking_executor(self._loop)
        await asyncio.gather(*(self._work(slot) for slot in self.slots))

    def submit(self, units: list[Unit]) -> None:
        try:
            self._loop.call_soon_threadsafe(self._feed, units)
        except RuntimeError:  # the loop is closed: the units are never run (the run is over)
            pass

    def take_queued(self) -> list[Unit]:
        # units still on their way to the loop (call_soon_threadsafe) are not reached: a revoke's
        # wait takes them at its next turn
        return _drain(self._units)

    def close(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self._feed, None)
        except RuntimeError:
            pass

    def join(self, timeout_s: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)
        elif self._done is not None:
            try:
                self._done.result(timeout_s)
            except Exception:  # timed out or cancelled: the loop's owner ends it
                pass

    def _feed(self, units: list[Unit] | None) -> None:
        """(The loop thread.) Queue ``units`` and wake as many idle workers; ``None``: close."""
        if units is None:
            self._closing = True
            n = len(self._idle)
        else:
            self._units.extend(units)
            n = len(units)
        idle = self._idle
        while n > 0 and idle:
            fut = idle.popleft()
            if not fut.done():
                fut.set_result(None)
                n -= 1

    async def _work(self, slot: Slot) -> None:
        units, idle, loop = self._units, self._idle, self._loop
        run, report, mailbox = self._run, self._report, self._mailbox
        post, ring = mailbox.post_quiet, mailbox.ring
        quiet = False  # this worker's last outcome was posted without ringing
        while True:
            if not units:
                if quiet:  # about to wait: the owner must hear of that outcome first
                    ring()
                    quiet = False
                if self._closing:
                    return
                fut: asyncio.Future[None] = loop.create_future()
                idle.append(fut)
                await fut
                continue
            try:
                unit = units.popleft()
            except IndexError:  # the owner took it back
                continue
            quiet = False
            steps = self._steps
            try:
                out = await run(slot, unit)
            except asyncio.CancelledError:
                # this worker is cancelled (the loop is going away): what it did not finish is not
                # done and runs again later (the runner left its outcomes in the slot)
                mailbox.post(report, (slot.abandon(), 0.0))
                raise
            post(report, out)
            if len(units) <= self._low or mailbox.eager:
                ring()
            else:
                quiet = True
            # Handlers that never await must not starve the loop (the hand-overs, the caller's
            # tasks): yield after a unit unless another worker ran one meanwhile, which it could
            # only do while this one was suspended in an await, when the loop ran what else was ready.
            self._steps += 1
            if self._steps == steps + 1:
                await asyncio.sleep(0)


def new_event_loop(kind: str = "auto") -> asyncio.AbstractEventLoop:
    """A new event loop for the workers' own thread (``ConsumerConfig.event_loop``): uvloop's for
    ``"uvloop"``, and for ``"auto"`` when uvloop is installed (the ``keyedconsumer[uvloop]``
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
