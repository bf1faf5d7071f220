"""Adversarial scenarios against the README's Semantics section, on the real broker.

Each test asserts the documented contract through the public API (KeyedConsumer, Message, Status,
RetryLater, SkipMessage, PermanentError, middleware); a few read the engine's internal counters
(``consumer._run.engine``) only to observe memory, never to drive it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition
from confluent_kafka.admin import AdminClient

from keyedconsumer import (
    KafkaClientError,
    KeyedConsumer,
    KeyedConsumerError,
    Message,
    MessageError,
    RetryLater,
    Status,
)

from .kafkautil import committed, end_offsets, produce, wait_until

pytestmark = [pytest.mark.kafka]
ROOT = Path(__file__).resolve().parents[2]


def gid(prefix: str) -> str:
    return f"adv-{prefix}-{uuid.uuid4().hex[:8]}"


def group_offsets(bootstrap: str, group: str, topic: str, partitions: int) -> dict[int, int | None]:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    req = ConsumerGroupTopicPartitions(group, [TopicPartition(topic, p) for p in range(partitions)])
    res = admin.list_consumer_group_offsets([req], request_timeout=10)[group].result(timeout=10)
    return {tp.partition: (tp.offset if tp.offset >= 0 else None) for tp in res.topic_partitions}


def consumer(bootstrap: str, topic: str, group: str, handler: Any, **kw: Any) -> KeyedConsumer:
    return KeyedConsumer(name=group, handler=handler, brokers=[bootstrap], topics=[topic], **kw)


# ------------------------------------------------------------------------------------------------
# stop(): lost when it arrives while run()/run_async() is starting
# ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_stop_issued_as_run_thread_starts_is_not_lost(kafka_bootstrap: str, new_topic, start) -> None:  # type: ignore[no-untyped-def]
    # given a consumer whose run() is being started in a thread
    topic = new_topic(1)
    c = consumer(kafka_bootstrap, topic, gid("stoprace"), lambda m: None)
    for _ in range(3):
        entering = threading.Event()

        def go(entering: threading.Event = entering) -> None:
            entering.set()
            c.run()

        t = threading.Thread(target=go, daemon=True)
        t.start()
        # when stop() is called once the thread is entering run()
        entering.wait(5)
        c.stop()
        # then run() returns (the stop is not silently discarded)
        t.join(10)
        alive = t.is_alive()
        if alive:
            c.stop()  # clean up
            t.join(10)
        assert not alive, "run() ignored a stop() issued while it was starting and ran on"


@pytest.mark.timeout(30)
def test_stop_before_run_async_task_first_runs_is_not_lost(kafka_bootstrap: str, new_topic) -> None:  # type: ignore[no-untyped-def]
    topic = new_topic(1)

    async def handle(msg: Message) -> None:
        return None

    c = consumer(kafka_bootstrap, topic, gid("stoprace-async"), handle)

    async def main() -> bool:
        task = asyncio.create_task(c.run_async())
        c.stop()  # e.g. a shutdown request that arrives right after the task was created
        try:
            await asyncio.wait_for(asyncio.shield(task), 5)
            return True
        except asyncio.TimeoutError:
            c.stop()
            await task
            return False

    assert asyncio.run(main()), "run_async() ignored a stop() issued before it first ran"


@pytest.mark.timeout(60)
def test_two_concurrent_run_async_calls_are_refused(kafka_bootstrap: str, new_topic) -> None:  # type: ignore[no-untyped-def]
    # given one consumer object
    topic = new_topic(1)
    produce(kafka_bootstrap, topic, [(b"k", str(i).encode(), 0) for i in range(20)])
    seen: list[int] = []
    c = consumer(kafka_bootstrap, topic, gid("twice"), lambda m: seen.append(m.offset))

    async def main() -> list[Any]:
        async def stopper() -> None:
            # stop once all 20 messages ran (20 s at most), and 1 s later, long enough for a
            # second run to show its duplicates
            deadline = time.monotonic() + 20
            while len(set(seen)) < 20 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.sleep(1)
            c.stop()

        s = asyncio.create_task(stopper())
        # when run_async() is awaited twice at once
        res = await asyncio.wait_for(asyncio.gather(c.run_async(), c.run_async(), return_exceptions=True), 40)
        await s
        return res

    res = asyncio.run(main())
    # then exactly one of them is refused ("already running") and each message ran once
    refused = [r for r in res if isinstance(r, KeyedConsumerError)]
    assert len(refused) == 1, f"both run_async() calls ran: {res!r}"
    assert sorted(seen) == list(range(20))


# ------------------------------------------------------------------------------------------------
# async handlers raising CancelledError (a BaseException): a failure like any other
# ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_async_handler_raising_cancelled_error_fails_its_message(
    kafka_bootstrap: str, new_topic, start
) -> None:  # type: ignore[no-untyped-def]
    # given 6 messages of one key, and an async handler that raises CancelledError at offset 2
    # (e.g. it awaited a future some other task cancelled)
    topic = new_topic(1)
    produce(kafka_bootstrap, topic, [(b"k", str(i).encode(), 0) for i in range(6)])
    group = gid("cancelled")
    seen: list[int] = []

    async def handle(msg: Message) -> None:
        seen.append(msg.offset)
        if msg.offset == 2:
            raise asyncio.CancelledError()

    r = start(consumer(kafka_bootstrap, topic, group, handle))
    # then, with no error_handler, the consumer stops by itself and run() raises MessageError
    # naming offset 2 (README: "A handler fails by raising (any exception, BaseException
    # subclasses included)")
    ended = r.join(25)
    if not ended:
        r.stop()
    assert ended, f"the consumer neither failed nor went on: handled {seen}, then stalled"
    assert isinstance(r.error, MessageError) and r.error.offset == 2, r.error
    assert committed(kafka_bootstrap, group, topic, 1) == {0: 2}


@pytest.mark.timeout(60)
def test_async_handler_raising_cancelled_error_goes_to_error_handler(
    kafka_bootstrap: str, new_topic, start
) -> None:  # type: ignore[no-untyped-def]
    # given an error_handler, and an async handler that raises CancelledError at offset 1 of key k
    topic = new_topic(1)
    produce(kafka_bootstrap, topic, [(b"k", str(i).encode(), 0) for i in range(5)])
    group = gid("cancelled-eh")
    seen: list[int] = []
    handled: list[tuple[str, int]] = []

    async def handle(msg: Message) -> None:
        seen.append(msg.offset)
        if msg.offset == 1:
            raise asyncio.CancelledError()

    c = consumer(
        kafka_bootstrap,
        topic,
        group,
        handle,
        concurrency=2,
        error_handler=lambda e, m: handled.append((type(e).__name__, m.offset if m else -1)),
    )
    r = start(c)
    # then the failure is handled (error_handler called) and the key's later messages still run
    ok = wait_until(lambda: sorted(seen) == [0, 1, 2, 3, 4], 25)
    assert r.stop()
    assert ok, f"handled {sorted(seen)}: the rest of the key was silently dropped"
    assert handled == [("CancelledError", 1)]
    assert committed(kafka_bootstrap, group, topic, 1) == {0: 5}


# ------------------------------------------------------------------------------------------------
# handlers that hang beyond shutdown_timeout_s
# ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_stop_returns_in_bounded_time_with_many_hung_handlers(
    kafka_bootstrap: str, new_topic, start, is_async: bool
) -> None:  # type: ignore[no-untyped-def]
    # given 5 messages of key "a" (10 ms each), then 6 messages of 6 other keys whose handlers hang
    topic = new_topic(1)
    records = [(b"a", b"x", 0)] * 5 + [(f"h{i}".encode(), b"x", 0) for i in range(6)]
    produce(kafka_bootstrap, topic, records)
    group = gid("hung")
    release = threading.Event()
    started: set[int] = set()

    if is_async:

        async def handle(msg: Message) -> None:
            if msg.key == b"a":
                await asyncio.sleep(0.01)
                return
            started.add(msg.offset)
            while not release.is_set():
                await asyncio.sleep(0.05)
    else:

        def handle(msg: Message) -> None:  # type: ignore[misc]
            if msg.key == b"a":
                time.sleep(0.01)
                return
            started.add(msg.offset)
            release.wait(60)

    c = consumer(kafka_bootstrap, topic, group, handle, concurrency=7, shutdown_timeout_s=1.0)
    r = start(c)
    try:
        assert wait_until(lambda: len(started) == 6, 10)
        time.sleep(0.5)  # key "a" (5 x 10 ms) ends on the 7th worker
        # when stop() is called
        t0 = time.monotonic()
        c.stop()
        ended = r.join(20)
        took = time.monotonic() - t0
        # then run() returns about shutdown_timeout_s later (plus closing), not once per hung thread
        assert ended and r.error is None, r.error
        assert took < 1.0 + 3.0, f"run() returned {took:.1f} s after stop() with shutdown_timeout_s=1"
        # and the hung messages' offsets are not committed
        assert committed(kafka_bootstrap, group, topic, 1) == {0: 5}
    finally:
        release.set()


@pytest.mark.timeout(60)
def test_late_failure_of_a_previous_runs_handler_does_not_stop_the_next_run(
    kafka_bootstrap: str, new_topic, start
) -> None:  # type: ignore[no-untyped-def]
    # given a first run whose handler of offset 0 hangs past shutdown_timeout_s (it fails later)
    topic = new_topic(1)
    produce(kafka_bootstrap, topic, [(b"k", str(i).encode(), 0) for i in range(5)])
    group = gid("stale")
    release = threading.Event()
    calls: list[int] = []

    def handle(msg: Message) -> None:
        calls.append(msg.offset)
        if len(calls) == 1:  # only the very first call hangs, then fails
            release.wait(30)
            raise RuntimeError("late failure of run 1")

    c = consumer(kafka_bootstrap, topic, group, handle, shutdown_timeout_s=0.5)
    r1 = start(c)
    assert wait_until(lambda: len(calls) == 1, 10)
    assert r1.stop(15) and r1.error is None
    # when the same object runs again, processes everything, and then run 1's handler fails
    r2 = start(c)
    try:
        assert wait_until(lambda: sorted(set(calls)) == [0, 1, 2, 3, 4] and len(calls) >= 6, 15)
    finally:
        release.set()
    time.sleep(1.0)
    # then the second run is not affected: it is still running and stops cleanly
    still_running = r2.thread.is_alive()
    assert r2.stop()
    assert still_running and r2.error is None, f"run 2 was stopped by run 1's stale handler: {r2.error!r}"


# ------------------------------------------------------------------------------------------------
# different keys run concurrently: a slow message must not hold other keys back
# ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(90)
@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_one_slow_key_does_not_block_other_keys_with_idle_workers(
    kafka_bootstrap: str, new_topic, start, is_async: bool
) -> None:  # type: ignore[no-untyped-def]
    # given 4,000 messages of 4,000 distinct keys and concurrency 8; after a warm-up of fast
    # messages, the messages of 2 keys block until released
    topic = new_topic(1)
    n = 4000
    slow_offsets = {2500, 3300}
    produce(kafka_bootstrap, topic, [(f"k{i}".encode(), b"x", 0) for i in range(n)])
    group = gid("hol")
    release = threading.Event()
    slow_started: set[int] = set()
    done: set[int] = set()
    lock = threading.Lock()

    if is_async:

        async def handle(msg: Message) -> None:
            if msg.offset in slow_offsets:
                slow_started.add(msg.offset)
                while not release.is_set():
                    await asyncio.sleep(0.02)
            with lock:
                done.add(msg.offset)
    else:

        def handle(msg: Message) -> None:  # type: ignore[misc]
            if msg.offset in slow_offsets:
                slow_started.add(msg.offset)
                release.wait(60)  # above the 30 + 6 s the test can wait: only the test releases them
            with lock:
                done.add(msg.offset)

    r = start(consumer(kafka_bootstrap, topic, group, handle, concurrency=8))
    try:
        others = set(range(n)) - slow_offsets
        # (once both slow handlers run: the group join and the warm-up take what they take)
        wait_until(lambda: slow_started == slow_offsets, 30)
        # then while the 2 slow keys wait (6 of 8 workers free), every other key completes
        ok = wait_until(lambda: others <= done, 6)
        with lock:
            missing = sorted(others - done)
        assert ok, f"{len(missing)} messages of other keys were held behind the slow ones: {missing[:5]}..."
    finally:
        release.set()
    assert r.stop()


# ------------------------------------------------------------------------------------------------
# stop() from inside a handler: nothing new starts
# ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_stop_from_inside_a_handler_starts_nothing_new(kafka_bootstrap: str, new_topic, start) -> None:  # type: ignore[no-untyped-def]
    # given 2,000 messages of one key and a handler that calls stop() at offset 100
    topic = new_topic(1)
    produce(kafka_bootstrap, topic, [(b"k", str(i).encode(), 0) for i in range(2000)])
    group = gid("stop-in")
    stopped = threading.Event()
    after_stop: list[int] = []
    c: KeyedConsumer

    def handle(msg: Message) -> None:
        if stopped.is_set():
            after_stop.append(msg.offset)
        if msg.offset == 100:
            c.stop()
            stopped.set()

    c = consumer(kafka_bootstrap, topic, group, handle)
    r = start(c)
    assert r.join(15) and r.error is None
    # then no handler started after stop() returned ("nothing new starts"), and the commit is 101
    assert after_stop == [], (
        f"{len(after_stop)} messages started after stop(): {after_stop[:3]}...{after_stop[-1:]}"
    )
    assert committed(kafka_bootstrap, group, topic, 1) == {0: 101}


# ------------------------------------------------------------------------------------------------
# startup, re-running, stop twice
# ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_wrong_broker_address_raises_within_startup_timeout(new_topic) -> None:  # type: ignore[no-untyped-def]
    c = KeyedConsumer(
        name=gid("nobroker"),
        handler=lambda m: None,
        brokers=["127.0.0.1:1"],
        topics=["whatever"],
        startup_timeout_s=2.0,
    )
    t0 = time.monotonic()
    with pytest.raises(KafkaClientError):
        c.run()
    assert time.monotonic() - t0 < 2.0 + 4.0
    c.stop()  # stop() after run() returned is harmless
    c.stop()


@pytest.mark.timeout(60)
def test_rerun_same_object_after_stop_processes_only_the_rest(kafka_bootstrap: str, new_topic, start) -> None:  # type: ignore[no-untyped-def]
    topic = new_topic(2)
    produce(kafka_bootstrap, topic, [(f"k{i % 7}".encode(), str(i).encode(), i % 2) for i in range(200)])
    group = gid("rerun")
    seen: list[tuple[int, int]] = []
    lock = threading.Lock()

    def handle(msg: Message) -> None:
        with lock:
            seen.append((msg.partition, msg.offset))

    c = consumer(kafka_bootstrap, topic, group, handle, concurrency=4)
    r1 = start(c)
    assert wait_until(lambda: len(seen) == 200, 15)
    assert r1.stop() and r1.error is None
    assert committed(kafka_bootstrap, group, topic, 2) == {0: 100, 1: 100}
    produce(kafka_bootstrap, topic, [(f"k{i % 7}".encode(), str(i).encode(), i % 2) for i in range(200, 260)])
    # a stop() while no run is active is kept for the next run (documented): that run returns at once
    c.stop()
    t0 = time.monotonic()
    c.run()
    assert time.monotonic() - t0 < 10 and len(seen) == 200
    r2 = start(c)
    assert wait_until(lambda: len(seen) == 260, 15)
    time.sleep(0.5)
    assert r2.stop() and r2.error is None
    assert len(seen) == len(set(seen)) == 260  # nothing ran twice
    assert committed(kafka_bootstrap, group, topic, 2) == {0: 130, 1: 130}


# ------------------------------------------------------------------------------------------------
# errors: error_handler raising, BaseException subclasses, ack combinations
# ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(40)
def test_error_handler_that_raises_stops_and_never_commits_past_the_failure(
    kafka_bootstrap: str, new_topic, start
) -> None:  # type: ignore[no-untyped-def]
    # given 2 partitions; p0 fails at offset 3, p1 is all good
    topic = new_topic(2)
    produce(
        kafka_bootstrap,
        topic,
        [(f"k{i}".encode(), b"x", 0) for i in range(10)] + [(f"j{i}".encode(), b"x", 1) for i in range(10)],
    )
    group = gid("eh-raises")

    def handle(msg: Message) -> None:
        if msg.partition == 0 and msg.offset == 3:
            raise ValueError("boom")
        time.sleep(0.01)

    def error_handler(err: BaseException, msg: Message | None) -> None:
        raise RuntimeError("the error handler failed too")

    r = start(consumer(kafka_bootstrap, topic, group, handle, concurrency=1, error_handler=error_handler))
    assert r.join(15)
    assert isinstance(r.error, MessageError) and (r.error.partition, r.error.offset) == (0, 3), r.error
    assert isinstance(r.error.__cause__, RuntimeError)
    assert committed(kafka_bootstrap, group, topic, 2)[0] == 3


@pytest.mark.timeout(40)
def test_unhandled_failure_lets_other_running_handlers_finish_and_commits_them(
    kafka_bootstrap: str, new_topic, start
) -> None:  # type: ignore[no-untyped-def]
    # given p1's offset 0 running for 1 s when p0's offset 1 fails (no error_handler)
    topic = new_topic(2)
    produce(kafka_bootstrap, topic, [(b"a", b"x", 0), (b"b", b"x", 0), (b"c", b"x", 1), (b"c", b"x", 1)])
    group = gid("fail-drain")
    p1_started = threading.Event()
    ended: list[tuple[int, int]] = []

    def handle(msg: Message) -> None:
        if msg.partition == 1:
            p1_started.set()
            time.sleep(1.0)
        elif msg.offset == 1:
            assert p1_started.wait(5)
            raise ValueError("boom")
        ended.append((msg.partition, msg.offset))

    r = start(consumer(kafka_bootstrap, topic, group, handle, concurrency=3, shutdown_timeout_s=5))
    assert r.join(15)
    assert isinstance(r.error, MessageError) and (r.error.partition, r.error.offset) == (0, 1), r.error
    # then the running handler of p1 finished, and its offset was committed; p1's next did not start
    assert sorted(ended) == [(0, 0), (1, 0)]
    assert committed(kafka_bootstrap, group, topic, 2) == {0: 1, 1: 1}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("exc_type", [SystemExit, KeyboardInterrupt, GeneratorExit])
def test_base_exception_from_a_handler_fails_its_message(
    kafka_bootstrap: str, new_topic, start, is_async: bool, exc_type: type
) -> None:  # type: ignore[no-untyped-def]
    topic = new_topic(1)
    produce(kafka_bootstrap, topic, [(b"k", str(i).encode(), 0) for i in range(5)])
    group = gid("baseexc")

    if is_async:

        async def handle(msg: Message) -> None:
            await asyncio.sleep(0)
            if msg.offset == 2:
                raise exc_type()
    else:

        def handle(msg: Message) -> None:  # type: ignore[misc]
            if msg.offset == 2:
                raise exc_type()

    r = start(consumer(kafka_bootstrap, topic, group, handle, concurrency=2))
    assert r.join(15), "the consumer did not stop on the failure"
    assert isinstance(r.error, MessageError) and r.error.offset == 2, r.error
    assert isinstance(r.error.__cause__, exc_type)
    assert committed(kafka_bootstrap, group, topic, 1) == {0: 2}


@pytest.mark.timeout(40)
@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_ack_combinations(kafka_bootstrap: str, new_topic, start, is_async: bool) -> None:  # type: ignore[no-untyped-def]
    # offset % 5: 0 plain, 1 ack_skip, 2 ack_fail (handled), 3 ack_fail then ack_skip (skip wins),
    # 4 ack_skip then raise (raise wins -> handled failure)
    topic = new_topic(1)
    produce(kafka_bootstrap, topic, [(f"k{i % 3}".encode(), b"x", 0) for i in range(20)])
    group = gid("acks")
    statuses: dict[int, Status] = {}
    handled: list[int] = []
    lock = threading.Lock()

    def body(msg: Message) -> None:
        kind = msg.offset % 5
        if kind == 1:
            msg.ack_skip()
        elif kind == 2:
            msg.ack_fail(ValueError("nack"))
        elif kind == 3:
            msg.ack_fail(ValueError("nack"))
            msg.ack_skip()
        elif kind == 4:
            msg.ack_skip()
            raise ValueError("raised after skip")

    def eh(err: BaseException, msg: Message | None) -> None:
        assert msg is not None and isinstance(err, ValueError)
        with lock:
            handled.append(msg.offset)

    if is_async:

        async def handle(msg: Message) -> None:
            try:
                body(msg)
            finally:
                with lock:
                    statuses[msg.offset] = msg
    else:

        def handle(msg: Message) -> None:  # type: ignore[misc]
            try:
                body(msg)
            finally:
                with lock:
                    statuses[msg.offset] = msg

    r = start(consumer(kafka_bootstrap, topic, group, handle, concurrency=3, error_handler=eh))
    assert wait_until(lambda: len(statuses) == 20, 15)
    time.sleep(0.3)
    assert r.stop() and r.error is None
    final = {o: m.status for o, m in statuses.items()}  # type: ignore[attr-defined]
    expect = {0: Status.SUCCESS, 1: Status.SKIP, 2: Status.FAIL, 3: Status.SKIP, 4: Status.FAIL}
    assert final == {o: expect[o % 5] for o in range(20)}
    assert sorted(handled) == [o for o in range(20) if o % 5 in (2, 4)]
    assert committed(kafka_bootstrap, group, topic, 1) == {0: 20}


# ------------------------------------------------------------------------------------------------
# async: a handler that never awaits; run_async cancellation
# ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(40)
def test_run_async_handler_that_never_awaits_does_not_starve_the_callers_loop(
    kafka_bootstrap: str, new_topic
) -> None:  # type: ignore[no-untyped-def]
    # 6,000 handlers of 0.5 ms CPU each, no await, at concurrency 8 (at concurrency 1 the worst
    # gap is ~0.4 s; it must not grow with concurrency)
    topic = new_topic(1)
    n = 6000
    produce(kafka_bootstrap, topic, [(f"k{i % 50}".encode(), b"x", 0) for i in range(n)])
    done: list[int] = []

    async def handle(msg: Message) -> None:  # CPU work, no await
        t = time.perf_counter()
        while time.perf_counter() - t < 0.0005:
            pass
        done.append(msg.offset)

    c = consumer(kafka_bootstrap, topic, gid("noawait"), handle, concurrency=8)

    async def main() -> float:
        task = asyncio.create_task(c.run_async())
        worst, last = 0.0, time.monotonic()
        deadline = last + 20
        while len(done) < n and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            worst, last = max(worst, now - last), now
        c.stop()
        await task
        return worst

    worst = asyncio.run(main())
    assert len(done) == n
    assert worst < 1.0, f"the caller's loop was blocked for {worst:.2f} s"


@pytest.mark.timeout(40)
@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_cancelling_run_async_stops_gracefully_and_reraises(
    kafka_bootstrap: str, new_topic, is_async: bool
) -> None:  # type: ignore[no-untyped-def]
    # given one key, and the handler of offset 0 taking 1 s
    topic = new_topic(1)
    produce(kafka_bootstrap, topic, [(b"k", str(i).encode(), 0) for i in range(5)])
    group = gid("cancel")
    started, finished = threading.Event(), []

    if is_async:

        async def handle(msg: Message) -> None:
            started.set()
            if msg.offset == 0:
                await asyncio.sleep(1.0)
            finished.append(msg.offset)
    else:

        def handle(msg: Message) -> None:  # type: ignore[misc]
            started.set()
            if msg.offset == 0:
                time.sleep(1.0)
            finished.append(msg.offset)

    c = consumer(kafka_bootstrap, topic, group, handle)

    async def main() -> str:
        task = asyncio.create_task(c.run_async())
        while not started.is_set():
            await asyncio.sleep(0.01)
        # when the awaiting task is cancelled while offset 0 runs
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return "cancelled"
        return "returned"

    # then the cancellation propagates after the running handler finished, and nothing else ran
    assert asyncio.run(main()) == "cancelled"
    assert finished == [0]
    assert committed(kafka_bootstrap, group, topic, 1) == {0: 1}


# ------------------------------------------------------------------------------------------------
# RetryLater with ordering none / partition; stop during back-off
# ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(40)
@pytest.mark.parametrize("ordering", ["none", "partition", "key"])
def test_retry_later_then_stop_during_backoff(kafka_bootstrap: str, new_topic, start, ordering: str) -> None:  # type: ignore[no-untyped-def]
    # given 2 partitions of 20; offset 5 of p0 asks to be retried in 0.3 s, then in 60 s
    topic = new_topic(2)
    produce(kafka_bootstrap, topic, [(f"k{i}".encode(), b"x", p) for p in (0, 1) for i in range(20)])
    group = gid(f"retry-{ordering}")
    attempts: list[int] = []
    done: set[tuple[int, int]] = set()
    lock = threading.Lock()

    def handle(msg: Message) -> None:
        if (msg.partition, msg.offset) == (0, 5):
            attempts.append(msg.attempt)
            raise RetryLater(0.3 if msg.attempt == 1 else 60.0)
        with lock:
            done.add((msg.partition, msg.offset))

    c = consumer(kafka_bootstrap, topic, group, handle, concurrency=4, ordering=ordering)
    r = start(c)
    expect_done = {(1, o) for o in range(20)} | {(0, o) for o in range(5)}
    if ordering != "partition":
        expect_done |= {(0, o) for o in range(6, 20)}
    assert wait_until(lambda: len(attempts) >= 2 and expect_done <= done, 10), (attempts, sorted(done))
    if ordering == "partition":  # one at a time per partition: p0 waits behind offset 5
        assert not any(p == 0 and o > 5 for p, o in done)
    assert attempts == [1, 2]
    # when stop() is called during the 60 s back-off: it returns promptly
    t0 = time.monotonic()
    assert r.stop(10) and r.error is None
    assert time.monotonic() - t0 < 5
    # then p0 is committed at the waiting message, p1 at its end
    assert committed(kafka_bootstrap, group, topic, 2) == {0: 5, 1: 20}


# ------------------------------------------------------------------------------------------------
# manual commit: committed offsets exact after each advance, never past an unfinished message
# ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(40)
def test_manual_commit_is_exact_after_each_advance(kafka_bootstrap: str, new_topic, start) -> None:  # type: ignore[no-untyped-def]
    topic = new_topic(1)
    produce(kafka_bootstrap, topic, [(b"k", str(i).encode(), 0) for i in range(6)])
    group = gid("manual")
    seen_commit: dict[int, int | None] = {}

    def handle(msg: Message) -> None:
        # before offset i runs, offset i-1 ended: within a poll loop the group's commit is i
        if msg.offset > 0:
            wait_until(lambda: group_offsets(kafka_bootstrap, group, topic, 1)[0] == msg.offset, 3, 0.05)
        seen_commit[msg.offset] = group_offsets(kafka_bootstrap, group, topic, 1)[0]

    r = start(consumer(kafka_bootstrap, topic, group, handle, manual_commit=True))
    assert wait_until(lambda: len(seen_commit) == 6, 30)
    assert wait_until(lambda: group_offsets(kafka_bootstrap, group, topic, 1)[0] == 6, 3)
    assert r.stop() and r.error is None
    assert seen_commit == {0: None, **{i: i for i in range(1, 6)}}


@pytest.mark.timeout(40)
def test_manual_commit_never_passes_an_unfinished_message(kafka_bootstrap: str, new_topic, start) -> None:  # type: ignore[no-untyped-def]
    # offset 0 (key "slow") blocks while offsets 1..49 of other keys all end
    topic = new_topic(1)
    produce(
        kafka_bootstrap, topic, [(b"slow", b"x", 0)] + [(f"k{i}".encode(), b"x", 0) for i in range(1, 50)]
    )
    group = gid("manual-hold")
    release = threading.Event()
    done: set[int] = set()

    def handle(msg: Message) -> None:
        if msg.offset == 0:
            release.wait(20)
        done.add(msg.offset)

    r = start(consumer(kafka_bootstrap, topic, group, handle, concurrency=4, manual_commit=True))
    assert wait_until(lambda: len(done) == 49, 15)
    time.sleep(0.5)
    held = group_offsets(kafka_bootstrap, group, topic, 1)[0]
    release.set()
    assert wait_until(lambda: group_offsets(kafka_bootstrap, group, topic, 1)[0] == 50, 5)
    assert r.stop() and r.error is None
    assert held is None or held == 0


# ------------------------------------------------------------------------------------------------
# back-pressure in bytes; many partitions at concurrency 1; memory
# ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(40)
def test_backpressure_in_bytes_bounds_buffered_bytes(kafka_bootstrap: str, new_topic, start) -> None:  # type: ignore[no-untyped-def]
    # given 1,000 values of 8 KiB on one key whose first message blocks, max_in_flight_bytes=256 KiB
    topic = new_topic(1)
    size, bound = 8192, 256 * 1024
    produce(kafka_bootstrap, topic, [(b"k", os.urandom(size), 0) for _ in range(1000)])
    release = threading.Event()

    def handle(msg: Message) -> None:
        if msg.offset == 0:
            release.wait(20)

    c = consumer(kafka_bootstrap, topic, gid("bytes"), handle, max_in_flight_bytes=bound)
    r = start(c)
    peak = 0
    t_end = time.monotonic() + 4
    while time.monotonic() < t_end:
        peak = max(peak, c.in_flight)
        time.sleep(0.005)
    release.set()
    assert r.stop() and r.error is None
    # then the buffer stayed about the bound (pausing at it), not the whole topic
    assert peak * (size + 1) <= bound + 2 * (size + 1), (
        f"{peak} messages ({peak * size // 1024} KiB) buffered, bound 256 KiB"
    )


@pytest.mark.timeout(60)
def test_24_partitions_at_concurrency_1(kafka_bootstrap: str, new_topic, start) -> None:  # type: ignore[no-untyped-def]
    topic = new_topic(24)
    produce(
        kafka_bootstrap,
        topic,
        [(f"k{i % 5}".encode(), str(i).encode(), p) for p in range(24) for i in range(30)],
    )
    group = gid("p24")
    order: dict[tuple[int, bytes | None], list[int]] = {}
    running = [0]
    overlap = [0]
    lock = threading.Lock()

    def handle(msg: Message) -> None:
        with lock:
            running[0] += 1
            overlap[0] = max(overlap[0], running[0])
            order.setdefault((msg.partition, msg.key), []).append(msg.offset)
        time.sleep(0.0005)
        with lock:
            running[0] -= 1

    r = start(consumer(kafka_bootstrap, topic, group, handle))
    assert wait_until(lambda: sum(len(v) for v in order.values()) == 720, 30)
    time.sleep(0.3)
    assert r.stop() and r.error is None
    assert overlap[0] == 1
    assert all(v == sorted(v) and len(v) == len(set(v)) for v in order.values())
    assert committed(kafka_bootstrap, group, topic, 24) == dict.fromkeys(range(24), 30)


@pytest.mark.timeout(90)
def test_memory_does_not_grow_with_distinct_keys(kafka_bootstrap: str, new_topic, start) -> None:  # type: ignore[no-untyped-def]
    topic = new_topic(2)
    n = 50_000
    produce(kafka_bootstrap, topic, [(f"key-{i}".encode(), b"v", i % 2) for i in range(n)])
    count = [0]
    lock = threading.Lock()

    def handle(msg: Message) -> None:
        with lock:
            count[0] += 1

    c = consumer(kafka_bootstrap, topic, gid("mem"), handle, concurrency=8)
    r = start(c)
    try:
        assert wait_until(lambda: count[0] == n, 60)
        d = c._run.engine  # internal, read only

        def held() -> tuple[int, ...]:
            lanes = sum(len(lanes) for lanes in d.partitions.lanes_of())
            pending = sum(p.tracker.pending for p in d.partitions.by_tp.values())
            done_sets = sum(len(p.tracker._done) for p in d.partitions.by_tp.values())
            flow = d.flow
            return (
                lanes,
                flow.buffered,
                flow.buffered_bytes,
                flow.running,
                len(d.queue),
                pending,
                done_sets,
            )

        # (the last handlers' ends are booked just after they return: wait for them, 10 s at most)
        zeros = (0, 0, 0, 0, 0, 0, 0)
        assert wait_until(lambda: held() == zeros, 10), held()
    finally:
        assert r.stop()


def test_message_repr_does_not_show_values_or_headers() -> None:
    m = Message("t", 0, 1, b"k", b"secret-value", [("h", b"secret-header")], 1)
    assert "secret" not in repr(m) and "secret" not in str(m)


# ------------------------------------------------------------------------------------------------
# signals
# ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(40)
def test_sigterm_during_run_in_main_thread_stops_gracefully(kafka_bootstrap: str, new_topic) -> None:  # type: ignore[no-untyped-def]
    assert threading.current_thread() is threading.main_thread()
    topic = new_topic(1)
    produce(kafka_bootstrap, topic, [(b"k", str(i).encode(), 0) for i in range(2000)])
    group = gid("sigterm")
    done: list[int] = []
    before = signal.getsignal(signal.SIGTERM)

    def handle(msg: Message) -> None:
        time.sleep(0.002)
        done.append(msg.offset)
        if msg.offset == 50:
            threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGTERM)).start()

    c = consumer(kafka_bootstrap, topic, group, handle)
    t0 = time.monotonic()
    c.run()  # returns on SIGTERM
    assert time.monotonic() - t0 < 15
    assert signal.getsignal(signal.SIGTERM) is before
    assert 50 < len(done) < 2000
    assert committed(kafka_bootstrap, group, topic, 1) == {0: len(done)}


ASYNC_SIGTERM_SCRIPT = textwrap.dedent(
    """
    import asyncio, sys
    from keyedconsumer import KeyedConsumer
    bootstrap, topic, group, marker = sys.argv[1:5]
    done = []
    async def handle(msg):
        await asyncio.sleep(0.005)
        done.append(msg.offset)
        if len(done) == 50:
            open(marker, "w").write("ready")
    c = KeyedConsumer(name=group, handler=handle, brokers=[bootstrap], topics=[topic])
    asyncio.run(c.run_async())
    print("DONE", len(done), flush=True)
    """
)


@pytest.mark.timeout(60)
def test_sigterm_during_run_async_stops_gracefully(kafka_bootstrap: str, new_topic, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # README Shutdown: "stop(), SIGINT and SIGTERM: nothing new starts, running handlers finish,
    # done offsets are committed, and the client is closed"
    topic = new_topic(1)
    produce(kafka_bootstrap, topic, [(b"k", str(i).encode(), 0) for i in range(3000)])
    group = gid("sigterm-async")
    script, marker = tmp_path / "c.py", tmp_path / "ready"
    script.write_text(ASYNC_SIGTERM_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), kafka_bootstrap, topic, group, str(marker)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert wait_until(marker.exists, 30)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, (
        f"rc={proc.returncode}: SIGTERM killed the run_async() process without a graceful stop"
    )
    processed = int(out.split()[-1])
    assert committed(kafka_bootstrap, group, topic, 1) == {0: processed}


@pytest.mark.timeout(40)
def test_run_async_returns_in_bounded_time_with_a_hung_async_handler(kafka_bootstrap: str, new_topic) -> None:  # type: ignore[no-untyped-def]
    topic = new_topic(1)
    produce(kafka_bootstrap, topic, [(b"a", b"x", 0)] * 3 + [(b"h", b"x", 0)])
    group = gid("hung-async-caller")
    release = asyncio.Event()
    started = []

    async def handle(msg: Message) -> None:
        if msg.key == b"h":
            started.append(msg.offset)
            await release.wait()

    c = consumer(kafka_bootstrap, topic, group, handle, concurrency=2, shutdown_timeout_s=1.0)

    async def main() -> float:
        task = asyncio.create_task(c.run_async())
        while not started:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        t0 = time.monotonic()
        c.stop()
        await asyncio.wait_for(task, 15)
        took = time.monotonic() - t0
        release.set()
        await asyncio.sleep(0.1)
        return took

    took = asyncio.run(main())
    assert took < 1.0 + 3.0, took
    got = committed(kafka_bootstrap, group, topic, 1)[0]
    assert got is not None and got <= 3  # never past the hung message


@pytest.mark.timeout(60)
def test_async_one_hung_handler_does_not_block_another_key_with_a_free_worker(
    kafka_bootstrap: str, new_topic, start
) -> None:  # type: ignore[no-untyped-def]
    # given concurrency 2 and 4 messages: a, a, a, then h whose handler hangs
    topic = new_topic(1)
    produce(kafka_bootstrap, topic, [(b"a", b"x", 0)] * 3 + [(b"h", b"x", 0)])
    release = threading.Event()
    ran: list[int] = []

    async def handle(msg: Message) -> None:
        ran.append(msg.offset)
        if msg.key == b"h":
            while not release.is_set():
                await asyncio.sleep(0.02)

    r = start(consumer(kafka_bootstrap, topic, gid("hol-min"), handle, concurrency=2))
    try:
        # then key a's 3 messages all run on the free worker while h hangs
        ok = wait_until(lambda: sorted(ran) == [0, 1, 2, 3], 25)
        assert ok, f"ran {sorted(ran)}: key a waits behind the hung key h although a worker is free"
    finally:
        release.set()
        r.stop()


@pytest.mark.timeout(30)
def test_max_in_flight_1_is_a_hard_bound(kafka_bootstrap: str, new_topic, start) -> None:  # type: ignore[no-untyped-def]
    topic = new_topic(2)
    # (each pause/resume cycle costs librdkafka one fetch wait, ~0.5 s: keep it to 10 messages)
    produce(kafka_bootstrap, topic, [(f"k{i % 9}".encode(), b"x", i % 2) for i in range(10)])
    seen: list[int] = []
    lock = threading.Lock()

    def handle(msg: Message) -> None:
        time.sleep(0.001)
        with lock:
            seen.append(msg.offset)

    c = consumer(kafka_bootstrap, topic, gid("mif1"), handle, concurrency=8, max_in_flight=1)
    r = start(c)
    assert wait_until(lambda: len(seen) == 10, 15)
    assert r.stop() and r.error is None
    assert c.peak_in_flight == 1


@pytest.mark.timeout(60)
def test_handler_reassigning_msg_key_does_not_break_its_lane(kafka_bootstrap: str, new_topic, start) -> None:  # type: ignore[no-untyped-def]
    # given 3 messages of key "a"; the handler normalises msg.key (a public, writable attribute)
    topic = new_topic(1)
    produce(kafka_bootstrap, topic, [(b"a", str(i).encode(), 0) for i in range(3)])
    ran: list[int] = []

    def handle(msg: Message) -> None:
        ran.append(msg.offset)
        msg.key = (msg.key or b"").upper()

    r = start(consumer(kafka_bootstrap, topic, gid("rekey"), handle, concurrency=2))
    ok = wait_until(lambda: ran == [0, 1, 2], 25)
    assert r.stop()
    assert ok, f"ran {ran}: the rest of key a never ran after the handler changed msg.key"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("manual_commit", [False, True], ids=["auto", "manual"])
def test_join_and_leave_mid_run_loses_nothing_and_never_overlaps_or_moves_back(
    kafka_bootstrap: str, new_topic, start, manual_commit: bool
) -> None:  # type: ignore[no-untyped-def]
    # given 1,500 messages on 4 partitions (30 keys), handlers of 5-25 ms at concurrency 8 (0.2 s
    # while B joins, so that A cannot end the run before the rebalance gave B partitions)
    import random

    topic = new_topic(4)
    n = 1500
    produce(kafka_bootstrap, topic, [(f"k{i % 30}".encode(), str(i).encode(), None) for i in range(n)])
    group = gid(f"rebal-{'m' if manual_commit else 'a'}")
    lock = threading.Lock()
    ended: set[tuple[int, int]] = set()
    active: dict[bytes | None, int] = {}
    overlaps: list[bytes | None] = []

    by: dict[str, int] = {"a": 0, "b": 0}
    joining = threading.Event()

    def handler(who: str) -> Callable[[Message], None]:
        def handle(msg: Message) -> None:
            with lock:
                active[msg.key] = active.get(msg.key, 0) + 1
                if active[msg.key] > 1:
                    overlaps.append(msg.key)
            time.sleep(0.2 if joining.is_set() else random.uniform(0.005, 0.025))
            with lock:
                active[msg.key] -= 1
                ended.add((msg.partition, msg.offset))
                by[who] += 1

        return handle

    def make(who: str) -> KeyedConsumer:
        return consumer(
            kafka_bootstrap,
            topic,
            group,
            handler(who),
            concurrency=8,
            manual_commit=manual_commit,
            config={"heartbeat.interval.ms": 500},
        )

    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    samples: list[dict[int, int | None]] = []
    stop_sampling = threading.Event()

    def sample() -> None:
        req = ConsumerGroupTopicPartitions(group, [TopicPartition(topic, p) for p in range(4)])
        while not stop_sampling.is_set():
            try:
                res = admin.list_consumer_group_offsets([req], request_timeout=5)[group].result(timeout=5)
                samples.append({tp.partition: tp.offset for tp in res.topic_partitions})
            except Exception:
                pass
            stop_sampling.wait(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    ca, cb = make("a"), make("b")
    a = start(ca)
    assert wait_until(lambda: len(ended) > 200, 15)
    # when B joins mid-run (and runs handlers), and then A leaves mid-run; A's handlers are slow
    # until the rebalance gave B partitions (taken from A)
    joining.set()
    b = start(cb)
    assert wait_until(lambda: len(cb.assignment) > 0 and len(ca.assignment) < 4, 20), (
        ca.assignment,
        cb.assignment,
    )
    joining.clear()
    assert wait_until(lambda: by["b"] > 50, 20)
    assert len(ended) < n - 300
    assert a.stop() and a.error is None
    # then B ends everything, nothing is lost, and no key ever ran twice at once
    assert wait_until(lambda: len(ended) == n, 25), n - len(ended)
    time.sleep(0.5)
    assert b.stop() and b.error is None
    stop_sampling.set()
    sampler.join(10)
    assert overlaps == []
    assert committed(kafka_bootstrap, group, topic, 4) == end_offsets(kafka_bootstrap, topic, 4)
    for p in range(4):
        seq = [s[p] for s in samples if s.get(p) is not None and s[p] >= 0]
        assert all(y >= x for x, y in zip(seq, seq[1:], strict=False)), (
            f"p{p} committed offset moved back: {seq}"
        )
