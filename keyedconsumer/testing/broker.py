"""The in-memory broker: topics and records, consumer groups, and the protocol its members speak.

:class:`InMemoryBroker` has two faces. Tests produce records, build and run consumers, and observe
commits, assignments and callbacks through its test methods. Its members (each a
:class:`~keyedconsumer.testing.FakeClient`) use it only through the *member protocol*, a small API
shaped like the Kafka protocol a real client speaks:

=====================================  ==========================================================
group coordinator                      :meth:`~InMemoryBroker.join_group`,
                                       :meth:`~InMemoryBroker.leave_group`,
                                       :meth:`~InMemoryBroker.next_event` (heartbeat / sync: the
                                       member's next assign, revoke or lost),
                                       :meth:`~InMemoryBroker.revoke_done`,
                                       :meth:`~InMemoryBroker.assignment`,
                                       :meth:`~InMemoryBroker.take_errors` (``error_cb``)
offsets                                :meth:`~InMemoryBroker.store_offset`,
                                       :meth:`~InMemoryBroker.commit_offsets`,
                                       :meth:`~InMemoryBroker.commit_stored` (auto commit),
                                       :meth:`~InMemoryBroker.fetch_committed` (OffsetFetch)
fetch path                             :meth:`~InMemoryBroker.fetch` (records from positions),
                                       :meth:`~InMemoryBroker.list_offsets` (end offsets)
waiting                                :meth:`~InMemoryBroker.version`,
                                       :meth:`~InMemoryBroker.wait_for_change`
=====================================  ==========================================================

:class:`~keyedconsumer.testing.run.Run` runs consumers on the broker in threads.

A member is named by the member id :meth:`~InMemoryBroker.new_client` gave it; the broker knows
its group. The group's state is a :class:`~keyedconsumer.testing.group.ConsumerGroup`'s own; one
lock (the broker's) guards all of it.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..app import KeyedApp
from ..consumer import KeyedConsumer
from ..errors import KafkaClientError
from ..kafka import TP
from .client import FakeClient, FakePublisher
from .clock import FakeClock
from .group import Commit, ConsumerGroup, EventKind, matches
from .run import AppRun, Run

if TYPE_CHECKING:
    from ..kafka import ClientFactory, Connector, PublisherFactory

__all__ = ["InMemoryBroker", "BrokerConnector", "Record", "GroupEvent"]

Bytes = bytes | str | None
Headers = Sequence[tuple[str, bytes | str | None]]


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
class GroupEvent:
    """A rebalance callback for a member to run, from :meth:`InMemoryBroker.next_event`.

    For an ``"assign"``, ``committed`` and ``end_offsets`` are the group's committed offset (``None``:
    none) and the log end offset of each partition, read at the instant the partitions became the
    member's, so the member picks its start positions (``auto.offset.reset``) without a race with
    producers. Both are empty for ``"revoke"`` and ``"lost"``.
    """

    kind: EventKind
    partitions: list[TP]
    committed: dict[TP, int | None] = dataclasses.field(default_factory=dict)
    end_offsets: dict[TP, int] = dataclasses.field(default_factory=dict)


class BrokerConnector:
    """An :class:`InMemoryBroker`'s :class:`~keyedconsumer.kafka.Connector` (its ``client_factory``):
    the one object a consumer gets its Kafka clients from, and its middleware their producers.

    Called as a :data:`~keyedconsumer.kafka.ClientFactory`, ``connector(conf, on_error)``, it makes a
    :class:`FakeClient`, a new member of the group ``conf["group.id"]``; it reads ``group.id``,
    ``enable.auto.commit``, ``auto.commit.interval.ms`` and ``auto.offset.reset`` and ignores the
    rest (``KafkaClientError`` ``_INVALID_ARG`` without ``group.id``). :meth:`publisher` makes a
    :class:`FakePublisher` into the broker, whatever ``brokers`` it is given: the in-memory broker
    stands for every cluster, so ``DeadLetter(brokers=["other:9092"])`` writes into it too.
    """

    def __init__(self, broker: InMemoryBroker) -> None:
        self._broker = broker

    def __call__(self, conf: dict[str, Any], on_error: Callable[[KafkaClientError], None]) -> FakeClient:
        return self._broker.new_client(conf, on_error)

    def publisher(
        self, brokers: Sequence[str], config: Mapping[str, Any], *, delivery_timeout_s: float
    ) -> FakePublisher:
        """A :class:`~keyedconsumer.kafka.PublisherFactory`: a :class:`FakePublisher` into the broker."""
        return FakePublisher(self._broker)

    def __repr__(self) -> str:
        return f"BrokerConnector({self._broker!r})"


def _bytes(value: Bytes) -> bytes | None:
    return value.encode() if isinstance(value, str) else value


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
        self._groups: dict[str, ConsumerGroup] = {}
        self._members: dict[str, str] = {}  # live member id -> its group, in creation order
        self._errors: dict[str, list[KafkaClientError]] = {}  # per live member, not yet reported
        self._member_ids = itertools.count(1)
        #: The :class:`~keyedconsumer.kafka.Connector` of this broker:
        #: ``KeyedConsumer(client_factory=broker.client_factory)``. See :class:`BrokerConnector`.
        self.client_factory = BrokerConnector(self)

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
            if g.subscribes_to(name):
                g.topics_changed(self._partition_counts())
        self._bump()
        return logs

    def topics(self) -> dict[str, int]:
        """``{topic: partition count}``."""
        with self._lock:
            return self._partition_counts()

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
            return g.committed() if g else {}

    def commits(self, group: str) -> list[Commit]:
        """Every commit of the group, in order (auto commits, synchronous commits, on revoke and close)."""
        with self._lock:
            g = self._groups.get(group)
            return g.history() if g else []

    def lag(self, group: str, topics: str | Sequence[str]) -> dict[TP, int]:
        """``{(topic, partition): end offset - committed offset}`` for every partition of ``topics``
        (names, or ``^regex`` patterns as in a subscription); never committed counts from 0."""
        names = [topics] if isinstance(topics, str) else list(topics)
        with self._lock:
            g = self._groups.get(group)
            committed = g.committed() if g else {}
            out = {}
            for topic, logs in self._logs.items():
                if matches(names, topic):
                    for p, log_ in enumerate(logs):
                        out[(topic, p)] = len(log_) - committed.get((topic, p), 0)
            return out

    def stored(self, group: str) -> dict[TP, int]:
        """Offsets stored (not yet committed or already) by the group's live members."""
        with self._lock:
            g = self._groups.get(group)
            return g.stored() if g else {}

    def assignments(self, group: str) -> dict[str, list[TP]]:
        """``{member id: partitions it holds now}`` for the group's live members, in join order."""
        with self._lock:
            g = self._groups.get(group)
            return g.assignments() if g else {}

    def delivered(self, group: str) -> int:
        """Records handed to the group's members so far, re-deliveries included."""
        with self._lock:
            g = self._groups.get(group)
            return g.delivered() if g else 0

    def callbacks(self, group: str) -> list[tuple[str, str, list[TP]]]:
        """The rebalance callbacks the group's members ran, in order: ``(member id, kind, partitions)``
        with kind ``"assign"``, ``"revoke"`` (listed when it returned) or ``"lost"``."""
        with self._lock:
            g = self._groups.get(group)
            return g.callbacks() if g else []

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
            self._group(group).rebalance(lost, self._partition_counts())
            self._bump()

    def inject_error(self, error: KafkaClientError, group: str | None = None) -> None:
        """Report ``error`` to the ``on_error`` callback of every live client (of ``group``), in its
        next ``poll_batch``, as librdkafka's ``error_cb``. A ``fatal=True`` error stops a consumer."""
        with self._lock:
            for member_id, member_group in self._members.items():
                if group is None or member_group == group:
                    self._errors[member_id].append(error)
            self._bump()

    # -- the member protocol: a group coordinator ---------------------------------------------------

    def join_group(self, member_id: str, topics: Sequence[str]) -> None:
        """Join the member's group (or change its subscription) with a subscription to ``topics``
        (names, or ``^regex`` patterns). Partitions move to it, or away from others, only through
        :meth:`next_event`: cooperative-sticky, only what balance needs.

        Raises
        ------
        KeyError
            Unknown member id (not made by :meth:`new_client`, or it left).
        """
        with self._lock:
            self._group_of(member_id).join(member_id, topics, self._partition_counts())
            self._bump()

    def leave_group(self, member_id: str, revoked: Sequence[TP] = (), *, commit_stored: bool = False) -> None:
        """The member leaves (its client closes), after its ``on_revoke`` of ``revoked`` returned;
        with ``commit_stored`` its stored offsets of ``revoked`` are auto-committed first. Its
        partitions go to the other members. Leaving twice does nothing."""
        with self._lock:
            group_id = self._members.pop(member_id, None)
            if group_id is None:
                return
            self._errors.pop(member_id, None)
            g = self._group(group_id)
            if revoked:
                g.record(member_id, "revoke", list(revoked))
                if commit_stored:
                    g.commit_stored(member_id, revoked)
            g.leave(member_id, self._partition_counts())
            self._bump()

    def next_event(self, member_id: str) -> GroupEvent | None:
        """The member's next rebalance callback to run: partitions lost first, then revoked, then
        assigned; ``None`` when there is none.

        The partitions of an ``"assign"`` belong to the member from now on. Those of a ``"revoke"``
        stay its own until it calls :meth:`revoke_done`; those of a ``"lost"`` are already gone
        (commits for them are refused). ``"assign"`` and ``"lost"`` are recorded in
        :meth:`callbacks` now, a revoke when it is done.
        """
        with self._lock:
            g = self._group_of(member_id)
            event = g.next_event(member_id)
            if event is None:
                return None
            kind, tps = event
            if kind != "assign":
                return GroupEvent(kind, tps)
            committed = {tp: c for tp, (c, _) in g.committed_of(tps).items()}
            return GroupEvent(kind, tps, committed, {tp: len(self._logs[tp[0]][tp[1]]) for tp in tps})

    def revoke_done(self, member_id: str, partitions: Sequence[TP], *, commit_stored: bool = False) -> None:
        """The member's ``on_revoke`` of ``partitions`` returned; with ``commit_stored`` its stored
        offsets of them are auto-committed (as librdkafka does on unassign). They are no longer its
        own, and go to their new owners."""
        with self._lock:
            g = self._group_of(member_id)
            g.record(member_id, "revoke", list(partitions))
            if commit_stored:
                g.commit_stored(member_id, partitions)
            g.revoked(member_id, partitions)
            self._bump()

    def assignment(self, member_id: str) -> list[TP]:
        """The partitions the member owns now, sorted (a revoke in progress included, lost ones not;
        none once it left)."""
        with self._lock:
            group = self._members.get(member_id)
            return self._group(group).assignment(member_id) if group is not None else []

    def take_errors(self, member_id: str) -> list[KafkaClientError]:
        """The errors injected for the member (:meth:`inject_error`) since the last call, oldest first."""
        with self._lock:
            errors = self._errors.get(member_id)
            if not errors:
                return []
            self._errors[member_id] = []
            return errors

    # -- the member protocol: offsets ---------------------------------------------------------------

    def store_offset(self, member_id: str, tp: TP, offset: int, metadata: str = "") -> bool:
        """Keep ``offset`` (the next to consume) and its ``metadata`` for the member's next
        :meth:`commit_stored`; :meth:`stored` shows it. (librdkafka keeps its offset store in the
        client; here the broker keeps it, so :meth:`stored` is exact and a lost partition's stored
        offset is dropped the moment it is lost.)

        Returns
        -------
        ``False`` (nothing stored): the member does not own ``tp``.
        """
        with self._lock:
            return self._group_of(member_id).store(member_id, tp, offset, metadata)

    def commit_offsets(self, member_id: str, offsets: Sequence[tuple[TP, int, str]]) -> list[tuple[TP, int]]:
        """Commit ``(partition, offset, metadata)`` for the member's group, each at once.

        Returns
        -------
        ``(partition, offset)`` of each one refused because the member does not own the partition
        (stricter than Kafka, to catch a commit for a revoked partition); the others are committed.
        """
        with self._lock:
            g = self._group_of(member_id)
            refused = [(tp, o) for tp, o, meta in offsets if not g.commit(member_id, tp, o, meta)]
            if len(refused) < len(offsets):
                self._bump()
            return refused

    def commit_stored(self, member_id: str, partitions: Sequence[TP] | None = None) -> None:
        """Commit the member's stored offsets (of ``partitions``; default: all it owns) that differ
        from the committed ones, as automatic commits (librdkafka's auto commit)."""
        with self._lock:
            if self._group_of(member_id).commit_stored(member_id, partitions):
                self._bump()

    def fetch_committed(self, group: str, partitions: Sequence[TP]) -> dict[TP, tuple[int | None, str]]:
        """``{partition: (committed offset, metadata)}`` of ``group`` (``None``, ``""``: nothing
        committed)."""
        with self._lock:
            return self._group(group).committed_of(partitions)

    # -- the member protocol: the fetch path --------------------------------------------------------

    def fetch(self, member_id: str, positions: Sequence[tuple[TP, int]], max_records: int) -> list[Record]:
        """Up to ``max_records`` records, read from each ``(partition, position)`` in the order given
        until the limit, skipping partitions the member does not own. Counted in :meth:`delivered`.

        Raises
        ------
        KeyError
            Unknown member id.
        """
        with self._lock:
            g = self._group_of(member_id)
            out: list[Record] = []
            for tp, position in positions:
                if len(out) >= max_records:
                    break
                if g.owns(member_id, tp):
                    out.extend(self._logs[tp[0]][tp[1]][position : position + max_records - len(out)])
            g.count_delivered(len(out))
            return out

    def list_offsets(self, partitions: Sequence[TP]) -> dict[TP, int | None]:
        """``{partition: end offset}``; ``None`` for an unknown topic or partition."""
        with self._lock:
            logs = self._logs
            return {
                (t, p): len(logs[t][p]) if t in logs and 0 <= p < len(logs[t]) else None
                for t, p in partitions
            }

    # -- the member protocol: waiting for a change --------------------------------------------------

    def version(self) -> int:
        """A number that changes with every change of the broker (a record, a commit, a rebalance)."""
        with self._lock:
            return self._version

    def wait_for_change(self, version: int, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` real seconds while :meth:`version` is still ``version``.

        Returns
        -------
        Whether it changed.
        """
        with self._lock:
            if self._version == version:
                self._changed.wait(timeout_s)
            return self._version != version

    # -- inside -----------------------------------------------------------------------------------

    def _group(self, name: str) -> ConsumerGroup:
        g = self._groups.get(name)
        if g is None:
            g = self._groups[name] = ConsumerGroup(name)
        return g

    def _group_of(self, member_id: str) -> ConsumerGroup:
        return self._group(self._members[member_id])

    def _partition_counts(self) -> dict[str, int]:
        return {t: len(p) for t, p in self._logs.items()}

    def _bump(self) -> None:
        self._version += 1
        self._changed.notify_all()

    # -- wiring -----------------------------------------------------------------------------------

    def new_client(self, conf: dict[str, Any], on_error: Callable[[KafkaClientError], None]) -> FakeClient:
        """A new :class:`FakeClient`, a member of the group ``conf["group.id"]`` (what
        :attr:`client_factory` does when called; see :class:`BrokerConnector`).

        Raises
        ------
        KafkaClientError
            ``_INVALID_ARG``: ``conf`` has no ``group.id``.
        """
        if not conf.get("group.id"):
            raise KafkaClientError("the consumer configuration has no group.id", code="_INVALID_ARG")
        group = str(conf["group.id"])
        member_id = f"{group}-member-{next(self._member_ids)}"
        with self._lock:
            self._members[member_id] = group
            self._errors[member_id] = []
        return FakeClient(self, conf, on_error, member_id)

    def publisher(self) -> FakePublisher:
        """A :class:`~keyedconsumer.RecordPublisher` writing into this broker, in place of a
        :class:`~keyedconsumer.Publisher`: ``DeadLetter(publisher=broker.publisher())``."""
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
        return KeyedConsumer(
            client_factory=self.client_factory, clock=self.clock, poll_timeout_s=poll_timeout_s, **options
        )

    def run(self, *consumers: KeyedConsumer) -> Run:
        """Start ``consumer.run()`` of each consumer in a thread; use the result as a context manager,
        which stops them on exit. See :class:`Run`.

        Raises
        ------
        ValueError
            A consumer uses the real Kafka client (it was built without ``client_factory``).
        """
        return Run(self, consumers)

    def run_app(self, app: KeyedApp) -> AppRun:
        """Run ``app`` (a :class:`~keyedconsumer.KeyedApp`: its routes, hooks and middleware as
        written) on this broker and its fake clock, in a thread; use the result as a context manager,
        which stops it on exit. See :class:`AppRun`::

            with broker.run_app(app) as run:
                broker.produce("payments", "10", key="acct-1")
                run.until_idle()
        """
        return AppRun(self, app)


if TYPE_CHECKING:  # mypy checks that the fake satisfies the engine's seams

    def _is_a_client_factory(broker: InMemoryBroker) -> ClientFactory:
        return broker.client_factory

    def _is_a_connector(broker: InMemoryBroker) -> Connector:
        return broker.client_factory

    def _makes_publishers(broker: InMemoryBroker) -> PublisherFactory:
        return broker.client_factory.publisher
