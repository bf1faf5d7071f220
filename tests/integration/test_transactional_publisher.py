"""The replay tool's transactional publisher when a newer publisher of its id fences it off.

Also seen: ``produce`` on a fenced producer raises only "Local: Fatal error"; the replay reported
that, without the word "fenced" its test (and its user) looks for.

Seen in CI: the fenced replay's ``close()`` flushed the producer, confluent-kafka ran the purged
records' delivery callbacks with the fatal error pending as a Python exception, and the replay died
with a ``SystemError`` traceback instead of its "fenced" error (confluent-kafka-python #865).
"""

from __future__ import annotations

import time
import uuid

import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from keyedconsumer.errors import KafkaClientError
from keyedconsumer.kafka import admin


def _topic(bootstrap: str) -> str:
    name = f"txp-{uuid.uuid4().hex[:8]}"
    client = AdminClient({"bootstrap.servers": bootstrap})  # kept alive until the topic exists
    client.create_topics([NewTopic(name, 1, 1)])[name].result(30)
    return name


@pytest.mark.kafka
@pytest.mark.timeout(120)
def test_a_fenced_publisher_reports_fenced_and_closes_without_raising(kafka_bootstrap: str) -> None:
    conf = {"bootstrap.servers": kafka_bootstrap}
    # three rounds: the old close() raised in only some of them (a race inside librdkafka)
    for _ in range(3):
        # given a publisher with an open transaction, fenced off by a newer publisher of its id
        topic, tid = _topic(kafka_bootstrap), f"txp-{uuid.uuid4().hex[:8]}"
        older = admin.TransactionalPublisher(conf, tid, 10)
        older.begin()
        newer = admin.TransactionalPublisher(conf, tid, 10)
        try:
            # when the older one goes on sending
            with pytest.raises(KafkaClientError, match="_FENCED") as raised:
                for _ in range(500):
                    older.send(topic, b"k", b"v", [])
                    time.sleep(0.01)
            # then the error names the fatal error (not librdkafka's bare "Local: Fatal error"),
            # and closing the publisher raises nothing
            assert raised.value.fatal
            older.close()
        finally:
            newer.close()


@pytest.mark.kafka
@pytest.mark.timeout(120)
def test_a_commit_after_a_newer_publisher_started_reports_the_fence(kafka_bootstrap: str) -> None:
    conf = {"bootstrap.servers": kafka_bootstrap}
    topic, tid = _topic(kafka_bootstrap), f"txp-{uuid.uuid4().hex[:8]}"
    reader = admin.TopicReader(conf, topic, f"g-{tid}", 10)
    # given a publisher with a record in its open transaction, fenced off by a newer publisher of its id
    older = admin.TransactionalPublisher(conf, tid, 10)
    older.begin()
    older.send(topic, b"k", b"v", [])
    newer = admin.TransactionalPublisher(conf, tid, 10)
    try:
        # when the older one commits, then its error is a fatal one that names the fence
        with pytest.raises(KafkaClientError) as raised:
            older.commit({(topic, 0): (1, "")}, reader)
        assert raised.value.fatal and "FENCED" in (raised.value.code or "").upper(), raised.value
        older.close()
    finally:
        newer.close()
        reader.close()
