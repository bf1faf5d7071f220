"""Helpers for integration tests on the real broker (tests only: they may import confluent_kafka)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition


def produce(
    bootstrap: str, topic: str, records: Iterable[tuple[bytes | None, bytes | None, int | None]]
) -> list[tuple[int, int]]:
    """Produce ``(key, value, partition)`` records with acks=all; return their (partition, offset)."""
    p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True, "linger.ms": 5})
    acked: list[tuple[int, int]] = []

    def cb(err, msg):  # type: ignore[no-untyped-def]
        assert err is None, err
        acked.append((msg.partition(), msg.offset()))

    for key, value, partition in records:
        kwargs = {} if partition is None else {"partition": partition}
        while True:
            try:
                p.produce(topic, value=value, key=key, on_delivery=cb, **kwargs)
                break
            except BufferError:
                p.poll(0.1)
        p.poll(0)
    assert p.flush(60) == 0
    return acked


def end_offsets(bootstrap: str, topic: str, partitions: int) -> dict[int, int]:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"probe-{uuid.uuid4().hex}"})
    try:
        return {
            p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in range(partitions)
        }
    finally:
        c.close()


# the errors librdkafka returns while the group coordinator loads or moves (the KafkaError of
# Consumer.committed() does not carry retriable(): the codes are named)
_COORDINATOR_NOT_READY = frozenset(
    {
        KafkaError.NOT_COORDINATOR,
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        KafkaError.COORDINATOR_NOT_AVAILABLE,
    }
)


def committed(
    bootstrap: str, group: str, topic: str, partitions: int, timeout_s: float = 30.0
) -> dict[int, int | None]:
    """The group's committed offsets (``None``: nothing committed).

    An error saying the group coordinator is not ready (loading or moved, e.g. just after a broker was
    resumed: NOT_COORDINATOR, COORDINATOR_LOAD_IN_PROGRESS) is asked again until ``timeout_s``;
    any other error is raised. The answer itself is never retried into a different one.
    """
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                res = c.committed([TopicPartition(topic, p) for p in range(partitions)], timeout=10)
                return {tp.partition: (tp.offset if tp.offset >= 0 else None) for tp in res}
            except KafkaException as exc:
                if exc.args[0].code() not in _COORDINATOR_NOT_READY or time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)
    finally:
        c.close()


def wait_until(pred, timeout_s: float, interval_s: float = 0.05) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval_s)
    return bool(pred())


def read_all(bootstrap: str, topic: str, expect: int, timeout_s: float = 30.0) -> list:  # type: ignore[type-arg]
    """Read ``topic`` from the beginning until ``expect`` records arrived or ``timeout_s`` passed."""
    c = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"reader-{uuid.uuid4().hex}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    c.subscribe([topic])
    out = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < expect and time.monotonic() < deadline:
            for m in c.consume(100, 0.5):
                if m.error() is None:
                    out.append(m)
        # a short extra read shows there is nothing more
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            out.extend(m for m in c.consume(100, 0.2) if m.error() is None)
    finally:
        c.close()
    return out
