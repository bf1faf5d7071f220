"""Exactly one dead-letter record per dead-lettered offset, on the real broker.

- A publish reported as failed is never delivered later (spring-kafka #1749): the producer's own
  delivery timeout is the middleware's ``timeout_s``, and the failure is reported only with the
  record's delivery report. Shown with a dead-letter topic that does not exist yet (the producer
  may not create it), a consumer whose run raised and that runs again in the same process once the
  topic exists.
- A run that no longer owns its message does not publish (karafka PR #3220): a failing message still
  running when its partition is revoked past ``revoke_timeout_s`` is dead-lettered by the new owner
  only.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from confluent_kafka.admin import AdminClient, NewTopic
from keyedconsumer.middleware import DeadLetter

from keyedconsumer import KeyedConsumer, Message, MessageError

from .kafkautil import committed, produce, read_all, wait_until

pytestmark = pytest.mark.kafka


def _dlq_offsets(bootstrap: str, topic: str, expect: int) -> list[tuple[str, str]]:
    out = []
    for m in read_all(bootstrap, topic, expect, timeout_s=20):
        h = {k: (v or b"").decode() for k, v in (m.headers() or [])}
        out.append((h["kafka_dlt-original-partition"], h["kafka_dlt-original-offset"]))
    return sorted(out)


class Poison(Exception):
    pass


@pytest.mark.timeout(120)
def test_a_dead_letter_reported_failed_is_never_delivered_later(kafka_bootstrap, new_topic) -> None:  # type: ignore[no-untyped-def]
    # given a poison message between two good ones, and a dead-letter topic that does not exist yet
    # (the producer may not create it: it refuses every write for now)
    topic = new_topic(1)
    produce(kafka_bootstrap, topic, [(b"a", b"ok", 0), (b"b", b"poison", 0), (b"c", b"ok", 0)])
    dlq = f"{topic}.dlq"
    group = f"g-{uuid.uuid4().hex[:8]}"

    def handle(msg: Message) -> None:
        if msg.value == b"poison":
            raise Poison("bad record")

    dead_letter = DeadLetter(
        brokers=[kafka_bootstrap],
        topic=dlq,
        timeout_s=3.0,
        producer_config={"allow.auto.create.topics": False},
    )
    c = KeyedConsumer(
        name=group, handler=handle, middlewares=[dead_letter], brokers=[kafka_bootstrap], topics=[topic]
    )
    # when its run raises (the dead-letter publish failed: nothing handled it)
    with pytest.raises(MessageError) as info:
        c.run()
    assert info.value.offset == 1
    # then nothing was committed past the poison message
    assert committed(kafka_bootstrap, group, topic, 1)[0] in (None, 1)
    # when the topic is created and the same consumer runs again in the same process
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(dlq, 1, 1)])[dlq].result(30)
    runner = threading.Thread(target=c.run, daemon=True)
    runner.start()
    try:
        assert wait_until(lambda: committed(kafka_bootstrap, group, topic, 1)[0] == 3, 30)
    finally:
        c.stop()
        runner.join(30)
    # then the poison offset is in the dead-letter topic exactly once: the first, failed publish was
    # given up by the producer itself and never delivered behind the second
    time.sleep(1.0)
    assert _dlq_offsets(kafka_bootstrap, dlq, 1) == [("0", "1")]


@pytest.mark.timeout(120)
def test_a_run_revoked_while_it_fails_does_not_dead_letter_its_message(
    kafka_bootstrap, new_topic, start
) -> None:  # type: ignore[no-untyped-def]
    # given a failing message at the head of each of two partitions that runs until the second member
    # holds its partition (so a run of the first member is revoked while it runs, however long the
    # join takes), and a first member whose revokes wait 1 s for running handlers
    topic = new_topic(2)
    produce(
        kafka_bootstrap,
        topic,
        [(b"p0", b"poison", 0), (b"p1", b"poison", 1)]
        + [(f"k{i}".encode(), b"ok", i % 2) for i in range(20)],
    )
    dlq = f"{topic}.dlq"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(dlq, 1, 1)])[dlq].result(30)
    group = f"g-{uuid.uuid4().hex[:8]}"
    started = threading.Semaphore(0)
    moved = threading.Event()

    def handle(msg: Message) -> None:
        if msg.value == b"poison":
            started.release()
            moved.wait(60)
            raise Poison("bad record")

    def member() -> KeyedConsumer:
        return KeyedConsumer(
            name=group,
            handler=handle,
            middlewares=[DeadLetter(brokers=[kafka_bootstrap], topic=dlq)],
            brokers=[kafka_bootstrap],
            topics=[topic],
            concurrency=4,
            revoke_timeout_s=1.0,
            config={"session.timeout.ms": 6000, "heartbeat.interval.ms": 500},
        )

    a = member()
    ra = start(a)
    assert started.acquire(timeout=30) and started.acquire(timeout=30)
    # when a second member joins while both failing messages run: one partition moves to it while the
    # first member's run of its failing message goes on past the revoke
    b = member()
    rb = start(b)
    assert wait_until(lambda: len(a.assignment) == 1 and len(b.assignment) == 1, 30), (
        a.assignment,
        b.assignment,
    )
    moved.set()
    # then each failing offset is dead-lettered once: by the first member for the partition it kept,
    # by the new owner for the one that moved (the revoked run, ending later, does not publish)
    assert wait_until(lambda: committed(kafka_bootstrap, group, topic, 2) == {0: 11, 1: 11}, 60)
    time.sleep(1.0)
    assert rb.stop(30) and ra.stop(30) and ra.error is None and rb.error is None
    assert _dlq_offsets(kafka_bootstrap, dlq, 2) == [("0", "0"), ("1", "0")]
