"""Work that outlives its time limit, and cancellations the framework causes, on the real broker
(issue 25 §5-6; the promises are in docs/guarantees.md, "Time limits and cancellation").

- An attempt past ``handler_timeout_s`` fails with ``HandlerTimeoutError`` and is counted, however
  it ended: it raised its own exception, turned the cancellation into another one, swallowed it.
- A batch call past the limit fails every message of the batch, also one it named in ``BatchFailed``.
- A key's retry never overlaps a thread its timed-out attempt started (``asyncio.to_thread``).
- A cancellation the framework caused that the handler turned into another exception is not the
  message's failure: no dead letter, no ``error_handler``, no stored offset, ``CANCELLED`` in the
  audit trail.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Any

import pytest
from keyedconsumer.middleware import DeadLetter, Retry

from keyedconsumer import BatchFailed, HandlerTimeoutError, KeyedConsumer, Message

from .kafkautil import committed, produce, read_all, wait_until

pytestmark = [pytest.mark.kafka]


def _consumer(bootstrap: str, topic: str, **kw: Any) -> KeyedConsumer:
    return KeyedConsumer(name=f"tl-{uuid.uuid4().hex[:8]}", brokers=[bootstrap], topics=[topic], **kw)


class Failures:
    """What ``error_handler`` was given, by offset."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_offset: dict[int, BaseException] = {}

    def __call__(self, error: BaseException, msg: Message | None) -> None:
        if msg is not None:
            with self.lock:
                self.by_offset[msg.offset] = error


@pytest.mark.timeout(60)
def test_a_plain_handler_that_overruns_and_then_raises_fails_with_the_timeout(
    kafka_bootstrap: str, new_topic, start
) -> None:  # type: ignore[no-untyped-def]
    # given a plain handler that overruns its 0.3 s limit and then raises its own exception
    topic = new_topic(1)
    produce(kafka_bootstrap, topic, [(b"k", b"v", 0)])
    failures = Failures()

    def handle(msg: Message) -> None:
        time.sleep(0.6)
        raise ValueError("its own failure")

    c = _consumer(kafka_bootstrap, topic, handler=handle, handler_timeout_s=0.3, error_handler=failures)
    r = start(c)
    # when it ran
    assert wait_until(lambda: 0 in failures.by_offset, 30)
    assert r.stop(30)
    # then its failure is the time limit's (its own is the cause), and it was counted
    err = failures.by_offset[0]
    assert isinstance(err, HandlerTimeoutError) and isinstance(err.__cause__, ValueError), repr(err)
    assert c.handler_timeouts == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["converts", "swallows"])
def test_an_async_handler_that_converts_or_swallows_the_cancellation_fails_with_the_timeout(
    kafka_bootstrap: str, new_topic, start, how: str
) -> None:  # type: ignore[no-untyped-def]
    # given an async handler that, cancelled at its 0.2 s limit, raises another exception (or
    # swallows the cancellation and goes on a little, then returns)
    topic = new_topic(1)
    produce(kafka_bootstrap, topic, [(b"k", b"v", 0)])
    failures = Failures()

    async def handle(msg: Message) -> None:
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            if how == "converts":
                raise RuntimeError("cleanup failed after the cancellation") from None
            await asyncio.sleep(0.05)  # swallowed: goes on, then returns

    c = _consumer(kafka_bootstrap, topic, handler=handle, handler_timeout_s=0.2, error_handler=failures)
    r = start(c)
    assert wait_until(lambda: 0 in failures.by_offset, 30)
    assert r.stop(30)
    # then the attempt failed with the time limit, not with what the handler made of it, and counted
    assert isinstance(failures.by_offset[0], HandlerTimeoutError), repr(failures.by_offset[0])
    assert c.handler_timeouts == 1


@pytest.mark.timeout(90)
def test_a_keys_retry_never_overlaps_a_thread_its_timed_out_attempt_started(
    kafka_bootstrap: str, new_topic, start
) -> None:  # type: ignore[no-untyped-def]
    # given an async handler whose work runs in a thread (asyncio.to_thread) for 1 s, a 0.2 s limit,
    # and retries at once: the cancelled attempt's thread goes on after the cancellation
    topic = new_topic(1)
    produce(kafka_bootstrap, topic, [(b"k", b"v", 0)])
    lock = threading.Lock()
    spans: list[tuple[float, float]] = []  # each attempt's thread: (start, end)
    done = threading.Event()

    def blocking_work(attempt: int) -> None:
        t0 = time.monotonic()
        time.sleep(1.0 if attempt < 3 else 0.0)
        with lock:
            spans.append((t0, time.monotonic()))

    async def handle(msg: Message) -> None:
        await asyncio.to_thread(blocking_work, msg.attempt)
        done.set()

    c = _consumer(
        kafka_bootstrap,
        topic,
        handler=handle,
        handler_timeout_s=0.2,
        middlewares=[Retry(max_attempts=5, initial_delay_s=0.0, jitter=0.0)],
    )
    r = start(c)
    assert wait_until(done.is_set, 60)
    assert r.stop(30)
    # then the third attempt succeeded, after two timed out, and no attempt's thread started
    # before the previous attempt's thread had ended
    with lock:
        ordered = sorted(spans)
    assert len(ordered) == 3 and c.handler_timeouts == 2, (ordered, c.handler_timeouts)
    overlaps = [(a, b) for a, b in zip(ordered, ordered[1:], strict=False) if b[0] < a[1]]
    assert overlaps == [], overlaps


@pytest.mark.timeout(60)
def test_a_batch_call_that_overruns_fails_every_message_of_the_batch(
    kafka_bootstrap: str, new_topic, start
) -> None:  # type: ignore[no-untyped-def]
    # given a batch handler that overruns its 0.3 s limit, then fails one message by name
    topic = new_topic(1)
    produce(kafka_bootstrap, topic, [(f"k{i}".encode(), b"v", 0) for i in range(3)])
    failures = Failures()
    calls: list[int] = []

    def handle(msgs: list[Message]) -> None:
        calls.append(len(msgs))
        time.sleep(0.6)
        raise BatchFailed({msgs[0]: ValueError("only this one")})

    c = _consumer(
        kafka_bootstrap,
        topic,
        batch_handler=handle,
        handler_timeout_s=0.3,
        handler_batch_size=3,
        handler_batch_linger_s=1.0,
        error_handler=failures,
    )
    r = start(c)
    assert wait_until(lambda: len(failures.by_offset) == 3, 30), failures.by_offset
    assert r.stop(30)
    # then every message of the batch failed with the time limit, not only the one named
    assert calls == [3]
    assert all(isinstance(e, HandlerTimeoutError) for e in failures.by_offset.values()), failures.by_offset


@pytest.mark.timeout(90)
def test_a_cancellation_at_the_loops_end_turned_into_another_error_is_not_the_messages_failure(
    kafka_bootstrap: str, new_topic
) -> None:  # type: ignore[no-untyped-def]
    # given an app loop running a consumer (run_async) whose async handler turns a cancellation into
    # another exception, under a dead-letter middleware and an error handler
    topic = new_topic(1)
    dlq = f"{topic}.dlq"
    produce(kafka_bootstrap, topic, [(b"k", b"v", 0)])
    failures = Failures()
    started = threading.Event()
    group = f"tl-{uuid.uuid4().hex[:8]}"

    async def handle(msg: Message) -> None:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            raise RuntimeError("cancelled mid-write") from None

    c = KeyedConsumer(
        name=group,
        brokers=[kafka_bootstrap],
        topics=[topic],
        handler=handle,
        error_handler=failures,
        shutdown_timeout_s=1.0,
        middlewares=[DeadLetter(brokers=[kafka_bootstrap], topic=dlq)],
    )

    async def main() -> None:
        asyncio.get_running_loop().create_task(c.run_async())
        while not started.is_set():
            await asyncio.sleep(0.05)
        # when the loop goes away with the handler running: asyncio.run cancels every task left

    asyncio.run(main())
    assert wait_until(lambda: not c.running, 30)
    # then nothing took the conversion for the message's failure: no error handler call, no dead
    # letter, and the offset was not committed past it
    assert failures.by_offset == {}
    assert read_all(kafka_bootstrap, dlq, 1, timeout_s=3.0) == []
    assert committed(kafka_bootstrap, group, topic, 1) in ({0: None}, {0: 0})
