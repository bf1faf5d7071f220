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
from keyedconsumer.middleware import DeadLetter, Logging, Recover, Retry, Typed

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
        DeadLetter(publisher=broker.publisher()),
        Retry(max_attempts=3, initial_delay_s=1.0, jitter=0.0),
    ],
    "recover-logging-retry": lambda broker: [
        Recover(),
        Logging(),
        Retry(max_attempts=3, initial_delay_s=1.0),
    ],
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
        name="g",
        topics=["orders"],
        handler=lambda m: handle_async(m),
        middlewares=STACKS[stack](broker),
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

    consumer = broker.consumer(
        name="g",
        topics=["orders"],
        handler=lambda m: None,
        middlewares=[bad_middleware],
        error_handler=lambda e, m: None,
    )
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


# -- error_handler and middlewares are checked at construction ---------------------------------------


class Timing:
    """A middleware written as a class whose constructor takes the handler: the class itself is one."""

    def __init__(self, handler: Any) -> None:
        self.handler = handler
        self.calls = 0

    def __call__(self, msg: Message) -> None:
        self.calls += 1
        self.handler(msg)


class OnError:
    def __call__(self, err: BaseException, msg: Message | None) -> None:
        pass


def build(**kw: Any) -> Any:
    return InMemoryBroker().consumer(name="g", topics=["t"], handler=kw.pop("handler", lambda m: None), **kw)


@pytest.mark.parametrize(
    "middlewares,expected",
    [
        (lambda: [Retry], "middlewares[0] is the class Retry: pass an instance, e.g. Retry(...)"),
        (
            lambda: [Recover(), DeadLetter],
            "middlewares[1] is the class DeadLetter: pass an instance, e.g. DeadLetter(...)",
        ),
        (lambda: [Recover], "middlewares[0] is the class Recover: pass an instance, e.g. Recover(...)"),
        (lambda: [Logging(), Typed], "middlewares[1] is the class Typed: pass an instance, e.g. Typed(...)"),
        (lambda: [Retry(), "retry"], "middlewares[1] is a str, not a middleware"),
        (lambda: [None], "middlewares[0] is a NoneType, not a middleware"),
        (lambda: Retry(), "middlewares must be a list of middleware, e.g. [Retry(...)]"),
    ],
    ids=[
        "class-retry",
        "class-dead-letter",
        "class-recover",
        "class-typed",
        "a-string",
        "none",
        "not-a-list",
    ],
)
def test_a_bad_middleware_is_refused_at_construction_saying_what_to_write(
    middlewares: Callable[[], Any], expected: str
) -> None:
    with pytest.raises(TypeError) as info:
        build(middlewares=middlewares())
    assert expected in str(info.value)


def test_a_middleware_class_whose_constructor_takes_the_handler_is_a_middleware() -> None:
    broker = InMemoryBroker()
    broker.create_topic("t", partitions=1)
    broker.produce("t", "v", key="k")
    seen: list[int] = []
    consumer = broker.consumer(
        name="g", topics=["t"], handler=lambda m: seen.append(m.offset), middlewares=[Timing]
    )
    with broker.run(consumer) as run:
        run.until_idle(timeout_s=10)
    assert seen == [0]


async def async_on_error(err: BaseException, msg: Message | None) -> None:
    pass


@pytest.mark.parametrize(
    "error_handler,expected",
    [
        (OnError, "error_handler is the class OnError: pass an instance, e.g. OnError(...)"),
        ("log", "error_handler must be callable as error_handler(error, message), got a str"),
        (lambda err: None, "error_handler(err) cannot be called as error_handler(error, message)"),
        (lambda: None, "error_handler() cannot be called as error_handler(error, message)"),
        (
            lambda err, msg, extra: None,
            "error_handler(err, msg, extra) cannot be called as error_handler(error, message)",
        ),
        (async_on_error, "error_handler must be a plain function"),
    ],
    ids=["class", "string", "one-argument", "no-argument", "three-arguments", "async-def"],
)
def test_a_bad_error_handler_is_refused_at_construction_naming_the_signature(
    error_handler: Any, expected: str
) -> None:
    with pytest.raises(TypeError) as info:
        build(error_handler=error_handler)
    assert expected in str(info.value)
    if "cannot be called" in expected:
        assert "def on_error(error: BaseException, message: Message | None) -> None" in str(info.value)


@pytest.mark.parametrize(
    "error_handler",
    [lambda err, msg: None, lambda *args: None, lambda err, msg=None, extra=1: None, OnError(), print, None],
    ids=["two", "varargs", "defaults", "instance", "builtin", "none"],
)
def test_error_handlers_that_take_error_and_message_are_accepted(error_handler: Any) -> None:
    build(error_handler=error_handler)
