"""Key leases through a Redis that stops answering (issue 25 §8; the promises are in
docs/guarantees.md, "Redis sequencer"), on the real broker and a test's own redis-server.

- A run starts only while at least half its key's lease TTL is left (``LeaseTable.may_start``):
  when Redis stalls, the runs stop starting at the latest half a TTL after the last confirmed
  renewal, not when the lease is about to lapse; they go on once a renewal is confirmed again.
- When one instance's connection to Redis is cut off for longer than the TTL while the other's is
  not, the other takes its keys over, and no key ever runs on both instances at once; the cut
  instance works again after the connection heals.
"""

from __future__ import annotations

import signal
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from keyedconsumer import KeyedConsumer, Message, RedisSequencer

from .kafkautil import committed, end_offsets, produce, wait_until
from .redisnodes import RedisNode, TcpProxy, free_ports

pytestmark = [pytest.mark.kafka, pytest.mark.redis]


class Runs:
    """Every run: (instance, partition, offset, key, start_ns, end_ns), monotonic clock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done: list[tuple[str, int, int, str, int, int]] = []

    def handler(self, instance: str, sleep_s: float) -> Any:
        def handle(msg: Message) -> None:
            t0 = time.monotonic_ns()
            time.sleep(sleep_s)
            with self.lock:
                key = (msg.key or b"-").decode()
                self.done.append((instance, msg.partition, msg.offset, key, t0, time.monotonic_ns()))

        return handle

    def offsets(self) -> set[tuple[int, int]]:
        with self.lock:
            return {(r[1], r[2]) for r in self.done}

    def snapshot(self) -> list[tuple[str, int, int, str, int, int]]:
        with self.lock:
            return list(self.done)


def _consumer(bootstrap: str, topic: str, group: str, handler: Any, seq: RedisSequencer) -> KeyedConsumer:
    return KeyedConsumer(
        name=group,
        handler=handler,
        brokers=[bootstrap],
        topics=[topic],
        concurrency=4,
        sequencer=seq,
        config={"auto.commit.interval.ms": 500},
    )


@pytest.mark.timeout(120)
def test_runs_stop_starting_half_a_ttl_after_the_last_renewal_when_redis_stalls(
    kafka_bootstrap: str, new_topic, start, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    # given a private Redis, a 4 s lease TTL (renewed every second), and one key's 3,000 messages
    # that run 5 ms each, flowing
    rs = RedisNode(free_ports(1)[0], tmp_path)
    rs.start()
    try:
        topic = new_topic(1)
        acked = produce(kafka_bootstrap, topic, [(b"k", str(i).encode(), 0) for i in range(3000)])
        runs = Runs()
        seq = RedisSequencer(rs.url, f"t{uuid.uuid4().hex[:8]}", lease_ttl_s=4.0)
        group = f"ls-{uuid.uuid4().hex[:8]}"
        r = start(_consumer(kafka_bootstrap, topic, group, runs.handler("a", 0.005), seq))
        assert wait_until(lambda: len(runs.offsets()) >= 200, 60)
        # when Redis stops answering for 3 s (shorter than the TTL)
        rs.signal(signal.SIGSTOP)
        stalled_ns = time.monotonic_ns()
        time.sleep(3.0)
        resumed_ns = time.monotonic_ns()
        rs.signal(signal.SIGCONT)
        assert wait_until(lambda: runs.offsets() >= set(acked), 60), "not everything was processed"
        assert r.stop(30)
        # then no run started from half a TTL after the stall began (the last confirmed renewal was
        # before it; 0.3 s allowed for a worker's start) until Redis answered again; on a lease
        # merely still valid, runs went on starting until it was about to lapse
        late = [x for x in runs.snapshot() if stalled_ns + 2.3e9 < x[4] < resumed_ns]
        assert late == [], f"{len(late)} runs started with less than half the lease TTL left"
        # and runs started again after it (a renewal was confirmed), and every offset was committed
        assert any(x[4] > resumed_ns for x in runs.snapshot())
        assert committed(kafka_bootstrap, group, topic, 1) == end_offsets(kafka_bootstrap, topic, 1)
    finally:
        rs.stop()


@pytest.mark.timeout(150)
def test_an_instance_cut_off_from_redis_never_runs_a_key_beside_the_instance_that_took_it_over(
    kafka_bootstrap: str, new_topic, start, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    # given two instances of one group (one partition each) sharing a private Redis with a 2 s
    # lease TTL, instance "a" through a proxy, and 20 keys whose messages are on both partitions
    rs = RedisNode(free_ports(1)[0], tmp_path)
    rs.start()
    proxy = TcpProxy(rs.port)
    try:
        topic = new_topic(2)
        n = 6000
        runs = Runs()
        ns, group = f"t{uuid.uuid4().hex[:8]}", f"ls-{uuid.uuid4().hex[:8]}"
        a_seq = RedisSequencer(f"redis://127.0.0.1:{proxy.port}/0", ns, lease_ttl_s=2.0)
        b_seq = RedisSequencer(rs.url, ns, lease_ttl_s=2.0)
        ra = start(_consumer(kafka_bootstrap, topic, group, runs.handler("a", 0.003), a_seq))
        rb = start(_consumer(kafka_bootstrap, topic, group, runs.handler("b", 0.003), b_seq))
        # (the messages come once each instance has its partition: produced before the second
        # joined, the first could run them all alone before the rebalance gave the second one)
        one_each = lambda: len(ra.consumer.assignment) == 1 and len(rb.consumer.assignment) == 1  # noqa: E731
        assert wait_until(one_each, 60), "the group never settled"
        recs = [(f"k{i % 20}".encode(), str(i).encode(), (i // 20) % 2) for i in range(n)]
        acked = produce(kafka_bootstrap, topic, recs)
        both = lambda: {x[0] for x in runs.snapshot()} == {"a", "b"}  # noqa: E731
        assert wait_until(both, 60), "both instances did not work"
        # when a's connection to Redis is cut off for 3 s (longer than the TTL), b's is not
        proxy.freeze()
        time.sleep(3.0)
        healed_ns = time.monotonic_ns()
        proxy.thaw()
        # and 1,000 more messages of the same keys come after it heals
        more = [(f"k{i % 20}".encode(), str(i).encode(), (i // 20) % 2) for i in range(n, n + 1000)]
        acked += produce(kafka_bootstrap, topic, more)
        assert wait_until(lambda: runs.offsets() >= set(acked), 120), "not everything was processed"
        assert ra.stop(30) and rb.stop(30)
        # then no key ever ran on both instances at the same time
        by_key: dict[str, list[tuple[int, int, str]]] = defaultdict(list)
        for inst, _p, _o, key, s, e in runs.snapshot():
            by_key[key].append((s, e, inst))
        overlaps = [
            (key, x, y)
            for key, rs_ in by_key.items()
            for x, y in zip(sorted(rs_), sorted(rs_)[1:], strict=False)
            if y[0] < x[1]
        ]
        assert overlaps == []
        # and a worked again after its connection healed (its partition's new messages), and every
        # offset was committed
        assert any(x[0] == "a" and x[4] > healed_ns for x in runs.snapshot())
        assert committed(kafka_bootstrap, group, topic, 2) == end_offsets(kafka_bootstrap, topic, 2)
    finally:
        proxy.close()
        rs.stop()
