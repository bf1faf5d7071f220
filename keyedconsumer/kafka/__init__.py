"""The Kafka seams: what the engine and the middleware need of Kafka, as protocols.

This module holds types only and loads no Kafka library, so any module may import it (the engine
core takes :data:`TP` from here). The implementations on librdkafka live in the submodules, the
only modules of the package that import ``confluent_kafka``:

- :mod:`keyedconsumer.kafka.client`: :func:`~keyedconsumer.kafka.client.connect`, the real
  :class:`KafkaClient`; :mod:`keyedconsumer.kafka.properties`: librdkafka's check of a property dict;
- :mod:`keyedconsumer.kafka.publisher`: :class:`~keyedconsumer.Publisher`, the real
  :class:`RecordPublisher`;
- :mod:`keyedconsumer.kafka.transactional`: the real :class:`TransactionalProducer`;
- :mod:`keyedconsumer.kafka.admin`: the command line's admin, inspection and replay tools.

:mod:`keyedconsumer.testing` implements :class:`KafkaClient` (``FakeClient``) and
:class:`RecordPublisher` (``FakePublisher``) on an in-memory broker.

**Where producers come from.** Every producer a consumer's middleware makes (``DeadLetter``'s,
``Audit``'s) comes from the consumer's client factory when that factory is a :class:`Connector`
(it also makes publishers: ``InMemoryBroker.client_factory`` is one, so under the in-memory broker
they write into it), else they are :class:`~keyedconsumer.Publisher` s (:func:`publishers_of`). The
records handlers produce (``msg.produce``, exactly-once results) come from the consumer's own
client (:meth:`KafkaClient.publisher`, :meth:`KafkaClient.transactional_producer`). So the one
object a test hands to the consumer decides where everything goes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from ..errors import KafkaClientError, PublishError
from ..message import Message, Record

__all__ = [
    "TP",
    "MISSING_TOPIC",
    "RebalanceListener",
    "KafkaClient",
    "ClientFactory",
    "Connector",
    "PublisherFactory",
    "publishers_of",
    "RecordPublisher",
    "BatchPublisher",
    "TransactionalProducer",
]

#: A topic-partition: ``(topic, partition)``.
TP = tuple[str, int]

#: The ``code`` of the :class:`~keyedconsumer.KafkaClientError` a client reports for a subscribed
#: topic the cluster does not have (librdkafka's ``UNKNOWN_TOPIC_OR_PART``), naming the topic and
#: the closest existing name. Not fatal: librdkafka assigns the topic's partitions once it exists.
MISSING_TOPIC = "UNKNOWN_TOPIC_OR_PART"


class RebalanceListener(Protocol):
    """Receives assignment changes, in the poll thread, inside ``poll_batch``."""

    def on_assign(self, partitions: list[TP]) -> None: ...
    def on_revoke(self, partitions: list[TP]) -> None: ...
    def on_lost(self, partitions: list[TP]) -> None: ...


class KafkaClient(Protocol):
    """What the engine needs of a Kafka consumer client. Used from one thread (the poll thread).

    A client reports to its ``on_error`` (:data:`ClientFactory`) the errors of the client that no
    call raises; among them each subscribed topic the cluster does not have (code
    :data:`MISSING_TOPIC`), the real one at :meth:`subscribe` when :meth:`check_brokers` saw the
    cluster's topics.
    """

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

    def wait_outcomes(self, wait: Callable[[float], int], timeout_s: float) -> int:
        """The owner waits for its workers' outcomes instead of in a poll: ``wait(seconds)`` waits
        on its mailbox and returns how many posts it ran. The real client calls
        ``wait(timeout_s)``; the in-memory one waits a moment of real time and, when nothing came,
        lets ``timeout_s`` pass on its fake clock, as an idle poll does.
        """
        ...

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


class PublisherFactory(Protocol):
    """``factory(brokers, config, delivery_timeout_s=...) -> BatchPublisher``: a producer of the
    cluster at ``brokers`` (``host:port`` strings) with the librdkafka producer properties
    ``config``, whose records are given up after ``delivery_timeout_s`` seconds.
    :class:`~keyedconsumer.Publisher` is the real one.

    Raises
    ------
    PublishError
        The producer could not be created (an invalid property).
    """

    def __call__(
        self, brokers: Sequence[str], config: Mapping[str, Any], *, delivery_timeout_s: float
    ) -> BatchPublisher: ...


@runtime_checkable
class Connector(Protocol):
    """A :data:`ClientFactory` that also makes the producers of its cluster (a
    :class:`PublisherFactory` as :meth:`publisher`): ``KeyedConsumer(client_factory=...)`` with one
    gives its middleware their producers from it (:func:`publishers_of`).
    ``keyedconsumer.testing.InMemoryBroker.client_factory`` is one."""

    def __call__(self, conf: dict[str, Any], on_error: Callable[[KafkaClientError], None]) -> KafkaClient: ...

    def publisher(
        self, brokers: Sequence[str], config: Mapping[str, Any], *, delivery_timeout_s: float
    ) -> BatchPublisher: ...


def publishers_of(client_factory: ClientFactory | None) -> PublisherFactory | None:
    """Where the middleware of a consumer built with ``client_factory`` gets its producers: the
    factory's own :meth:`Connector.publisher` when it is a :class:`Connector`; else ``None``, and
    the middleware builds the real :class:`~keyedconsumer.Publisher` (librdkafka)."""
    if isinstance(client_factory, Connector):
        return client_factory.publisher
    return None


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
