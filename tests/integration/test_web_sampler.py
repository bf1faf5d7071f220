"""The dashboard's sampler on the real broker: a topic deleted under a group, a group without
members, a dead-letter topic deleted while its page is open."""

from __future__ import annotations

import uuid

import pytest
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient

from keyedconsumer.errors import KafkaClientError
from keyedconsumer.web.deadletters import DeadLetterReader
from keyedconsumer.web.sampler import Sampler

from .kafkautil import produce, wait_until

pytestmark = [pytest.mark.kafka]


def _commit(bootstrap: str, group: str, offsets: list[tuple[str, int, int]]) -> None:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    try:
        c.commit(offsets=[TopicPartition(t, p, o) for t, p, o in offsets], asynchronous=False)
    finally:
        c.close()


@pytest.mark.timeout(90)
def test_a_group_without_members_whose_topic_was_deleted_is_still_shown(kafka_bootstrap, new_topic) -> None:  # type: ignore[no-untyped-def]
    # given a group (no members) that committed on two topics, one of which is then deleted
    keep, gone = new_topic(2), new_topic(1)
    produce(kafka_bootstrap, keep, [(b"k", b"v", 0), (b"k", b"v", 1), (b"k", b"v", 1)])
    produce(kafka_bootstrap, gone, [(b"k", b"v", 0)])
    group = f"web-sampler-{uuid.uuid4().hex[:8]}"
    _commit(kafka_bootstrap, group, [(keep, 0, 1), (keep, 1, 1), (gone, 0, 1)])
    sampler = Sampler({"bootstrap.servers": kafka_bootstrap}, groups=[group], timeout_s=10.0)
    g = sampler.sample().groups[group]
    assert g.error is None and g.state == "empty" and g.members == ()
    assert {(r["topic"], r["partition"], r["lag"]) for r in g.rows} == {
        (keep, 0, 0),
        (keep, 1, 1),
        (gone, 0, 0),
    }
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.delete_topics([gone])[gone].result(30)

    # when it is sampled again: the deleted topic's partitions go, the other topic's stay, no error
    def settled() -> bool:
        g = sampler.sample().groups[group]
        return g.error is None and {r["topic"] for r in g.rows} == {keep}

    assert wait_until(settled, 40, 1.0), sampler.snapshot().groups[group]
    assert sampler.snapshot().kafka_error is None


@pytest.mark.timeout(60)
def test_a_deleted_dead_letter_topic_reads_as_missing(kafka_bootstrap, new_topic) -> None:  # type: ignore[no-untyped-def]
    dlq = new_topic(1)
    produce(kafka_bootstrap, dlq, [(b"k", b"v", 0)])
    reader = DeadLetterReader({"bootstrap.servers": kafka_bootstrap}, cache_s=0.0)
    assert [d.key.text for d in reader.records(dlq).rows if d.key is not None] == ["k"]
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.delete_topics([dlq])[dlq].result(30)

    def missing() -> bool:
        try:
            reader.records(dlq)
        except KafkaClientError as exc:
            return exc.code == "UNKNOWN_TOPIC_OR_PART"
        return False

    assert wait_until(missing, 30, 0.5)
