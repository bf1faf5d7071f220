"""The four xkafka simulations (seed 003): sequential and async, with and without manual commit.

10 messages over 2 partitions, keys key-0..key-9; the handler fails some. The first run stops with
the error and commits, per partition, exactly the first offset not done (never past the failed
message); a second run processes exactly what was unfinished; nothing is lost.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import pytest

from keyedconsumer import KeyedConsumer, Message, MessageError

from .kafkautil import committed, produce

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(120)]

FAILING = {b"key-2", b"key-6"}  # one failure per partition, as in the seed's runs
FAILED_AT = {0: 2, 1: 1}  # key-2 is offset 2 of partition 0, key-6 offset 1 of partition 1


def layout() -> list[tuple[bytes, bytes, int]]:
    # key-0..key-4 -> partition 0, key-5..key-9 -> partition 1 (offsets 0..4 each)
    return [(f"key-{i}".encode(), f"value-{i}".encode(), 0 if i < 5 else 1) for i in range(10)]


@pytest.mark.parametrize("is_async", [False, True], ids=["sequential", "async"])
@pytest.mark.parametrize("manual_commit", [False, True], ids=["auto-commit", "manual-commit"])
def test_xkafka_simulation(kafka_bootstrap: str, new_topic, is_async: bool, manual_commit: bool) -> None:  # type: ignore[no-untyped-def]
    topic = new_topic(2)
    acked = produce(kafka_bootstrap, topic, layout())
    assert len(acked) == 10
    group = f"xkafka-{uuid.uuid4().hex[:8]}"
    concurrency = 1 if not is_async else 4
    lock = threading.Lock()
    run1: list[tuple[int, int, str]] = []

    def record(msg: Message, outcome: str) -> None:
        with lock:
            run1.append((msg.partition, msg.offset, outcome))

    def sync_handler(msg: Message) -> None:
        time.sleep(0.02)
        if msg.key in FAILING:
            record(msg, "FAIL")
            raise RuntimeError(f"cannot process {msg.key!r}")
        record(msg, "SUCCESS")

    async def async_handler(msg: Message) -> None:
        await asyncio.sleep(0.02)
        if msg.key in FAILING:
            record(msg, "FAIL")
            raise RuntimeError(f"cannot process {msg.key!r}")
        record(msg, "SUCCESS")

    consumer = KeyedConsumer(
        name=group,
        handler=async_handler if is_async else sync_handler,
        brokers=[kafka_bootstrap],
        topics=[topic],
        concurrency=concurrency,
        manual_commit=manual_commit,
    )
    # When the first run meets a failure nobody handles
    with pytest.raises(MessageError) as info:
        consumer.run()
    # then the error names the message
    err = info.value
    assert err.topic == topic and FAILED_AT[err.partition] == err.offset
    assert "cannot process" in str(err) and f"offset={err.offset}" in str(err)

    # and each partition's committed offset is its first offset not done
    done = {(p, o) for p, o, outcome in run1 if outcome == "SUCCESS"}
    expected: dict[int, int] = {}
    for p in (0, 1):
        first = 0
        while (p, first) in done:
            first += 1
        expected[p] = first
        assert first <= FAILED_AT[p]  # never past the failed message
    got = committed(kafka_bootstrap, group, topic, 2)
    assert {p: (got[p] or 0) for p in (0, 1)} == expected

    # When a second run (the failure fixed) consumes again
    run2: list[tuple[int, int]] = []
    # what run 1 left unfinished: from each committed offset, less what finished above it (the
    # commit's metadata names those; the next run skips them)
    unfinished = sorted((p, o) for p in (0, 1) for o in range(expected[p], 5) if (p, o) not in done)

    def fixed(msg: Message) -> None:
        with lock:
            run2.append((msg.partition, msg.offset))
        if len(run2) == len(unfinished):
            second.stop()

    second = KeyedConsumer(
        name=group,
        handler=fixed,
        brokers=[kafka_bootstrap],
        topics=[topic],
        concurrency=concurrency,
        manual_commit=manual_commit,
    )
    timer = threading.Timer(60, second.stop)
    timer.start()
    try:
        second.run()
    finally:
        timer.cancel()
    # then it processes exactly what was unfinished, and nothing is lost
    assert sorted(run2) == unfinished
    assert done | set(run2) == {(p, o) for p in (0, 1) for o in range(5)}
    assert committed(kafka_bootstrap, group, topic, 2) == {0: 5, 1: 5}
