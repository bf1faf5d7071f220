"""The engine's state and its one owner: lanes, offsets, the ready queue and the in-flight counts.

One thread owns an :class:`Engine`: the consumer's poll thread (:mod:`.run`). It admits polled
records, hands work to the workers (:meth:`Engine.take`, :meth:`Engine.take_batch`), settles what
they report (:meth:`Engine.finish`, from the mailbox it drains in bulk), serves rebalances and reads
the offsets to store. No lock guards this state: nothing but the owner writes it. Workers only read
it, through :meth:`Engine.may_start` and :meth:`Engine.owns`, and reach the owner by posting to its
mailbox (:mod:`.workers`). The sequencer (:mod:`.sequencer`) is called in the owner thread and acts
on the lanes through the narrow :class:`~.sequencer.LanePort` the engine hands it.
The objects under it are pure data behind short lists of methods: the partitions and their offset
trackers (:mod:`.partitions`), lanes (:mod:`.lanes`), ready heads (:mod:`.ready`), counts (:mod:`.flow`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from ..kafka import TP
from ..message import Message
from ..offsets import FinishedOffsets
from .admission import Admission
from .delivery import Delivery
from .flow import InFlight
from .latch import Latch
from .outcome import HALT, Done, NotStarted, Outcome, Park, Retry
from .partitions import ACTIVE, CLOSED, REVOKING, Partition, Partitions
from .port import Port
from .ready import ReadyQueue
from .sequencer import InMemorySequencer, LanePort, Sequencer

__all__ = ["Engine", "CHUNK_QUANTUM_S", "MAX_CHUNK"]

#: A worker gets at once as many ready messages as its handler runs in about this time (seconds,
#: from a moving average of handler durations): fast handlers are handed over in chunks, so one
#: hand-over serves many messages; slow handlers one by one.
CHUNK_QUANTUM_S = 0.002
#: Upper bound of a chunk, in messages.
MAX_CHUNK = 256


class Engine:
    """Lanes, ready heads, in-flight accounting and partitions of one run of a consumer.

    Owner thread only, except :meth:`may_start`, :meth:`owns`, :meth:`signal_halt` and the read-only
    counters (see the module docstring).

    Parameters
    ----------
    ordering:
        ``"key"``, ``"partition"`` or ``"none"``.
    sequencer:
        Who may run a lane's head (default :class:`~.sequencer.InMemorySequencer`).
    post:
        ``post(fn, arg)`` runs ``fn(arg)`` in the owner thread soon (the owner's mailbox): given to
        the sequencer's threads through its port.
    clock:
        Monotonic clock in seconds for retry due times (:mod:`keyedconsumer.testing` passes a fake one).
    group:
        The consumer group, set on every message admitted (``Message.group_id``).
    metadata_max_bytes:
        Bound of the commit metadata (``commit_metadata_max_bytes``).
    max_in_flight, max_in_flight_bytes:
        The back-pressure bounds.
    conflate:
        Only the newest waiting message of a lane runs (``conflate=True``).
    stop_signal:
        The consumer's stop latch (set from any thread by ``stop()``): see :meth:`stop_starting`.
    """

    def __init__(
        self,
        ordering: str,
        sequencer: Sequencer | None = None,
        post: Callable[[Callable[[Any], None], Any], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        group: str = "",
        metadata_max_bytes: int = 0,
        max_in_flight: int = 1 << 62,
        max_in_flight_bytes: int = 1 << 62,
        conflate: bool = False,
        stop_signal: Latch | None = None,
    ) -> None:
        self.ordering = ordering
        self.group = group
        self.seq: Sequencer = sequencer or InMemorySequencer()
        # an in-memory sequencer answers every question with the default: not asked on the hot path
        self._plain = bool(getattr(self.seq, "trivial", False))
        self.partitions = Partitions(metadata_max_bytes)
        self.queue = ReadyQueue(clock)
        self.flow = InFlight(max_in_flight, max_in_flight_bytes)
        self.conflate = conflate and ordering != "none"
        self.halted = False  # no new message starts
        self._stop_signal = stop_signal if stop_signal is not None else Latch()  # see stop_starting
        self.closed = False  # the run is over: no result counts any more
        self._halt_signal = Latch()  # a failure in a worker: nothing new starts from now
        self._retries = 0  # Retry and Park outcomes so far
        self._conflated = 0  # messages conflated in the lanes (replaced by a newer one of their lane)
        self._avg_handler_s = 0.001  # moving average of handler durations
        self._chunk = 1  # messages one worker gets at once
        # a lane's run goes to one worker in one unit (see take): with the in-memory sequencer only
        # (a lease is asked for each head), and not with conflate (only the newest waiting runs)
        self._follow = self._take_along if self._plain and not self.conflate and ordering != "none" else None
        #: The partitions assigned now (a tuple the owner replaces: safe to read from any thread).
        self.assignment: tuple[TP, ...] = ()
        self._admission = Admission(
            ordering, self.partitions, self.queue, self.flow, self.seq, self.owns, group, self.conflate
        )
        self._port = Port(self, post)
        self.port: LanePort = self._port

    # -- handing out work ---------------------------------------------------------------------------

    def take(self, max_chunks: int) -> list[list[Delivery]]:
        """Up to ``max_chunks`` chunks of ready heads, oldest admitted first, for workers that run
        them one message after the other, in admission order.

        When the oldest message left is queued behind a head already in the chunk, it is taken
        along (the lane's *run*: :attr:`.delivery.Delivery.follower`): the worker runs it right
        after that head if the head ended done, and skips it otherwise (the owner then queues it on
        its lane again). So a hot lane (a hot key, or ``ordering="partition"``) runs a chunk's worth
        of messages per hand-over, not one per turn of the owner. With a Redis sequencer (a lease
        per head) or ``conflate`` the chunk stops before such a message instead."""
        out: list[list[Delivery]] = []
        queue, chunk, partitions, flow = self.queue, self._chunk, self.partitions, self.flow
        while queue and len(out) < max_chunks:
            taken = queue.take(chunk, self._behind, self._follow)
            partitions.started(taken)
            flow.started(len(taken))
            out.append(taken)
        return out

    def take_batch(self, size: int) -> list[Delivery]:
        """Up to ``size`` ready heads for one batch handler call (:meth:`.ready.ReadyQueue.take_batch`)."""
        batch = self.queue.take_batch(size)
        self.partitions.started(batch)
        self.flow.started(len(batch))
        return batch

    @property
    def chunk(self) -> int:  # messages a worker gets at once now (from handlers' average duration)
        return self._chunk

    @property
    def stopping(self) -> bool:
        """A graceful stop is under way (see :meth:`stop_starting`)."""
        return self._stop_signal.on

    @staticmethod
    def _behind(d: Delivery) -> int | None:
        part = d.part
        return part.lanes.next_order(d) if part is not None and d.lane is not None else None

    @staticmethod
    def _take_along(d: Delivery) -> Delivery:
        """Take the message queued behind ``d`` off its lane: it runs after ``d``, in ``d``'s unit."""
        assert d.part is not None
        f = d.part.lanes.take_next(d)
        d.take_along(f)
        return f

    def _return_run(self, d: Delivery) -> list[Delivery]:
        """The messages taken along behind ``d`` go back to its lane, unstarted (``d`` did not end
        done, or is still running while the rest of its unit is taken back)."""
        part = d.part
        assert part is not None
        run = d.cut_run()
        part.lanes.return_taken(run)
        part.ended(len(run))
        self.flow.ended(len(run))
        return run

    def ready_count(self) -> int:
        return len(self.queue)

    def may_start(self, d: Delivery) -> bool:
        """(Workers, read only.) True unless the consumer halted, its partition was revoked or
        lost, the consumer is stopping (or its partition being revoked) and it is not below its
        partition's highest finished offset, or the sequencer says no."""
        if self._halt_signal.on:
            return False
        part = d.part
        if part is not None:
            # (the common case, an active partition and no stop, without a call)
            stopping = self._stop_signal.on
            if (part.state != ACTIVE or stopping or part.catching_up) and not part.may_start(
                d.offset, stopping
            ):
                return False
            if d.lane is None or self._plain:
                return True
        return self.seq.may_start(d)

    def signal_halt(self) -> None:
        """(Any thread.) A failure nothing handled: no message starts from now on (then :meth:`halt`)."""
        self._halt_signal.set()

    # -- settling -------------------------------------------------------------------------------------

    def finish(self, results: list[tuple[Delivery, Outcome]], elapsed_s: float = 0.0) -> None:
        """Workers ran ``results`` (``[(delivery, outcome)]``) in ``elapsed_s`` seconds of handler
        time: the lanes go on (their next messages become ready), the offsets count done."""
        if elapsed_s and results:
            avg = self._avg_handler_s = self._avg_handler_s * 0.95 + elapsed_s / len(results) * 0.05
            self._chunk = max(1, min(MAX_CHUNK, int(CHUNK_QUANTUM_S / avg) if avg > 0 else MAX_CHUNK))
        finish, push = self._finish, self.queue.push
        if not self._plain or self.halted:
            for d, outcome in results:
                nxt = finish(d, outcome)
                if nxt is not None:
                    push(nxt)
            return
        # the common case in one pass: in-memory sequencing, done messages of active partitions
        done = self.partitions.done_many
        ended = nbytes = 0
        for d, outcome in results:
            part = d.part
            if type(outcome) is not Done or part is None or part.state != ACTIVE:
                nxt = finish(d, outcome)
                if nxt is not None:
                    push(nxt)
                continue
            if d.follower is not None:  # taken along: the lane's head now, running in the same unit
                d.hand_over()
            elif d.lane is not None:
                nxt = part.lanes.advance(d)
                if nxt is not None:
                    push(nxt)  # the same assignment's next message of the lane: it may run
            done(part, d.offset)
            ended += 1
            nbytes += d.size
        if ended:
            self.flow.finished(ended, nbytes)

    def give_back(self, ds: Iterable[Delivery]) -> None:
        """Taken, not started messages return to the ready queue (taken back from a stuck worker, or
        queued units no worker took yet);
        those taken along behind a message not ended yet return to their lane (call it before
        :meth:`finish` of the outcomes taken back with them)."""
        ds = list(ds)
        returned: set[Delivery] = set()
        for d in ds:
            if d.prev is not None and d not in returned:
                returned.update(self._return_run(d.prev))
        for d in ds:
            if d in returned:
                continue
            if d.follower is not None:
                self._return_run(d)
            if self.halted or (d.part is not None and not d.part.active):
                # revoked, lost or halted: it ends here; its lane's next message (of a next assignment) may run
                nxt = self._finish(d, HALT)
                if nxt is not None:
                    self.queue.push(nxt)
                continue
            if d.part is not None:
                d.part.ended()
            self.flow.ended()
            self.queue.push(d)

    def _finish(self, d: Delivery, outcome: Outcome) -> Delivery | None:
        """One taken message ended: returns its lane's next message when that may run now."""
        part = d.part
        flow = self.flow
        if d.follower is not None and type(outcome) is not Done:
            self._return_run(d)  # the worker skipped the messages taken along behind it
        if part is None:  # brought by the sequencer: it settles it (e.g. in Redis)
            flow.ended()
            flow.forget(d.size)
            return self.seq.on_external_end(d, outcome)
        lane = d.lane
        live = part.state == ACTIVE and not self.halted
        plain = self._plain
        if lane is not None and live and not plain and not self.seq.accepts(d):
            # it ran under a lease this instance lost: its result does not count; the sequencer
            # keeps it, first of its lane, until it may run again
            part.ended()
            flow.ended()
            return None
        if type(outcome) is not Done and self._keep(d, part, outcome, live):
            return None
        nxt = None
        if d.follower is not None:  # done, and taken along: the lane's head now, running
            d.hand_over()
        elif lane is not None:
            lanes = part.lanes
            nxt = lanes.advance(d)
            if nxt is not None and (self.halted or nxt.part is None or nxt.part.state != ACTIVE):
                for x in [nxt, *lanes.end(nxt)]:
                    flow.forget(x.size)
                nxt = None  # the lane ends here, as one that ran dry: its key's lease may go on
            if nxt is not None:
                if not plain:
                    self.seq.on_next(d, nxt)
            elif not plain:  # e.g. to the key's lane of another partition, waiting for the lease
                ready = self.seq.on_lane_end(d)
                if ready is not None:
                    self.queue.push(ready)
        if type(outcome) is Done:
            self.partitions.done(part, d.offset)
        part.ended()
        flow.ended()
        flow.forget(d.size)
        return nxt

    def _keep(self, d: Delivery, part: Partition, outcome: Outcome, live: bool) -> bool:
        """A run that did not end its message (not started, a retry, a park): keep the message
        where it belongs now and return ``True``; ``False`` when it ends after all (its partition
        or the consumer stopped: it is dropped, not done)."""
        lane = d.lane
        match outcome:
            case NotStarted() if lane is not None and live:
                # it stays its lane's head (its key's later messages must not run first): held while
                # stopping or catching up (until it is below the highest finished offset), else
                # ready again at once, or kept by the sequencer (until its lease was renewed)
                part.ended()
                self.flow.ended()
                if self.stopping or part.catching_up:
                    self.queue.hold(d)
                elif self._plain or self.seq.not_started(d):
                    self.queue.push(d)
                return True
            case Park(delay_s) if lane is not None and live and self.seq.park(d, delay_s):
                # its key is parked: it and its lane go to the sequencer (done once stored there)
                part.ended()
                self.flow.ended()
                d.msg.attempt += 1
                self._retries += 1
                return True
            case Retry(delay_s) | Park(delay_s) if live:
                # run again later, still its lane's head (its key waits, others go on), unfinished
                part.ended()
                self.flow.ended()
                d.msg.attempt += 1
                self._retries += 1
                self.queue.delay(d, delay_s, type(outcome) is Retry and outcome.alone)
                return True
        return False

    # -- admitting --------------------------------------------------------------------------------

    def admit(self, msgs: list[Message]) -> list[Message]:
        """Take freshly polled messages: track their offsets and queue them on their lanes
        (:class:`.admission.Admission`). Returns the messages conflated meanwhile (``conflate``):
        they count done and never run."""
        conflated = self._admission.admit(msgs)
        self._conflated += len(conflated)
        return conflated

    # -- retries, holds, stop -----------------------------------------------------------------------

    def release_due(self, now: float) -> float | None:
        """Make ready the retries due at ``now`` (clock seconds). Returns the seconds until the
        next one is due, or ``None`` when none waits."""
        self.queue.release_due(now)
        due = self.queue.next_due_s()
        return None if due is None else due - now

    def next_due_s(self) -> float | None:
        """When the next retry is due (clock seconds), or ``None``."""
        return self.queue.next_due_s()

    def release_held(self) -> None:
        """Make ready the held heads that may start now (below their partition's highest finished
        offset, or no longer stopping / catching up)."""
        stopping = self.stopping
        self.queue.release_held(lambda d: d.part is None or d.part.may_start(d.offset, stopping))

    def stop_starting(self) -> None:
        """(Any thread.) From now on only messages below their partition's highest finished offset
        start (a graceful stop)."""
        self._stop_signal.set()

    def halt(self) -> None:
        """Start nothing new: drop every ready, delayed, held and queued message (they stay not done)."""
        self.halted = True
        self._halt_signal.set()
        forget = self.flow.forget
        for d in self.queue.clear():
            forget(d.size)
            self.seq.on_drop(d)
        for d in self.seq.drop(lambda d: False):
            forget(d.size)
        for lanes in self.partitions.lanes_of():
            for d in lanes.clear_queued():
                forget(d.size)

    def close(self) -> None:
        """The run is over: nothing starts, no late result counts."""
        self.closed = True
        self.halted = True
        self._halt_signal.set()

    def catching_up(self, parts: list[Partition], retry_before: float) -> bool:
        """Whether a catch-up of ``parts`` should go on: one still has a message below its highest
        finished offset, and something may still finish it (a handler running, a head ready, a
        retry due before ``retry_before`` (clock seconds), or the sequencer's work under way)."""
        if not any(p.active and p.tracker.behind_done() for p in parts):
            return False
        due = self.queue.next_due_s()
        soon = due is not None and due < retry_before
        return self.flow.running > 0 or bool(self.queue) or soon or self.seq.busy()

    def running_in(self, parts: list[Partition] | None) -> int:
        """Messages of ``parts`` (all when ``None``) taken by a worker and not finished."""
        return self.flow.running if parts is None else sum(p.running for p in parts)

    # -- assignment -----------------------------------------------------------------------------

    def assign(self, tps: Iterable[TP], finished: dict[TP, FinishedOffsets] | None = None) -> None:
        """Start tracking newly assigned partitions; ``finished``: per partition, the offsets its
        previous owner finished above the committed offset (read from the commit metadata)."""
        self.partitions.assign(tps, finished)
        self.assignment = tuple(self.partitions.by_tp)

    def catch_up(self, parts: list[Partition]) -> None:
        """``parts`` are being revoked: only their messages below the highest finished offset start."""
        for p in parts:
            p.catch_up(True)

    def begin_revoke(self, tps: Iterable[TP], lost: bool = False) -> list[Partition]:
        """Stop the partitions: drop their queued messages; none of theirs starts from now on.
        With ``lost`` the partitions are closed at once (nothing of theirs is stored again)."""
        parts = self.partitions.begin_revoke(tps, lost)
        self.assignment = tuple(self.partitions.by_tp)
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
        """Close revoked partitions; return what to commit for them (as
        :meth:`~.partitions.Partitions.commit_offsets`)."""
        out = self.partitions.commit_offsets([p for p in parts if p.state == REVOKING])
        self.partitions.close(parts)
        return out

    def take_conflated(self) -> list[Message]:
        """The messages the sequencer conflated since the last call (the owner reports them)."""
        return self._port.take_conflated()

    @property
    def conflated(self) -> int:
        """Messages conflated so far: in the lanes, and where the sequencer keeps them."""
        return self._conflated + self._port.conflated_count

    @property
    def retries(self) -> int:
        """Retry and Park outcomes so far, and the sequencer's retries of parked messages."""
        return self._retries + self._port.retries

    @property
    def skipped_finished(self) -> int:  # messages the previous owner had finished: not run
        return self.partitions.skipped_finished

    # -- still owned (Message.still_owned; any thread, read only) -------------------------------

    def owns(self, d: Delivery) -> bool:
        """True while a run of ``d`` still counts: its partition is assigned (or being revoked: the
        revoke's commit covers it), this run of the consumer is not over, and the sequencer agrees
        (its key's lease is still this instance's)."""
        if self.closed:
            return False
        part = d.part
        if part is not None and part.state == CLOSED:
            return False
        if part is not None and d.lane is None:
            return True
        return self.seq.owns(d)

    # -- status (any thread: plain counters) --
    @property
    def in_flight(self) -> int:  # messages buffered or running now
        return self.flow.buffered

    @property
    def running(self) -> int:  # messages taken by a worker and not finished
        return self.flow.running
