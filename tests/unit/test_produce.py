"""Handlers producing result records (``msg.produce``) on the in-memory broker: the records are
written when the handler returns normally, before the message counts done; a failed attempt's
records are dropped; ``transactional=True`` is refused by the fake with a clear error."""

from __future__ import annotations

import asyncio

import pydantic
import pytest

from keyedconsumer import ConsumerConfig, Message, RetryLater
from keyedconsumer.errors import MessageError, PublishError, TransactionError
from keyedconsumer.testing import InMemoryBroker

pytestmark = pytest.mark.timeout(60)


def test_each_message_writes_its_records_in_key_order(kc_broker: InMemoryBroker) -> None:
    # given 3 keys x 5 messages on 2 partitions, and a handler producing two records per message
    kc_broker.create_topic("orders", partitions=2)
    kc_broker.create_topic("results", partitions=2)
    for i in range(5):
        for k in "abc":
            kc_broker.produce("orders", f"{k}{i}", key=k)

    def handle(msg: Message) -> None:
        msg.produce("results", msg.key, b"first:" + (msg.value or b""))
        msg.produce("results", msg.key, b"second:" + (msg.value or b""), headers=[("src", b"orders")])

    consumer = kc_broker.consumer(name="prod", handler=handle, topics=["orders"], concurrency=4)
    # when it runs until idle
    with kc_broker.run(consumer) as run:
        run.until_idle()
    # then every message wrote both records, each key's in offset order, and every offset was committed
    out = kc_broker.records("results")
    assert len(out) == 30
    for k in "abc":
        values = [r.value for r in out if r.key == k.encode()]
        assert values == [f"{w}:{k}{i}".encode() for i in range(5) for w in ("first", "second")]
    assert all(r.header("src") == b"orders" for r in out if r.value and r.value.startswith(b"second"))
    assert sum(kc_broker.committed("prod").values()) == 15


def test_a_failed_attempt_writes_nothing_and_its_retry_writes_once(kc_broker: InMemoryBroker) -> None:
    # given a handler that produces, then asks to be retried on its first attempt
    kc_broker.create_topic("in", partitions=1)
    kc_broker.produce("in", "x", key="k")

    def handle(msg: Message) -> None:
        msg.produce("out", msg.key, f"attempt {msg.attempt}".encode())
        if msg.attempt == 1:
            raise RetryLater(delay_s=1.0)

    consumer = kc_broker.consumer(name="retry", handler=handle, topics=["in"])
    # when it runs until idle
    with kc_broker.run(consumer) as run:
        run.until_idle()
    # then only the successful attempt's record was written
    assert [r.value for r in kc_broker.records("out")] == [b"attempt 2"]


def test_async_handlers_produce_too(kc_broker: InMemoryBroker) -> None:
    # given an async def handler producing one record per message
    kc_broker.create_topic("in", partitions=1)
    for i in range(4):
        kc_broker.produce("in", str(i), key="k")

    async def handle(msg: Message) -> None:
        await asyncio.sleep(0)
        msg.produce("out", msg.key, msg.value)

    consumer = kc_broker.consumer(name="async-prod", handler=handle, topics=["in"], concurrency=2)
    with kc_broker.run(consumer) as run:
        run.until_idle()
    assert [r.value for r in kc_broker.records("out")] == [b"0", b"1", b"2", b"3"]


def test_a_record_not_written_fails_the_attempt_and_the_offset_does_not_pass_it() -> None:
    # given a broker that creates no topics, and a handler producing to a topic that does not exist
    broker = InMemoryBroker(auto_create_topics=False)
    broker.create_topic("in", partitions=1)
    broker.produce("in", "ok", key="k")
    broker.produce("in", "bad", key="k")
    broker.produce("in", "after", key="k")
    broker.create_topic("out", partitions=1)

    def handle(msg: Message) -> None:
        msg.produce("missing" if msg.value == b"bad" else "out", msg.key, msg.value)

    consumer = broker.consumer(name="fails", handler=handle, topics=["in"])
    # when it runs
    with pytest.raises(MessageError) as info, broker.run(consumer) as run:
        run.until_idle()
    # then the failure names the record and the offset stops at the message whose record failed
    assert isinstance(info.value.cause, PublishError)
    assert "missing" in str(info.value.cause)
    assert broker.committed("fails") == {("in", 0): 1}
    assert [r.value for r in broker.records("out")] == [b"ok"]


def test_transactional_mode_is_refused_by_the_in_memory_broker(kc_broker: InMemoryBroker) -> None:
    kc_broker.create_topic("in", partitions=1)
    consumer = kc_broker.consumer(name="tx", handler=lambda m: None, topics=["in"], transactional=True)
    with pytest.raises(TransactionError, match="does not model Kafka transactions"), kc_broker.run(consumer) as run:
        run.until_idle()


def test_transactional_refuses_manual_commit_naming_the_field() -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        ConsumerConfig(name="x", topics=["t"], transactional=True, manual_commit=True)
    assert "manual_commit" in str(info.value)


@pytest.mark.parametrize("field,value", [("transaction_interval_s", 0), ("transaction_timeout_s", 0.5),
                                         ("produce_timeout_s", -1), ("transactional", 1)])
def test_bad_transaction_options_name_the_field(field: str, value: object) -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        ConsumerConfig(name="x", topics=["t"], **{field: value})
    assert field in str(info.value)


def test_produce_checks_its_arguments() -> None:
    msg = Message("t", 0, 0)
    with pytest.raises(TypeError):
        msg.produce("", b"k", b"v")
    with pytest.raises(TypeError):
        msg.produce("out", "k", b"v")  # type: ignore[arg-type]
    msg.produce("out", None, None)
    assert msg.produced == [("out", None, None, None)]
