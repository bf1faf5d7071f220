"""Conflation (latest value per key) on the in-memory broker: while a key's head runs, only the
newest waiting message of the key stays; the replaced ones count done, never run, are reported."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pydantic
import pytest

from keyedconsumer import ConsumerConfig, Message
from keyedconsumer.testing import InMemoryBroker

pytestmark = pytest.mark.timeout(60)


def _wait(condition: Callable[[], bool], timeout_s: float = 20.0) -> None:
    """Wait in a handler (the test's ``run`` may not be bound yet when the first message runs)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition did not come true"
        time.sleep(0.001)


def test_only_the_newest_waiting_message_of_a_key_runs_and_the_rest_count_done(
    kc_broker: InMemoryBroker,
) -> None:
    # given key "a" with 10 messages and key "b" with 3, on one partition
    kc_broker.create_topic("prices", partitions=1)
    for i in range(10):
        kc_broker.produce("prices", f"a{i}", key="a")
    for i in range(3):
        kc_broker.produce("prices", f"b{i}", key="b")
    ran: list[bytes] = []
    reported: list[bytes] = []
    lock = threading.Lock()
    consumer_box: list[object] = []

    def handle(msg: Message) -> None:
        if msg.value in (b"a0", b"b0"):  # each key's first message runs until the rest were admitted
            _wait(lambda: consumer_box[0].conflated == 8 + 1)  # type: ignore[attr-defined]
        with lock:
            ran.append(msg.value or b"")

    consumer = kc_broker.consumer(
        name="sync",
        handler=handle,
        topics=["prices"],
        concurrency=4,
        conflate=True,
        on_conflated=lambda m: reported.append(m.value or b""),
    )
    consumer_box.append(consumer)
    # when it runs until idle
    with kc_broker.run(consumer) as run:
        run.until_idle()
    # then each key ran its first message (the head) and its newest, in order; the others were
    # conflated: reported, counted, and their offsets committed
    assert [v for v in ran if v.startswith(b"a")] == [b"a0", b"a9"]
    assert [v for v in ran if v.startswith(b"b")] == [b"b0", b"b2"]
    assert sorted(reported) == sorted([f"a{i}".encode() for i in range(1, 9)] + [b"b1"])
    assert consumer.conflated == 9
    assert kc_broker.committed("sync") == {("prices", 0): 13}


def test_without_conflate_every_message_runs(kc_broker: InMemoryBroker) -> None:
    kc_broker.create_topic("prices", partitions=1)
    for i in range(10):
        kc_broker.produce("prices", f"a{i}", key="a")
    ran: list[bytes] = []
    consumer = kc_broker.consumer(name="all", handler=lambda m: ran.append(m.value or b""), topics=["prices"])
    with kc_broker.run(consumer) as run:
        run.until_idle()
    assert ran == [f"a{i}".encode() for i in range(10)] and consumer.conflated == 0


def test_conflate_needs_an_ordering() -> None:
    with pytest.raises(pydantic.ValidationError, match="conflate"):
        ConsumerConfig(name="x", topics=["t"], conflate=True, ordering="none")
    with pytest.raises(pydantic.ValidationError, match="conflate"):
        ConsumerConfig(name="x", topics=["t"], conflate=1)


def test_conflated_messages_reach_the_audit_trail(kc_broker: InMemoryBroker) -> None:
    import json

    from keyedconsumer.middleware import Audit

    kc_broker.create_topic("prices", partitions=1)
    kc_broker.create_topic("keyedconsumer.audit", partitions=1)
    for i in range(5):
        kc_broker.produce("prices", f"a{i}", key="a")
    audit = Audit(publisher=kc_broker.publisher(), flush_interval_s=0.01)
    box: list[object] = []

    def handle(msg: Message) -> None:
        if msg.value == b"a0":
            _wait(lambda: box[0].conflated == 3)  # type: ignore[attr-defined]

    consumer = kc_broker.consumer(
        name="g",
        handler=handle,
        topics=["prices"],
        conflate=True,
        middlewares=[audit],
        on_conflated=audit.conflated,
    )
    box.append(consumer)
    with kc_broker.run(consumer) as run:
        run.until_idle()
    assert audit.flush(10)
    outcomes = sorted(
        (json.loads(r.value or b"{}")["offset"], json.loads(r.value or b"{}")["outcome"])
        for r in kc_broker.records("keyedconsumer.audit")
    )
    assert outcomes == [(0, "SUCCESS"), (1, "CONFLATED"), (2, "CONFLATED"), (3, "CONFLATED"), (4, "SUCCESS")]
    audit.close()
