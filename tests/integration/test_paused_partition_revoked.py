"""A partition paused by back-pressure, revoked and assigned back, is fetched again.

The fault run's "stall" (partitions 0 and 1 stuck until the drain timed out): the consumer that got
them back had paused them for back-pressure during an earlier assignment. librdkafka keeps a
partition's pause across a revoke and a re-assignment, while the engine forgot it (the revoke
dropped the partition from ``_paused``), so nothing ever resumed it: not one message of it was
fetched again, and its committed offset stayed put.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from confluent_kafka import Consumer

from keyedconsumer import KeyedConsumer, Message

from .kafkautil import produce, wait_until

pytestmark = [pytest.mark.kafka]


@pytest.mark.timeout(120)
def test_partition_paused_then_revoked_and_assigned_back_is_fetched_again(  # type: ignore[no-untyped-def]
    kafka_bootstrap: str, new_topic, start
) -> None:
    # given two partitions of two messages of one key each, whose handlers block: 4 in flight, so
    # back-pressure (max_in_flight=4) pauses both (after a revoke 3 stay in flight: no pause or
    # resume happens by itself until the handlers are released)
    topic = new_topic(2)
    produce(kafka_bootstrap, topic, [(b"stuck", b"x", p) for p in (0, 1) for _ in range(2)])
    release = threading.Event()
    done: set[tuple[int, int]] = set()
    lock = threading.Lock()

    def handle(msg: Message) -> None:
        if not release.is_set():
            release.wait(60)
        with lock:
            done.add((msg.partition, msg.offset))

    group = f"pause-{uuid.uuid4().hex[:8]}"
    consumer = KeyedConsumer(
        name=group,
        handler=handle,
        brokers=[kafka_bootstrap],
        topics=[topic],
        concurrency=4,
        max_in_flight=4,
        batch_size=4,
        revoke_timeout_s=0.5,
    )
    running = start(consumer)
    both = {(topic, 0), (topic, 1)}
    assert wait_until(lambda: set(consumer.paused) == both, 30)  # back-pressure paused both

    # when another member joins (one paused partition is revoked) and leaves (it comes back)
    other = Consumer(
        {
            "bootstrap.servers": kafka_bootstrap,
            "group.id": group,
            "enable.auto.commit": False,
            "partition.assignment.strategy": "cooperative-sticky",
            "auto.offset.reset": "earliest",
        }
    )
    other.subscribe([topic])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (len(consumer.assignment) != 1 or not other.assignment()):
        other.poll(0.1)
    assert len(consumer.assignment) == 1 and other.assignment()
    other.close()
    assert wait_until(lambda: set(consumer.assignment) == both, 30)

    # and the handlers are released, and one more message arrives on each partition
    release.set()
    acked = produce(kafka_bootstrap, topic, [(b"k", b"y", p) for p in (0, 1)])

    # then every message of both partitions runs (the revoked one is not left paused forever)
    expected = {(p, o) for p in (0, 1) for o in range(2)} | set(acked)
    ok = wait_until(lambda: done >= expected, 30)
    missing = sorted(expected - done)
    assert ok, f"never ran: {missing[:10]} ({len(missing)})"
    assert running.stop()
    assert running.error is None
