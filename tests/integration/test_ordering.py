"""Per-key order under concurrency, on the real broker."""

from __future__ import annotations

import asyncio
import random
import threading
import time
import uuid
from collections import defaultdict

import pytest

from keyedconsumer import KeyedConsumer, Message

from .kafkautil import committed, end_offsets, produce

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180)]


class Recorder:
    """Records per-key arrival order and same-key overlap, from any thread."""

    def __init__(self, total: int) -> None:
        self.lock = threading.Lock()
        self.total = total
        self.order: dict[bytes | None, list[int]] = defaultdict(list)
        self.running: dict[bytes | None, int] = defaultdict(int)
        self.overlaps = 0
        self.max_parallel = 0
        self.parallel = 0
        self.seen: set[tuple[int, int]] = set()
        self.all_seen = threading.Event()

    def start(self, msg: Message) -> None:
        with self.lock:
            self.running[msg.key] += 1
            if self.running[msg.key] > 1:
                self.overlaps += 1
            self.parallel += 1
            self.max_parallel = max(self.max_parallel, self.parallel)

    def end(self, msg: Message) -> None:
        with self.lock:
            self.running[msg.key] -= 1
            self.parallel -= 1
            self.order[msg.key].append(int(msg.value or b"-1"))
            self.seen.add((msg.partition, msg.offset))
            if len(self.seen) >= self.total:
                self.all_seen.set()


def keyed_records(n: int, keys: int, seed: int = 7) -> list[tuple[bytes, bytes, None]]:
    rng = random.Random(seed)
    seq: dict[int, int] = defaultdict(int)
    out = []
    for _ in range(n):
        k = rng.randrange(keys)
        out.append((f"k{k}".encode(), str(seq[k]).encode(), None))
        seq[k] += 1
    return out


def run_until(consumer: KeyedConsumer, event: threading.Event, timeout_s: float) -> None:
    def watch() -> None:
        event.wait(timeout_s)
        consumer.stop()

    threading.Thread(target=watch, daemon=True).start()
    consumer.run()


@pytest.mark.parametrize("is_async", [False, True], ids=["threads", "asyncio"])
def test_per_key_order_at_concurrency_32(kafka_bootstrap: str, new_topic, is_async: bool) -> None:  # type: ignore[no-untyped-def]
    # given 6,000 messages over 4 partitions and 1,000 keys, each value the key's sequence number
    topic = new_topic(4)
    records = keyed_records(6000, 1000)
    produce(kafka_bootstrap, topic, records)
    rec = Recorder(len(records))
    rng = random.Random(1)

    def handle(msg: Message) -> None:
        rec.start(msg)
        time.sleep(rng.random() * 0.002)
        rec.end(msg)

    async def ahandle(msg: Message) -> None:
        rec.start(msg)
        await asyncio.sleep(rng.random() * 0.002)
        rec.end(msg)

    group = f"order-{uuid.uuid4().hex[:8]}"
    consumer = KeyedConsumer(
        name=group,
        handler=ahandle if is_async else handle,
        brokers=[kafka_bootstrap],
        topics=[topic],
        concurrency=32,
        ordering="key",
    )
    # when consumed at concurrency 32
    run_until(consumer, rec.all_seen, 90)
    # then every message ran, each key in order, never two of one key at once, and with real parallelism
    assert len(rec.seen) == len(records)
    assert rec.overlaps == 0
    assert all(seqs == list(range(len(seqs))) for seqs in rec.order.values())
    assert rec.max_parallel > 4
    assert committed(kafka_bootstrap, group, topic, 4) == end_offsets(kafka_bootstrap, topic, 4)


def test_partition_ordering_runs_one_at_a_time_per_partition(kafka_bootstrap: str, new_topic) -> None:  # type: ignore[no-untyped-def]
    topic = new_topic(2)
    produce(kafka_bootstrap, topic, [(f"k{i}".encode(), str(i).encode(), i % 2) for i in range(200)])
    lock = threading.Lock()
    running = defaultdict(int)
    overlaps = 0
    order: dict[int, list[int]] = defaultdict(list)
    done = threading.Event()

    def handle(msg: Message) -> None:
        nonlocal overlaps
        with lock:
            running[msg.partition] += 1
            overlaps += running[msg.partition] > 1
        time.sleep(0.001)
        with lock:
            running[msg.partition] -= 1
            order[msg.partition].append(msg.offset)
            if sum(map(len, order.values())) == 200:
                done.set()

    consumer = KeyedConsumer(
        name=f"p-{uuid.uuid4().hex[:8]}",
        handler=handle,
        brokers=[kafka_bootstrap],
        topics=[topic],
        concurrency=8,
        ordering="partition",
    )
    run_until(consumer, done, 60)
    assert overlaps == 0
    assert order[0] == list(range(100)) and order[1] == list(range(100))


def test_null_and_empty_keys_are_different_lanes(kafka_bootstrap: str, new_topic) -> None:  # type: ignore[no-untyped-def]
    # given null keys and empty keys interleaved on one partition
    topic = new_topic(1)
    recs = [(None if i % 2 else b"", str(i).encode(), 0) for i in range(100)]
    produce(kafka_bootstrap, topic, recs)
    rec = Recorder(100)

    def handle(msg: Message) -> None:
        rec.start(msg)
        time.sleep(0.001)
        rec.end(msg)

    consumer = KeyedConsumer(
        name=f"n-{uuid.uuid4().hex[:8]}",
        handler=handle,
        brokers=[kafka_bootstrap],
        topics=[topic],
        concurrency=4,
    )
    run_until(consumer, rec.all_seen, 60)
    # then each of the two lanes kept its order, and a null key is not an empty key
    assert set(rec.order) == {None, b""}
    assert rec.order[None] == sorted(rec.order[None]) and rec.order[b""] == sorted(rec.order[b""])
    assert rec.overlaps == 0
