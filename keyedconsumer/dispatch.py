"""Per-key sequencing, the ready queue and in-flight accounting, shared by the poll thread and the
workers under one lock.

A *lane* is what must run one message at a time: ``(partition, key)`` under ``ordering="key"``
(null keys share one lane per partition), the partition under ``"partition"``, nothing under
``"none"``. A lane's head is running or in the ready queue; the rest wait in the lane's deque. The
lanes of a partition outlive its assignment while a head still runs, so a partition revoked and
assigned back cannot start a second message of a key whose first is still running.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

from .kafka import TP
from .message import Message
from .offsets import FinishedOffsets, OffsetTracker, encode_finished
from .sequencing.keys import lease_id
from .sequencing.leases import LeaseTable

__all__ = ["Dispatcher", "Partition", "Park", "ACTIVE", "REVOKING", "CLOSED"]

ACTIVE, REVOKING, CLOSED = 0, 1, 2

#: A worker takes at once as many ready messages as its handler runs in about this time (seconds,
#: from a moving average of handler durations): fast handlers are taken in chunks, so the workers
#: do not wake each other for every message; slow handlers are taken one by one.
CHUNK_QUANTUM_S = 0.002
Lanes = dict[object, "deque[Message] | None"]
#: What a worker reports for a message: ``True`` done, ``False`` not done, a ``float``: run it again
#: after that many seconds (it stays its lane's head, and its offset stays unfinished).
Outcome = bool | float



class Park(float):
    """Outcome: park the message's key in Redis, due again after this many seconds (a ``float``)."""


#: Upper bound of a chunk, in messages.
MAX_CHUNK = 256
#: A worker in one handler for longer than this (seconds) gets its chunk's unstarted messages
#: taken back and its finished ones reported by the poll thread (:meth:`Dispatcher.rescue`).
RESCUE_AFTER_S = 0.01


class Slot:
    """What one worker holds: its chunk, the next position in it, results not yet reported."""

    __slots__ = ("lock", "chunk", "pos", "results", "started_s")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.chunk: list[Message] | None = None
        self.pos = 0
        self.results: list[tuple[Message, Outcome]] = []
        self.started_s = 0.0  # when the running handler started (monotonic seconds)

    def load(self, chunk: list[Message]) -> None:
        with self.lock:
            self.chunk = chunk
            self.pos = 0
            self.results = []

    def next(self, done: tuple[Message, Outcome] | None) -> Message | None:
        """Record the last message's result (if any) and take the next one, or ``None`` at the end
        of the chunk (or when the poll thread took the rest back)."""
        with self.lock:
            if done is not None:
                self.results.append(done)
            chunk = self.chunk
            i = self.pos
            if chunk is None or i >= len(chunk):
                return None
            self.pos = i + 1
            self.started_s = time.monotonic()
            return chunk[i]

    def abandon(self, done: tuple[Message, Outcome]) -> list[tuple[Message, Outcome]]:
        """End the chunk early: the results so far, ``done``, and every unstarted message as not done."""
        with self.lock:
            chunk = self.chunk or []
            results = self.results + [done] + [(m, False) for m in chunk[self.pos :]]
            self.results = []
            self.chunk = None
            return results

    def unload(self) -> list[tuple[Message, Outcome]]:
        """End the chunk: return the results not reported yet."""
        with self.lock:
            results = self.results
            self.results = []
            self.chunk = None
            return results




class Partition:
    """One assignment of one partition: its offset tracker and what runs from it."""

    __slots__ = (
        "topic", "partition", "group", "tracker", "state", "running", "stored", "lanes", "high", "parked", "catching_up",
        "finished", "owns",
    )

    def __init__(
        self, tp: TP, lanes: Lanes, group: str = "", parked: bool = False,
        owns: Callable[[Message], bool] | None = None,
    ) -> None:
        self.topic, self.partition = tp
        self.group = group
        # does a run of a message of this partition still count (Message.still_owned)
        self.owns: Callable[[Message], bool] = owns or (lambda msg: True)
        self.tracker = OffsetTracker()
        self.state = ACTIVE
        self.running = 0  # taken by a worker and not finished
        self.stored: int | None = None  # last offset stored or committed for this assignment
        self.lanes = lanes
        self.high: int | None = None  # the partition's end offset (high watermark), last seen
        self.parked = parked  # the stand-in of messages run from Redis parked lists (no offsets)
        self.catching_up = False  # being revoked: only messages below the highest done offset start
        # offsets the previous owner finished above its committed offset (its commit metadata):
        # they count done when they arrive and do not run again
        self.finished: FinishedOffsets | None = None

    @property
    def tp(self) -> TP:
        return (self.topic, self.partition)


class Dispatcher:
    """State shared by the poll thread and the workers. Every method takes ``self.lock``.

    Parameters
    ----------
    ordering:
        ``"key"``, ``"partition"`` or ``"none"``.
    concurrency:
        Number of workers; sets how many ready messages one worker takes at once.
    clock:
        Monotonic clock in seconds for retry due times (:mod:`keyedconsumer.testing` passes a fake one).
    """

    def __init__(
        self, ordering: str, concurrency: int, group: str = "", clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.group = group
        self.clock = clock  # monotonic seconds; due times of RetryLater delays use it
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)  # workers: work is ready
        self.settled = threading.Condition(self.lock)  # wait_idle: something finished
        self.ordering = ordering
        self.concurrency = concurrency
        self.ready: deque[Message] = deque()
        self.parts: dict[TP, Partition] = {}
        self._lanes_by_tp: dict[TP, Lanes] = {}
        self.buffered = 0  # admitted and not finished or dropped
        self.buffered_bytes = 0
        self.running = 0
        self.halted = False  # no new message starts
        # stopping gracefully: only messages below their partition's highest done offset start, so
        # the committed offset can reach what already finished (no re-runs after the stop)
        self.stopping = False
        self.closed = False  # workers exit
        self.waiters = 0  # threads waiting in wait_* for running to drop
        self.wake: Callable[[int], None] = lambda n: None  # set by the executor; called under lock
        self.avg_handler_s = 0.001  # moving average of handler durations, updated by finish()
        self.chunk = 1  # messages one worker takes at once (from avg_handler_s)
        self._dirty: set[Partition] = set()
        self.delayed: list[tuple[float, int, Message]] = []  # heap of (due monotonic s, seq, msg)
        self._seq = itertools.count()
        self.retries = 0  # RetryLater outcomes so far
        self.skipped_finished = 0  # messages not run: the previous owner had finished them
        # lane heads a worker could not start while stopping or catching up (see _finish_locked)
        self.held: list[Message] = []
        self.metadata_max_bytes = 0  # commit metadata naming finished offsets (0: none)
        self.leases: LeaseTable | None = None  # set when a lease-based sequencer (Redis) is used
        self.slots: list[Slot] = []  # one per worker (registered by the executor)
        self.avg_size: float | None = None  # key + value bytes per message (None: none seen yet)
        # Parking (with a Redis sequencer that parks): lane heads whose key goes to Redis, with the
        # delay of their next attempt (0.0 for messages that only follow a parked one); drain jobs
        # that got their key's lease; results of messages run from parked lists.
        self.parking = False
        self.quarantine = False  # a dead-lettered parked message ends its drained batch
        self.to_park: list[tuple[Message, float]] = []
        self.drains: list[Message] = []
        # (message, outcome, last of its drained batch)
        self.parked_results: list[tuple[Message, Outcome, bool]] = []
        # messages of a drained batch not started yet, per lease id: run one after the other
        self.parked_lanes: dict[str, deque[Message]] = {}
        self.parked_part = Partition(("", -1), {}, group, parked=True, owns=self.owns)

    # -- assignment -----------------------------------------------------------------------------

    def assign(self, tps: Iterable[TP], finished: dict[TP, FinishedOffsets] | None = None) -> None:
        """Start tracking newly assigned partitions; ``finished``: per partition, the offsets its
        previous owner finished above the committed offset (read from the commit metadata)."""
        with self.lock:
            for tp in tps:
                lanes = self._lanes_by_tp.setdefault(tp, {})
                part = self.parts[tp] = Partition(tp, lanes, self.group, owns=self.owns)
                if finished:
                    part.finished = finished.get(tp)

    def owns(self, msg: Message) -> bool:
        """True while a run of ``msg`` (taken by a worker) still counts: its partition is assigned
        (or being revoked: the revoke's commit covers it), this run of the consumer is not over,
        and, with a lease-based sequencer, its key's lease is still this instance's."""
        with self.lock:
            part = msg._part
            if self.closed or part.state == CLOSED:
                return False
            leases = self.leases
            if leases is None or (msg._lanes is None and not part.parked):
                return True
            return leases.still_valid(msg, self.lid(msg))

    def commit_offsets(self, parts: Iterable[Partition]) -> tuple[list[tuple[str, int, int]], dict[TP, str]]:
        """What to commit for ``parts`` (active or being revoked): ``([(topic, partition, watermark)],
        {tp: metadata})``, the metadata naming the offsets done above each watermark
        (:func:`~keyedconsumer.offsets.encode_finished`, up to ``metadata_max_bytes``)."""
        offsets: list[tuple[str, int, int]] = []
        meta: dict[TP, str] = {}
        with self.lock:
            for part in parts:
                if part.state == CLOSED or part.parked:
                    continue
                wm = part.tracker.watermark()
                if wm is None:
                    continue
                offsets.append((part.topic, part.partition, wm))
                text = encode_finished(part.tracker, self.metadata_max_bytes, part.finished)
                if text:
                    meta[part.tp] = text
        return offsets, meta

    def assigned(self) -> list[TP]:
        with self.lock:
            return list(self.parts)

    def begin_revoke(self, tps: Iterable[TP], lost: bool = False) -> list[Partition]:
        """Stop the partitions: drop their queued messages; none of theirs starts from now on.

        With ``lost`` the partitions are closed at once (nothing of theirs is stored again).
        """
        out: list[Partition] = []
        with self.lock:
            for tp in tps:
                part = self.parts.pop(tp, None)
                if part is None:
                    continue
                part.state = CLOSED if lost else REVOKING
                self._drop_queued(part)
                out.append(part)
        return out

    def _drop_queued(self, part: Partition) -> None:
        lanes = part.lanes
        for q in lanes.values():
            if q:
                for m in q:
                    self._forget(m)
                q.clear()
        heads: list[Message] = []  # lane heads of the partition that did not start
        if self.held:
            heads.extend(m for m in self.held if m._part is part)
            self.held = [m for m in self.held if m._part is not part]
        if self.ready:
            keep: deque[Message] = deque()
            for m in self.ready:
                (heads if m._part is part else keep).append(m)
            self.ready = keep
        if self.delayed:
            waiting = [e for e in self.delayed if e[2]._part is not part]
            heads.extend(e[2] for e in self.delayed if e[2]._part is part)
            heapq.heapify(waiting)
            self.delayed = waiting
        if self.to_park:
            for m, _ in self.to_park:
                if m._part is part:
                    heads.append(m)
            self.to_park = [e for e in self.to_park if e[0]._part is not part]
        leases = self.leases
        if leases is not None:
            heads.extend(m for m in leases.waiting_heads() if m._part is part)
        for m in heads:
            self._forget(m)
            lanes.pop(self._lane_key(m), None)
            if leases is not None:
                self._lease_drop(m)
        self._dirty.discard(part)

    def wait_idle(self, parts: list[Partition] | None, timeout_s: float) -> bool:
        """Wait until nothing of ``parts`` (all partitions when ``None``) runs. Returns success.

        Messages a worker took but has not started are handed back meanwhile, and results it has
        not reported yet are reported (:meth:`rescue`), so only handlers really running are waited for.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            self.rescue(force=True)
            with self.lock:
                busy = self.running if parts is None else sum(p.running for p in parts)
                if busy == 0:
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.waiters += 1
                try:
                    self.settled.wait(min(left, 0.05))
                finally:
                    self.waiters -= 1

    def rescue(self, force: bool = False) -> None:
        """Take back from a worker stuck in one handler for more than ``RESCUE_AFTER_S`` (or from
        every worker with ``force``) the messages of its chunk it has not started, and report the
        results it has not reported yet: a slow handler never holds other keys' messages or
        finished offsets hostage. Called by the poll thread."""
        now = time.monotonic()
        for slot in self.slots:
            if slot.chunk is None:
                continue
            with slot.lock:
                chunk = slot.chunk
                if chunk is None or not (force or now - slot.started_s > RESCUE_AFTER_S):
                    continue
                rest = chunk[slot.pos :]
                slot.pos = len(chunk)
                results = slot.results
                slot.results = []
            if not rest and not results:
                continue
            with self.lock:
                for msg, done in results:
                    nxt = self._finish_locked(msg, done)
                    if nxt is not None:  # handed to this thread: back to the queue instead
                        self._give_back(nxt)
                for msg in reversed(rest):
                    self._give_back(msg)
                if self.ready:
                    self.wake(len(self.ready))
                if self.waiters:
                    self.settled.notify_all()

    def _give_back(self, msg: Message) -> None:
        """A taken, not started message returns to the front of the ready queue (lock held)."""
        msg._part.running -= 1
        self.running -= 1
        if self.halted or msg._part.state != ACTIVE:
            msg._part.running += 1
            self.running += 1
            nxt = self._finish_locked(msg, False)
            if nxt is not None:
                self._give_back(nxt)
        else:
            self.ready.appendleft(msg)

    def close_parts(self, parts: list[Partition]) -> tuple[list[tuple[str, int, int]], dict[TP, str]]:
        """Close revoked partitions; return what to commit for them (as :meth:`commit_offsets`)."""
        out = self.commit_offsets([p for p in parts if p.state == REVOKING])
        with self.lock:
            for part in parts:
                part.state = CLOSED
        return out

    # -- the poll thread ------------------------------------------------------------------------

    def _lane_key(self, msg: Message) -> object:
        return msg._lk

    def lid(self, msg: Message) -> str:
        """The lease id of the message's lane (its key; its partition for null keys)."""
        part = msg._part
        if part.parked:
            return msg._lk  # type: ignore[no-any-return]
        return lease_id(msg._lk if self.ordering == "key" else None, part.topic, part.partition)

    def route(self, head: Message) -> None:
        """A lane head (or drain job) that now holds its key's lease goes where it must: the ready
        queue, the parking batch (its key is parked in Redis), or the drain jobs (lock held)."""
        if head._part.parked:
            self.drains.append(head)
            return
        leases = self.leases
        if self.parking and leases is not None and leases.is_parked(self.lid(head)):
            self.to_park.append((head, 0.0))
            return
        self.ready.append(head)
        self.wake(1)

    def admit(self, msgs: list[Message]) -> None:
        """Take freshly polled messages: track their offsets and queue them on their lanes."""
        ready = self.ready
        by_key = self.ordering == "key"
        sequenced = self.ordering != "none"
        leases = self.leases if sequenced else None
        added = 0
        now = time.monotonic()
        with self.lock:
            parts = self.parts
            before = self.buffered_bytes
            for msg in msgs:
                part = parts.get((msg.topic, msg.partition))
                if part is None or not part.tracker.add(msg.offset, now):
                    continue  # not assigned (any more), or a re-delivery of a tracked offset
                fin = part.finished
                if fin is not None:
                    if fin.covers(msg.offset):  # the previous owner finished it: it does not run again
                        part.tracker.done(msg.offset)
                        self._dirty.add(part)
                        self.skipped_finished += 1
                        continue
                    if msg.offset >= fin.end:
                        part.finished = None
                msg._part = part
                self.buffered += 1
                self.buffered_bytes += msg._size
                if sequenced:
                    lanes = part.lanes
                    msg._lanes = lanes
                    lk = msg._lk = msg.key if by_key else 0
                    if lk in lanes:
                        q = lanes[lk]
                        if q is None:
                            lanes[lk] = q = deque()
                        q.append(msg)
                        continue
                    lanes[lk] = None
                    if leases is not None:
                        lid = self.lid(msg)
                        if not leases.admit_head(msg, lid):
                            continue  # waits for its key's lease
                        if self.parking and leases.is_parked(lid):
                            self.to_park.append((msg, 0.0))
                            continue
                ready.append(msg)
                added += 1
            if msgs:
                # grows at once with bigger messages, shrinks slowly: the byte bound errs on the safe side
                batch_avg = max(1.0, (self.buffered_bytes - before) / len(msgs))
                avg = self.avg_size
                self.avg_size = batch_avg if avg is None else max(batch_avg, avg * 0.8 + batch_avg * 0.2)
            if added:
                self.wake(added)

    def advances(self) -> list[tuple[Partition, int, str]]:
        """Partitions whose watermark moved past what was stored: ``[(partition, offset, metadata)]``,
        the metadata naming what finished above the offset (as :meth:`commit_offsets`), so every
        store and commit names at least what the one before it named."""
        with self.lock:
            if not self._dirty:
                return []
            out = []
            for part in self._dirty:
                if part.state == ACTIVE:
                    wm = part.tracker.watermark()
                    if wm is not None and (part.stored is None or wm > part.stored):
                        out.append((part, wm, encode_finished(part.tracker, self.metadata_max_bytes, part.finished)))
            self._dirty.clear()
            return out

    def mark_dirty(self, parts: Iterable[Partition]) -> None:
        """Report ``parts`` again from :meth:`advances` (their store or commit failed)."""
        with self.lock:
            self._dirty.update(p for p in parts if p.state == ACTIVE)

    def release_due(self, now: float) -> float | None:
        """Move the delayed messages due at ``now`` (monotonic seconds) to the ready queue.

        Returns the seconds until the next one is due, or ``None`` when none waits.
        """
        with self.lock:
            delayed = self.delayed
            added = 0
            while delayed and delayed[0][0] <= now:
                msg = heapq.heappop(delayed)[2]
                self.ready.append(msg)  # a revoked partition's are dropped in begin_revoke
                added += 1
            if added:
                self.wake(added)
            return (delayed[0][0] - now) if delayed else None

    def release_held(self) -> None:
        """Make ready the held lane heads that may start now (below their partition's highest
        finished offset, or no longer stopping / catching up). Called by the poll thread."""
        with self.lock:
            if not self.held:
                return
            keep: list[Message] = []
            added = 0
            for m in self.held:
                part = m._part
                if self.stopping or part.catching_up:
                    if m._off >= part.tracker.highest_done:
                        keep.append(m)
                        continue
                self.ready.append(m)
                added += 1
            self.held = keep
            if added:
                self.wake(added)

    def halt(self) -> None:
        """Start nothing new: drop every ready, delayed and queued message (they stay not done)."""
        with self.lock:
            self.halted = True
            for m in self.ready:
                self._forget(m)
            self.ready.clear()
            for m in self.held:
                self._forget(m)
                if self.leases is not None:
                    self.leases.drop(m, self.lid(m))
            self.held.clear()
            for _, _, m in self.delayed:
                self._forget(m)
            self.delayed.clear()
            for m, _ in self.to_park:
                self._forget(m)
            self.to_park.clear()
            for batch in self.parked_lanes.values():
                for m in batch:
                    self._forget(m)
            self.parked_lanes.clear()
            if self.leases is not None:
                for m in self.leases.waiting_heads():
                    self._forget(m)
                    self.leases.drop(m, self.lid(m))
            for lanes in self._lanes_by_tp.values():
                for q in lanes.values():
                    if q:
                        for m in q:
                            self._forget(m)
                        q.clear()
            self.cond.notify_all()

    def close(self) -> None:
        """Let the workers exit once they are idle."""
        with self.lock:
            self.closed = True
            self.halted = True
            self.cond.notify_all()
            self.wake(1 << 30)

    # -- the workers ----------------------------------------------------------------------------

    def take_locked(self) -> list[Message]:
        """Pop a chunk of ready messages for one worker (caller holds ``lock``; ready not empty)."""
        ready = self.ready
        n = min(len(ready), self.chunk)
        if n <= 1:
            msg = ready.popleft()
            msg._part.running += 1
            self.running += 1
            return [msg]
        chunk = [ready.popleft() for _ in range(n)]
        for msg in chunk:
            msg._part.running += 1
        self.running += n
        return chunk

    def may_start(self, msg: Message) -> bool:
        """True unless the consumer halted, the message's partition was revoked or lost, the
        consumer is stopping (or the partition being revoked) and the message is not below the
        partition's highest done offset, or the lease of its key (with a Redis sequencer) is no
        longer this instance's."""
        part = msg._part
        if self.halted or part.state != ACTIVE:
            return False
        if (self.stopping or part.catching_up) and not part.parked and msg._off >= part.tracker.highest_done:
            return False
        leases = self.leases
        if leases is None or (msg._lanes is None and not msg._part.parked):
            return True
        return leases.still_valid(msg, self.lid(msg))

    def wakes_for(self, added: int) -> int:
        """How many idle workers ``added`` new ready messages need (caller holds ``lock``)."""
        return -(-added // self.chunk)

    def finish(self, msg: Message, done: Outcome, elapsed_s: float | None = None) -> Message | None:
        """A taken message ended (``done``: its offset may be stored) or was not started;
        ``elapsed_s`` is how long its handler ran (seconds), ``None`` when it did not run.

        Returns
        -------
        The lane's next message, already taken, when the calling worker should run it itself (no
        other message waits for a worker, so keeping the lane costs nobody anything and saves a
        hand-off); else ``None`` (the next message, if any, went to the ready queue).
        """
        with self.lock:
            if elapsed_s is not None:
                self._observe(elapsed_s)
            nxt = self._finish_locked(msg, done)
            if self.waiters:
                self.settled.notify_all()
        return nxt

    def finish_many(self, results: list[tuple[Message, Outcome]], elapsed_s: float) -> list[Message]:
        """:meth:`finish` for a chunk that ran: ``results`` is ``[(message, done)]`` and
        ``elapsed_s`` the chunk's total handler time. Returns the next messages to run."""
        out = []
        with self.lock:
            if results:
                self._observe(elapsed_s / len(results))
            for msg, done in results:
                nxt = self._finish_locked(msg, done)
                if nxt is not None:
                    out.append(nxt)
            if self.waiters:
                self.settled.notify_all()
        return out

    def _observe(self, per_message_s: float) -> None:
        avg = self.avg_handler_s = self.avg_handler_s * 0.95 + per_message_s * 0.05
        self.chunk = max(1, min(MAX_CHUNK, int(CHUNK_QUANTUM_S / avg) if avg > 0 else MAX_CHUNK))

    def _lease_drop(self, msg: Message) -> None:
        assert self.leases is not None
        self.leases.drop(msg, self.lid(msg))

    def _finish_locked(self, msg: Message, done: Outcome) -> Message | None:
        nxt = None
        part = msg._part
        if part.parked:  # run from a Redis parked list: the sequencer settles it with Redis
            part.running -= 1
            self.running -= 1
            self.buffered -= 1
            self.buffered_bytes -= msg._size
            q = self.parked_lanes.get(msg._lk)
            dead = self.quarantine and msg._state is not None and msg._state.get("dead_lettered")
            if q and done is True and not dead and not self.halted and self.leases is not None:
                # the drained batch goes on: the next parked message, under the same lease
                self.parked_results.append((msg, done, False))
                nxt = q.popleft()
                if not q:
                    del self.parked_lanes[msg._lk]
                self.leases.handover(msg, nxt, msg._lk)
                if self.ready:
                    self.ready.append(nxt)
                    self.wake(1)
                    return None
                part.running += 1
                self.running += 1
                return nxt
            if q is not None:  # the batch ends here: what did not start is read again later
                for m in self.parked_lanes.pop(msg._lk):
                    self._forget(m)
            self.parked_results.append((msg, done, True))
            return None
        leases = self.leases if msg._lanes is not None else None
        if leases is not None and part.state == ACTIVE and not self.halted:
            lid = self.lid(msg)
            if not leases.still_valid(msg, lid):
                # It ran under a lease this instance lost (expired, taken over, Redis down): its
                # result does not count. It waits, first of its lane, to run again under a new lease.
                part.running -= 1
                self.running -= 1
                leases.requeue(msg, lid)
                return None
        if done is False and msg._lanes is not None and part.state == ACTIVE and not self.halted:
            # Not started (Dispatcher.may_start said no): it stays its lane's head, the lane does
            # not go on without it (that would run its key's later messages first and hold the
            # partition's offset back). While the consumer stops or the partition is being revoked
            # it waits in ``held`` until it is below the highest finished offset (then it may run:
            # release_held) or is dropped; otherwise (its lease was briefly unconfirmed) it is
            # ready again at once.
            part.running -= 1
            self.running -= 1
            if self.stopping or part.catching_up:
                self.held.append(msg)
            else:
                self.ready.appendleft(msg)
                self.wake(1)
            return None
        if type(done) is Park and leases is not None and self.parking:
            if not (self.halted or part.state != ACTIVE):
                # Park the key: this message (due again after the delay) and every later message of
                # its lane go to Redis; their offsets count done once Redis acknowledged them.
                part.running -= 1
                self.running -= 1
                msg.attempt += 1
                self.retries += 1
                self.to_park.append((msg, float(done)))
                return None
            done = False
        if isinstance(done, float):
            if self.halted or part.state != ACTIVE:
                done = False  # nobody will run it again here: it ends not done
            else:
                # Run again later: it stays the head of its lane (its key waits, others go on) and
                # its offset stays unfinished. The attempt number grows before the next attempt.
                part.running -= 1
                self.running -= 1
                msg.attempt += 1
                self.retries += 1
                heapq.heappush(self.delayed, (self.clock() + done, next(self._seq), msg))
                return None
        lanes = msg._lanes
        if lanes is not None:
            lk = msg._lk
            q = lanes.get(lk)
            if q:
                nxt = q.popleft()
                if self.halted or nxt._part.state != ACTIVE:
                    self._forget(nxt)
                    for m in q:
                        self._forget(m)
                    del lanes[lk]
                    nxt = None
                    if leases is not None:
                        leases.drop(msg, self.lid(msg))
                else:
                    if leases is not None:
                        leases.handover(msg, nxt, self.lid(msg))
                    if self.ready:
                        self.ready.append(nxt)
                        self.wake(1)
                        nxt = None
                    else:
                        nxt._part.running += 1
                        self.running += 1
            else:
                lanes.pop(lk, None)
                if leases is not None:
                    other = leases.lane_dry(msg, self.lid(msg))
                    if other is not None:  # the same key's lane of another partition goes on
                        self.route(other)
        if done and part.state != CLOSED:
            part.tracker.done(msg._off)
            self._dirty.add(part)
        part.running -= 1
        self.running -= 1
        self.buffered -= 1
        self.buffered_bytes -= msg._size
        return nxt

    # -- parking (the poll thread, lock held) ---------------------------------------------------

    def done_parked(self, msg: Message) -> None:
        """``msg`` is parked in Redis (acknowledged on disk): its offset counts done."""
        part = msg._part
        if part.state != CLOSED:
            part.tracker.done(msg._off)
            self._dirty.add(part)
        self.buffered -= 1
        self.buffered_bytes -= msg._size

    def lane_end(self, head: Message, lid: str) -> None:
        """The lane of ``head`` has nothing left: the lease goes to another lane head, or idles."""
        if head._lanes is not None:
            head._lanes.pop(head._lk, None)
        assert self.leases is not None
        other = self.leases.lane_dry(head, lid)
        if other is not None:
            self.route(other)

    def lease_lost(self, msgs: list[Message], lid: str) -> None:
        """Redis refused to park ``msgs`` (the lease is not ours): they wait for the lease again."""
        head = msgs[0]
        if len(msgs) > 1 and head._lanes is not None:
            q = head._lanes.get(head._lk)
            if q is None:
                q = head._lanes[head._lk] = deque()
            q.extendleft(reversed(msgs[1:]))
        assert self.leases is not None
        self.leases.requeue(head, lid)

    def _forget(self, msg: Message) -> None:
        self.buffered -= 1
        self.buffered_bytes -= msg._size
