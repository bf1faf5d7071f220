"""A deterministic simulation of the engine's owner (FoundationDB's and TigerBeetle's way of testing).

With one owner thread, the engine's state is a function of the events it receives. This drives an
:class:`~keyedconsumer.engine.engine.Engine` (the in-memory sequencer) from a seed through random
interleavings of the events a run delivers to its owner: records produced and polled (an
:class:`~keyedconsumer.testing.InMemoryBroker` holds the topic), work handed to simulated workers,
each worker starting a message (or finding it may not start) and ending it (done, failed and retried
later, parked, timed out and retried, not started), outcomes reported in bulk or taken back from a
worker stuck in a handler, stores, clock jumps, revokes (with their catch-up and commit), assigns
(from the committed offset and its metadata), lost partitions, and stops followed by a new run.

After every event it checks what the engine promises:

- **per-key order**: within one assignment of a partition, each key's messages start in offset
  order (a retried message starts again at the same offset);
- **one in flight per key**: no two messages of one key (of one partition) run at once, across
  assignments too (a revoked partition's running message and the next assignment's);
- **no offset past an unfinished message**: every offset stored or committed has every received
  offset below it finished (done, conflated, or finished by a previous owner);
- **memory within its bound**: buffered messages never exceed ``max_in_flight``, and the engine's
  counts match what the simulated workers hold;
- **nothing lost** (at the end): after a last run drains the topic, every record below the final
  committed offset of its partition ended done at least once, and that offset is the log's end.

A failing run raises :class:`Violation` naming the seed and the event: ``scripts/simulate --seed S
--events N`` replays it exactly (nothing here reads a real clock or iterates a hash-ordered set).
"""

from __future__ import annotations

import dataclasses
import random
import weakref
from collections import deque
from collections.abc import Callable

from keyedconsumer.engine.delivery import Delivery
from keyedconsumer.engine.engine import Engine
from keyedconsumer.engine.handout import HandOut
from keyedconsumer.engine.outcome import DONE, NOT_STARTED, Done, Outcome, Park, Retry
from keyedconsumer.engine.partitions import ACTIVE, CLOSED
from keyedconsumer.engine.workers import Slot, Unit, Workers
from keyedconsumer.message import Message
from keyedconsumer.offsets import FinishedOffsets
from keyedconsumer.testing import InMemoryBroker

__all__ = ["Simulation", "SimConfig", "Violation", "simulate"]

TOPIC = "t"


class Violation(AssertionError):
    """A broken promise: the seed and event index replay it."""


@dataclasses.dataclass(frozen=True)
class SimConfig:
    """The shape of a simulated run."""

    partitions: int = 3
    keys: int = 5
    workers: int = 3
    max_in_flight: int = 40
    batch: int = 6
    metadata_max_bytes: int = 64
    conflate: bool = False
    #: batch handlers: each unit is one call of up to this many lane heads (0: per-message chunks)
    batch_size: int = 0
    #: every run ends done (no retries, parks or refusals): with one worker each partition then
    #: starts in offset order, which is checked too
    only_done: bool = False
    #: handlers take microseconds: chunks grow to MAX_CHUNK and carry lanes' runs (a message taken
    #: along behind its lane's head, run only if the head ended done)
    fast: bool = False


class _Workers(Workers):
    """The worker pool the owner hands units to (:class:`~keyedconsumer.engine.handout.HandOut`):
    one shared FIFO of units and a slot a worker; the simulation plays the workers."""

    def __init__(self, concurrency: int) -> None:
        self.concurrency = concurrency
        self.slots = [Slot() for _ in range(concurrency)]
        self.queue: deque[Unit] = deque()

    def submit(self, units: list[Unit]) -> None:
        self.queue.extend(units)

    def take_queued(self) -> list[Unit]:
        out = list(self.queue)
        self.queue.clear()
        return out


@dataclasses.dataclass
class _Worker:
    """What one simulated worker does now: a chunk (run one message after the other through its
    slot), or a batch (all of it starts in one call and ends together)."""

    slot: Slot
    chunk: bool = False  # a chunk is loaded in the slot
    running: Delivery | None = None
    ended: tuple[Delivery, Outcome] | None = None  # the last outcome, not in the slot yet
    batch: list[Delivery] | None = None  # a batch handed over, not started
    batch_running: list[Delivery] = dataclasses.field(default_factory=list)
    batch_results: list[tuple[Delivery, Outcome]] = dataclasses.field(default_factory=list)

    @property
    def idle(self) -> bool:
        return not self.chunk and self.batch is None and not self.batch_running


class Simulation:
    """One seeded simulation (see the module docstring)."""

    def __init__(self, seed: int, config: SimConfig | None = None) -> None:
        self.seed = seed
        self.cfg = cfg = config or SimConfig()
        self.rng = random.Random(seed)
        self.now = 0.0
        self.events = 0
        self.broker = InMemoryBroker()
        self.broker.create_topic(TOPIC, partitions=cfg.partitions)
        self.log: list[list[tuple[bytes, int]]] = [[] for _ in range(cfg.partitions)]  # (key, offset)
        self.committed: dict[int, tuple[int, str]] = {}  # partition -> (offset, metadata)
        self.done_ever: list[set[int]] = [set() for _ in range(cfg.partitions)]
        # per partition, what its previous owner finished above the committed offset (metadata)
        self._inherited: dict[int, FinishedOffsets | None] = {}
        self.runs = 0
        self.last = ""
        self._new_engine()

    # -- a run --------------------------------------------------------------------------------------

    def _new_engine(self) -> None:
        cfg = self.cfg
        self.engine = Engine(
            "key",
            None,
            lambda fn, arg=None: fn(arg),
            lambda: self.now,
            "sim",
            cfg.metadata_max_bytes,
            cfg.max_in_flight,
            1 << 40,
            cfg.conflate,
        )
        self.runs += 1
        self.assigned: list[int] = []
        self.position: dict[int, int] = {}  # the next offset to fetch, per assigned partition
        self.generation: dict[int, int] = {}  # assignment number, per partition
        self.received: dict[int, list[int]] = {}  # offsets admitted in this assignment
        self.finished: dict[int, set[int]] = {}  # offsets finished in this assignment
        self.pool = _Workers(cfg.workers)
        self.workers = [_Worker(slot) for slot in self.pool.slots]
        self.handout = HandOut(self.engine, self.pool, cfg.batch_size, 0.0)
        self.starts: dict[tuple[int, int], int] = {}  # (generation, partition) -> last offset started
        self.alone: weakref.WeakSet[Delivery] = weakref.WeakSet()  # retries to come in a batch of their own
        self.last_start: dict[tuple[int, int, bytes], int] = {}  # (generation, partition, key)
        self.paused = False
        self.stopping = False

    def _running(self) -> list[Delivery]:
        out = []
        for w in self.workers:
            if w.running is not None:
                out.append(w.running)
            out.extend(w.batch_running)
        return out

    # -- events -------------------------------------------------------------------------------------

    def step(self) -> str:
        """One random event; returns its name (after checking every promise)."""
        rng = self.rng
        choices: list[tuple[float, str, Callable[[], None]]] = [
            (3.0, "produce", self.produce),
            (0.5 if self.stopping else 3.0, "poll", self.poll),
            (3.0, "dispatch", self.dispatch),
            (12.0, "work", self.work),
            (0.5, "rescue", self.rescue),
            (2.0, "store", self.store),
            (1.0, "clock", self.clock),
            (0.2, "revoke", self.revoke),
            (2.0 * (self.cfg.partitions - len(self.assigned)), "assign", self.assign),
            (0.05, "lost", self.lose),
            (0.03, "stop", self.stop),
        ]
        total = sum(w for w, _, _ in choices)
        x = rng.random() * total
        name, fn = choices[-1][1], choices[-1][2]
        for w, n, f in choices:
            x -= w
            if x <= 0:
                name, fn = n, f
                break
        self.events += 1
        self.last = name
        fn()
        self.check()
        return name

    def produce(self) -> None:
        for _ in range(self.rng.randint(1, 4)):
            p = self.rng.randrange(self.cfg.partitions)
            key = b"k%d" % self.rng.randrange(self.cfg.keys)
            rec = self.broker.produce(TOPIC, b"v", key=key, partition=p)
            self.log[p].append((key, rec.offset))

    def poll(self) -> None:
        """Fetch what the room allows from the assigned partitions (not while paused)."""
        e = self.engine
        if self.paused or self.stopping or not self.assigned:
            return
        n = e.flow.poll_size(self.cfg.batch)
        msgs = []
        for p in self.rng.sample(self.assigned, len(self.assigned)):
            log = self.log[p]
            while self.position[p] < len(log) and len(msgs) < n:
                key, off = log[self.position[p]]
                msgs.append(Message(TOPIC, p, off, key, b"v"))
                self.position[p] += 1
        for m in msgs:
            self.received[m.partition].append(m.offset)
        conflated = e.admit(msgs)
        for m in conflated:
            self.finished[m.partition].add(m.offset)
            self.done_ever[m.partition].add(m.offset)
        for m in msgs:  # skipped: the previous owner had finished them (commit metadata)
            fin = self._inherited.get(m.partition)
            if fin is not None and fin.covers(m.offset):
                self.finished[m.partition].add(m.offset)
        self._backpressure()

    def _backpressure(self) -> None:
        flow = self.engine.flow
        if flow.over():
            self.paused = True
        elif self.paused and flow.under_half():
            self.paused = False

    def dispatch(self) -> None:
        # the owner's turn: how long it took to answer a ring sizes the queue ahead of the workers
        # (HandOut.turn), from one unit a worker up to three
        self.handout.turn(self.rng.choice((0.0, 0.0, 0.001, 0.05)), self.now)
        self.handout.dispatch()

    def work(self) -> None:
        """One worker's next step: take a unit, start a message (or find it may not start), end the
        running one; a worker at the end of its unit reports it."""
        self._step(self.rng.choice(self.workers))

    def _step(self, w: _Worker) -> None:
        if w.idle:
            if self.pool.queue:
                unit = self.pool.queue.popleft()
                if self.cfg.batch_size:
                    w.batch = unit
                    alone = [d for d in unit if d in self.alone]
                    if alone and len(unit) > 1:
                        self.fail(
                            f"a retry that failed with its whole batch came with {len(unit) - 1} other(s)"
                        )
                    for d in alone:
                        self.alone.discard(d)
                else:
                    w.slot.load(unit)
                    w.chunk = True
            return
        if w.batch is not None:  # a batch: all of it starts in one call
            for d in w.batch:
                if not self.engine.may_start(d):
                    w.batch_results.append((d, NOT_STARTED))
                elif self._start(d):
                    w.batch_running.append(d)
            w.batch = None
            if not w.batch_running:
                self._report(w.batch_results)
                w.batch_results = []
            return
        if w.batch_running:  # and all of it ends together
            ends = [(d, self._outcome()) for d in w.batch_running]
            if len(ends) > 1 and self.rng.random() < 0.2:  # the call raised, naming no message
                ends = [(d, Retry(0.0, alone=True)) for d, _ in ends]
                self.alone.update(d for d, _ in ends if d.part is not None and d.part.state == ACTIVE)
            w.batch_results.extend(ends)
            w.batch_running = []
            self._report(w.batch_results)
            w.batch_results = []
            return
        if w.running is not None:
            w.ended, w.running = (w.running, self._outcome()), None
            return
        d = w.slot.next(w.ended)
        w.ended = None
        if d is None:  # the chunk is over: its outcomes go to the owner
            w.chunk = False
            self._report(w.slot.unload())
            return
        if not self.engine.may_start(d):
            w.ended = (d, NOT_STARTED)
        elif self._start(d):
            w.running = d

    def _start(self, d: Delivery) -> bool:
        """``d`` starts: checks that no message of its key runs and that its key goes in order."""
        p, key = d.msg.partition, _key(d)
        if any((r.msg.partition, _key(r)) == (p, key) for r in self._running()):
            self.fail(f"two messages of key {key!r} of partition {p} run at once")
        part = d.part
        assert part is not None
        gen = self.generation.get(p, 0) if part.state == ACTIVE else -1
        last = self.last_start.get((gen, p, key))
        if gen >= 0 and last is not None and d.offset < last:
            self.fail(f"key {key!r} of partition {p} started offset {d.offset} after {last}")
        if gen >= 0:
            self.last_start[(gen, p, key)] = d.offset
            if self.cfg.only_done and self.cfg.workers == 1:
                prev = self.starts.get((gen, p))
                if prev is not None and d.offset <= prev:
                    self.fail(f"one worker started partition {p}'s offset {d.offset} after {prev}")
                self.starts[(gen, p)] = d.offset
        return True

    def _outcome(self) -> Outcome:
        if self.cfg.only_done:
            return DONE
        x = self.rng.random()
        if x < 0.78:
            return DONE
        if x < 0.88:
            return Retry(self.rng.choice([0.0, 0.5, 2.0]))  # failed (or timed out) and retried
        if x < 0.94:
            return Park(self.rng.choice([0.0, 1.0]))  # the in-memory sequencer retries it in memory
        return NOT_STARTED

    def _report(self, results: list[tuple[Delivery, Outcome]]) -> None:
        """A worker posts a unit's outcomes; the owner drains them (the mailbox, in order)."""
        self._record(results)
        elapsed_s = 1e-6 * len(results) if self.cfg.fast else self.rng.choice([0.0, 1e-5, 0.01])
        self.handout.report((results, elapsed_s))
        self._backpressure()

    def rescue(self, force: bool = False) -> None:
        """The owner takes back from workers stuck in a handler what they did not start (with
        ``force``, or with several workers) and settles the outcomes they did not report yet."""
        for slot in self.pool.slots:
            slot.started_s = -1e9  # every worker counts as stuck: no real clock is read
        taken = [list(slot.results) for slot in self.pool.slots]
        for results in taken:
            self._record(results)
        self.handout.rescue(force)
        self._backpressure()

    def _record(self, results: list[tuple[Delivery, Outcome]]) -> None:
        for d, outcome in results:
            part = d.part
            if outcome is DONE and part is not None and part.state != CLOSED:
                p = d.msg.partition
                self.finished[p].add(d.offset)
                self.done_ever[p].add(d.offset)

    def _settle(self, until: Callable[[], bool]) -> None:
        """Workers end what they run and finish their units (the owner takes back what they did
        not start) until ``until()``: a revoke's or a stop's wait for running handlers."""
        for _ in range(100_000):
            if until():
                return
            self.rescue(force=True)
            for w in self.workers:
                self._step(w)
            self.handout.dispatch()
        self.fail("running handlers never ended")

    def store(self) -> None:
        # paced as AutoCommit paces it (auto.commit.interval.ms 5 s x STORE_SHARE), on the sim's clock
        for part, wm, _meta in self.engine.partitions.advances(self.now, 0.5):
            self._check_offset(part.partition, wm, "stored")
            part.mark_stored(wm)

    def clock(self) -> None:
        self.now += self.rng.choice([0.1, 0.5, 1.0, 3.0])
        self.engine.release_due(self.now)

    def assign(self) -> None:
        free = [p for p in range(self.cfg.partitions) if p not in self.assigned]
        if not free or self.stopping:
            return
        p = self.rng.choice(free)
        offset, meta = self.committed.get(p, (0, ""))
        fin = FinishedOffsets.decode(offset, meta)
        self._inherited[p] = fin
        self.engine.assign([(TOPIC, p)], {(TOPIC, p): fin} if fin is not None else None)
        self.assigned.append(p)
        self.position[p] = offset
        self.generation[p] = self.generation.get(p, 0) + 1
        self.received[p] = []
        self.finished[p] = set()

    def revoke(self) -> None:
        """A revoke: a catch-up (only messages below the highest finished offset start), the
        revoked partition's queued messages dropped, its running handlers waited for, its offset
        committed with the metadata."""
        if not self.assigned:
            return
        p = self.rng.choice(self.assigned)
        e = self.engine
        part = e.partitions.get((TOPIC, p))
        assert part is not None
        e.catch_up([part])
        for _ in range(self.rng.randint(0, 30)):  # the catch-up's turns: no polls meanwhile
            self.rng.choice([self.dispatch, self.work, self.work, self.clock])()
            e.release_held()
            self.check()
        (closing,) = e.begin_revoke([(TOPIC, p)])
        self._settle(lambda: e.running_in([closing]) == 0)
        offsets, meta = e.close_parts([closing])
        for _t, pp, off in offsets:
            self._check_offset(pp, off, "committed at revoke")
            self.committed[pp] = (off, meta.get((TOPIC, pp), ""))
        self.assigned.remove(p)

    def lose(self) -> None:
        if not self.assigned:
            return
        p = self.rng.choice(self.assigned)
        self.engine.begin_revoke([(TOPIC, p)], lost=True)
        self.assigned.remove(p)

    def stop(self) -> None:
        """A graceful stop: catch up, halt, wait for the running handlers, commit; then a new run."""
        e = self.engine
        self.stopping = True
        e.stop_starting()
        for _ in range(self.rng.randint(0, 40)):
            self.rng.choice([self.dispatch, self.work, self.work, self.clock, self.store])()
            e.release_held()
            self.check()
        e.halt()
        self._settle(lambda: e.running == 0)
        self.check()
        offsets, meta = e.partitions.commit_offsets(e.partitions.active())
        for _t, p, off in offsets:
            self._check_offset(p, off, "committed at the stop")
            self.committed[p] = (off, meta.get((TOPIC, p), ""))
        e.close()
        self._new_engine()

    # -- the promises -------------------------------------------------------------------------------

    def fail(self, what: str) -> None:
        raise Violation(f"seed {self.seed}, event {self.events} ({self.last}): {what}")

    def _check_offset(self, p: int, offset: int, what: str) -> None:
        unfinished = [o for o in self.received.get(p, []) if o < offset and o not in self.finished[p]]
        if unfinished:
            self.fail(f"partition {p}: offset {offset} {what} past unfinished offset {unfinished[0]}")

    def check(self) -> None:
        e = self.engine
        flow = e.flow
        if flow.buffered > self.cfg.max_in_flight:
            self.fail(f"{flow.buffered} messages buffered, above max_in_flight={self.cfg.max_in_flight}")
        held = sum(len(u) for u in self.pool.queue) + sum(
            len(w.slot.todo)
            + len(w.slot.results)
            + (w.running is not None)
            + (w.ended is not None)
            + len(w.batch or ())
            + len(w.batch_running)
            + len(w.batch_results)
            + self._skipped(w)
            for w in self.workers
        )
        if flow.running != held:
            self.fail(f"the engine counts {flow.running} messages running, the workers hold {held}")
        if flow.buffered < flow.running:
            self.fail(f"{flow.buffered} buffered, fewer than the {flow.running} running")

    @staticmethod
    def _skipped(w: _Worker) -> int:
        """Messages taken along behind one that did not end done, which the worker skipped: the
        owner counts them running until it reads that outcome (then they go back to their lane)."""
        n = 0
        todo = set(w.slot.todo)
        for d, outcome in w.slot.results:
            if type(outcome) is Done:
                continue
            f = d.follower
            while f is not None:
                n += f not in todo and f is not w.running and (w.ended is None or f is not w.ended[0])
                f = f.follower
        return n

    def finish_and_check(self) -> None:
        """The end: stop, then a last run drains the topic; nothing may be lost."""
        self.stop()
        while len(self.assigned) < self.cfg.partitions:
            self.assign()
        for _ in range(200_000):
            if self._drained():
                break
            self.rng.choice([self.poll, self.dispatch, self.work, self.work, self.work, self.clock])()
            self.check()
        else:
            self.fail("the last run did not drain the topic")
        self.store()
        offsets, _meta = self.engine.partitions.commit_offsets(self.engine.partitions.active())
        for _t, p, off in offsets:
            self.committed[p] = (off, "")
        for p in range(self.cfg.partitions):
            end = len(self.log[p])
            got = self.committed.get(p, (0, ""))[0]
            if end and got != end:
                self.fail(f"partition {p}: committed {got} at the end, its log ends at {end}")
            missing = [o for o in range(end) if o not in self.done_ever[p]]
            if missing:
                self.fail(f"partition {p}: offsets {missing[:5]} never ended done (lost)")

    def _drained(self) -> bool:
        e = self.engine
        if e.flow.buffered:
            return False
        return all(self.position[p] >= len(self.log[p]) for p in self.assigned)


def _key(d: Delivery) -> bytes:
    key = d.msg.key
    return key if key is not None else b""


def simulate(seed: int, events: int, config: SimConfig | None = None) -> Simulation:
    """Run ``events`` random events from ``seed``, then drain and check that nothing was lost.

    Raises
    ------
    Violation
        A promise was broken (the message names the seed and the event).
    """
    sim = Simulation(seed, config)
    for _ in range(events):
        sim.step()
    sim.finish_and_check()
    return sim


def main(argv: list[str] | None = None) -> int:
    """``scripts/simulate``: run seeds 1, 2, ... (``--per-seed`` events each) up to ``--events``
    events in all, or replay one ``--seed``. Exits 1 on a broken promise, naming seed and event."""
    import argparse
    import time

    ap = argparse.ArgumentParser(description="Deterministic simulation of the engine's owner")
    ap.add_argument("--events", type=int, default=100_000, help="events in all (default 100,000)")
    ap.add_argument("--per-seed", type=int, default=2_000, help="events per seed (default 2,000)")
    ap.add_argument("--seed", type=int, default=None, help="replay one seed (with --events of it)")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    seeds = [(args.seed, args.events)] if args.seed is not None else []
    if args.seed is None:
        left, seed = args.events, 1
        while left > 0:
            seeds.append((seed, min(args.per_seed, left)))
            left -= args.per_seed
            seed += 1
    try:
        for seed, n in seeds:
            simulate(seed, n)
    except Violation as exc:
        print(f"VIOLATION: {exc}")
        return 1
    total = sum(n for _, n in seeds)
    print(f"{total} events over {len(seeds)} seed(s): every promise held ({time.monotonic() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
