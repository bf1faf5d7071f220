"""Unit-testing a handler and its middleware with keyedconsumer.testing: no Kafka, milliseconds.

    pytest examples/unit_test_example.py

The in-memory broker runs the real engine against a fake Kafka client: partitions, offsets,
commits, rebalances, and a fake clock, so Retry's back-off of minutes takes no real time.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable

import pytest
from keyedconsumer.middleware import DeadLetter, Retry, Typed
from pydantic import BaseModel

from keyedconsumer import Message, Middleware
from keyedconsumer.testing import InMemoryBroker

# -- the application code under test -----------------------------------------------------------------


class Payment(BaseModel):
    account: str
    cents: int


class Ledger:
    """Balances per account; a payment to a frozen account fails (and is retried, then dead-lettered)."""

    def __init__(self, frozen: Iterable[str] = ()) -> None:
        self.balances: dict[str, int] = {}
        self.frozen = set(frozen)
        self.lock = threading.Lock()

    def handle(self, msg: Message) -> None:
        payment: Payment = msg.payload
        if payment.account in self.frozen:
            raise RuntimeError(f"account {payment.account} is frozen")
        with self.lock:
            self.balances[payment.account] = self.balances.get(payment.account, 0) + payment.cents


def middlewares(broker: InMemoryBroker) -> list[Middleware]:
    return [
        DeadLetter(publisher=broker.publisher()),  # final failures -> "payments.dlq"
        Retry(max_attempts=3, initial_delay_s=60.0),  # minutes of back-off, in fake time
        Typed(Payment),
    ]


def pay(broker: InMemoryBroker, account: str, cents: int) -> None:
    broker.produce("payments", json.dumps({"account": account, "cents": cents}), key=account)


# -- the tests -----------------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_payments_are_booked_and_committed_and_failures_dead_lettered() -> None:
    # given three payments, one to a frozen account, and one record that is not JSON
    broker = InMemoryBroker()
    broker.create_topic("payments", partitions=3)
    pay(broker, "alice", 100)
    pay(broker, "bob", 250)
    pay(broker, "mallory", 999)
    broker.produce("payments", b"\x00 not json", key="alice")
    ledger = Ledger(frozen={"mallory"})
    consumer = broker.consumer(
        name="ledger",
        handler=ledger.handle,
        topics=["payments"],
        middlewares=middlewares(broker),
        concurrency=4,
    )

    # when the consumer runs until every record is committed
    with broker.run(consumer) as run:
        run.until_idle(timeout_s=5)

    # then the good payments are booked, every offset is committed ...
    assert ledger.balances == {"alice": 100, "bob": 250}
    assert set(broker.lag("ledger", "payments").values()) == {0}
    # ... and the two bad records are in the dead-letter topic, with the reason
    dead = {r.key: r for r in broker.records("payments.dlq")}
    assert (
        dead[b"mallory"].header("kafka_dlt-attempts") == b"3"
    )  # retried after about 60 s and 120 s of fake time
    assert dead[b"mallory"].header("kafka_dlt-exception-message") == b"account mallory is frozen"
    assert dead[b"alice"].header("kafka_dlt-exception-fqcn") == b"keyedconsumer.middleware.typed.DecodeError"


@pytest.mark.timeout(30)
def test_a_rebalance_in_the_middle_loses_no_payment() -> None:
    # given two instances of the service in one consumer group
    broker = InMemoryBroker()
    broker.create_topic("payments", partitions=4)
    ledger = Ledger()
    first = broker.consumer(
        name="ledger-1",
        group_id="ledger",
        handler=ledger.handle,
        topics=["payments"],
        middlewares=middlewares(broker),
    )
    second = broker.consumer(
        name="ledger-2",
        group_id="ledger",
        handler=ledger.handle,
        topics=["payments"],
        middlewares=middlewares(broker),
    )
    with broker.run(first, second) as run:
        for i in range(100):
            pay(broker, f"acct-{i % 10}", 1)
        # when the group rebalances mid-run (every partition moves to the other instance)
        run.wait_for(lambda: broker.delivered("ledger") > 0, what="the first delivery")
        broker.rebalance("ledger")
        run.until_idle(timeout_s=10)

    # then every payment is committed; a payment may run twice after a rebalance (at-least-once),
    # never zero times
    assert set(broker.lag("ledger", "payments").values()) == {0}
    assert all(balance >= 10 for balance in ledger.balances.values()) and len(ledger.balances) == 10
