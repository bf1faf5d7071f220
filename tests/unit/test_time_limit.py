"""handler_timeout_s on the in-memory broker: an async handler is cancelled at the limit, a plain
one is reported while it overruns (health not ready) and fails when it returns; retry and
dead-letter middleware handle the failure."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from keyedconsumer.middleware import DeadLetter, Retry

from keyedconsumer import HandlerTimeoutError, Message
from keyedconsumer.health import Health
from keyedconsumer.testing import InMemoryBroker

pytestmark = pytest.mark.timeout(60)


def test_an_async_handler_is_cancelled_at_the_limit_and_the_failure_is_retried_then_dead_lettered(
    kc_broker: InMemoryBroker,
) -> None:
    kc_broker.create_topic("t", partitions=1)
    kc_broker.create_topic("t.dlq", partitions=1)
    kc_broker.produce("t", "slow", key="k")
    kc_broker.produce("t", "fast", key="k")
    cancelled: list[str] = []

    async def handle(msg: Message) -> None:
        if msg.value == b"slow":
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.append(f"attempt {msg.attempt}")
                raise

    consumer = kc_broker.consumer(
        name="g",
        handler=handle,
        topics=["t"],
        handler_timeout_s=0.2,
        middlewares=[
            DeadLetter(publisher=kc_broker.publisher()),
            Retry(max_attempts=2, initial_delay_s=0.01),
        ],
    )
    started = time.monotonic()
    with kc_broker.run(consumer) as run:
        run.until_idle(timeout_s=20)
    assert time.monotonic() - started < 15  # two cancelled attempts of 0.2 s, not 30 s sleeps
    assert cancelled == ["attempt 1", "attempt 2"] and consumer.handler_timeouts == 2
    (dead,) = kc_broker.records("t.dlq")
    assert dead.value == b"slow"
    assert dict(dead.headers)["kafka_dlt-exception-fqcn"] == b"keyedconsumer.errors.HandlerTimeoutError"


def test_a_plain_handler_is_reported_while_it_overruns_and_fails_when_it_returns(
    kc_broker: InMemoryBroker,
) -> None:
    kc_broker.create_topic("t", partitions=1)
    kc_broker.produce("t", "slow", key="k")
    release = threading.Event()
    errors: list[BaseException] = []

    def handle(msg: Message) -> None:
        release.wait(20)

    consumer = kc_broker.consumer(
        name="g",
        handler=handle,
        topics=["t"],
        handler_timeout_s=0.1,
        error_handler=lambda e, m: errors.append(e),
    )
    health = Health(consumer)
    with kc_broker.run(consumer) as run:
        run.wait_for(lambda: consumer.overrunning == 1, timeout_s=10, what="the overrun to be noticed")
        report = health.check()
        assert report.live and not report.ready and report.overrunning == 1
        release.set()
        run.until_idle(timeout_s=10)
        assert consumer.overrunning == 0 and health.check().ready
    assert len(errors) == 1 and isinstance(errors[0], HandlerTimeoutError) and consumer.handler_timeouts == 1


def test_no_limit_by_default_and_a_fast_handler_never_counts(kc_broker: InMemoryBroker) -> None:
    kc_broker.create_topic("t", partitions=1)
    for i in range(20):
        kc_broker.produce("t", str(i), key=f"k{i}")
    limited = kc_broker.consumer(
        name="g", handler=lambda m: None, topics=["t"], handler_timeout_s=5, concurrency=4
    )
    with kc_broker.run(limited) as run:
        run.until_idle()
    assert limited.handler_timeouts == 0 and limited.overrunning == 0
