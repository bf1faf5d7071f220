"""The audit middleware on the in-memory broker: one record per attempt, keyed by the message key,
with the outcome the middleware saw; batched; refused records counted, never dropped silently."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
from keyedconsumer.middleware import Audit, DeadLetter, Retry

from keyedconsumer import Message, PublishError, SkipMessage
from keyedconsumer.testing import InMemoryBroker

pytestmark = pytest.mark.timeout(60)


def _records(broker: InMemoryBroker, topic: str = "keyedconsumer.audit") -> list[dict[str, Any]]:
    return [json.loads(r.value or b"{}") | {"_key": r.key} for r in broker.records(topic)]


def test_each_attempt_leaves_one_record_with_its_outcome(kc_broker: InMemoryBroker) -> None:
    # given keys that succeed, skip, and always fail (retried once, then dead-lettered)
    kc_broker.create_topic("orders", partitions=2)
    kc_broker.create_topic("orders.dlq", partitions=1)
    kc_broker.create_topic("keyedconsumer.audit", partitions=3)
    for i in range(20):
        kc_broker.produce("orders", str(i), key=f"k{i % 4}")
    kc_broker.produce("orders", "x", key="skip")
    kc_broker.produce("orders", "y", key="bad")

    def handle(msg: Message) -> None:
        if msg.key == b"skip":
            raise SkipMessage()
        if msg.key == b"bad":
            raise ValueError("no such account")

    audit = Audit(publisher=kc_broker.publisher(), flush_interval_s=0.01, max_batch=7)
    consumer = kc_broker.consumer(
        name="billing",
        handler=handle,
        topics=["orders"],
        concurrency=4,
        middlewares=[
            audit,
            DeadLetter(publisher=kc_broker.publisher()),
            Retry(max_attempts=2, initial_delay_s=5),
        ],
    )
    # when it runs until idle
    with kc_broker.run(consumer) as run:
        run.until_idle()
    assert audit.flush(10)
    recs = _records(kc_broker)
    # then: one record per attempt, keyed by the message key, with the outcome and the error
    assert audit.written == len(recs) == 23 and audit.failed == 0
    by_key: dict[str, list[dict[str, Any]]] = {}
    for r in recs:
        assert r["_key"] == r["key"].encode()
        by_key.setdefault(r["key"], []).append(r)
    assert [r["outcome"] for r in by_key["bad"]] == ["RETRY", "DEAD_LETTERED"]
    assert [r["attempt"] for r in by_key["bad"]] == [1, 2]
    assert all(
        r["error_type"] == "builtins.ValueError" and r["error"] == "no such account" for r in by_key["bad"]
    )
    assert by_key["bad"][0]["retry_in_s"] > 0
    assert [r["outcome"] for r in by_key["skip"]] == ["SKIP"]
    assert all(r["outcome"] == "SUCCESS" for k in ("k0", "k1", "k2", "k3") for r in by_key[k])
    # each key's records are in offset order (one partition of the audit topic per key)
    for k in ("k0", "k1", "k2", "k3"):
        assert [r["offset"] for r in by_key[k]] == sorted(r["offset"] for r in by_key[k])
    assert {r["group"] for r in recs} == {"billing"} and all(
        set(r) >= {"v", "time_ms", "instance"} for r in recs
    )
    audit.close()


class _Refusing:
    """A publisher that refuses every record (a topic that does not exist)."""

    delivery_timeout_s = 0.0

    def __init__(self) -> None:
        self.calls = 0

    def publish(
        self, topic: str, key: Any, value: Any, headers: Any = None, timeout_s: Any = None
    ) -> tuple[int, int]:
        raise PublishError("refused")

    def publish_many(self, records: Any) -> list[Any]:
        self.calls += 1
        return [PublishError(f"the record for {r[0]} was not delivered: UNKNOWN_TOPIC") for r in records]

    def close(self, timeout_s: float = 10.0) -> None:
        pass


def test_refused_records_are_counted_and_with_wait_the_message_fails(kc_broker: InMemoryBroker) -> None:
    kc_broker.create_topic("t", partitions=1)
    kc_broker.produce("t", "1", key="a")
    errors: list[BaseException] = []
    audit = Audit(publisher=_Refusing(), flush_interval_s=0.01, wait=True)
    consumer = kc_broker.consumer(
        name="g",
        handler=lambda m: None,
        topics=["t"],
        middlewares=[audit],
        error_handler=lambda e, m: errors.append(e),
    )
    with kc_broker.run(consumer) as run:
        run.until_idle()
    # the record was refused: counted, and (wait=True) the message's attempt failed with a PublishError
    assert audit.failed == 1 and audit.written == 0
    assert len(errors) == 1 and isinstance(errors[0], PublishError)
    audit.close()


def test_many_threads_append_and_every_record_is_published_once() -> None:
    broker = InMemoryBroker()
    broker.create_topic("keyedconsumer.audit", partitions=2)
    audit = Audit(publisher=broker.publisher(), flush_interval_s=0.005, max_batch=50, max_queue=100)
    msgs = []
    for i in range(2000):
        m = Message("t", 0, i, f"k{i % 10}".encode(), b"v")
        m.group_id = "g"
        msgs.append(m)

    def work(part: list[Message]) -> None:
        for m in part:
            audit.append(m, None, 0.001)

    threads = [threading.Thread(target=work, args=(msgs[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert audit.flush(30)
    offsets = sorted(json.loads(r.value or b"{}")["offset"] for r in broker.records("keyedconsumer.audit"))
    assert offsets == list(range(2000)) and audit.written == 2000
    audit.close()


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="flush_interval_s"):
        Audit(brokers=["x:1"], flush_interval_s=0)
    audit = Audit()  # construction alone is fine: a consumer binds it to its cluster
    with pytest.raises(ValueError, match=r"Audit\(\) has no brokers: use it in KeyedConsumer"):
        audit(lambda m: None)  # composed without a consumer
    audit.close()


def test_a_cancelled_run_is_recorded_cancelled_not_failed() -> None:
    # the engine cancelled the run (its event loop goes away): the message runs again, it did not fail
    import asyncio

    from keyedconsumer.middleware.logging import outcome_of

    from keyedconsumer import Message

    assert outcome_of(Message("t", 0, 1, b"k", b"v"), asyncio.CancelledError()) == "CANCELLED"
    assert outcome_of(Message("t", 0, 1, b"k", b"v"), RuntimeError("x")) == "FAIL"
