"""The fakes of the Kafka seams, on an :class:`~keyedconsumer.testing.InMemoryBroker`.

:class:`FakeClient` is a :class:`~keyedconsumer.kafka.KafkaClient` (one group member) and
:class:`FakePublisher` a :class:`~keyedconsumer.kafka.RecordPublisher`. Both use the broker only
through its public methods (the client: the member protocol listed in :mod:`keyedconsumer.testing.broker`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar
from weakref import WeakKeyDictionary

from ..errors import CommitError, KafkaClientError, PublishError, TransactionError
from ..kafka import TP, RebalanceListener
from ..message import Message, Record

if TYPE_CHECKING:
    from ..kafka import BatchPublisher, RecordPublisher, TransactionalProducer
    from .broker import GroupEvent, InMemoryBroker

__all__ = ["FakeClient", "FakePublisher", "FakeTransactionalProducer"]

#: The committed offset librdkafka reports when there is none (``RD_KAFKA_OFFSET_INVALID``).
OFFSET_INVALID = -1001


def _truthy(value: Any) -> bool:
    return value if isinstance(value, bool) else str(value).strip().lower() in ("true", "1", "yes")


class FakeClient:
    """A :class:`~keyedconsumer.kafka.KafkaClient` on an :class:`InMemoryBroker` (one group member).

    Made by :meth:`InMemoryBroker.client_factory`. Like the real client it is used from one thread,
    the consumer's poll thread, where it also runs the rebalance callbacks and ``on_error``.

    What librdkafka keeps in the client is kept here: the listener, the fetch positions, the paused
    partitions and the auto-commit schedule. What the group coordinator knows (membership, the
    assignment, stored and committed offsets) the broker keeps, and this client asks for it.
    """

    def __init__(
        self,
        broker: InMemoryBroker,
        conf: dict[str, Any],
        on_error: Callable[[KafkaClientError], None],
        member_id: str,
    ) -> None:
        self._broker = broker
        self._on_error = on_error
        self.member_id = member_id
        self.group_id = str(conf["group.id"])
        self._auto_commit = _truthy(conf.get("enable.auto.commit", True))
        self._commit_interval_s = float(conf.get("auto.commit.interval.ms", 5000)) / 1000.0
        self._earliest = str(conf.get("auto.offset.reset", "latest")).lower() in (
            "earliest",
            "smallest",
            "beginning",
        )
        self._next_commit_s = broker.clock() + self._commit_interval_s
        self._listener: RebalanceListener | None = None
        self._positions: dict[TP, int] = {}  # next offset to fetch, per assigned partition
        self._paused: set[TP] = set()
        self._turn = 0  # rotates the partition a fetch starts with
        self._closed = False

    def __repr__(self) -> str:
        return f"FakeClient({self.member_id!r}, assigned={self._broker.assignment(self.member_id)})"

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise KafkaClientError(f"{what}: the consumer is closed", code="_STATE")

    # -- the KafkaClient protocol -----------------------------------------------------------------

    def publisher(self, delivery_timeout_s: float) -> BatchPublisher:
        """A :class:`FakePublisher` on the same broker: what handlers produce (``msg.produce``)
        lands in its topics (read them with ``InMemoryBroker.records``)."""
        return FakePublisher(self._broker)

    def transactional_producer(
        self, transactional_id: str, timeout_s: float, transaction_timeout_s: float
    ) -> TransactionalProducer:
        """A :class:`FakeTransactionalProducer` committing for this member (and fencing off an
        earlier one of the same ``transactional_id`` on this broker)."""
        return FakeTransactionalProducer(self._broker, self, transactional_id)

    def subscribe(self, topics: Sequence[str], listener: RebalanceListener) -> None:
        """Join the group with a subscription to ``topics``; assignments come in ``poll_batch``."""
        self._check_open("subscribe")
        self._listener = listener
        self._broker.join_group(self.member_id, topics)

    def poll_batch(self, max_messages: int, timeout_s: float) -> list[Message]:
        """Run due callbacks and the auto-commit tick, then return up to ``max_messages`` records.

        With nothing to deliver, waits ``idle_wait_s`` of real time for new records, then advances
        the fake clock by ``timeout_s`` seconds and returns ``[]``.
        """
        b = self._broker
        self._check_open("poll")
        self._serve()
        seen = b.version()
        out = self._fetch(max_messages)
        if out:
            return out
        b.wait_for_change(seen, b.idle_wait_s)
        self._serve()
        out = self._fetch(max_messages)
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
        self._check_open("store_offsets")
        if not self._broker.store_offset(self.member_id, (topic, partition), offset, metadata):
            raise KafkaClientError(
                f"store_offsets topic={topic} partition={partition}: _STATE: Local: Erroneous state",
                code="_STATE",
            )

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
        self._check_open("commit")
        meta = metadata or {}
        refused = self._broker.commit_offsets(
            self.member_id, [((t, p), o, meta.get((t, p), "")) for t, p, o in offsets]
        )
        if refused:
            failed = ", ".join(f"{t}[{p}]@{o}: ILLEGAL_GENERATION" for (t, p), o in refused)
            raise CommitError(
                f"commit failed for {failed} (not assigned to this member)", code="ILLEGAL_GENERATION"
            )

    def commit_async(
        self, offsets: Sequence[tuple[str, int, int]], metadata: Mapping[TP, str] | None = None
    ) -> None:
        """:meth:`commit` whose failure is not reported (as librdkafka's asynchronous commit
        without an ``on_commit`` callback)."""
        try:
            self.commit(offsets, metadata)
        except KafkaClientError:
            pass

    def committed(self, partitions: Sequence[TP], timeout_s: float) -> dict[TP, tuple[int, str]]:
        """The group's committed ``(offset, metadata)`` of ``partitions`` (``-1001`` when none)."""
        self._check_open("committed")
        found = self._broker.fetch_committed(self.group_id, partitions)
        return {
            tp: (OFFSET_INVALID if offset is None else offset, meta) for tp, (offset, meta) in found.items()
        }

    def pause(self, partitions: Sequence[TP]) -> None:
        """Stop fetching ``partitions`` (assigned ones; others are ignored). As in librdkafka, the
        pause outlives a revoke and a later re-assignment of the partition."""
        owned = set(self._broker.assignment(self.member_id))
        self._paused.update(tp for tp in partitions if tp in owned)

    def resume(self, partitions: Sequence[TP]) -> None:
        """Fetch ``partitions`` again, from the next record not yet delivered."""
        self._paused.difference_update(partitions)

    def high_watermarks(self, partitions: Sequence[TP]) -> dict[TP, int | None]:
        """End offsets; ``None`` for an unknown topic or partition."""
        return self._broker.list_offsets(partitions)

    def check_brokers(self, timeout_s: float) -> None:
        """The in-memory broker always answers."""
        self._check_open("list_topics")

    def wait_outcomes(self, wait: Callable[[float], int], timeout_s: float) -> int:
        """Wait ``idle_wait_s`` of real time for the owner's mailbox; when nothing came, let
        ``timeout_s`` pass on the fake clock (as an idle :meth:`poll_batch` does)."""
        n = wait(self._broker.idle_wait_s)
        if not n:
            self._broker.clock.advance(max(0.0, timeout_s))
        return n

    def close(self, timeout_s: float | None = None) -> bool:
        """Revoke the whole assignment (``on_revoke``, in this thread), auto-commit the stored offsets,
        and leave the group, whose partitions go to the other members. A second call does nothing.
        Returns ``True`` (the in-memory broker always answers)."""
        if self._closed:
            return True
        tps = self._broker.assignment(self.member_id)
        try:
            if tps and self._listener is not None:
                self._listener.on_revoke(tps)
        finally:
            self._broker.leave_group(self.member_id, tps, commit_stored=self._auto_commit)
            self._closed = True
            self._positions.clear()
        return True

    # -- inside poll_batch ------------------------------------------------------------------------

    def _serve(self) -> None:
        """Report injected errors, run scheduled rebalance callbacks, then the auto-commit tick."""
        b = self._broker
        while True:
            errors = b.take_errors(self.member_id)
            event = b.next_event(self.member_id)
            for err in errors:
                self._on_error(err)
            if event is None:
                break
            self._run(event)
        now = b.clock()
        if self._auto_commit and now >= self._next_commit_s:
            self._next_commit_s = now + self._commit_interval_s
            b.commit_stored(self.member_id)

    def _run(self, event: GroupEvent) -> None:
        listener = self._listener
        assert listener is not None  # events exist only after subscribe()
        tps = event.partitions
        if event.kind == "assign":
            for tp in tps:
                end, committed = event.end_offsets[tp], event.committed[tp]
                valid = committed is not None and 0 <= committed <= end
                self._positions[tp] = (
                    committed if valid and committed is not None else (0 if self._earliest else end)
                )
            listener.on_assign(tps)
        elif event.kind == "lost":
            self._forget(tps)
            listener.on_lost(tps)
        else:
            try:
                listener.on_revoke(tps)
            finally:
                # librdkafka commits the stored offsets it unassigns
                self._broker.revoke_done(self.member_id, tps, commit_stored=self._auto_commit)
                self._forget(tps)

    def _forget(self, tps: Sequence[TP]) -> None:
        # like librdkafka, a pause outlives a revoke: a partition assigned back stays paused until
        # resumed (issue confluentinc/librdkafka#1849)
        for tp in tps:
            self._positions.pop(tp, None)

    def _fetch(self, max_messages: int) -> list[Message]:
        parts = [tp for tp in self._broker.assignment(self.member_id) if tp not in self._paused]
        if not parts:
            return []
        self._turn += 1
        order = [parts[(self._turn + i) % len(parts)] for i in range(len(parts))]
        positions = [(tp, self._positions[tp]) for tp in order if tp in self._positions]
        records = self._broker.fetch(self.member_id, positions, max_messages)
        out: list[Message] = []
        for r in records:
            self._positions[(r.topic, r.partition)] = r.offset + 1
            out.append(
                Message(
                    r.topic, r.partition, r.offset, r.key, r.value, list(r.headers) or None, r.timestamp_ms
                )
            )
        return out


class FakeTransactionalProducer:
    """A :class:`~keyedconsumer.kafka.TransactionalProducer` on an :class:`InMemoryBroker`.

    A transaction is applied at once and whole, or not at all: its offsets are committed for the
    member's group and its records appended to their topics, after checking that it can do both
    (the member owns every partition of the offsets: otherwise an *abortable* ``TransactionError``,
    like the group coordinator's generation check of KIP-447; the topics exist, or the broker
    creates topics). Starting a producer with a ``transactional_id`` fences off the earlier one of
    that id on the same broker: its next transaction fails with a *fatal* ``_FENCED`` error.

    Not modelled: transactions left open (there is no crash in memory), ``read_uncommitted``
    readers, the transaction timeout. Get a consumer's producer with :meth:`of` to inject a failure.

    Attributes
    ----------
    fail_next:
        When set, the next transaction raises it (and is not applied); then it is cleared. An
        ``in_doubt`` error models a commit whose answer was lost: the transaction is applied first
        when ``in_doubt_committed`` is true, and :meth:`resolve` then says which.
    in_doubt_committed:
        Whether a transaction failed with an ``in_doubt`` error had committed (default ``True``).
    transactions:
        Transactions applied so far.
    """

    _live: ClassVar[WeakKeyDictionary[InMemoryBroker, dict[str, FakeTransactionalProducer]]] = (
        WeakKeyDictionary()
    )
    _live_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, broker: InMemoryBroker, client: FakeClient, transactional_id: str) -> None:
        self._broker = broker
        self._client = client
        self.transactional_id = transactional_id
        self.fail_next: TransactionError | None = None
        self.in_doubt_committed = True
        self._doubt: bool | None = None  # the outcome resolve() tells
        self.transactions = 0
        with self._live_lock:
            self._live.setdefault(broker, {})[transactional_id] = self

    @classmethod
    def of(cls, broker: InMemoryBroker, transactional_id: str) -> FakeTransactionalProducer | None:
        """The live producer of ``transactional_id`` on ``broker`` (the newest one started), or ``None``."""
        with cls._live_lock:
            return cls._live.get(broker, {}).get(transactional_id)

    def run(
        self,
        records: Sequence[Record],
        offsets: Sequence[tuple[str, int, int]],
        metadata: Mapping[TP, str],
        timeout_s: float,
        budget: Callable[[float], float] | None = None,
    ) -> None:
        """Apply one transaction (see the class docstring).

        Raises
        ------
        TransactionError
            ``fail_next``; fatal ``_FENCED`` when a newer producer of this id started; abortable
            ``ILLEGAL_GENERATION`` when the member does not own a partition of ``offsets``; not
            abortable when a record's topic does not exist and the broker creates none.
        """
        if self._doubt is not None:
            raise TransactionError("resolve() first", code="_IN_DOUBT", retriable=True, in_doubt=True)
        error, self.fail_next = self.fail_next, None
        if error is not None and error.in_doubt:
            if self.in_doubt_committed:
                self._apply(records, offsets, metadata)
            self._doubt = self.in_doubt_committed
            raise error
        if error is not None:
            raise error
        self._apply(records, offsets, metadata)

    def resolve(self, timeout_s: float, budget: Callable[[float], float] | None = None) -> bool:
        """Whether the transaction failed ``in_doubt`` had committed (``in_doubt_committed``)."""
        outcome, self._doubt = self._doubt, None
        return True if outcome is None else outcome

    def _apply(
        self, records: Sequence[Record], offsets: Sequence[tuple[str, int, int]], metadata: Mapping[TP, str]
    ) -> None:
        if self.of(self._broker, self.transactional_id) is not self:
            raise TransactionError(
                f"transactional id {self.transactional_id!r}: _FENCED: a newer producer started",
                code="_FENCED",
                fatal=True,
            )
        owned = set(self._broker.assignment(self._client.member_id))
        stale = [(t, p) for t, p, _ in offsets if (t, p) not in owned]
        if stale:
            raise TransactionError(
                f"transaction aborted: ILLEGAL_GENERATION: {stale} not assigned to this member",
                code="ILLEGAL_GENERATION",
                abortable=True,
                retriable=True,
            )
        topics = self._broker.topics()
        missing = sorted({r[0] for r in records if r[0] not in topics})
        if missing and not self._broker.auto_create_topics:
            raise TransactionError(
                f"transaction aborted: unknown topic(s) {missing}", code="UNKNOWN_TOPIC_OR_PART"
            )
        if offsets:
            try:
                self._client.commit(offsets, metadata)
            except KafkaClientError as exc:  # a revoke between the check and the commit
                raise TransactionError(
                    f"transaction aborted: {exc}", code=exc.code, abortable=True, retriable=True
                ) from None
        for topic, key, value, headers in records:
            self._broker.produce(topic, value, key=key, headers=headers)
        self.transactions += 1

    def close(self) -> None:
        """Nothing is left open."""


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

    def publish_many(
        self, records: Sequence[tuple[str, bytes | None, bytes | None, list[tuple[str, bytes | None]] | None]]
    ) -> list[tuple[int, int] | PublishError]:
        """:meth:`publish` of each ``(topic, key, value, headers)``; per record ``(partition, offset)``
        or the :class:`PublishError` it raised."""
        out: list[tuple[int, int] | PublishError] = []
        for topic, key, value, headers in records:
            try:
                out.append(self.publish(topic, key, value, headers))
            except PublishError as exc:
                out.append(exc)
        return out

    def close(self, timeout_s: float = 10.0) -> None:
        """Nothing is queued: returns at once."""


if TYPE_CHECKING:  # mypy checks that the fake satisfies the dead-letter seam

    def _is_a_record_publisher(publisher: FakePublisher) -> RecordPublisher:
        return publisher

    def _is_a_batch_publisher(publisher: FakePublisher) -> BatchPublisher:
        return publisher

    def _is_a_transactional_producer(producer: FakeTransactionalProducer) -> TransactionalProducer:
        return producer
