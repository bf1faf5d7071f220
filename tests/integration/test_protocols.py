"""Both group protocols on the real broker: classic (cooperative-sticky) and KIP-848 (consumer).

Two consumers of one group; the second joins while the first is working, so partitions move with
messages in flight. Per key, messages run one at a time and in offset order across both members,
nothing is skipped, and at the end the committed offsets are the end offsets.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import defaultdict

import pytest

from keyedconsumer import ConsumerConfig, KeyedConsumer, Message

from .kafkautil import committed, end_offsets, produce, wait_until

pytestmark = [pytest.mark.kafka]

PARTITIONS = 4
KEYS = 40


class Journal:
    """Every handler start, in time order, and any overlap of one key."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.log: list[tuple[str, bytes, int]] = []  # (member, key, sequence number)
        self.running: dict[bytes, int] = defaultdict(int)
        self.overlaps = 0
        self.delay_s = 0.05  # slow until the rebalance is over, so it happens with work in flight

    def handler(self, member: str):  # type: ignore[no-untyped-def]
        def handle(msg: Message) -> None:
            key = msg.key or b""
            with self.lock:
                if self.running[key]:
                    self.overlaps += 1
                self.running[key] += 1
                self.log.append((member, key, int(msg.value or b"-1")))
            try:
                time.sleep(self.delay_s)
            finally:
                with self.lock:
                    self.running[key] -= 1

        return handle


def records(start: int, count: int) -> list[tuple[bytes, bytes, None]]:
    """``count`` messages per key numbered ``start..``; the key decides the partition."""
    return [
        (f"key-{k}".encode(), str(n).encode(), None) for n in range(start, start + count) for k in range(KEYS)
    ]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("protocol", ["classic", "consumer"])
def test_order_and_offsets_across_a_rebalance(protocol: str, kafka_bootstrap: str, new_topic, start) -> None:  # type: ignore[no-untyped-def]
    topic = new_topic(PARTITIONS)
    group = f"proto-{protocol}-{uuid.uuid4().hex[:8]}"
    config = {"group.protocol": "consumer"} if protocol == "consumer" else {}
    # the options each protocol rejects are not set
    conf = ConsumerConfig(name=group, topics=[topic], config=config).librdkafka()
    if protocol == "consumer":
        assert not {"partition.assignment.strategy", "session.timeout.ms", "heartbeat.interval.ms"} & set(
            conf
        )
    else:
        assert conf["partition.assignment.strategy"] == "cooperative-sticky"
    journal = Journal()

    def member(name: str) -> KeyedConsumer:
        return KeyedConsumer(
            name=group,
            handler=journal.handler(name),
            brokers=[kafka_bootstrap],
            topics=[topic],
            concurrency=4,
            config=config,
        )

    # given 40 messages per key, consumed by member A alone, slowly
    produce(kafka_bootstrap, topic, records(0, 40))
    a = member("A")
    run_a = start(a)
    assert wait_until(lambda: len(a.assignment) == PARTITIONS, 60)
    assert wait_until(lambda: len(journal.log) >= 100, 30)
    # when member B joins while A is working: the partitions are shared
    b = member("B")
    run_b = start(b)
    assert wait_until(lambda: b.assignment and len(a.assignment) < PARTITIONS, 60), (
        a.assignment,
        b.assignment,
    )
    assert sorted(a.assignment + b.assignment) == [(topic, p) for p in range(PARTITIONS)]
    assert len(journal.log) < 40 * KEYS  # the rebalance came while the first messages were in progress
    journal.delay_s = 0.001
    # and 20 more messages per key arrive after the rebalance
    produce(kafka_bootstrap, topic, records(40, 20))
    total = 60 * KEYS
    assert wait_until(lambda: len({(k, n) for _, k, n in journal.log}) >= total, 90)
    assert run_a.stop(30) and run_b.stop(30)
    assert run_a.error is None and run_b.error is None
    # then both members did work, no key ran twice at once, and per key the messages ran in order:
    # each next start is the next number, or (a redelivery) one already seen; never a skip ahead
    members = {m for m, _, _ in journal.log}
    assert members == {"A", "B"}
    assert journal.overlaps == 0
    by_key: dict[bytes, list[int]] = defaultdict(list)
    for _, key, n in journal.log:
        by_key[key].append(n)
    assert len(by_key) == KEYS
    for key, seq in by_key.items():
        high = -1
        for n in seq:
            assert n <= high + 1, (key, seq)
            high = max(high, n)
        assert high == 59 and sorted(set(seq)) == list(range(60)), key
    # and the committed offsets are the end offsets
    assert committed(kafka_bootstrap, group, topic, PARTITIONS) == end_offsets(
        kafka_bootstrap, topic, PARTITIONS
    )
