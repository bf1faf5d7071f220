"""The dispatcher: admits polled messages to their lanes, hands lane heads to workers, and settles
what each run ended with.

It owns, under one lock, the objects that hold the engine's state, each behind a short list of
methods: the partitions and their offset trackers (:mod:`.partitions`), each partition's lanes
(:mod:`.lanes`), the heads waiting for a worker (:mod:`.ready`), and the in-flight accounting
(:mod:`.flow`). The sequencer (:mod:`keyedconsumer.sequencing.base`) decides whether a lane's
head may run; the dispatcher calls it and never asks which one it has. The same lock guards the
sequencer's in-memory state: it is called under it, and calls back only the ``*_locked`` methods.

Who calls what: the poll thread calls :meth:`Dispatcher.admit`, :meth:`~Dispatcher.rescue`,
:meth:`~Dispatcher.release_due` and the assignment methods; workers call
:meth:`~Dispatcher.wait_chunk` / :meth:`~Dispatcher.try_take`, :meth:`~Dispatcher.may_start` and
:meth:`~Dispatcher.finish_many`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import TypeVar

from ..kafka import TP
from ..message import Message
from ..offsets import FinishedOffsets
from ..sequencing.base import InMemorySequencer, Sequencer
from .delivery import NULL_KEY, Delivery
from .flow import InFlight
from .outcome import HALT, NOT_STARTED, Done, NotStarted, Outcome, Park, Retry
from .partitions import ACTIVE, CLOSED, REVOKING, Partition, Partitions
from .ready import ReadyQueue

__all__ = ["Dispatcher", "Slot", "CHUNK_QUANTUM_S", "MAX_CHUNK", "RESCUE_AFTER_S", "LINGER_CHECK_S"]

_T = TypeVar("_T")

#: A worker takes at once as many ready messages as its handler runs in about this time (seconds,
#: from a moving average of handler durations): fast handlers are taken in chunks, so the workers
#: do not wake each other for every message; slow handlers are taken one by one.
CHUNK_QUANTUM_S = 0.002
#: A batch worker lingering for more ready heads looks this often (seconds) whether a stop began.
LINGER_CHECK_S = 0.05
#: Upper bound of a chunk, in messages.
MAX_CHUNK = 256
#: A worker in one handler for longer than this (seconds) gets its chunk's unstarted messages
#: taken back and its finished ones reported by the poll thread (:meth:`Dispatcher.rescue`).
RESCUE_AFTER_S = 0.01


def _behind(d: Delivery) -> int | None:
    """The admission order of the message queued behind ``d`` on its lane, or ``None``."""
    part = d.part
    return part.lanes.next_order(d) if part is not None and d.lane is not None else None


def _nothing_behind(d: Delivery) -> None:
    return None


class Slot:
    """What one worker holds: the unstarted rest of its chunk and the results not reported yet.

    Lock-free: both are deques, and every message and every result leaves its deque by one
    ``popleft`` (atomic in CPython), taken either by the worker or by the poll thread's
    :meth:`take_back`, never by both.
    """

    __slots__ = ("todo", "results", "started_s")

    def __init__(self) -> None:
        self.todo: deque[Delivery] = deque()
        self.results: deque[tuple[Delivery, Outcome]] = deque()
        self.started_s = 0.0  # when the running handler (or the chunk) started (monotonic seconds)

    def load(self, chunk: list[Delivery]) -> None:
        self.started_s = time.monotonic()
        self.todo.extend(chunk)

    def next(self, done: tuple[Delivery, Outcome] | None) -> Delivery | None:
        """Record the last message's result (if any) and take the next one, or ``None`` at the end
        of the chunk (or when the poll thread took the rest back)."""
        if done is not None:
            self.results.append(done)
        todo = self.todo
        if not todo:
            return None
        try:
            d = todo.popleft()
        except IndexError:  # the poll thread took the rest meanwhile
            return None
        self.started_s = time.monotonic()
        return d

    @staticmethod
    def _drain(q: deque[_T]) -> list[_T]:
        out: list[_T] = []
        while q:
            try:
                out.append(q.popleft())
            except IndexError:
                break
        return out

    def abandon(self, done: tuple[Delivery, Outcome]) -> list[tuple[Delivery, Outcome]]:
        """End the chunk early: the results so far, ``done``, and every unstarted message as not started."""
        results = self._drain(self.results)
        results.append(done)
        results.extend((d, NOT_STARTED) for d in self._drain(self.todo))
        return results

    def unload(self) -> list[tuple[Delivery, Outcome]]:
        """End the chunk: return the results not reported yet."""
        return self._drain(self.results)

    def take_back(self, force: bool, now: float) -> tuple[list[Delivery], list[tuple[Delivery, Outcome]]]:
        """The poll thread takes back the unstarted rest of a chunk stuck in one handler for more
        than ``RESCUE_AFTER_S`` (or any chunk with ``force``), and the results not reported yet."""
        if not self.todo and not self.results:
            return [], []
        if not (force or now - self.started_s > RESCUE_AFTER_S):
            return [], []
        return self._drain(self.todo), self._drain(self.results)


class Dispatcher:
    """Lanes, ready heads, in-flight accounting and partitions of one run of a consumer.

    Parameters
    ----------
    ordering:
        ``"key"``, ``"partition"`` or ``"none"``.
    concurrency:
        Number of workers.
    sequencer:
        Who may run a lane's head (default :class:`~keyedconsumer.sequencing.base.InMemorySequencer`).
    clock:
        Monotonic clock in seconds for retry due times (:mod:`keyedconsumer.testing` passes a fake one).
    group:
        The consumer group, set on every message admitted (``Message.group_id``).
    metadata_max_bytes:
        Bound of the commit metadata (``commit_metadata_max_bytes``).
    max_in_flight, max_in_flight_bytes:
        The back-pressure bounds.
    """

    def __init__(
        self,
        ordering: str,
        concurrency: int,
        sequencer: Sequencer | None = None,
        clock: Callable[[], float] = time.monotonic,
        group: str = "",
        metadata_max_bytes: int = 0,
        max_in_flight: int = 1 << 62,
        max_in_flight_bytes: int = 1 << 62,
        conflate: bool = False,
    ) -> None:
        self.lock = threading.Lock()
        self._work = threading.Condition(self.lock)  # idle worker threads wait for ready heads
        self._settled = threading.Condition(self.lock)  # wait_idle: something finished
        self.ordering = ordering
        self.concurrency = concurrency
        self.group = group
        self.seq: Sequencer = sequencer or InMemorySequencer()
        self.partitions = Partitions(metadata_max_bytes)
        self.queue = ReadyQueue(clock)
        self.flow = InFlight(max_in_flight, max_in_flight_bytes)
        self.halted = False  # no new message starts
        # stopping gracefully: only messages below their partition's highest finished offset start,
        # so the committed offset can reach what already finished (no re-runs after the stop)
        self.stopping = False
        self.closed = False  # workers exit
        self.retries = 0  # Retry and Park outcomes so far
        self.conflate = conflate and ordering != "none"
        self.conflated = 0  # messages conflated so far (replaced by a newer one of their lane)
        self._conflated_out: list[Message] = []  # conflated by the sequencer, not reported yet
        self._waiters = 0  # threads in wait_idle
        self._idle_threads = 0  # worker threads waiting for work
        self._on_ready: Callable[[int], None] | None = None  # the async executor's waker
        self._slots: list[Slot] = []
        self._avg_handler_s = 0.001  # moving average of handler durations
        self._chunk = 1  # messages one worker takes at once
        self._lane_id = self.seq.lane_id

    # -- workers ------------------------------------------------------------------------------------

    def register(self, slot: Slot) -> None:
        """A worker's slot, which :meth:`rescue` may take messages back from."""
        with self.lock:
            self._slots.append(slot)

    def on_ready(self, waker: Callable[[int], None]) -> None:
        """``waker(n)`` is called (under the lock) when ``n`` heads became ready: for workers that
        do not wait in :meth:`wait_chunk` (the asyncio executor)."""
        self._on_ready = waker

    def wakes_for(self, added: int) -> int:
        """How many idle workers ``added`` new ready heads need (caller holds the lock)."""
        return -(-added // self._chunk)

    def _notify(self, added: int) -> None:
        if self._idle_threads:
            self._work.notify(min(self.wakes_for(added), self._idle_threads))
        if self._on_ready is not None:
            self._on_ready(added)

    def wait_chunk(self) -> list[Delivery] | None:
        """A worker thread's next chunk, waiting for one; ``None`` once the dispatcher is closed."""
        with self._work:
            while not self.queue:
                if self.closed:
                    return None
                self._idle_threads += 1
                self._work.wait()
                self._idle_threads -= 1
            return self._take_locked()

    def try_take(self) -> list[Delivery] | None:
        """A chunk if one is ready now, else ``None`` (see :attr:`is_closed`)."""
        with self.lock:
            return self._take_locked() if self.queue else None

    @property
    def is_closed(self) -> bool:
        return self.closed

    def has_ready(self) -> bool:
        """Whether heads are ready (caller holds the lock)."""
        return bool(self.queue)

    def ready_count(self) -> int:
        """How many heads are ready (caller holds the lock)."""
        return len(self.queue)

    def take_locked(self) -> list[Delivery]:
        """A chunk of ready heads for one worker (caller holds the lock; some are ready)."""
        return self._take_locked()

    def _take_locked(self) -> list[Delivery]:
        chunk = self.queue.take(self._chunk, _behind)
        self.partitions.started(chunk)
        self.flow.started(len(chunk))
        return chunk

    # -- batches (engine/batch.py) ----------------------------------------------------------------

    def wait_batch(self, size: int, linger_s: float) -> list[Delivery] | None:
        """A batch worker thread's next batch: up to ``size`` ready heads, oldest admitted first,
        waiting for the first one, then up to ``linger_s`` seconds more while fewer than ``size``
        are ready (not once stopping or halted: noticed within ``LINGER_CHECK_S``). Every lane has one head at a time, so a batch
        holds at most one message per lane. ``None`` once the dispatcher is closed."""
        with self._work:
            while True:
                while not self.queue:
                    if self.closed:
                        return None
                    self._idle_threads += 1
                    self._work.wait()
                    self._idle_threads -= 1
                if linger_s > 0 and len(self.queue) < size:
                    deadline = time.monotonic() + linger_s
                    while len(self.queue) < size and not (self.halted or self.stopping):
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        self._idle_threads += 1
                        # in slices: stop_starting() is lock-free and notifies nobody
                        self._work.wait(min(left, LINGER_CHECK_S))
                        self._idle_threads -= 1
                    if not self.queue:  # another worker took them meanwhile
                        continue
                return self._take_batch_locked(size)

    def take_batch_locked(self, size: int) -> list[Delivery]:
        """Up to ``size`` ready heads for one batch (caller holds the lock; some are ready)."""
        return self._take_batch_locked(size)

    def _take_batch_locked(self, size: int) -> list[Delivery]:
        # no stop before a head younger than a message queued behind another (as a chunk has): the
        # batch runs as one call, not one message after the other
        batch = self.queue.take(size, _nothing_behind)
        self.partitions.started(batch)
        self.flow.started(len(batch))
        return batch

    def finish_batch(self, results: list[tuple[Delivery, Outcome]]) -> None:
        """A batch ran: ``results`` is ``[(delivery, outcome)]``. The lanes' next messages go to the
        ready queue (the next batch takes them, with other lanes' heads), not to the caller."""
        with self.lock:
            for d, outcome in results:
                nxt = self._finish_locked(d, outcome)
                if nxt is not None:
                    self._give_back(nxt)
            if self.queue:
                self._notify(len(self.queue))
            if self._waiters:
                self._settled.notify_all()

    def may_start(self, d: Delivery) -> bool:
        """True unless the consumer halted, its partition was revoked or lost, the consumer is
        stopping (or its partition being revoked) and it is not below its partition's highest
        finished offset, or the sequencer says no (its key's lease is no longer this instance's)."""
        if self.halted:
            return False
        part = d.part
        if part is not None:
            # (the common case, an active partition and no stop, without a call)
            if (part.state != ACTIVE or self.stopping or part.catching_up) and not part.may_start(
                d.offset, self.stopping
            ):
                return False
            if d.lane is None:
                return True
        return self.seq.may_start(d)

    def finish_many(self, results: list[tuple[Delivery, Outcome]], elapsed_s: float) -> list[Delivery]:
        """A chunk ran: ``results`` is ``[(delivery, outcome)]`` and ``elapsed_s`` the chunk's total
        handler time (seconds). Returns the lanes' next messages the calling worker should run
        itself (no other head waits for a worker, so keeping the lane saves a hand-off)."""
        out = []
        with self.lock:
            if results:
                self._observe(elapsed_s / len(results))
            for d, outcome in results:
                nxt = self._finish_locked(d, outcome)
                if nxt is not None:
                    out.append(nxt)
            if len(out) > 1:
                # several lanes went on: their next messages run in admission order, and a chunk
                # stops before a message younger than one queued behind its heads (ReadyQueue.take)
                for x in out:
                    self._give_back(x)
                out = self._take_locked() if self.queue else []
                if self.queue:
                    self._notify(len(self.queue))
            if self._waiters:
                self._settled.notify_all()
        return out

    def finish(self, d: Delivery, outcome: Outcome) -> Delivery | None:
        """One taken message ended (:meth:`finish_many` of one, without timing it)."""
        with self.lock:
            nxt = self._finish_locked(d, outcome)
            if self._waiters:
                self._settled.notify_all()
        return nxt

    def _observe(self, per_message_s: float) -> None:
        avg = self._avg_handler_s = self._avg_handler_s * 0.95 + per_message_s * 0.05
        self._chunk = max(1, min(MAX_CHUNK, int(CHUNK_QUANTUM_S / avg) if avg > 0 else MAX_CHUNK))

    def _finish_locked(self, d: Delivery, outcome: Outcome) -> Delivery | None:
        part = d.part
        flow = self.flow
        if part is None:  # brought by the sequencer: it settles it (e.g. in Redis)
            flow.ended()
            flow.forget(d.size)
            nxt = self.seq.on_external_end(d, outcome)
            return self._hand_over(nxt)
        lane = d.lane
        live = part.active and not self.halted
        if lane is not None and live and not self.seq.accepts(d):
            # it ran under a lease this instance lost: its result does not count; the sequencer
            # keeps it, first of its lane, until it may run again
            part.ended()
            flow.ended()
            return None
        if type(outcome) is not Done and self._keep_locked(d, part, outcome, live):
            return None
        nxt = None
        if lane is not None:
            nxt = part.lanes.advance(d)
            if nxt is not None:
                nxt_part = nxt.part
                if self.halted or nxt_part is None or not nxt_part.active:
                    for x in [nxt, *part.lanes.end(nxt)]:
                        flow.forget(x.size)
                    nxt = None
                    # the lane ends here: its key's lease goes to another lane waiting for it (the
                    # key's lane of another partition), as when a lane runs dry
                    ready = self.seq.on_lane_end(d)
                    if ready is not None:
                        self._make_ready(ready)
                else:
                    self.seq.on_next(d, nxt)
                    nxt = self._hand_over(nxt)
            else:
                ready = self.seq.on_lane_end(d)
                if ready is not None:
                    self._make_ready(ready)
        if type(outcome) is Done:
            self.partitions.done(part, d.offset)
        part.ended()
        flow.ended()
        flow.forget(d.size)
        return nxt

    def _keep_locked(self, d: Delivery, part: Partition, outcome: Outcome, live: bool) -> bool:
        """A run that did not end its message (not started, a retry, a park): keep the message
        where it belongs now and return ``True``; ``False`` when it ends after all (its partition
        or the consumer stopped: it is dropped, not done)."""
        lane = d.lane
        flow = self.flow
        match outcome:
            case NotStarted() if lane is not None and live:
                # it stays its lane's head: the lane does not go on without it (that would run its
                # key's later messages first). While the consumer stops or the partition is being
                # revoked it is held until it is below the highest finished offset (or dropped);
                # else (its lease was briefly unconfirmed) it is ready again at once.
                part.ended()
                flow.ended()
                if self.stopping or part.catching_up:
                    self.queue.hold(d)
                else:
                    self.queue.push(d)
                    self._notify(1)
                return True
            case Park(delay_s) if lane is not None and live and self.seq.park(d, delay_s):
                # its key is parked: it and its lane's later messages go to the sequencer, whose
                # offsets count done once it stored them (parked_locked)
                part.ended()
                flow.ended()
                d.msg.attempt += 1
                self.retries += 1
                return True
            case Retry(delay_s) | Park(delay_s) if live:
                # run again later: it stays its lane's head (its key waits, others go on) and its
                # offset stays unfinished; the attempt number grows before the next attempt
                part.ended()
                flow.ended()
                d.msg.attempt += 1
                self.retries += 1
                self.queue.delay(d, delay_s)
                return True
        return False

    def _hand_over(self, nxt: Delivery | None) -> Delivery | None:
        """``nxt`` may run now: to the calling worker, unless an older head waits in the ready
        queue (then ``nxt`` queues too: the oldest admitted runs first)."""
        if nxt is None:
            return None
        oldest = self.queue.oldest_order()
        if oldest is not None and oldest < nxt.order:
            self.queue.push(nxt)
            self._notify(1)
            return None
        if nxt.part is not None:
            nxt.part.started()
        self.flow.started()
        return nxt

    def _make_ready(self, d: Delivery | None) -> None:
        if d is not None:
            self.queue.push(d)
            self._notify(1)

    # -- the poll thread ------------------------------------------------------------------------

    def admit(self, msgs: list[Message]) -> list[Message]:
        """Take freshly polled messages: track their offsets and queue them on their lanes.

        Returns the messages conflated meanwhile (``conflate``): they count done and never run."""
        by_key = self.ordering == "key"
        sequenced = self.ordering != "none"
        lane_id = self._lane_id
        seq = self.seq
        queue = self.queue
        flow = self.flow
        group = self.group
        owns = self.owns
        added = admitted = nbytes = 0
        conflated: list[Message] = []
        now = time.monotonic()
        with self.lock:
            receive = self.partitions.receive
            for msg in msgs:
                part = receive(msg.topic, msg.partition, msg.offset, now)
                if part is None:
                    continue  # not assigned (any more), a re-delivery, or finished by the previous owner
                key, value = msg.key, msg.value
                size = (len(key) if key else 0) + (len(value) if value else 0)
                msg.group_id = group
                if sequenced:
                    lane: object = (key if key is not None else NULL_KEY) if by_key else 0
                    d = Delivery(msg, part, lane, lane_id(part.topic, part.partition, lane), size)
                else:
                    d = Delivery(msg, part, None, None, size)
                msg._bind(owns, d)
                admitted += 1
                nbytes += size
                if sequenced and not part.lanes.push(d):
                    if self.conflate:  # queued behind its lane's head: the older waiting ones go
                        for old in part.lanes.conflate(d):
                            self.partitions.done(part, old.offset)
                            flow.forget(old.size)
                            conflated.append(old.msg)
                    continue
                if sequenced and not seq.on_head(d):
                    continue  # kept by the sequencer
                queue.push(d)
                added += 1
            flow.admit(admitted, nbytes)
            flow.observe_batch(len(msgs), nbytes)
            self.conflated += len(conflated)
            if added:
                self._notify(added)
        return conflated

    def rescue(self, force: bool = False) -> None:
        """Take back from a worker stuck in one handler for more than ``RESCUE_AFTER_S`` (or from
        every worker with ``force``) the messages of its chunk it has not started, and report the
        results it has not reported yet: a slow handler never holds other keys' messages or
        finished offsets hostage."""
        now = time.monotonic()
        for slot in self._slots:
            rest, results = slot.take_back(force, now)
            if not rest and not results:
                continue
            with self.lock:
                for d, outcome in results:
                    nxt = self._finish_locked(d, outcome)
                    if nxt is not None:  # handed to this thread: back to the queue instead
                        self._give_back(nxt)
                for d in reversed(rest):
                    self._give_back(d)
                if self.queue:
                    self._notify(len(self.queue))
                if self._waiters:
                    self._settled.notify_all()

    def _give_back(self, d: Delivery) -> None:
        """A taken, not started message returns to the front of the ready queue (lock held)."""
        if self.halted or (d.part is not None and not d.part.active):
            nxt = self._finish_locked(d, HALT)
            if nxt is not None:
                self._give_back(nxt)
            return
        if d.part is not None:
            d.part.ended()
        self.flow.ended()
        self.queue.push(d)

    def release_due(self, now: float) -> float | None:
        """Make ready the retries due at ``now`` (clock seconds). Returns the seconds until the
        next one is due, or ``None`` when none waits."""
        with self.lock:
            added = self.queue.release_due(now)
            if added:
                self._notify(added)
            due = self.queue.next_due_s()
            return None if due is None else due - now

    def next_due_s(self) -> float | None:
        """When the next retry is due (clock seconds), or ``None``."""
        return self.queue.next_due_s()

    def release_held(self) -> None:
        """Make ready the held heads that may start now (below their partition's highest finished
        offset, or no longer stopping / catching up)."""
        with self.lock:
            added = self.queue.release_held(
                lambda d: d.part is None or d.part.may_start(d.offset, self.stopping)
            )
            if added:
                self._notify(added)

    def stop_starting(self) -> None:
        """From now on only messages below their partition's highest finished offset start (a
        graceful stop). Lock-free: safe from a signal handler."""
        self.stopping = True

    def halt(self) -> None:
        """Start nothing new: drop every ready, delayed, held and queued message (they stay not done)."""
        with self.lock:
            self.halted = True
            forget = self.flow.forget
            for d in self.queue.clear():
                forget(d.size)
                self.seq.on_drop(d)
            for d in self.seq.drop(lambda d: False):
                forget(d.size)
            for lanes in self.partitions.lanes_of():
                for d in lanes.clear_queued():
                    forget(d.size)
            self._work.notify_all()

    def close(self) -> None:
        """Let the workers exit once they are idle."""
        with self.lock:
            self.closed = True
            self.halted = True
            self._work.notify_all()
            if self._on_ready is not None:
                self._on_ready(1 << 30)

    def wait_room(self, batch: int, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds until the in-flight bounds leave room for a poll of
        ``batch`` records (:meth:`~.flow.InFlight.short_of_room`). Returns whether they do."""
        deadline = time.monotonic() + timeout_s
        with self.lock:
            while self.flow.short_of_room(batch) and not self.halted:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._waiters += 1
                try:
                    self._settled.wait(left)
                finally:
                    self._waiters -= 1
            return True

    def wait_idle(self, parts: list[Partition] | None, timeout_s: float) -> bool:
        """Wait until nothing of ``parts`` (all partitions when ``None``) runs. Returns success.

        Messages a worker took but has not started are handed back meanwhile, and results it has
        not reported yet are reported (:meth:`rescue`), so only handlers really running are waited for.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            self.rescue(force=True)
            with self.lock:
                busy = self.flow.running if parts is None else sum(p.running for p in parts)
                if busy == 0:
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._waiters += 1
                try:
                    self._settled.wait(min(left, 0.05))
                finally:
                    self._waiters -= 1

    def catching_up(self, parts: list[Partition], retry_before: float) -> bool:
        """Whether a catch-up of ``parts`` should go on: one still has a message below its highest
        finished offset, and something may still finish it (a handler running, a head ready, a
        retry due before ``retry_before`` (clock seconds), or the sequencer's work under way)."""
        with self.lock:
            if not any(p.active and p.tracker.behind_done() for p in parts):
                return False
            due = self.queue.next_due_s()
            soon = due is not None and due < retry_before
            return self.flow.running > 0 or bool(self.queue) or soon or self.seq.busy()

    # -- assignment -----------------------------------------------------------------------------

    def assign(self, tps: Iterable[TP], finished: dict[TP, FinishedOffsets] | None = None) -> None:
        """Start tracking newly assigned partitions; ``finished``: per partition, the offsets its
        previous owner finished above the committed offset (read from the commit metadata)."""
        with self.lock:
            self.partitions.assign(tps, finished)

    def assigned(self) -> list[TP]:
        with self.lock:
            return list(self.partitions.by_tp)

    def partition(self, tp: TP) -> Partition | None:
        return self.partitions.by_tp.get(tp)

    def active(self) -> list[Partition]:
        with self.lock:
            return self.partitions.active()

    def catch_up(self, parts: list[Partition]) -> None:
        """``parts`` are being revoked: only their messages below the highest finished offset start."""
        with self.lock:
            for p in parts:
                p.catch_up(True)

    def begin_revoke(self, tps: Iterable[TP], lost: bool = False) -> list[Partition]:
        """Stop the partitions: drop their queued messages; none of theirs starts from now on.
        With ``lost`` the partitions are closed at once (nothing of theirs is stored again)."""
        with self.lock:
            parts = self.partitions.begin_revoke(tps, lost)
            for part in parts:
                self._drop_queued(part)
            return parts

    def _drop_queued(self, part: Partition) -> None:
        """Forget every message of ``part`` that has not started: those queued behind their lanes'
        heads, the heads waiting for a worker, and the heads the sequencer keeps."""
        forget = self.flow.forget
        lanes = part.lanes
        for d in lanes.clear_queued():
            forget(d.size)
        for d in self.queue.remove(lambda d: d.part is part):
            forget(d.size)
            lanes.end(d)
            self.seq.on_drop(d)
        for d in self.seq.drop(lambda d: d.part is not part):
            forget(d.size)
            lanes.end(d)

    def close_parts(self, parts: list[Partition]) -> tuple[list[tuple[str, int, int]], dict[TP, str]]:
        """Close revoked partitions; return what to commit for them (as :meth:`commit_offsets`)."""
        with self.lock:
            out = self.partitions.commit_offsets([p for p in parts if p.state == REVOKING])
            self.partitions.close(parts)
            return out

    def commit_offsets(self, parts: Iterable[Partition]) -> tuple[list[tuple[str, int, int]], dict[TP, str]]:
        """What to commit for ``parts``: ``([(topic, partition, first unfinished offset)],
        {tp: metadata naming the offsets finished above it})``."""
        with self.lock:
            return self.partitions.commit_offsets(parts)

    def advances(self) -> list[tuple[Partition, int, str]]:
        """Partitions whose first unfinished offset moved past what was stored (see
        :meth:`~keyedconsumer.engine.partitions.Partitions.advances`)."""
        with self.lock:
            return self.partitions.advances()

    def mark_dirty(self, parts: Iterable[Partition]) -> None:
        with self.lock:
            self.partitions.mark_dirty(parts)

    def count_retry(self) -> None:
        """A parked message was set to run again later (a retry the sequencer made)."""
        with self.lock:
            self.retries += 1

    @property
    def skipped_finished(self) -> int:
        return self.partitions.skipped_finished

    # -- still owned (Message.still_owned) -------------------------------------------------------

    def owns(self, d: Delivery) -> bool:
        """True while a run of ``d`` still counts: its partition is assigned (or being revoked: the
        revoke's commit covers it), this run of the consumer is not over, and the sequencer agrees
        (its key's lease is still this instance's)."""
        with self.lock:
            if self.closed:
                return False
            part = d.part
            if part is not None and part.state == CLOSED:
                return False
            if part is not None and d.lane is None:
                return True
            return self.seq.owns(d)

    # -- for the sequencer (lock held: from a sequencer callback or under ``with lock``) ----------

    def make_ready_locked(self, d: Delivery) -> None:
        """A head the sequencer kept may run now."""
        self._make_ready(d)

    def lane_rest_locked(self, head: Delivery) -> list[Delivery]:
        """Remove and return the messages queued behind ``head`` on its lane."""
        return head.part.lanes.take_rest(head) if head.part is not None else []

    def lane_put_back_locked(self, head: Delivery, rest: list[Delivery]) -> None:
        """Queue ``rest`` behind ``head`` again."""
        if head.part is not None:
            head.part.lanes.put_back(head, rest)

    def lane_advance_locked(self, head: Delivery) -> Delivery | None:
        """``head`` was settled by the sequencer (parked): its lane's next message, now the head
        (the sequencer decides where it goes), or ``None`` when the lane ran dry (it ends, and the
        sequencer's :meth:`~keyedconsumer.sequencing.base.Sequencer.on_lane_end` is asked)."""
        if head.part is None:
            return None
        nxt = head.part.lanes.advance(head)
        if nxt is None:
            self._make_ready(self.seq.on_lane_end(head))
        return nxt

    def parked_locked(self, ds: Iterable[Delivery]) -> None:
        """The sequencer stored ``ds`` durably elsewhere (parked in Redis): their offsets count done."""
        for d in ds:
            if d.part is not None:
                self.partitions.done(d.part, d.offset)
            self.flow.forget(d.size)

    def conflated_locked(self, msgs: list[Message]) -> None:
        """The sequencer conflated ``msgs`` where it keeps them (a parked key's list in Redis; their
        offsets counted done when they were parked): they are counted with the lanes' conflated
        messages and handed to the consumer's ``on_conflated`` (:meth:`take_conflated`)."""
        for m in msgs:
            m.group_id = self.group
        self.conflated += len(msgs)
        self._conflated_out.extend(msgs)

    def take_conflated(self) -> list[Message]:
        """The messages the sequencer conflated since the last call (the poll thread reports them)."""
        with self.lock:
            out, self._conflated_out = self._conflated_out, []
        return out

    def admit_external(self, batch: list[Delivery]) -> None:
        """Messages the sequencer brought (a parked key's list, in order): they count in flight;
        the first is ready now, the sequencer hands out the rest as the first ones end
        (:meth:`~keyedconsumer.sequencing.base.Sequencer.on_external_end`)."""
        with self.lock:
            self.admit_external_locked(batch)

    def admit_external_locked(self, batch: list[Delivery]) -> None:
        for d in batch:
            d.msg.group_id = self.group
            d.msg._bind(self.owns, d)
            self.flow.admit(1, d.size)
        if batch:
            self._make_ready(batch[0])

    def forget_locked(self, ds: Iterable[Delivery]) -> None:
        """Messages the sequencer brought that will not run here (the rest of a batch it ended)."""
        for d in ds:
            self.flow.forget(d.size)

    # -- status ---------------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Messages buffered or running now."""
        return self.flow.buffered

    @property
    def running(self) -> int:
        return self.flow.running
