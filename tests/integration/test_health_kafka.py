"""Health on the real broker: ready after assignment, stalled while a key blocks, not live after stop."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
import uuid

import pytest

from keyedconsumer import KeyedConsumer, Message
from keyedconsumer.health import Health

from .kafkautil import committed, end_offsets, produce, wait_until

pytestmark = [pytest.mark.kafka]


def get(url: str) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.mark.timeout(90)
def test_ready_then_stalled_by_a_blocked_key_then_not_live_after_stop(
    kafka_bootstrap: str, new_topic, start
) -> None:  # type: ignore[no-untyped-def]
    # given one partition: 10 messages of other keys, then one of key "blocked", then 10 more others
    topic = new_topic(1)
    records = [(f"k{i}".encode(), b"v", 0) for i in range(10)]
    records += [(b"blocked", b"v", 0)] + [(f"k{i}".encode(), b"v", 0) for i in range(10, 20)]
    produce(kafka_bootstrap, topic, records)
    release = threading.Event()
    done: list[int] = []

    def handle(msg: Message) -> None:
        if msg.key == b"blocked":
            release.wait(60)
        done.append(msg.offset)

    consumer = KeyedConsumer(
        name=f"health-{uuid.uuid4().hex[:8]}",
        handler=handle,
        brokers=[kafka_bootstrap],
        topics=[topic],
        concurrency=4,
    )
    health = Health(consumer, stall_after_s=2.0, live_within_s=1.0)
    port = health.serve(0)
    base = f"http://127.0.0.1:{port}"
    try:
        # before run(): neither live nor ready
        r = health.check()
        assert not r.live and not r.ready
        assert get(base + "/livez")[0] == 503
        # when it runs: live, then ready once the partition is assigned
        running = start(consumer)
        assert wait_until(lambda: health.check().ready, 30)
        assert get(base + "/readyz")[0] == 200 and consumer.assignment == [(topic, 0)]
        # when the blocked key holds the offset at 10 while later messages are done and lag > 0
        assert wait_until(lambda: len(done) == 20, 30)
        assert wait_until(lambda: bool(health.check().stalled), 20)
        (stalled,) = health.check().stalled
        assert (stalled.topic, stalled.partition, stalled.stored_offset, stalled.lag) == (topic, 0, 10, 11)
        assert stalled.stalled_for_s >= 2.0
        code, body = get(base + "/healthz")
        assert code == 503 and body["live"] is True and body["healthy"] is False
        assert get(base + "/livez")[0] == 200
        # when the key is released: the offset moves to the end and the stall clears
        release.set()
        assert wait_until(lambda: not health.check().stalled and health.check().healthy, 20)
        assert get(base + "/healthz")[0] == 200
        # when the consumer stops: no longer live (within live_within_s), nor ready
        assert running.stop(30) and running.error is None
        assert wait_until(lambda: not health.check().live, 5)
        assert not health.check().ready and get(base + "/livez")[0] == 503
        assert committed(kafka_bootstrap, consumer.config.group, topic, 1) == end_offsets(
            kafka_bootstrap, topic, 1
        )
    finally:
        release.set()
        health.close()
