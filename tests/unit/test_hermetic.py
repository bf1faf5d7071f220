"""In-memory app tests are hermetic: every producer an app makes writes into the in-memory broker,
and anything that would reach a network address during such a run fails the run, naming what tried.

The producers come from one seam, the consumer's client factory (``InMemoryBroker.client_factory``
is a :class:`keyedconsumer.kafka.Connector`); nothing is patched.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from keyedconsumer.middleware import Audit, DeadLetter, Retry

from keyedconsumer import KeyedApp, KeyedConsumer, Message, Publisher, PublishError, RedisSequencer
from keyedconsumer.testing import FakePublisher, InMemoryBroker, NetworkRefusedError

# an address nothing listens on: a test that reached it would hang or fail on a timeout, not pass
NOWHERE = "127.0.0.1:9"

pytestmark = pytest.mark.timeout(60)


def _app(audit: Audit) -> KeyedApp:
    """A service as a user writes it: no broker given anywhere but the app's (which a test never
    reaches), dead letters and an audit trail bound to the app's cluster, results produced."""
    app = KeyedApp(brokers=[NOWHERE], group_id="orders-svc")

    @app.handler("orders", middlewares=[audit, DeadLetter(), Retry(max_attempts=2, initial_delay_s=5.0)])
    def order(msg: Message) -> None:
        if msg.value == b"bad":
            raise ValueError("bad order")
        msg.produce("orders.accepted", msg.key, msg.value)

    @app.handler("refunds", middlewares=[DeadLetter(brokers=["other-cluster:9092"])], transactional=True)
    def refund(msg: Message) -> None:
        if msg.value == b"bad":
            raise ValueError("bad refund")
        msg.produce("refunds.done", msg.key, msg.value)

    return app


def test_every_producer_of_an_app_writes_into_the_in_memory_broker(kc_broker: InMemoryBroker) -> None:
    # given an app with dead letters (the app's cluster, and another cluster), an audit trail,
    # results and exactly-once results
    audit = Audit(topic="orders.audit", flush_interval_s=0.01, wait=True)
    app = _app(audit)
    kc_broker.create_topic("orders", partitions=2)
    kc_broker.create_topic("refunds", partitions=2)
    # when it runs on the in-memory broker
    with kc_broker.run_app(app) as run:
        kc_broker.produce("orders", "ok", key="o1")
        kc_broker.produce("orders", "bad", key="o2")
        kc_broker.produce("refunds", "ok", key="r1")
        kc_broker.produce("refunds", "bad", key="r2")
        run.until_idle()
    # then every record it produced is in the broker's topics, readable by the test
    assert [(r.key, r.value) for r in kc_broker.records("orders.dlq")] == [(b"o2", b"bad")]
    assert [(r.key, r.value) for r in kc_broker.records("refunds.dlq")] == [(b"r2", b"bad")]
    assert [r.value for r in kc_broker.records("orders.accepted")] == [b"ok"]
    assert [r.value for r in kc_broker.records("refunds.done")] == [b"ok"]
    outcomes = sorted(json.loads(r.value or b"{}")["outcome"] for r in kc_broker.records("orders.audit"))
    assert outcomes == ["DEAD_LETTERED", "RETRY", "SUCCESS"]
    audit.close()


def test_a_consumer_built_with_the_broker_gives_its_middleware_the_broker_s_producers() -> None:
    # given one DeadLetter(), bound first by a consumer on the in-memory broker
    broker = InMemoryBroker()
    dl = DeadLetter(timeout_s=1.0)
    KeyedConsumer(
        client_factory=broker.client_factory, handler=lambda m: None, middlewares=[dl], name="a", topics=["t"]
    )
    assert isinstance(dl._source.current(), FakePublisher)
    # when a consumer of a real cluster binds it later (the same app run on Kafka after its test)
    KeyedConsumer(handler=lambda m: None, middlewares=[dl], name="a", brokers=[NOWHERE], topics=["t"])
    # then it builds a real producer for that cluster
    assert isinstance(dl._source.current(), Publisher)


class _OwnProducer:
    """A middleware that publishes with a producer the application built itself, before the run."""

    def __init__(self, swallow: bool) -> None:
        self.publisher = Publisher([NOWHERE], delivery_timeout_s=1.0)
        self.swallow = swallow

    def __call__(self, handler: Any) -> Any:
        def run(msg: Message) -> None:
            handler(msg)
            try:
                self.publisher.publish("copies", msg.key, msg.value)
            except (NetworkRefusedError, PublishError):
                if not self.swallow:
                    raise

        return run


@pytest.mark.parametrize("swallow", [False, True], ids=["raised", "swallowed"])
def test_a_producer_built_outside_the_seam_fails_the_run_naming_what_tried(swallow: bool) -> None:
    # given an app whose middleware uses its own producer, built before the run (it may even
    # swallow the error)
    broker = InMemoryBroker()
    broker.create_topic("orders")
    app = KeyedApp(group_id="g")
    app.handler("orders", middlewares=[_OwnProducer(swallow)])(lambda m: None)
    broker.produce("orders", "1", key="k")
    # when it runs on the in-memory broker, then the run fails with the refusal, naming the
    # producer and the address it tried
    with pytest.raises(
        NetworkRefusedError, match=r"a Kafka producer \(keyedconsumer\.Publisher.*127\.0\.0\.1:9"
    ):
        with broker.run_app(app) as run:
            run.until_idle(timeout_s=10)
    # and the refusal ends with the run: the same producer may publish (and fail on its own) after it
    assert not _hermetic_active()


def _hermetic_active() -> bool:
    from keyedconsumer import hermetic

    return hermetic.active()


def test_a_redis_sequencer_under_the_in_memory_broker_is_refused() -> None:
    # given a route with a Redis sequencer (a real network address)
    broker = InMemoryBroker()
    broker.create_topic("orders")
    app = KeyedApp(group_id="g")
    app.handler("orders", sequencer=lambda: RedisSequencer("redis://:secret@127.0.0.1:6379/0", "ns"))(
        lambda m: None
    )
    # when it runs on the in-memory broker, then the run fails naming Redis and its address,
    # not the password
    with pytest.raises(
        NetworkRefusedError,
        match=r"a Redis client \(RedisSequencer\) tried to reach redis://127\.0\.0\.1:6379",
    ) as info:
        with broker.run_app(app) as run:
            run.until_idle(timeout_s=10)
    assert "secret" not in str(info.value)


def test_a_consumer_on_the_real_client_is_refused_by_a_run() -> None:
    broker = InMemoryBroker()
    with pytest.raises(ValueError, match="uses the real Kafka client"):
        broker.run(KeyedConsumer(handler=lambda m: None, name="n", brokers=[NOWHERE], topics=["t"]))
    assert not _hermetic_active()


PLUGIN_TESTS = """
from keyedconsumer import KeyedConsumer, Publisher
from keyedconsumer.testing import InMemoryBroker


def test_a_test_with_kc_broker_that_builds_a_producer_fails(kc_broker):
    try:
        Publisher(["127.0.0.1:9"])
    except Exception:
        pass  # swallowed: the test fails all the same, at its end


def test_a_leaked_run(kc_broker):
    broker = InMemoryBroker()
    broker.run(broker.consumer(name="leaked", handler=lambda m: None, topics=["t"]))  # never stopped


def test_a_later_test_without_kc_broker_may_use_the_network():
    Publisher(["127.0.0.1:9"], delivery_timeout_s=1.0).close(0)
"""


def test_the_pytest_plugin_makes_a_test_with_kc_broker_hermetic(tmp_path: Path) -> None:
    # given a test file using the plugin's kc_broker fixture
    (tmp_path / "test_user.py").write_text(textwrap.dedent(PLUGIN_TESTS))
    # when pytest runs it
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-q",
            "-rA",
            "-W",
            "always",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=50,
        cwd=tmp_path,
    )
    text = out.stdout + out.stderr
    # then the test that built a producer fails, naming it, although it swallowed the error
    assert "ERROR test_user.py::test_a_test_with_kc_broker_that_builds_a_producer_fails" in text, text
    assert "a Kafka producer (keyedconsumer.Publisher" in text and "127.0.0.1:9" in text
    # a run left running stops being hermetic with its test (with a warning), so a later test may
    # reach the network
    assert "InMemoryBroker.run(leaked) was still running at the end of the test" in text, text
    assert "PASSED test_user.py::test_a_later_test_without_kc_broker_may_use_the_network" in text, text
