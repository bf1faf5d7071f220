"""A revoke or stop that cannot finish a message commits, with its offset, metadata naming what
finished above it; the partition's next owner skips those offsets (issue 6, check 6: joins, leaves
and SIGTERM cause no duplicates, even when a message cannot finish in time)."""

from __future__ import annotations

import threading
import time
import uuid
from collections import defaultdict

import pytest
from confluent_kafka import Consumer, TopicPartition

from keyedconsumer import KeyedConsumer, Message

from .kafkautil import committed, produce, wait_until

pytestmark = pytest.mark.kafka


def committed_metadata(bootstrap: str, group: str, topic: str, partition: int) -> tuple[int, str]:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    try:
        (tp,) = c.committed([TopicPartition(topic, partition)], timeout=10)
        return tp.offset, tp.metadata or ""
    finally:
        c.close()


class Recorder:
    def __init__(self, member: str, block: set[bytes], release: threading.Event) -> None:
        self.member, self.block, self.release = member, block, release
        self.runs: list[tuple[int, int]] = []
        self.lock = threading.Lock()

    def __call__(self, msg: Message) -> None:
        if msg.key in self.block:
            self.release.wait(30)
        with self.lock:
            self.runs.append((msg.partition, msg.offset))


@pytest.mark.timeout(120)
def test_a_stop_commits_finished_offsets_above_a_stuck_message_and_the_next_owner_skips_them(
    kafka_bootstrap, new_topic, start
) -> None:  # type: ignore[no-untyped-def]
    # given key "a" stuck at offset 0 and 30 other keys finished above it (offsets 1..30)
    topic = new_topic(1)
    produce(kafka_bootstrap, topic, [(b"a", b"stuck", 0)] + [(f"k{i}".encode(), b"x", 0) for i in range(30)])
    group = f"meta-{uuid.uuid4().hex[:8]}"
    release = threading.Event()
    first = Recorder("first", {b"a"}, release)
    a = KeyedConsumer(
        name=group,
        handler=first,
        brokers=[kafka_bootstrap],
        topics=[topic],
        concurrency=4,
        shutdown_timeout_s=1.0,
    )
    ra = start(a)
    try:
        assert wait_until(lambda: len(first.runs) == 30, 30), first.runs
        # when it stops (SIGTERM's path) while offset 0 cannot finish within shutdown_timeout_s
        assert ra.stop(30)
        # then offset 0 is committed (never past it) with metadata naming offsets 1..30 finished
        offset, meta = committed_metadata(kafka_bootstrap, group, topic, 0)
        assert offset == 0 and meta.startswith("kc1:"), (offset, meta)
        # and the next consumer of the group runs offset 0 and the new message only
        produce(kafka_bootstrap, topic, [(b"k1", b"new", 0)])
        second = Recorder("second", set(), release)
        b = KeyedConsumer(
            name=group, handler=second, brokers=[kafka_bootstrap], topics=[topic], concurrency=4
        )
        rb = start(b)
        assert wait_until(lambda: committed(kafka_bootstrap, group, topic, 1) == {0: 32}, 30)
        assert rb.stop(30)
    finally:
        release.set()
    assert sorted(second.runs) == [(0, 0), (0, 31)]
    assert b.skipped_finished == 30


@pytest.mark.timeout(120)
def test_a_member_joining_moves_a_partition_without_re_running_what_finished_above_a_stuck_message(
    kafka_bootstrap, new_topic, start
) -> None:  # type: ignore[no-untyped-def]
    # given two partitions, each with a stuck key at offset 0 and 30 keys finished above it, all on member A
    topic = new_topic(2)
    recs = []
    for p, stuck in ((0, b"a"), (1, b"b")):
        recs += [(stuck, b"stuck", p)] + [(f"k{p}-{i}".encode(), b"x", p) for i in range(30)]
    produce(kafka_bootstrap, topic, recs)
    group = f"meta-join-{uuid.uuid4().hex[:8]}"
    release = threading.Event()
    first = Recorder("A", {b"a", b"b"}, release)
    second = Recorder("B", set(), release)
    common = dict(
        brokers=[kafka_bootstrap],
        topics=[topic],
        concurrency=4,
        revoke_timeout_s=1.0,
        config={"session.timeout.ms": 10000, "heartbeat.interval.ms": 500},
    )
    a = KeyedConsumer(name=group, handler=first, **common)  # type: ignore[arg-type]
    b = KeyedConsumer(name=group, handler=second, **common)  # type: ignore[arg-type]
    ra = start(a)
    try:
        assert wait_until(lambda: len(first.runs) == 60, 30), first.runs
        # when member B joins (cooperative-sticky: one partition moves, revoked from A with its
        # stuck message still running)
        rb = start(b)
        assert wait_until(lambda: len(b.assignment) == 1 and len(a.assignment) == 1, 60)
        (moved,) = [p for _, p in b.assignment]
        assert wait_until(lambda: (moved, 0) in second.runs, 30), second.runs
        time.sleep(1.0)
        # then B ran only the stuck message of the moved partition, nothing A had finished
        by_part: dict[int, list[int]] = defaultdict(list)
        for p, o in second.runs:
            by_part[p].append(o)
        assert by_part == {moved: [0]}
        assert b.skipped_finished == 30
        release.set()
        assert wait_until(lambda: committed(kafka_bootstrap, group, topic, 2) == {0: 31, 1: 31}, 30)
        assert rb.stop(30) and ra.stop(30)
    finally:
        release.set()
