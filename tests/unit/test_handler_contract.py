"""The handler contract, checked strictly (issue 12, section 8), on the in-memory broker.

A plain ``def`` handler that returns an awaitable (``handler=lambda m: handle_async(m)``) is a
programming error: the engine closes the coroutine, stops the consumer, and ``run()`` raises
``HandlerContractError`` naming the message; no middleware retries or dead-letters it and
``error_handler`` cannot mark it handled. The real-broker side is in
``tests/integration/test_bad_input.py``.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable
from typing import Any

import pytest
from keyedconsumer.middleware import DeadLetter, Logging, Recover, Retry

from keyedconsumer import KeyedConsumerError, Message
from keyedconsumer.testing import InMemoryBroker

pytestmark = [pytest.mark.timeout(30)]


def swallow_everything(handler: Any) -> Any:
    """A (bad) middleware that catches even ``BaseException`` and marks the message done."""

    def wrapped(msg: Message) -> None:
        try:
            handler(msg)
        except BaseException:
            msg.ack_skip()

    return wrapped


STACKS: dict[str, Callable[[InMemoryBroker], list[Any]]] = {
    "no-middleware": lambda broker: [],
    "dead-letter-retry": lambda broker: [
        DeadLetter(publisher=broker.publisher()), Retry(max_attempts=3, initial_delay_s=1.0, jitter=0.0)
    ],
    "recover-logging-retry": lambda broker: [Recover(), Logging(), Retry(max_attempts=3, initial_delay_s=1.0)],
    "swallowing": lambda broker: [swallow_everything],
}


@pytest.mark.parametrize("stack", list(STACKS))
def test_sync_handler_returning_a_coroutine_stops_the_consumer_naming_the_message(stack: str) -> None:
    # given one message and a plain handler that only calls an async def function (forgets to await)
    broker = InMemoryBroker()
    broker.create_topic("orders", partitions=1)
    broker.produce("orders", "v", key="k")
    ran: list[int] = []
    reported: list[BaseException] = []

    async def handle_async(msg: Message) -> None:
        ran.append(msg.offset)

    def error_handler(err: BaseException, msg: Message | None) -> None:
        reported.append(err)  # returning normally would mark a failure handled

    consumer = broker.consumer(
        name="g", topics=["orders"], handler=lambda m: handle_async(m), middlewares=STACKS[stack](broker),
        error_handler=error_handler,
    )
    # when it runs
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(KeyedConsumerError) as info:
            with broker.run(consumer) as run:
                run.until_idle(timeout_s=10)
        gc.collect()
    # then run() raised the contract error naming the message and what to write instead
    err = info.value
    assert type(err).__name__ == "HandlerContractError", repr(err)
    assert (err.topic, err.partition, err.offset) == ("orders", 0, 0)  # type: ignore[attr-defined]
    assert "topic=orders partition=0 offset=0" in str(err) and "async def" in str(err)
    # and the coroutine never ran, nothing handled, retried or dead-lettered it, nothing committed past it
    assert ran == [] and reported == []
    assert "orders.dlq" not in broker.topics()
    assert broker.committed("g").get(("orders", 0), 0) == 0
    assert broker.delivered("g") == 1  # delivered once: not run again by a retry
    # and the coroutine was closed: no "never awaited" warning
    assert not [w for w in caught if "never awaited" in str(w.message)], [str(w.message) for w in caught]


def test_middleware_returning_a_coroutine_is_caught_on_the_composed_chain() -> None:
    # given a sync handler and a sync middleware whose wrapper returns a coroutine
    broker = InMemoryBroker()
    broker.create_topic("orders", partitions=1)
    broker.produce("orders", "v", key="k")
    ran: list[int] = []

    async def inner(msg: Message) -> None:
        ran.append(msg.offset)

    def bad_middleware(handler: Any) -> Any:
        return lambda msg: inner(msg)

    consumer = broker.consumer(name="g", topics=["orders"], handler=lambda m: None, middlewares=[bad_middleware],
                               error_handler=lambda e, m: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(KeyedConsumerError) as info:
            with broker.run(consumer) as run:
                run.until_idle(timeout_s=10)
        gc.collect()
    assert type(info.value).__name__ == "HandlerContractError" and "offset=0" in str(info.value)
    assert ran == [] and broker.committed("g").get(("orders", 0), 0) == 0
    assert not [w for w in caught if "never awaited" in str(w.message)]


def test_async_handler_returning_a_coroutine_is_caught_on_the_composed_chain() -> None:
    # given an async def handler that returns (instead of awaiting) another coroutine
    broker = InMemoryBroker()
    broker.create_topic("orders", partitions=1)
    broker.produce("orders", "v", key="k")
    ran: list[int] = []

    async def inner(msg: Message) -> None:
        ran.append(msg.offset)

    async def handle(msg: Message) -> Any:
        return inner(msg)

    consumer = broker.consumer(name="g", topics=["orders"], handler=handle, error_handler=lambda e, m: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(KeyedConsumerError) as info:
            with broker.run(consumer) as run:
                run.until_idle(timeout_s=10)
        gc.collect()
    assert type(info.value).__name__ == "HandlerContractError" and "offset=0" in str(info.value)
    assert ran == [] and broker.committed("g").get(("orders", 0), 0) == 0
    assert not [w for w in caught if "never awaited" in str(w.message)]


def test_a_handler_returning_a_plain_value_is_fine() -> None:
    # a non-awaitable return value (e.g. from a lambda around list.append) is not a contract error
    broker = InMemoryBroker()
    broker.create_topic("orders", partitions=1)
    for i in range(3):
        broker.produce("orders", str(i), key="k")
    seen: list[int] = []
    consumer = broker.consumer(name="g", topics=["orders"], handler=lambda m: seen.append(m.offset) or 42)
    with broker.run(consumer) as run:
        run.until_idle(timeout_s=10)
    assert seen == [0, 1, 2] and broker.committed("g") == {("orders", 0): 3}
