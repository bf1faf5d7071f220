"""Handlers producing result records (``msg.produce``) on the in-memory broker: the records are
written when the handler returns normally, before the message counts done; a failed attempt's
records are dropped; with ``transactional=True`` (the fake's transactions are applied whole or not
at all) each result is written once, through a rebalance, an abort and a fencing."""

from __future__ import annotations

import asyncio
import threading
import time

import pydantic
import pytest

from keyedconsumer import ConsumerConfig, Message, RetryLater
from keyedconsumer.errors import MessageError, PublishError, TransactionError
from keyedconsumer.testing import FakeTransactionalProducer, InMemoryBroker

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


def _ledger(broker: InMemoryBroker, topic: str) -> list[bytes]:
    return [r.value or b"" for r in broker.records(topic)]


def test_transactional_writes_each_result_once_through_a_rebalance(kc_broker: InMemoryBroker) -> None:
    # given 4 keys x 25 messages on 4 partitions and two transactional consumers of one group
    kc_broker.create_topic("in", partitions=4)
    kc_broker.create_topic("out", partitions=4)
    inputs = [f"k{k}:{s}" for s in range(25) for k in range(4)]
    for v in inputs:
        kc_broker.produce("in", v, key=v.split(":")[0])
    handled: list[int] = []

    def handle(msg: Message) -> None:
        msg.produce("out", msg.key, msg.value)
        handled.append(1)

    def consumer(tid: str) -> object:
        return kc_broker.consumer(
            name="eos",
            handler=handle,
            topics=["in"],
            concurrency=4,
            transactional=True,
            transactional_id=tid,
            transaction_interval_s=0.005,
        )

    # when the group is rebalanced mid-run
    with kc_broker.run(consumer("a"), consumer("b")) as run:  # type: ignore[arg-type]
        run.wait_for(lambda: len(handled) >= 30, what="30 messages handled")
        kc_broker.rebalance("eos")
        run.until_idle()
    # then every input's result is in the output once, each key's in input order
    out = _ledger(kc_broker, "out")
    assert sorted(out) == sorted(v.encode() for v in inputs)
    for k in range(4):
        assert [v for v in out if v.startswith(f"k{k}:".encode())] == [
            f"k{k}:{s}".encode() for s in range(25)
        ]


def _five_results_through_a_failed_transaction(
    kc_broker: InMemoryBroker, name: str, failure: TransactionError, in_doubt_committed: bool = True
) -> FakeTransactionalProducer:
    """A transactional consumer of 5 messages of one key, whose first transaction raises
    ``failure`` (``in_doubt_committed``: as the fake's attribute), run until idle; returns its producer."""
    kc_broker.create_topic("in", partitions=1)
    for i in range(5):
        kc_broker.produce("in", str(i), key="k")
    started = threading.Event()

    def handle(msg: Message) -> None:
        started.wait(5)
        msg.produce("out", msg.key, msg.value)

    consumer = kc_broker.consumer(
        name=name,
        handler=handle,
        topics=["in"],
        transactional=True,
        transactional_id=f"{name}-1",
        transaction_interval_s=0.005,
    )
    with kc_broker.run(consumer) as run:
        run.wait_for(
            lambda: FakeTransactionalProducer.of(kc_broker, f"{name}-1") is not None, what="the producer"
        )
        producer = FakeTransactionalProducer.of(kc_broker, f"{name}-1")
        assert producer is not None
        producer.in_doubt_committed = in_doubt_committed
        producer.fail_next = failure
        started.set()
        run.until_idle()
    return producer


def test_an_abortable_failure_sends_the_same_records_in_the_next_transaction(
    kc_broker: InMemoryBroker,
) -> None:
    # given a transactional consumer whose next transaction will be aborted
    # when it runs until idle
    failure = TransactionError("aborted", code="REBALANCE_IN_PROGRESS", abortable=True)
    producer = _five_results_through_a_failed_transaction(kc_broker, "abort", failure)
    # then the aborted transaction left nothing, and the next one wrote every record once
    assert _ledger(kc_broker, "out") == [b"0", b"1", b"2", b"3", b"4"]
    assert producer.fail_next is None


@pytest.mark.parametrize("had_committed", [True, False], ids=["committed", "aborted"])
def test_a_commit_in_doubt_is_resolved_before_anything_is_written_again(
    kc_broker: InMemoryBroker, had_committed: bool
) -> None:
    # given a transactional consumer whose next commit goes unanswered (in doubt) after it did, or
    # did not, commit on the broker
    # when it runs until idle
    failure = TransactionError("no answer", code="_TIMED_OUT", retriable=True, in_doubt=True)
    producer = _five_results_through_a_failed_transaction(kc_broker, "doubt", failure, had_committed)
    # then the consumer asked how the commit ended before the next transaction: each record once
    assert _ledger(kc_broker, "out") == [b"0", b"1", b"2", b"3", b"4"]
    assert kc_broker.committed("doubt") == {("in", 0): 5}
    assert producer.fail_next is None


def test_a_fenced_producer_stops_the_consumer_and_commits_nothing_more(kc_broker: InMemoryBroker) -> None:
    # given a transactional consumer that committed its first message
    kc_broker.create_topic("in", partitions=1)
    kc_broker.produce("in", "first", key="k")

    def handle(msg: Message) -> None:
        msg.produce("out", msg.key, msg.value)

    consumer = kc_broker.consumer(
        name="fenced",
        handler=handle,
        topics=["in"],
        transactional=True,
        transactional_id="dup",
        transaction_interval_s=0.005,
    )
    with pytest.raises(TransactionError) as info, kc_broker.run(consumer) as run:
        run.until_idle()
        # when another producer with the same transactional id starts (a successor of a zombie)
        other = kc_broker.consumer(
            name="other", handler=handle, topics=["elsewhere"], transactional=True, transactional_id="dup"
        )
        run.add(other)
        run.wait_for(
            lambda: (
                FakeTransactionalProducer.of(kc_broker, "dup") is not None
                and FakeTransactionalProducer.of(kc_broker, "dup").transactional_id == "dup"  # type: ignore[union-attr]
                and other.running
            ),
            what="the second producer",
        )
        time.sleep(0.05)
        kc_broker.produce("in", "second", key="k")
        run.wait_for(lambda: not consumer.running, what="the first consumer stopping")
    # then the first consumer stopped with the fatal error; the second record was never written
    assert info.value.fatal and info.value.code == "_FENCED"
    assert _ledger(kc_broker, "out") == [b"first"]
    assert kc_broker.committed("fenced") == {("in", 0): 1}


def test_records_of_finished_messages_above_a_slow_one_wait_without_metadata(
    kc_broker: InMemoryBroker,
) -> None:
    # given commit metadata off, one slow message at offset 0 and fast ones behind it on other keys
    kc_broker.create_topic("in", partitions=1)
    kc_broker.produce("in", "slow", key="s")
    for i in range(5):
        kc_broker.produce("in", f"fast{i}", key=f"f{i}")
    release = threading.Event()
    fast_done: list[int] = []

    def handle(msg: Message) -> None:
        if msg.value == b"slow":
            release.wait(10)
        else:
            fast_done.append(1)
        msg.produce("out", msg.key, msg.value)

    consumer = kc_broker.consumer(
        name="held",
        handler=handle,
        topics=["in"],
        concurrency=4,
        transactional=True,
        transactional_id="held-1",
        transaction_interval_s=0.005,
        commit_metadata_max_bytes=0,
    )
    with kc_broker.run(consumer) as run:
        # when the fast ones finished while the slow one runs
        run.wait_for(lambda: len(fast_done) == 5, what="the fast messages")
        time.sleep(0.1)  # several transaction intervals
        # then none of their records is written: no committed offset covers them yet
        assert _ledger(kc_broker, "out") == []
        release.set()
        run.until_idle()
    # and once the slow one finished, all are written once, the partition's in the order they finished
    out = _ledger(kc_broker, "out")
    assert sorted(out) == sorted([b"slow"] + [f"fast{i}".encode() for i in range(5)])
    assert kc_broker.committed("held") == {("in", 0): 6}


def test_transactional_refuses_manual_commit_naming_the_field() -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        ConsumerConfig(name="x", topics=["t"], transactional=True, manual_commit=True)
    assert "manual_commit" in str(info.value)


@pytest.mark.parametrize(
    "field,value",
    [
        ("transaction_interval_s", 0),
        ("transaction_timeout_s", 0.5),
        ("produce_timeout_s", -1),
        ("transactional", 1),
    ],
)
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


def test_a_keyed_app_route_produces_transactionally(kc_broker: InMemoryBroker) -> None:
    # given an app whose async route produces in transactional mode
    from keyedconsumer import KeyedApp

    app = KeyedApp(group_id="app-eos")

    @app.handler("orders", concurrency=4, transactional=True, transactional_id="app-eos-1")
    async def invoice(msg: Message) -> None:
        msg.produce("invoices", msg.key, b"invoice " + (msg.value or b""))

    kc_broker.create_topic("orders", partitions=2)
    with kc_broker.run_app(app) as run:
        for i in range(20):
            kc_broker.produce("orders", str(i), key=f"c{i % 3}")
        run.until_idle()
    # then each order has one invoice, each customer's in order
    out = kc_broker.records("invoices")
    assert sorted(r.value or b"" for r in out) == sorted(f"invoice {i}".encode() for i in range(20))
    for k in range(3):
        assert [r.value for r in out if r.key == f"c{k}".encode()] == [
            f"invoice {i}".encode() for i in range(20) if i % 3 == k
        ]


@pytest.mark.parametrize("transactional", [False, True])
def test_a_batch_handler_writes_each_message_s_records_unless_that_message_failed(
    transactional: bool,
) -> None:
    # given a batch handler producing one record per message, and failing one message of key "b"
    # with BatchFailed on its first attempt
    from keyedconsumer import BatchFailed

    broker = InMemoryBroker()
    broker.create_topic("in", partitions=2)
    broker.create_topic("out", partitions=2)
    for i in range(4):
        for k in "abc":
            broker.produce("in", f"{k}{i}", key=k)
    failed: list[bytes] = []

    def handle(msgs: list[Message]) -> None:
        errors: dict[Message, BaseException] = {}
        for msg in msgs:
            msg.produce("out", msg.key, msg.value)
            if msg.value == b"b1" and not failed:
                failed.append(msg.value)
                errors[msg] = RetryLater(delay_s=0.5)
        if errors:
            raise BatchFailed(errors)

    consumer = broker.consumer(
        name=f"batch-prod-{transactional}",
        batch_handler=handle,
        topics=["in"],
        concurrency=2,
        transactional=transactional,
        transaction_interval_s=0.005,
    )
    # when it runs until idle
    with broker.run(consumer) as run:
        run.until_idle()
    # then each input's record was written once (b1's failed attempt wrote nothing), each key's in order
    out = _ledger(broker, "out")
    assert failed == [b"b1"]
    for k in "abc":
        assert [v for v in out if v.startswith(k.encode())] == [f"{k}{i}".encode() for i in range(4)]
    assert sum(broker.committed(f"batch-prod-{transactional}").values()) == 12
