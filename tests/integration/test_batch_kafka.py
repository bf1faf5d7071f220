"""Batch handlers on the real broker (and Redis): batches of many keys, one message per key, keys in
order and never at once; one failing message retried, dead-lettered or parked alone."""

from __future__ import annotations

import asyncio
import random
import threading
import time
import uuid
from collections import defaultdict

import pytest
from keyedconsumer.middleware import DeadLetter, Retry

from keyedconsumer import BatchFailed, KeyedConsumer, Message, RedisSequencer

from .kafkautil import committed, end_offsets, produce, read_all, wait_until

pytestmark = [pytest.mark.kafka]


class Batches:
    """Every batch a handler got, same-key overlaps across batches, per-key order."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sizes: list[int] = []
        self.dup_in_batch: list[list[bytes | None]] = []
        self.running: set[bytes | None] = set()
        self.overlaps: list[bytes | None] = []
        self.order: dict[bytes | None, list[int]] = defaultdict(list)  # values of done messages, per key
        self.attempts: dict[bytes | None, list[int]] = defaultdict(
            list
        )  # attempts of failing runs, per value

    def enter(self, msgs: list[Message]) -> None:
        keys = [m.key for m in msgs]
        with self.lock:
            self.sizes.append(len(msgs))
            if len(keys) != len(set(keys)):
                self.dup_in_batch.append(keys)
            for k in keys:
                if k in self.running:
                    self.overlaps.append(k)
                self.running.add(k)

    def leave(self, msgs: list[Message], failed: set[Message]) -> None:
        with self.lock:
            for m in msgs:
                self.running.discard(m.key)
                if m in failed:
                    self.attempts[m.value].append(m.attempt)
                else:
                    self.order[m.key].append(int((m.value or b"-1").split(b":")[1]))


def keyed(n: int, keys: int, seed: int) -> list[tuple[bytes, bytes, None]]:
    """``n`` records over ``keys`` keys, each value ``key:sequence number``."""
    rng = random.Random(seed)
    seq: dict[int, int] = defaultdict(int)
    out = []
    for _ in range(n):
        k = rng.randrange(keys)
        out.append((f"k{k}".encode(), f"k{k}:{seq[k]}".encode(), None))
        seq[k] += 1
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("is_async", [False, True], ids=["threads", "asyncio"])
def test_batches_of_many_keys_keep_key_order_and_dead_letter_one_failure_alone(  # type: ignore[no-untyped-def]
    kafka_bootstrap: str, new_topic, start, is_async: bool
) -> None:
    # given 2,000 messages over 4 partitions and 200 keys, one of which ("k7:0") always fails
    topic = new_topic(4)
    records = keyed(2000, 200, seed=3)
    produce(kafka_bootstrap, topic, records)
    poison = b"k7:0"
    assert any(v == poison for _, v, _ in records)
    rec = Batches()

    def ends(msgs: list[Message]) -> set[Message]:
        failed = {m for m in msgs if m.value == poison}
        rec.leave(msgs, failed)
        return failed

    def handle(msgs: list[Message]) -> None:
        rec.enter(msgs)
        time.sleep(0.002)
        failed = ends(msgs)
        if failed:
            raise BatchFailed({m: RuntimeError("poison pill") for m in failed})

    async def ahandle(msgs: list[Message]) -> None:
        rec.enter(msgs)
        await asyncio.sleep(0.002)
        failed = ends(msgs)
        if failed:
            raise BatchFailed({m: RuntimeError("poison pill") for m in failed})

    group = f"batch-{uuid.uuid4().hex[:8]}"
    consumer = KeyedConsumer(
        name=group,
        batch_handler=ahandle if is_async else handle,
        brokers=[kafka_bootstrap],
        topics=[topic],
        concurrency=4,
        handler_batch_size=50,
        middlewares=[
            DeadLetter(brokers=[kafka_bootstrap]),
            Retry(max_attempts=3, initial_delay_s=0.2, jitter=0.0),
        ],
    )
    # when it runs until every offset is committed
    r = start(consumer)
    ends_at = end_offsets(kafka_bootstrap, topic, 4)
    assert wait_until(lambda: committed(kafka_bootstrap, group, topic, 4, 10) == ends_at, 120, 0.5), (
        committed(kafka_bootstrap, group, topic, 4),
        ends_at,
    )
    assert r.stop(30) and r.error is None
    # then batches held several keys, never two messages of one key, and no key ran in two at once
    assert max(rec.sizes) > 1 and max(rec.sizes) <= 50
    assert rec.dup_in_batch == [] and rec.overlaps == []
    # and every other message ran once, each key in order (k7 went on after its poison message)
    per_key: dict[bytes, int] = defaultdict(int)
    for k, _, _ in records:
        per_key[k] += 1
    for k, n in per_key.items():
        expect = list(range(1, n)) if k == b"k7" else list(range(n))
        assert rec.order[k] == expect, k
    # and the poison message ran three times and was dead-lettered once
    assert rec.attempts[poison] == [1, 2, 3]
    dead = read_all(kafka_bootstrap, f"{topic}.dlq", 1)
    assert [(d.key(), d.value()) for d in dead] == [(b"k7", poison)]
    assert dict(dead[0].headers())["kafka_dlt-attempts"] == b"3"


@pytest.mark.redis
@pytest.mark.timeout(180)
def test_batches_under_redis_leases_park_one_key_and_keep_order(  # type: ignore[no-untyped-def]
    kafka_bootstrap: str, redis_url: str, new_topic, start
) -> None:
    # given 600 messages over 2 partitions and 60 keys, whose first message of key k3 fails twice
    topic = new_topic(2)
    records = keyed(600, 60, seed=5)
    produce(kafka_bootstrap, topic, records)
    flaky = b"k3:0"
    rec = Batches()

    def handle(msgs: list[Message]) -> None:
        rec.enter(msgs)
        time.sleep(0.002)
        failed = {m for m in msgs if m.value == flaky and m.attempt <= 2}
        rec.leave(msgs, failed)
        if failed:
            raise BatchFailed({m: ConnectionError("flaky") for m in failed})

    ns = f"batch-{uuid.uuid4().hex[:8]}"
    group = f"g-{ns}"
    seq = RedisSequencer(redis_url, ns, lease_ttl_s=2.0)
    consumer = KeyedConsumer(
        name=group,
        batch_handler=handle,
        brokers=[kafka_bootstrap],
        topics=[topic],
        concurrency=4,
        handler_batch_size=20,
        sequencer=seq,
        middlewares=[Retry(max_attempts=None, initial_delay_s=0.5, multiplier=1, jitter=0, park=True)],
    )
    # when it runs until everything is committed and the parked key drained
    r = start(consumer)
    ends_at = end_offsets(kafka_bootstrap, topic, 2)
    per_key: dict[bytes, int] = defaultdict(int)
    for k, _, _ in records:
        per_key[k] += 1
    assert wait_until(
        lambda: (
            committed(kafka_bootstrap, group, topic, 2, 10) == ends_at
            and len(rec.order[b"k3"]) == per_key[b"k3"]
            and not seq.parker.draining
        ),
        120,
        0.5,
    ), (committed(kafka_bootstrap, group, topic, 2), ends_at, rec.order[b"k3"])
    assert r.stop(30) and r.error is None
    # then the key was parked (its messages went to Redis and came back), and every key kept its order
    assert seq.parker.parked >= 1 and seq.parker.drained >= 1
    assert rec.attempts[flaky] == [1, 2]
    for k, n in per_key.items():
        assert rec.order[k] == list(range(n)), k
    assert rec.dup_in_batch == [] and rec.overlaps == []
