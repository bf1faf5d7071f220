"""A graceful stop leaves nothing finished to run again: messages below the highest finished offset
still run before the final commit (issue 6, check 6: SIGTERM causes no duplicates)."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from keyedconsumer import KeyedConsumer, Message

from .kafkautil import committed, produce, wait_until

pytestmark = pytest.mark.kafka


@pytest.mark.timeout(60)
def test_stop_runs_what_lies_below_finished_offsets_so_the_commit_covers_them(kafka_bootstrap, new_topic, start) -> None:  # type: ignore[no-untyped-def]
    # given key "a" at offsets 0 (slow, 1 s) and 1 (queued behind it), and 40 other keys at 2..41
    topic = new_topic(1)
    produce(kafka_bootstrap, topic, [(b"a", b"slow", 0), (b"a", b"next", 0)] + [(f"k{i}".encode(), b"x", 0) for i in range(40)])
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
    c = KeyedConsumer(name=group, handler=handle, brokers=[kafka_bootstrap], topics=[topic], concurrency=2, ordering="key")
    r = start(c)
    # when the others are done while offset 0 runs and offset 1 waits, and stop() is called
    assert wait_until(lambda: slow_started.is_set() and len(runs) >= 40, 30), runs
    assert r.stop(30) and r.error is None
    # then offset 1 ran before the commit, which covers every finished message: a restart re-runs nothing
    assert sorted(runs) == list(range(42))
    assert committed(kafka_bootstrap, group, topic, 1) == {0: 42}
