"""The Kafka seams: what the engine and the middleware need of Kafka, as protocols.

This module holds types only and loads no Kafka library, so any module may import it (the engine
core takes :data:`TP` from here). The implementations on librdkafka live in the submodules, the
only modules of the package that import ``confluent_kafka``:

- :mod:`keyedconsumer.kafka.client`: :func:`~keyedconsumer.kafka.client.connect`, the real
  :class:`KafkaClient`, and :func:`~keyedconsumer.kafka.client.check_config`;
- :mod:`keyedconsumer.kafka.publisher`: :class:`~keyedconsumer.Publisher`, the real
  :class:`RecordPublisher`;
- :mod:`keyedconsumer.kafka.transactional`: the real :class:`TransactionalProducer`;
- :mod:`keyedconsumer.kafka.admin`: the command line's admin, inspection and replay tools.

:mod:`keyedconsumer.testing` implements :class:`KafkaClient` (``FakeClient``) and
:class:`RecordPublisher` (``FakePublisher``) on an in-memory broker.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from ..errors import KafkaClientError, PublishError
from ..message import Message, Record

__all__ = [
    "TP",
    "RebalanceListener",
    "KafkaClient",
    "ClientFactory",
    "RecordPublisher",
    "BatchPublisher",
    "TransactionalProducer",
]

#: A topic-partition: ``(topic, partition)``.
TP = tuple[str, int]


class RebalanceListener(Protocol):
    """Receives assignment changes, in the poll thread, inside ``poll_batch``."""

    def on_assign(self, partitions: list[TP]) -> None: ...
    def on_revoke(self, partitions: list[TP]) -> None: ...
    def on_lost(self, partitions: list[TP]) -> None: ...


class KafkaClient(Protocol):
    """What the engine needs of a Kafka consumer client. Used from one thread (the poll thread)."""

    def subscribe(self, topics: Sequence[str], listener: RebalanceListener) -> None: ...
    def poll_batch(self, max_messages: int, timeout_s: float) -> list[Message]: ...
    def store(self, topic: str, partition: int, offset: int, metadata: str = "") -> None: ...
    def commit(
        self,
        offsets: Sequence[tuple[str, int, int]],
        metadata: Mapping[TP, str] | None = None,
        timeout_s: float | None = None,
    ) -> None: ...
    def commit_async(
        self, offsets: Sequence[tuple[str, int, int]], metadata: Mapping[TP, str] | None = None
    ) -> None: ...
    def committed(self, partitions: Sequence[TP], timeout_s: float) -> dict[TP, tuple[int, str]]: ...
    def pause(self, partitions: Sequence[TP]) -> None: ...
    def resume(self, partitions: Sequence[TP]) -> None: ...
    def high_watermarks(self, partitions: Sequence[TP]) -> dict[TP, int | None]: ...
    def check_brokers(self, timeout_s: float) -> None: ...
    def close(self, timeout_s: float | None = None) -> bool: ...

    def publisher(self, delivery_timeout_s: float) -> BatchPublisher:
        """A producer of the same cluster (same brokers and security settings) for the records
        handlers produce (``msg.produce``), waiting for each record's acknowledgement.

        Raises
        ------
        PublishError
            The producer could not be created.
        """
        ...

    def transactional_producer(
        self, transactional_id: str, timeout_s: float, transaction_timeout_s: float
    ) -> TransactionalProducer:
        """A transactional producer of the same cluster whose commits send this consumer's offsets
        with its group metadata (KIP-447), started (``init_transactions``) within ``timeout_s``.

        Raises
        ------
        TransactionError
            The producer could not be created or started (the brokers may lack transaction support).
        """
        ...


#: ``factory(librdkafka_config, on_error) -> KafkaClient``; ``on_error`` receives client errors.
ClientFactory = Callable[[dict[str, Any], Callable[[KafkaClientError], None]], KafkaClient]


class RecordPublisher(Protocol):
    """Writes one record at a time and waits for the broker's acknowledgement (the dead-letter
    middleware's seam). Safe to call from several threads at once.

    :class:`~keyedconsumer.Publisher` is the real one; ``keyedconsumer.testing.FakePublisher``
    writes into an in-memory broker.
    """

    #: Seconds a record is tried before :meth:`publish` reports it failed (0: answered at once).
    delivery_timeout_s: float

    def publish(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: list[tuple[str, bytes | None]] | None = None,
        timeout_s: float | None = None,
    ) -> tuple[int, int]:
        """Write one record and wait for its fate.

        Returns
        -------
        ``(partition, offset)`` of the acknowledged record.

        Raises
        ------
        PublishError
            The record was refused, could not be queued, or was not delivered.
        """
        ...

    def close(self, timeout_s: float = 10.0) -> None:
        """Wait up to ``timeout_s`` seconds for records still queued."""
        ...


class BatchPublisher(RecordPublisher, Protocol):
    """A :class:`RecordPublisher` that also writes a batch of records with one wait (the audit
    trail's seam). :class:`~keyedconsumer.Publisher` and ``keyedconsumer.testing.FakePublisher`` are ones."""

    def publish_many(
        self, records: Sequence[tuple[str, bytes | None, bytes | None, list[tuple[str, bytes | None]] | None]]
    ) -> list[tuple[int, int] | PublishError]:
        """Write ``[(topic, key, value, headers)]`` and wait for the fate of each.

        Returns
        -------
        Per record, in order, ``(partition, offset)`` or the :class:`~keyedconsumer.PublishError`
        saying why it was not delivered.

        Raises
        ------
        PublishError
            The publisher can send nothing more (a fatal producer error).
        """
        ...


class TransactionalProducer(Protocol):
    """Writes records and commits a consumer's offsets in one Kafka transaction (librdkafka's
    transactional API; ``send_offsets_to_transaction`` with the consumer's group metadata, KIP-447).
    Used from one thread (the consumer's poll thread).

    :meth:`run` is one transaction: begin, produce, send the offsets, commit. Nothing of it becomes
    visible to ``read_committed`` readers unless all of it does. A commit not answered in time is
    *in doubt*: :meth:`resolve` tells how it ended before another transaction may run.
    """

    def run(
        self,
        records: Sequence[Record],
        offsets: Sequence[tuple[str, int, int]],
        metadata: Mapping[TP, str],
        timeout_s: float,
        budget: Callable[[float], float] | None = None,
    ) -> None:
        """Write ``records`` (``(topic, key, value, headers)``, in order) and commit ``offsets``
        (``(topic, partition, next offset)`` with ``metadata[(topic, partition)]``) for the
        consumer's group, in one transaction, within about ``timeout_s`` seconds, cut further when
        ``budget(cap_s) -> seconds`` allows less (a stop under way).

        Raises
        ------
        TransactionError
            ``abortable``: it was aborted (nothing of it is visible) and another may be tried
            (``retriable``: the failure passes by itself, e.g. the broker did not answer, the group
            rebalances). ``in_doubt``: its commit was not answered in time; call :meth:`resolve`.
            Otherwise the producer failed for good (``fatal``, e.g. fenced) or a record was refused.
        """
        ...

    def resolve(self, timeout_s: float, budget: Callable[[float], float] | None = None) -> bool:
        """How the transaction that :meth:`run` left in doubt ended: ``True`` committed, ``False``
        aborted (nothing of it visible). Waits up to ``timeout_s`` seconds (cut by ``budget``).

        Raises
        ------
        TransactionError
            ``in_doubt``: still no answer; ``fatal``: the producer failed for good.
        """
        ...

    def close(self) -> None:
        """Abort an open transaction (best effort, briefly) and release the producer."""
        ...
