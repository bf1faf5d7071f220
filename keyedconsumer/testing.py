"""An in-memory Kafka for unit tests: partitions, offsets, commits, rebalances and a fake clock.

A handler with its middleware runs through the real engine, in milliseconds, with no Kafka::

    from keyedconsumer.testing import InMemoryBroker

    broker = InMemoryBroker()
    broker.create_topic("payments", partitions=3)
    for i in range(3):
        broker.produce("payments", f"{i}", key=f"acct-{i}")
    consumer = broker.consumer(name="billing", handler=handle, topics=["payments"])
    with broker.run(consumer) as run:
        run.until_idle(timeout_s=5)          # every record of "payments" committed by "billing"
    assert broker.lag("billing", "payments") == {("payments", 0): 0, ("payments", 1): 0, ("payments", 2): 0}

What is modelled, the way librdkafka and the Kafka group coordinator behave:

- **Topics and partitions**, offsets from 0 with no gaps. Keyed records go to ``crc32(key) % n``
  (librdkafka's default ``consistent_random`` partitioner); null keys go round-robin.
- **Store vs commit.** ``store()`` keeps an offset in the client; with ``enable.auto.commit`` the
  stored offsets are committed on each auto-commit tick of the *fake* clock
  (``auto.commit.interval.ms``, 5 s by default), after each revoke and on ``close()``; ``commit()``
  commits at once. Storing for a partition not assigned fails (``_STATE``), as in librdkafka.
  Deliberately stricter than a real broker: a commit for a partition the member does not own is
  refused (``CommitError``, code ``ILLEGAL_GENERATION``), so an engine that commits for a revoked
  partition is caught.
- **Consumer groups and incremental rebalances.** A member that subscribes or closes moves only the
  partitions needed for balance (cooperative-sticky). A partition is assigned to its new owner only
  after the old owner's ``on_revoke`` returned (and its offsets were committed). Callbacks run inside
  ``poll_batch``, in the poll thread, as librdkafka runs them. :meth:`InMemoryBroker.rebalance`
  revokes every partition of a group and deals them out again (each to another member when there
  are several); with ``lost=True`` they are lost instead (``on_lost``, stored offsets dropped).
- **A fake clock.** ``poll_batch(n, timeout_s)`` with nothing to deliver waits a fraction of a
  millisecond of real time (so worker threads run) and then advances :class:`FakeClock` by
  ``timeout_s`` instead of sleeping. Pass the clock to the consumer (``clock=broker.clock``;
  :meth:`InMemoryBroker.consumer` does) and ``RetryLater`` back-off of minutes takes milliseconds.
  Fake time passes only while a consumer polls idle; a handler's own run time is not fake time.

Not modelled: replication, transactions, compaction, retention, record size limits, quotas, and a
member being slower than ``max.poll.interval.ms``.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import re
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

from .consumer import KeyedConsumer
from .errors import CommitError, KafkaClientError, PublishError
from .kafka import TP, RebalanceListener
from .kafka.client import connect
from .message import Message

if TYPE_CHECKING:
    from .kafka import ClientFactory, RecordPublisher

__all__ = ["InMemoryBroker", "FakeClock", "FakeClient", "FakePublisher", "Record", "Commit", "Run"]

log = logging.getLogger("keyedconsumer.testing")

Bytes = bytes | str | None
Headers = Sequence[tuple[str, bytes | str | None]]


class FakeClock:
    """A monotonic clock in seconds that moves only when told to; callable like ``time.monotonic``.

    Parameters
    ----------
    start_s:
        The first reading, in seconds.
    """

    def __init__(self, start_s: float = 0.0) -> None:
        self._now = float(start_s)
        self._lock = threading.Lock()

    def __call__(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        """Move the clock forward by ``seconds`` (>= 0, finite). Thread-safe.

        Returns
        -------
        The new reading, in seconds.

        Raises
        ------
        ValueError
            ``seconds`` is negative, NaN or infinite (a monotonic clock never goes back).
        """
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"FakeClock.advance needs a finite number of seconds >= 0, got {seconds!r}")
        with self._lock:
            self._now += seconds
            return self._now

    def __repr__(self) -> str:
        return f"FakeClock({self._now:g} s)"


@dataclasses.dataclass(frozen=True)
class Record:
    """A record in the broker: where it is, and what was produced."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes | None], ...]
    timestamp_ms: int

    def header(self, name: str) -> bytes | None:
        """The value of the last header called ``name``, or ``None`` when absent."""
        for k, v in reversed(self.headers):
            if k == name:
                return v
        return None


@dataclasses.dataclass(frozen=True)
class Commit:
    """One committed offset, in commit order. ``offset`` is the next offset to consume;
    ``automatic`` is ``True`` for librdkafka-style auto commits of stored offsets."""

    group: str
    topic: str
    partition: int
    offset: int
    member: str
    automatic: bool
    metadata: str = ""


def _bytes(value: Bytes) -> bytes | None:
    return value.encode() if isinstance(value, str) else value


def _truthy(value: Any) -> bool:
    return value if isinstance(value, bool) else str(value).strip().lower() in ("true", "1", "yes")


class _Group:
    def __init__(self, name: str) -> None:
        self.name = name
        self.members: list[FakeClient] = []  # in join order
        self.committed: dict[TP, int] = {}
        self.metadata: dict[TP, str] = {}  # committed metadata per partition
        self.history: list[Commit] = []
        self.target: dict[TP, FakeClient] = {}  # where each partition should be
        self.callbacks: list[tuple[str, str, list[TP]]] = []
        self.delivered = 0


class InMemoryBroker:
    """A Kafka cluster in memory: topics, consumer groups, committed offsets, rebalances.

    Thread-safe. Build consumers with :meth:`consumer` (or pass ``client_factory=broker.client_factory``
    and ``clock=broker.clock`` to :class:`~keyedconsumer.KeyedConsumer`), run them with :meth:`run`.

    Parameters
    ----------
    clock:
        The fake clock idle polls advance (default: a new :class:`FakeClock` at 0 s).
    default_partitions:
        Partitions of a topic created on its first produce (dead-letter topics, for example).
    auto_create_topics:
        ``False``: producing to an unknown topic raises ``ValueError`` (``PublishError`` from
        :meth:`publisher`).
    idle_wait_s:
        Real seconds an idle ``poll_batch`` waits for new records before advancing the fake clock.
    """

    def __init__(
        self,
        *,
        clock: FakeClock | None = None,
        default_partitions: int = 1,
        auto_create_topics: bool = True,
        idle_wait_s: float = 0.0005,
    ) -> None:
        if default_partitions < 1 or not (idle_wait_s >= 0):
            raise ValueError("default_partitions must be >= 1 and idle_wait_s >= 0")
        self.clock = clock if clock is not None else FakeClock()
        self.default_partitions = default_partitions
        self.auto_create_topics = auto_create_topics
        self.idle_wait_s = idle_wait_s
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # notified on every change (idle polls wait)
        self._version = 0
        self._logs: dict[str, list[list[Record]]] = {}
        self._round_robin: dict[str, int] = {}
        self._groups: dict[str, _Group] = {}
        self._clients: list[FakeClient] = []
        self._member_ids = itertools.count(1)

    # -- topics and records -----------------------------------------------------------------------

    def create_topic(self, name: str, partitions: int = 1) -> None:
        """Create a topic with ``partitions`` partitions (>= 1).

        Raises
        ------
        ValueError
            The topic exists, or ``partitions`` < 1.
        """
        if partitions < 1:
            raise ValueError(f"a topic needs at least 1 partition, got {partitions}")
        with self._lock:
            if name in self._logs:
                raise ValueError(f"topic {name!r} exists")
            self._create_locked(name, partitions)

    def _create_locked(self, name: str, partitions: int) -> list[list[Record]]:
        logs: list[list[Record]] = [[] for _ in range(partitions)]
        self._logs[name] = logs
        for g in self._groups.values():  # a subscribed topic that appears is assigned (metadata refresh)
            if any(_matches(m._topics, name) for m in g.members):
                self._retarget(g, full=False)
        self._bump()
        return logs

    def topics(self) -> dict[str, int]:
        """``{topic: partition count}``."""
        with self._lock:
            return {t: len(p) for t, p in self._logs.items()}

    def produce(
        self,
        topic: str,
        value: Bytes,
        key: Bytes = None,
        headers: Headers | None = None,
        partition: int | None = None,
        timestamp_ms: int | None = None,
    ) -> Record:
        """Append a record. ``str`` keys, values and header values are UTF-8 encoded.

        Parameters
        ----------
        partition:
            The partition; default ``crc32(key) % partitions`` (librdkafka's default partitioner),
            round-robin for a null key.
        timestamp_ms:
            Milliseconds since the epoch; default now (wall clock).

        Returns
        -------
        The stored :class:`Record`, with its partition and offset.

        Raises
        ------
        ValueError
            No such partition, or an unknown topic while ``auto_create_topics`` is off.
        """
        k = _bytes(key)
        hdrs = tuple((name, _bytes(v)) for name, v in headers or ())
        ts = timestamp_ms if timestamp_ms is not None else int(time.time() * 1000)
        with self._lock:
            logs = self._logs.get(topic)
            if logs is None:
                if not self.auto_create_topics:
                    raise ValueError(f"unknown topic {topic!r} (auto_create_topics is off)")
                logs = self._create_locked(topic, self.default_partitions)
            if partition is None:
                if k is None:
                    partition = self._round_robin.get(topic, 0) % len(logs)
                    self._round_robin[topic] = partition + 1
                else:
                    partition = zlib.crc32(k) % len(logs)
            elif not 0 <= partition < len(logs):
                raise ValueError(f"topic {topic!r} has no partition {partition} (it has {len(logs)})")
            log_ = logs[partition]
            rec = Record(topic, partition, len(log_), k, _bytes(value), hdrs, ts)
            log_.append(rec)
            self._bump()
            return rec

    def records(self, topic: str, partition: int | None = None) -> list[Record]:
        """The records of ``topic`` (one partition, or all in partition then offset order);
        ``[]`` for an unknown topic."""
        with self._lock:
            logs = self._logs.get(topic, [])
            chosen = logs if partition is None else logs[partition : partition + 1]
            return [r for log_ in chosen for r in log_]

    def end_offsets(self, topic: str) -> dict[TP, int]:
        """``{(topic, partition): offset of the next record}`` for every partition of ``topic``.

        Raises
        ------
        KeyError
            Unknown topic.
        """
        with self._lock:
            return {(topic, p): len(log_) for p, log_ in enumerate(self._logs[topic])}

    # -- groups -----------------------------------------------------------------------------------

    def committed(self, group: str) -> dict[TP, int]:
        """The group's committed offsets (the next offset to consume), ``{(topic, partition): offset}``;
        partitions never committed are absent."""
        with self._lock:
            g = self._groups.get(group)
            return dict(g.committed) if g else {}

    def commits(self, group: str) -> list[Commit]:
        """Every commit of the group, in order (auto commits, synchronous commits, on revoke and close)."""
        with self._lock:
            g = self._groups.get(group)
            return list(g.history) if g else []

    def lag(self, group: str, topics: str | Sequence[str]) -> dict[TP, int]:
        """``{(topic, partition): end offset - committed offset}`` for every partition of ``topics``
        (names, or ``^regex`` patterns as in a subscription); never committed counts from 0."""
        names = [topics] if isinstance(topics, str) else list(topics)
        with self._lock:
            g = self._groups.get(group)
            committed = g.committed if g else {}
            out = {}
            for topic, logs in self._logs.items():
                if _matches(names, topic):
                    for p, log_ in enumerate(logs):
                        out[(topic, p)] = len(log_) - committed.get((topic, p), 0)
            return out

    def stored(self, group: str) -> dict[TP, int]:
        """Offsets stored (not yet committed or already) by the group's live members."""
        with self._lock:
            g = self._groups.get(group)
            return {tp: o for m in (g.members if g else []) for tp, o in m._stored.items()}

    def assignments(self, group: str) -> dict[str, list[TP]]:
        """``{member id: partitions it holds now}`` for the group's live members, in join order."""
        with self._lock:
            g = self._groups.get(group)
            return {m.member_id: sorted(m._assignment) for m in (g.members if g else [])}

    def delivered(self, group: str) -> int:
        """Records handed to the group's members so far, re-deliveries included."""
        with self._lock:
            g = self._groups.get(group)
            return g.delivered if g else 0

    def callbacks(self, group: str) -> list[tuple[str, str, list[TP]]]:
        """The rebalance callbacks the group's members ran, in order: ``(member id, kind, partitions)``
        with kind ``"assign"``, ``"revoke"`` (listed when it returned) or ``"lost"``."""
        with self._lock:
            g = self._groups.get(group)
            return list(g.callbacks) if g else []

    def rebalance(self, group: str, *, lost: bool = False) -> None:
        """Revoke every partition of ``group`` and deal them out again, each to another member
        where there is one (least loaded first). Returns at once: each member sees
        ``on_revoke`` (then ``on_assign``) in its next ``poll_batch``, and a partition reaches its
        new owner only after the old owner's ``on_revoke`` returned.

        With ``lost=True`` the partitions are *lost* instead (session timeout, fencing): their stored
        offsets are dropped, their owners get ``on_lost``, they are free for the new owners at once,
        and commits for them by the old owners are refused.
        """
        with self._lock:
            g = self._group(group)
            for m in g.members:
                m._to_assign.clear()
                if lost:
                    m._to_lose |= m._assignment
                    m._drop_locked(list(m._assignment))
                    m._to_revoke.clear()
                else:
                    m._to_revoke |= m._assignment
            self._retarget(g, full=True)

    def inject_error(self, error: KafkaClientError, group: str | None = None) -> None:
        """Report ``error`` to the ``on_error`` callback of every live client (of ``group``), in its
        next ``poll_batch``, as librdkafka's ``error_cb``. A ``fatal=True`` error stops a consumer."""
        with self._lock:
            for c in self._clients:
                if group is None or c.group_id == group:
                    c._errors.append(error)
            self._bump()

    def _group(self, name: str) -> _Group:
        g = self._groups.get(name)
        if g is None:
            g = self._groups[name] = _Group(name)
        return g

    def _bump(self) -> None:
        self._version += 1
        self._changed.notify_all()

    def _retarget(self, g: _Group, full: bool) -> None:
        """Compute where each partition should be (lock held), then schedule the moves."""
        wanted: dict[TP, list[FakeClient]] = {}  # eligible members per partition, in join order
        for m in g.members:
            for topic, logs in self._logs.items():
                if _matches(m._topics, topic):
                    for p in range(len(logs)):
                        wanted.setdefault((topic, p), []).append(m)
        tps = sorted(wanted)
        target: dict[TP, FakeClient] = {}
        load = {m: 0 for m in g.members}
        if full:  # each partition to another eligible member where there is one, least loaded first
            for tp in tps:
                others = [m for m in wanted[tp] if m is not g.target.get(tp)] or wanted[tp]
                best = target[tp] = min(others, key=load.__getitem__)
                load[best] += 1
        else:  # cooperative-sticky: keep owners, give out free partitions, move only for balance
            for tp in tps:
                old = g.target.get(tp)
                if old is not None and old in wanted[tp]:
                    target[tp] = old
                    load[old] += 1
            for tp in tps:
                if tp not in target:
                    best = min(wanted[tp], key=load.__getitem__)
                    target[tp] = best
                    load[best] += 1
            moved = True
            while moved:  # each move lowers the sum of squared loads, so this ends
                moved = False
                for tp in reversed(tps):
                    cur, best = target[tp], min(wanted[tp], key=load.__getitem__)
                    if load[cur] - load[best] > 1:
                        target[tp] = best
                        load[cur] -= 1
                        load[best] += 1
                        moved = True
        g.target = target
        self._reconcile(g)

    def _reconcile(self, g: _Group) -> None:
        """Schedule revokes of partitions held away from their target, and assigns of free ones."""
        held: set[TP] = set()
        for m in g.members:
            m._to_assign = {tp for tp in m._to_assign if g.target.get(tp) is m}
            m._to_revoke |= {tp for tp in m._assignment if g.target.get(tp) is not m}
            held |= m._assignment | m._to_assign
        for tp, m in g.target.items():
            if tp not in held:
                m._to_assign.add(tp)
        self._bump()

    # -- wiring -----------------------------------------------------------------------------------

    def client_factory(self, conf: dict[str, Any], on_error: Callable[[KafkaClientError], None]) -> FakeClient:
        """A :data:`~keyedconsumer.kafka.ClientFactory`: ``KeyedConsumer(client_factory=broker.client_factory)``.

        Reads ``group.id``, ``enable.auto.commit``, ``auto.commit.interval.ms`` and
        ``auto.offset.reset`` from ``conf``; ignores the rest.

        Raises
        ------
        KafkaClientError
            ``conf`` has no ``group.id``.
        """
        if not conf.get("group.id"):
            raise KafkaClientError("the consumer configuration has no group.id", code="_INVALID_ARG")
        client = FakeClient(self, conf, on_error, f"{conf['group.id']}-member-{next(self._member_ids)}")
        with self._lock:
            self._clients.append(client)
        return client

    def publisher(self) -> FakePublisher:
        """A :class:`~keyedconsumer.RecordPublisher` writing into this broker, in place of a
        :class:`~keyedconsumer.Publisher`:
        ``DeadLetter(publisher=broker.publisher())``."""
        return FakePublisher(self)

    def consumer(self, *, poll_timeout_s: float = 60.0, **options: Any) -> KeyedConsumer:
        """A :class:`~keyedconsumer.KeyedConsumer` on this broker and its fake clock.

        ``options`` are those of ``KeyedConsumer`` (``name``, ``handler``, ``topics``,
        ``middlewares``, ``concurrency`` ...). ``poll_timeout_s`` defaults to 60 s here: an idle poll
        then advances the fake clock straight to the next retry due time (the engine never asks
        to wait past it), so each back-off step costs one idle poll of real time.

        Raises
        ------
        pydantic.ValidationError
            A bad option.
        """
        return KeyedConsumer(client_factory=self.client_factory, clock=self.clock, poll_timeout_s=poll_timeout_s, **options)

    def run(self, *consumers: KeyedConsumer) -> Run:
        """Start ``consumer.run()`` of each consumer in a thread; use the result as a context manager,
        which stops them on exit. See :class:`Run`.

        Raises
        ------
        ValueError
            A consumer uses the real Kafka client (it was built without ``client_factory``).
        """
        return Run(self, consumers)


def _matches(patterns: Iterable[str], topic: str) -> bool:
    """Whether a subscription (names, ``^regex`` patterns as in librdkafka) covers ``topic``."""
    return any(re.search(p, topic) if p.startswith("^") else p == topic for p in patterns)


class FakeClient:
    """A :class:`~keyedconsumer.kafka.KafkaClient` on an :class:`InMemoryBroker` (one group member).

    Made by :meth:`InMemoryBroker.client_factory`. Like the real client it is used from one thread,
    the consumer's poll thread, where it also runs the rebalance callbacks and ``on_error``.
    """

    def __init__(
        self, broker: InMemoryBroker, conf: dict[str, Any], on_error: Callable[[KafkaClientError], None], member_id: str
    ) -> None:
        self._broker = broker
        self._on_error = on_error
        self.member_id = member_id
        self.group_id = str(conf["group.id"])
        self._auto_commit = _truthy(conf.get("enable.auto.commit", True))
        self._commit_interval_s = float(conf.get("auto.commit.interval.ms", 5000)) / 1000.0
        self._earliest = str(conf.get("auto.offset.reset", "latest")).lower() in ("earliest", "smallest", "beginning")
        self._next_commit_s = broker.clock() + self._commit_interval_s
        self._topics: list[str] = []
        self._listener: RebalanceListener | None = None
        self._assignment: set[TP] = set()
        self._positions: dict[TP, int] = {}
        self._stored: dict[TP, int] = {}
        self._stored_meta: dict[TP, str] = {}
        self._paused: set[TP] = set()
        self._to_revoke: set[TP] = set()
        self._to_lose: set[TP] = set()
        self._to_assign: set[TP] = set()
        self._errors: list[KafkaClientError] = []
        self._turn = 0  # rotates the partition a fetch starts with
        self._closed = False

    def __repr__(self) -> str:
        return f"FakeClient({self.member_id!r}, assigned={sorted(self._assignment)})"

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise KafkaClientError(f"{what}: the consumer is closed", code="_STATE")

    # -- the KafkaClient protocol -----------------------------------------------------------------

    def subscribe(self, topics: Sequence[str], listener: RebalanceListener) -> None:
        """Join the group with a subscription to ``topics``; assignments come in ``poll_batch``."""
        b = self._broker
        with b._lock:
            self._check_open("subscribe")
            self._topics = list(topics)
            self._listener = listener
            g = b._group(self.group_id)
            if self not in g.members:
                g.members.append(self)
            b._retarget(g, full=False)

    def poll_batch(self, max_messages: int, timeout_s: float) -> list[Message]:
        """Run due callbacks and the auto-commit tick, then return up to ``max_messages`` records.

        With nothing to deliver, waits ``idle_wait_s`` of real time for new records, then advances
        the fake clock by ``timeout_s`` seconds and returns ``[]``.
        """
        b = self._broker
        self._check_open("poll")
        self._serve()
        with b._lock:
            seen = b._version
            out = self._fetch_locked(max_messages)
            if out:
                return out
            if b._version == seen:
                b._changed.wait(b.idle_wait_s)
        self._serve()
        with b._lock:
            out = self._fetch_locked(max_messages)
        if not out:
            b.clock.advance(max(0.0, timeout_s))
        return out

    def store(self, topic: str, partition: int, offset: int, metadata: str = "") -> None:
        """Keep ``offset`` (and its commit ``metadata``) for the next (auto) commit.

        Raises
        ------
        KafkaClientError
            ``_STATE``: the partition is not assigned to this member (or the client is closed).
        """
        with self._broker._lock:
            self._check_open("store_offsets")
            if (topic, partition) not in self._assignment:
                raise KafkaClientError(
                    f"store_offsets topic={topic} partition={partition}: _STATE: Local: Erroneous state", code="_STATE"
                )
            self._stored[(topic, partition)] = offset
            self._stored_meta[(topic, partition)] = metadata

    def commit(
        self,
        offsets: Sequence[tuple[str, int, int]],
        metadata: Mapping[TP, str] | None = None,
        timeout_s: float | None = None,
    ) -> None:
        """Commit ``(topic, partition, offset)`` synchronously, with ``metadata[(topic, partition)]``
        (the in-memory broker answers at once: ``timeout_s`` is not needed).

        Raises
        ------
        CommitError
            ``ILLEGAL_GENERATION`` for partitions this member does not own (the others are committed).
        KafkaClientError
            The client is closed.
        """
        with self._broker._lock:
            self._check_open("commit")
            failed = []
            for topic, partition, offset in offsets:
                if (topic, partition) in self._assignment:
                    meta = (metadata or {}).get((topic, partition), "")
                    self._commit_locked((topic, partition), offset, automatic=False, metadata=meta)
                else:
                    failed.append(f"{topic}[{partition}]@{offset}: ILLEGAL_GENERATION")
        if failed:
            raise CommitError(f"commit failed for {', '.join(failed)} (not assigned to this member)",
                              code="ILLEGAL_GENERATION")

    def commit_async(self, offsets: Sequence[tuple[str, int, int]], metadata: Mapping[TP, str] | None = None) -> None:
        """:meth:`commit` whose failure is not reported (as librdkafka's asynchronous commit
        without an ``on_commit`` callback)."""
        try:
            self.commit(offsets, metadata)
        except KafkaClientError:
            pass

    def committed(self, partitions: Sequence[TP], timeout_s: float) -> dict[TP, tuple[int, str]]:
        """The group's committed ``(offset, metadata)`` of ``partitions`` (``-1001`` when none)."""
        b = self._broker
        with b._lock:
            self._check_open("committed")
            g = b._group(self.group_id)
            return {tp: (g.committed.get(tp, -1001), g.metadata.get(tp, "")) for tp in partitions}

    def pause(self, partitions: Sequence[TP]) -> None:
        """Stop fetching ``partitions`` (assigned ones; others are ignored). As in librdkafka, the
        pause outlives a revoke and a later re-assignment of the partition."""
        with self._broker._lock:
            self._paused.update(tp for tp in partitions if tp in self._assignment)

    def resume(self, partitions: Sequence[TP]) -> None:
        """Fetch ``partitions`` again, from the next record not yet delivered."""
        with self._broker._lock:
            self._paused.difference_update(partitions)

    def high_watermarks(self, partitions: Sequence[TP]) -> dict[TP, int | None]:
        """End offsets; ``None`` for an unknown topic or partition."""
        with self._broker._lock:
            logs = self._broker._logs
            return {(t, p): len(logs[t][p]) if t in logs and 0 <= p < len(logs[t]) else None for t, p in partitions}

    def check_brokers(self, timeout_s: float) -> None:
        """The in-memory broker always answers."""
        self._check_open("list_topics")

    def close(self, timeout_s: float | None = None) -> bool:
        """Revoke the whole assignment (``on_revoke``, in this thread), auto-commit the stored offsets,
        and leave the group, whose partitions go to the other members. A second call does nothing.
        Returns ``True`` (the in-memory broker always answers)."""
        b = self._broker
        with b._lock:
            if self._closed:
                return True
            tps = sorted(self._assignment)
        try:
            if tps and self._listener is not None:
                self._listener.on_revoke(tps)
        finally:
            with b._lock:
                if tps:
                    self._record("revoke", tps)
                if self._auto_commit:
                    self._commit_stored_locked(tps)
                self._drop_locked(tps)
                self._closed = True
                self._to_assign.clear()
                self._to_revoke.clear()
                if self in b._clients:
                    b._clients.remove(self)
                g = b._groups.get(self.group_id)
                if g is not None and self in g.members:
                    g.members.remove(self)
                    b._retarget(g, full=False)
                b._bump()
        return True

    # -- inside poll_batch ------------------------------------------------------------------------

    def _serve(self) -> None:
        """Report injected errors, run scheduled rebalance callbacks, then the auto-commit tick."""
        b = self._broker
        while True:
            with b._lock:
                errors, self._errors = self._errors, []
                event = self._next_event_locked()
            for err in errors:
                self._on_error(err)
            if event is None:
                break
            kind, tps = event
            listener = self._listener
            assert listener is not None  # events exist only after subscribe()
            if kind != "revoke":
                with b._lock:
                    self._record(kind, tps)
                (listener.on_lost if kind == "lost" else listener.on_assign)(tps)
            else:
                try:
                    listener.on_revoke(tps)
                finally:
                    with b._lock:
                        self._record(kind, tps)
                        if self._auto_commit:  # librdkafka commits the stored offsets it unassigns
                            self._commit_stored_locked(tps)
                        self._drop_locked(tps)
                        g = b._groups.get(self.group_id)
                        if g is not None:
                            b._reconcile(g)  # the partitions may now go to their new owners
        with b._lock:
            now = b.clock()
            if self._auto_commit and now >= self._next_commit_s:
                self._next_commit_s = now + self._commit_interval_s
                self._commit_stored_locked(sorted(self._assignment))

    def _next_event_locked(self) -> tuple[str, list[TP]] | None:
        if self._to_lose:
            tps = sorted(self._to_lose)
            self._to_lose.clear()
            return "lost", tps
        revoke = sorted(self._to_revoke & self._assignment)
        self._to_revoke.clear()
        if revoke:
            return "revoke", revoke
        if self._to_assign:
            tps = sorted(self._to_assign)
            self._to_assign.clear()
            g = self._broker._group(self.group_id)
            for tp in tps:
                end = len(self._broker._logs[tp[0]][tp[1]])
                committed = g.committed.get(tp)
                valid = committed is not None and 0 <= committed <= end
                self._positions[tp] = committed if valid and committed is not None else (0 if self._earliest else end)
            self._assignment.update(tps)
            return "assign", tps
        return None

    def _record(self, kind: str, tps: list[TP]) -> None:
        self._broker._group(self.group_id).callbacks.append((self.member_id, kind, tps))

    def _drop_locked(self, tps: Iterable[TP]) -> None:
        for tp in tps:
            self._assignment.discard(tp)
            self._positions.pop(tp, None)
            self._stored.pop(tp, None)
            self._stored_meta.pop(tp, None)
            # like librdkafka, a pause outlives a revoke: a partition assigned back stays paused
            # until resumed (issue confluentinc/librdkafka#1849)

    def _commit_stored_locked(self, tps: Iterable[TP]) -> None:
        g = self._broker._group(self.group_id)
        for tp in tps:
            offset = self._stored.get(tp)
            if offset is not None and offset != g.committed.get(tp):
                self._commit_locked(tp, offset, automatic=True, metadata=self._stored_meta.get(tp, ""))

    def _commit_locked(self, tp: TP, offset: int, automatic: bool, metadata: str = "") -> None:
        b = self._broker
        g = b._group(self.group_id)
        g.committed[tp] = offset
        g.metadata[tp] = metadata
        g.history.append(Commit(g.name, tp[0], tp[1], offset, self.member_id, automatic, metadata))
        b._bump()

    def _fetch_locked(self, max_messages: int) -> list[Message]:
        parts = sorted(tp for tp in self._assignment if tp not in self._paused)
        out: list[Message] = []
        if not parts:
            return out
        self._turn += 1
        logs = self._broker._logs
        for i in range(len(parts)):
            tp = parts[(self._turn + i) % len(parts)]
            log_ = logs[tp[0]][tp[1]]
            pos = self._positions[tp]
            while pos < len(log_) and len(out) < max_messages:
                r = log_[pos]
                out.append(Message(r.topic, r.partition, r.offset, r.key, r.value, list(r.headers) or None, r.timestamp_ms))
                pos += 1
            self._positions[tp] = pos
            if len(out) >= max_messages:
                break
        if out:
            self._broker._group(self.group_id).delivered += len(out)
        return out


class FakePublisher:
    """A :class:`~keyedconsumer.RecordPublisher` that writes into an :class:`InMemoryBroker` (no producer).

    Attributes
    ----------
    error:
        When set, every ``publish`` raises it (to test a failing dead-letter topic).
    """

    def __init__(self, broker: InMemoryBroker) -> None:
        self._broker = broker
        self.error: PublishError | None = None
        self.delivery_timeout_s = 0.0  # the in-memory broker answers at once

    def publish(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: list[tuple[str, bytes | None]] | None = None,
        timeout_s: float | None = None,
    ) -> tuple[int, int]:
        """Append a record to the broker (partitioned like :meth:`InMemoryBroker.produce`).

        Returns
        -------
        ``(partition, offset)`` of the record.

        Raises
        ------
        PublishError
            ``error`` is set, or the topic is unknown while the broker does not create topics.
        """
        if self.error is not None:
            raise self.error
        try:
            rec = self._broker.produce(topic, value, key=key, headers=headers)
        except ValueError as exc:
            raise PublishError(f"cannot publish to {topic}: {exc}") from None
        return rec.partition, rec.offset

    def close(self, timeout_s: float = 10.0) -> None:
        """Nothing is queued: returns at once."""


class _Runner:
    def __init__(self, consumer: KeyedConsumer) -> None:
        self.consumer = consumer
        self.error: BaseException | None = None
        self.reported = False
        self.thread = threading.Thread(target=self._main, name=f"keyedconsumer-run-{consumer.config.name}", daemon=True)

    def _main(self) -> None:
        try:
            self.consumer.run()
        except BaseException as exc:  # kept for the test thread, which re-raises it
            self.error = exc


class Run:
    """Consumers running in threads on an :class:`InMemoryBroker`; made by :meth:`InMemoryBroker.run`.

    Use it as a context manager: on exit every consumer is stopped and joined, and an error that
    ended a consumer's ``run()`` (a :class:`~keyedconsumer.MessageError` from an unhandled handler
    failure, a fatal :class:`~keyedconsumer.KafkaClientError`) is raised, unless one of the methods
    below raised it already. Each error is raised once.
    """

    def __init__(self, broker: InMemoryBroker, consumers: Iterable[KeyedConsumer]) -> None:
        self._broker = broker
        self._runners: list[_Runner] = []
        for c in consumers:
            self.add(c)

    def add(self, consumer: KeyedConsumer) -> None:
        """Start one more consumer (for example a second member of a group, mid-run).

        Raises
        ------
        ValueError
            ``consumer`` uses the real Kafka client (it was built without ``client_factory``).
        """
        if getattr(consumer, "_factory", None) is connect:
            raise ValueError("the consumer uses the real Kafka client: build it with broker.consumer(...) "
                             "or KeyedConsumer(client_factory=broker.client_factory, clock=broker.clock, ...)")
        runner = _Runner(consumer)
        self._runners.append(runner)
        runner.thread.start()

    def stop(self, consumer: KeyedConsumer | None = None) -> None:
        """Stop ``consumer`` (default: all) and wait until its ``run()`` returned.

        Raises
        ------
        BaseException
            The error that ended its ``run()``, if not raised before.
        TimeoutError
            ``run()`` did not return within ``shutdown_timeout_s`` + 10 s.
        """
        chosen = [r for r in self._runners if consumer is None or r.consumer is consumer]
        for r in chosen:
            r.consumer.stop()
        for r in chosen:
            r.thread.join(r.consumer.config.shutdown_timeout_s + 10.0)
            if r.thread.is_alive():
                raise TimeoutError(f"consumer {r.consumer.config.name!r} did not stop")
        self._raise_errors(chosen)

    def _raise_errors(self, runners: Iterable[_Runner]) -> None:
        for r in runners:
            if r.error is not None and not r.reported and not r.thread.is_alive():
                r.reported = True
                raise r.error

    def wait_for(self, condition: Callable[[], bool], timeout_s: float = 5.0, what: str = "the condition") -> None:
        """Wait until ``condition()`` is true, polling every millisecond of real time.

        Raises
        ------
        BaseException
            The error that ended a consumer's ``run()`` meanwhile.
        TimeoutError
            Not true within ``timeout_s`` real seconds.
        """
        deadline = time.monotonic() + timeout_s
        while not condition():
            self._raise_errors(self._runners)
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{what} did not happen within {timeout_s:g} s")
            time.sleep(0.001)

    def until_idle(self, timeout_s: float = 5.0) -> None:
        """Wait until every record of every topic the consumers subscribe to is committed by their
        groups (committed offset = end offset). The consumers go on running.

        Raises
        ------
        BaseException
            The error that ended a consumer's ``run()`` (e.g. ``MessageError``), once.
        RuntimeError
            Every consumer stopped, without error, before that.
        TimeoutError
            Not idle within ``timeout_s`` real seconds; the message names each partition left,
            with its committed and end offsets, and the messages in flight.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            self._raise_errors(self._runners)
            left = self._left()
            if not left:
                return
            if all(not r.thread.is_alive() for r in self._runners):
                self._raise_errors(self._runners)
                raise RuntimeError(f"the consumers stopped before every record was committed: {left}")
            if time.monotonic() >= deadline:
                in_flight = {r.consumer.config.name: r.consumer.in_flight for r in self._runners}
                raise TimeoutError(f"not idle after {timeout_s:g} s: {left}; messages in flight: {in_flight}")
            with self._broker._lock:
                self._broker._changed.wait(0.002)

    def _left(self) -> str:
        groups: dict[str, set[str]] = {}
        for r in self._runners:
            groups.setdefault(r.consumer.config.group, set()).update(r.consumer.config.topics)
        committed = {g: self._broker.committed(g) for g in groups}
        parts = []
        for g, topics in sorted(groups.items()):
            for (topic, p), lag in sorted(self._broker.lag(g, sorted(topics)).items()):
                if lag > 0:
                    c = committed[g].get((topic, p))
                    end = (c or 0) + lag
                    parts.append(f"group {g!r} {topic}[{p}] committed {c} of end {end} ({lag} left)")
        return ", ".join(parts)

    def __enter__(self) -> Run:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.stop()
            return
        try:  # the body's exception wins; a consumer's error is only logged
            self.stop()
        except BaseException as err:
            log.warning("a consumer also ended with: %r", err)


if TYPE_CHECKING:  # mypy checks that the fake satisfies the engine's seam

    def _is_a_client_factory(broker: InMemoryBroker) -> ClientFactory:
        return broker.client_factory

    def _is_a_record_publisher(publisher: FakePublisher) -> RecordPublisher:
        return publisher
