"""The only module that imports ``confluent_kafka``: the Kafka client behind a narrow seam.

The engine talks to :class:`KafkaClient`, a ``Protocol``; :func:`connect` builds the real one on
librdkafka. Tests and :mod:`keyedconsumer.testing` can pass another factory to the consumer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from .errors import CommitError, KafkaClientError, PublishError
from .message import Message

__all__ = ["KafkaClient", "ClientFactory", "RebalanceListener", "Publisher", "check_config", "connect", "TP"]

log = logging.getLogger("keyedconsumer.kafka")

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
    def store(self, topic: str, partition: int, offset: int) -> None: ...
    def commit(self, offsets: Sequence[tuple[str, int, int]]) -> None: ...
    def pause(self, partitions: Sequence[TP]) -> None: ...
    def resume(self, partitions: Sequence[TP]) -> None: ...
    def high_watermarks(self, partitions: Sequence[TP]) -> dict[TP, int | None]: ...
    def check_brokers(self, timeout_s: float) -> None: ...
    def close(self) -> None: ...


#: ``factory(librdkafka_config, on_error) -> KafkaClient``; ``on_error`` receives client errors.
ClientFactory = Callable[[dict[str, Any], Callable[[KafkaClientError], None]], KafkaClient]

# Errors librdkafka reports on commit that mean "nothing to do", not a failure (case C8).
_BENIGN_COMMIT = {KafkaError._NO_OFFSET}


def _client_error(err: KafkaError, what: str) -> KafkaClientError:
    return KafkaClientError(f"{what}: {err.name()}: {err.str()}", code=err.name(), fatal=err.fatal())


class _ConfluentClient:
    """:class:`KafkaClient` on ``confluent_kafka.Consumer``."""

    def __init__(self, conf: dict[str, Any], on_error: Callable[[KafkaClientError], None]) -> None:
        self._on_error = on_error
        conf = dict(conf)
        conf["error_cb"] = self._error_cb
        try:
            self._consumer = Consumer(conf)
        except KafkaException as exc:
            err = exc.args[0]
            raise KafkaClientError(f"cannot create the Kafka consumer: {err.str()}", code=err.name()) from None

    def _error_cb(self, err: KafkaError) -> None:
        self._on_error(_client_error(err, "Kafka client error"))

    def subscribe(self, topics: Sequence[str], listener: RebalanceListener) -> None:
        def tps(parts: list[TopicPartition]) -> list[TP]:
            return [(p.topic, p.partition) for p in parts]

        # The callbacks never call assign()/unassign(): confluent-kafka applies the (incremental)
        # assignment itself after the callback returns, which incremental protocols require (C10).
        self._consumer.subscribe(
            list(topics),
            on_assign=lambda _c, parts: listener.on_assign(tps(parts)),
            on_revoke=lambda _c, parts: listener.on_revoke(tps(parts)),
            on_lost=lambda _c, parts: listener.on_lost(tps(parts)),
        )

    def poll_batch(self, max_messages: int, timeout_s: float) -> list[Message]:
        out: list[Message] = []
        append = out.append
        for raw in self._consumer.consume(max_messages, timeout_s):
            err = raw.error()
            if err is not None:
                if err.code() != KafkaError._PARTITION_EOF:
                    where = f"topic={raw.topic()} partition={raw.partition()}"
                    self._on_error(_client_error(err, f"consume error ({where})"))
                continue
            ts_type, ts = raw.timestamp()
            append(
                Message(
                    raw.topic(),  # type: ignore[arg-type]
                    raw.partition(),  # type: ignore[arg-type]
                    raw.offset(),  # type: ignore[arg-type]
                    raw.key(),
                    raw.value(),
                    raw.headers(),  # type: ignore[arg-type]
                    ts if ts_type else None,
                )
            )
        return out

    def store(self, topic: str, partition: int, offset: int) -> None:
        # One partition per call: librdkafka fails a multi-partition store only when every
        # partition fails, so a mixed call could silently drop one (case C9).
        try:
            self._consumer.store_offsets(offsets=[TopicPartition(topic, partition, offset)])
        except KafkaException as exc:
            raise _client_error(exc.args[0], f"store_offsets topic={topic} partition={partition}") from None

    def commit(self, offsets: Sequence[tuple[str, int, int]]) -> None:
        tps = [TopicPartition(t, p, o) for t, p, o in offsets]
        try:
            result = self._consumer.commit(offsets=tps, asynchronous=False)
        except KafkaException as exc:
            err = exc.args[0]
            if err.code() in _BENIGN_COMMIT:
                return
            raise CommitError(f"commit failed: {err.name()}: {err.str()}", code=err.name(), fatal=err.fatal()) from None
        failed = [
            (tp, tp.error) for tp in result or [] if tp.error is not None and tp.error.code() not in _BENIGN_COMMIT
        ]
        if failed:
            desc = ", ".join(f"{tp.topic}[{tp.partition}]@{tp.offset}: {e.name()}" for tp, e in failed)
            raise CommitError(f"commit failed for {desc}", code=failed[0][1].name())

    def pause(self, partitions: Sequence[TP]) -> None:
        if partitions:
            self._consumer.pause([TopicPartition(t, p) for t, p in partitions])

    def resume(self, partitions: Sequence[TP]) -> None:
        if partitions:
            self._consumer.resume([TopicPartition(t, p) for t, p in partitions])

    def high_watermarks(self, partitions: Sequence[TP]) -> dict[TP, int | None]:
        # cached=True: the end offsets librdkafka learnt from its last fetch responses; no request
        out: dict[TP, int | None] = {}
        for t, p in partitions:
            try:
                high = self._consumer.get_watermark_offsets(TopicPartition(t, p), cached=True)
            except KafkaException:
                high = None
            out[(t, p)] = high[1] if high and high[1] >= 0 else None
        return out

    def check_brokers(self, timeout_s: float) -> None:
        try:
            self._consumer.list_topics(timeout=timeout_s)
        except KafkaException as exc:
            err = exc.args[0]
            raise KafkaClientError(
                f"no answer from the brokers within {timeout_s:g} s: {err.name()}: {err.str()} "
                "(check 'brokers' / bootstrap.servers)",
                code=err.name(),
            ) from None

    def close(self) -> None:
        self._consumer.close()


def check_config(conf: dict[str, Any]) -> None:
    """Check librdkafka properties by building (and at once closing) a consumer; no broker is contacted
    for long and no group is joined.

    Raises
    ------
    ValueError
        librdkafka's own message for an unknown property or an invalid value.
    """
    try:
        Consumer({**conf, "log_level": 0}).close()  # silent: it is only a check
    except KafkaException as exc:
        raise ValueError(exc.args[0].str()) from None


def connect(conf: dict[str, Any], on_error: Callable[[KafkaClientError], None]) -> KafkaClient:
    """Build the real client. Raises :class:`KafkaClientError` on an invalid librdkafka property."""
    return _ConfluentClient(conf, on_error)


class Publisher:
    """A producer that waits for the broker's acknowledgement of each record.

    Records are written with ``acks=all`` and ``enable.idempotence=true`` (librdkafka), so an
    acknowledged record is on every in-sync replica and a retried send is not duplicated. Safe to
    call from several threads at once. Used by the dead-letter middleware.

    Parameters
    ----------
    brokers:
        Bootstrap servers, ``host:port`` strings.
    config:
        Other librdkafka producer properties (``acks`` and ``enable.idempotence`` may not be
        weakened: they are set after these).
    """

    def __init__(self, brokers: Sequence[str], config: dict[str, Any] | None = None) -> None:
        conf: dict[str, Any] = {"bootstrap.servers": ",".join(brokers), "linger.ms": 5}
        conf.update(config or {})
        conf.update({"acks": "all", "enable.idempotence": True})
        try:
            self._producer = Producer(conf)
        except KafkaException as exc:
            raise PublishError(f"cannot create the producer: {exc.args[0].str()}") from None

    def publish(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: list[tuple[str, bytes | None]] | None = None,
        timeout_s: float = 30.0,
    ) -> tuple[int, int]:
        """Write one record and wait until the broker acknowledged it.

        Returns
        -------
        ``(partition, offset)`` of the acknowledged record.

        Raises
        ------
        PublishError
            The broker refused the record (e.g. too large, not authorised), it could not be queued,
            or no acknowledgement came within ``timeout_s`` seconds.
        """
        done = threading.Event()
        result: list[Any] = []

        def on_delivery(err: KafkaError | None, msg: Any) -> None:
            result.append((err, msg))
            done.set()

        try:
            wire: Any = list(headers) if headers else None
            self._producer.produce(topic, value=value, key=key, headers=wire, on_delivery=on_delivery)
        except (KafkaException, BufferError) as exc:
            raise PublishError(f"cannot publish to {topic}: {exc}") from None
        deadline = time.monotonic() + timeout_s
        while not done.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                raise PublishError(f"no acknowledgement from the broker for {topic} within {timeout_s:g} s")
            self._producer.poll(min(left, 0.1))
        err, msg = result[0]
        if err is not None:
            raise PublishError(f"the broker refused the record for {topic}: {err.name()}: {err.str()}")
        return msg.partition(), msg.offset()

    def close(self, timeout_s: float = 10.0) -> None:
        """Wait up to ``timeout_s`` seconds for queued records."""
        self._producer.flush(timeout_s)
