"""A graceful stop leaves nothing finished to run again: messages below the highest finished offset
still run before the final commit (issue 6, check 6: SIGTERM causes no duplicates)."""

from __future__ import annotations

import random
import threading
import time
import uuid

import pytest

from keyedconsumer import KeyedConsumer, Message

from .kafkautil import committed, produce, wait_until

pytestmark = pytest.mark.kafka


@pytest.mark.timeout(60)
def test_stop_runs_what_lies_below_finished_offsets_so_the_commit_covers_them(
    kafka_bootstrap, new_topic, start
) -> None:  # type: ignore[no-untyped-def]
    # given key "a" at offsets 0 (slow, 1 s) and 1 (queued behind it), and 40 other keys at 2..41
    topic = new_topic(1)
    produce(
        kafka_bootstrap,
        topic,
        [(b"a", b"slow", 0), (b"a", b"next", 0)] + [(f"k{i}".encode(), b"x", 0) for i in range(40)],
    )
    runs: list[int] = []
    lock = threading.Lock()
    slow_started = threading.Event()

    def handle(msg: Message) -> None:
        if msg.value == b"slow":
            slow_started.set()
            time.sleep(1.0)
        with lock:
            runs.append(msg.offset)

    group = f"g-{uuid.uuid4().hex[:8]}"
    c = KeyedConsumer(
        name=group, handler=handle, brokers=[kafka_bootstrap], topics=[topic], concurrency=2, ordering="key"
    )
    r = start(c)
    # when the others are done while offset 0 runs and offset 1 waits, and stop() is called
    assert wait_until(lambda: slow_started.is_set() and len(runs) >= 40, 30), runs
    assert r.stop(30) and r.error is None
    # then offset 1 ran before the commit, which covers every finished message: a restart re-runs nothing
    assert sorted(runs) == list(range(42))
    assert committed(kafka_bootstrap, group, topic, 1) == {0: 42}


@pytest.mark.timeout(90)
def test_one_worker_runs_each_partition_in_offset_order_so_a_stop_has_nothing_to_catch_up(
    kafka_bootstrap, new_topic, start
) -> None:  # type: ignore[no-untyped-def]
    # given 3,000 records on 2 partitions, of 300 keys in a random (seeded) order
    topic = new_topic(2)
    rng = random.Random(7)
    produce(kafka_bootstrap, topic, [(f"k{rng.randrange(300)}".encode(), b"x", i % 2) for i in range(3000)])
    runs: dict[int, list[int]] = {0: [], 1: []}
    lock = threading.Lock()
    stop_now = threading.Event()

    def handle(msg: Message) -> None:
        with lock:
            runs[msg.partition].append(msg.offset)
            if sum(len(v) for v in runs.values()) >= 1500:
                stop_now.set()

    group = f"g-{uuid.uuid4().hex[:8]}"
    c = KeyedConsumer(
        name=group, handler=handle, brokers=[kafka_bootstrap], topics=[topic], concurrency=1, ordering="key"
    )
    r = start(c)
    # when one worker runs them (a lane's next record competes with other keys' older records) and
    # the consumer stops half-way
    assert wait_until(stop_now.is_set, 60)
    assert r.stop(30) and r.error is None
    # then each partition ran in offset order, from 0 without a gap: the oldest ready record runs
    # first, so no record finished above an unfinished one and the commit is right after the last
    with lock:
        got = {p: list(v) for p, v in runs.items()}
    first_out_of_order = {p: next((i for i, o in enumerate(v) if o != i), None) for p, v in got.items()}
    assert all(i is None for i in first_out_of_order.values()), {
        p: (i, got[p][max(0, (i or 0) - 3) : (i or 0) + 5]) for p, i in first_out_of_order.items()
    }
    assert committed(kafka_bootstrap, group, topic, 2) == {p: len(v) or None for p, v in got.items()}
