"""Connection settings written once (issue 16 §3), without a broker.

- the ``bind_settings`` middleware hook: called by ``KeyedConsumer`` on each middleware, outermost
  first, before the chain is composed;
- the rule of ``ConsumerConfig.connection_properties()``, and ``DeadLetter()`` building its
  producer from it (explicit ``brokers`` / ``producer_config`` win; unbound it fails clearly);
- librdkafka's callback properties in ``ConsumerConfig.config`` (accepted, refused, never shown or
  serialized), the engine's ``error_cb`` and the user's both called, and ``Metrics.stats_cb``.

The SASL/OAUTHBEARER runs on the real broker are in ``tests/integration/test_sasl.py``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import pytest
from confluent_kafka import KafkaError
from keyedconsumer.middleware import DeadLetter, Metrics
from pydantic import ValidationError

from keyedconsumer import ConsumerConfig, KafkaClientError, KeyedConsumer, Message
from keyedconsumer.config import CALLBACK_PROPERTIES, CONNECTION_PREFIXES, CONNECTION_PROPERTIES, redact
from keyedconsumer.consumer import compose
from keyedconsumer.kafka.client import connect
from keyedconsumer.testing import FakePublisher, InMemoryBroker

UNREACHABLE = "127.0.0.1:9"
PASSWORD = "Zr7-bind-Pa55"

SECURITY = {
    "security.protocol": "SASL_SSL",
    "sasl.mechanism": "SCRAM-SHA-512",
    "sasl.username": "u",
    "sasl.password": PASSWORD,
    "ssl.endpoint.identification.algorithm": "none",
    "enable.ssl.certificate.verification": False,
    "broker.address.family": "v4",
    "client.dns.lookup": "use_all_dns_ips",
}
CONSUMER_ONLY = {
    "session.timeout.ms": 6000,
    "fetch.min.bytes": 1,
    "fetch.max.bytes": 4194304,
    "max.poll.interval.ms": 60000,
    "auto.commit.interval.ms": 1000,
    "group.instance.id": "i-1",
    "isolation.level": "read_committed",
}
TUNING = {
    "client.id": "me",
    "statistics.interval.ms": 1000,
    "debug": "cgrp",
    "socket.timeout.ms": 30000,
    "message.max.bytes": 2000000,
}


def oauth_cb(config: str) -> tuple[str, float]:
    return "token", time.time() + 3600


def _settings(**config: Any) -> ConsumerConfig:
    return ConsumerConfig(name="n", brokers=["b1:9093", "b2:9093"], topics=["t"], config=config)


# -- the rule --------------------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_connection_properties_are_the_security_and_address_ones_only() -> None:
    # given a consumer's settings with security, consumer-only, tuning properties and callbacks
    logger = logging.getLogger("test.librdkafka")
    cfg = _settings(
        **SECURITY,
        **CONSUMER_ONLY,
        **TUNING,
        oauth_cb=oauth_cb,
        logger=logger,
        error_cb=lambda e: None,
        stats_cb=lambda s: None,
        throttle_cb=lambda t: None,
    )
    # then only the security and address properties, and oauth_cb and logger, are shared; the
    # password revealed (librdkafka must get it)
    assert cfg.connection_properties() == {**SECURITY, "oauth_cb": oauth_cb, "logger": logger}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.timeout(20)
def test_librdkafka_takes_every_shared_property_on_a_producer_and_none_of_the_consumer_ones() -> None:
    # librdkafka's own scope table (the C/P column of CONFIGURATION.md is generated from it) warns
    # "... is a consumer property and will be ignored by this producer instance" for a property
    # marked C: none of the rule's properties draws it, and the consumer-only ones left out do
    from confluent_kafka import Producer

    def consumer_property_warnings(conf: dict[str, Any]) -> list[str]:
        lines = _Lines()
        logger = logging.getLogger(f"test.librdkafka.{id(lines)}")
        logger.addHandler(lines)
        logger.setLevel(logging.DEBUG)
        logger.propagate = False
        producer = Producer({"bootstrap.servers": UNREACHABLE, **conf, "logger": logger})
        producer.poll(0.5)  # librdkafka's log lines reach the logger through the poll
        producer.flush(0)
        return [line for line in lines.lines if "is a consumer property" in line]

    # (the callbacks are confluent-kafka's, not in the table; debug would only add noise)
    tuning = {k: v for k, v in TUNING.items() if k != "debug"}
    cfg = _settings(
        **SECURITY,
        **CONSUMER_ONLY,
        **tuning,
        **{
            "https.ca.location": "probe",
            "enable.sasl.oauthbearer.unsecure.jwt": False,
            "sasl.oauthbearer.config": "scope=x",
        },
    )
    shared = cfg.connection_properties()
    assert {k for k in shared if k in CONNECTION_PROPERTIES or k.startswith(CONNECTION_PREFIXES)} == set(
        shared
    )
    assert len(shared) == len(SECURITY) + 3
    assert consumer_property_warnings(shared) == []
    left_out = {k: v for k, v in cfg.properties().items() if k not in shared}
    warned = consumer_property_warnings(left_out)
    assert {k for k in CONSUMER_ONLY if any(f"property {k} is" in w for w in warned)} == set(CONSUMER_ONLY), (
        warned
    )


# -- the bind hook ---------------------------------------------------------------------------------


class Recording:
    def __init__(self, name: str, events: list[tuple[str, str]]) -> None:
        self.name, self.events = name, events

    def bind_settings(self, settings: ConsumerConfig) -> None:
        self.events.append(("bind", self.name))
        self.settings = settings

    def __call__(self, handler: Any) -> Any:
        self.events.append(("wrap", self.name))
        return handler


@pytest.mark.timeout(10)
def test_keyed_consumer_binds_each_middleware_outermost_first_before_composing() -> None:
    events: list[tuple[str, str]] = []
    outer, inner = Recording("outer", events), Recording("inner", events)
    consumer = KeyedConsumer(
        handler=lambda m: None,
        middlewares=[outer, lambda h: h, inner],
        name="n",
        brokers=[UNREACHABLE],
        topics=["t"],
    )
    # then every hook ran, outermost first, before any middleware wrapped the handler
    assert events == [("bind", "outer"), ("bind", "inner"), ("wrap", "inner"), ("wrap", "outer")]
    assert outer.settings is consumer.config and inner.settings is consumer.config


class RecordingConnector:
    """A :class:`~keyedconsumer.kafka.Connector` that records each producer asked of it: the
    consumer's ``client_factory``, the seam its middleware get their producers from."""

    def __init__(self) -> None:
        self.built: list[tuple[list[str], dict[str, Any]]] = []

    def __call__(self, conf: dict[str, Any], on_error: Any) -> Any:
        raise AssertionError("these tests make no consumer client")

    def publisher(self, brokers: Any, config: Any, *, delivery_timeout_s: float) -> FakePublisher:
        self.built.append((list(brokers), dict(config)))
        return FakePublisher(InMemoryBroker())


@pytest.fixture
def connector() -> RecordingConnector:
    return RecordingConnector()


@pytest.mark.timeout(10)
def test_dead_letter_without_brokers_takes_the_consumers_brokers_and_connection_properties(
    connector: RecordingConnector,
) -> None:
    dl = DeadLetter()
    assert connector.built == []  # nothing is built before a consumer binds it
    KeyedConsumer(
        client_factory=connector,
        handler=lambda m: None,
        middlewares=[dl],
        name="n",
        brokers=["b1:9093", "b2:9093"],
        topics=["t"],
        config={**SECURITY, **CONSUMER_ONLY, **TUNING, "oauth_cb": oauth_cb},
    )
    assert connector.built == [(["b1:9093", "b2:9093"], {**SECURITY, "oauth_cb": oauth_cb})]


@pytest.mark.timeout(10)
def test_producer_config_wins_over_the_consumers_properties(
    connector: RecordingConnector,
) -> None:
    dl = DeadLetter(producer_config={"sasl.username": "dlq-writer", "sasl.password": "other", "linger.ms": 0})
    KeyedConsumer(
        client_factory=connector, handler=lambda m: None, middlewares=[dl], settings=_settings(**SECURITY)
    )
    assert connector.built == [
        (
            ["b1:9093", "b2:9093"],
            {**SECURITY, "sasl.username": "dlq-writer", "sasl.password": "other", "linger.ms": 0},
        )
    ]


@pytest.mark.timeout(10)
def test_explicit_brokers_take_nothing_from_the_consumer(
    connector: RecordingConnector,
) -> None:
    # another cluster gets none of this one's credentials
    dl = DeadLetter(brokers=["other:9092"], producer_config={"linger.ms": 1})
    KeyedConsumer(
        client_factory=connector, handler=lambda m: None, middlewares=[dl], settings=_settings(**SECURITY)
    )
    assert connector.built == [(["other:9092"], {"linger.ms": 1})]


@pytest.mark.timeout(10)
def test_an_explicit_publisher_is_kept(connector: RecordingConnector) -> None:
    publisher = FakePublisher(InMemoryBroker())
    dl = DeadLetter(publisher=publisher)
    KeyedConsumer(
        client_factory=connector, handler=lambda m: None, middlewares=[dl], settings=_settings(**SECURITY)
    )
    assert connector.built == [] and dl._source.current() is publisher


@pytest.mark.timeout(10)
def test_one_dead_letter_in_two_consumers_of_the_same_cluster_builds_one_producer(
    connector: RecordingConnector,
) -> None:
    dl = DeadLetter()
    KeyedConsumer(
        client_factory=connector, handler=lambda m: None, middlewares=[dl], settings=_settings(**SECURITY)
    )
    KeyedConsumer(
        client_factory=connector,
        handler=lambda m: None,
        middlewares=[dl],
        settings=_settings(**SECURITY, **CONSUMER_ONLY),
        name="other",
        topics=["u"],
    )
    assert len(connector.built) == 1
    # but not one of another cluster, or with other credentials
    with pytest.raises(ValueError, match="already bound to a consumer of other brokers"):
        KeyedConsumer(
            client_factory=connector,
            handler=lambda m: None,
            middlewares=[dl],
            settings=_settings(**{**SECURITY, "sasl.username": "v"}),
        )
    with pytest.raises(ValueError, match="already bound"):
        KeyedConsumer(
            client_factory=connector,
            handler=lambda m: None,
            middlewares=[dl],
            settings=_settings(**SECURITY),
            brokers=["c:9092"],
        )


@pytest.mark.timeout(10)
def test_an_unbound_dead_letter_without_brokers_fails_clearly_at_first_use() -> None:
    dl = DeadLetter()  # construction alone is fine: a consumer may bind it later
    with pytest.raises(ValueError, match=r"DeadLetter\(\) has no brokers: use it in KeyedConsumer"):
        compose(lambda m: None, [dl])
    with pytest.raises(ValueError, match="or pass brokers="):
        dl.publish(Message("t", 0, 1, b"k", b"v"), RuntimeError("x"))


@pytest.mark.timeout(10)
def test_the_consumers_password_reaches_the_real_dead_letter_producer() -> None:
    # librdkafka really gets the inherited properties: an unsupported mechanism makes the real
    # Publisher fail to build, when the consumer binds it
    from keyedconsumer import PublishError

    dl = DeadLetter(producer_config={"sasl.mechanism": "SCRAM-SHA-1024"})
    with pytest.raises(PublishError, match="SCRAM-SHA-1024") as info:
        KeyedConsumer(
            handler=lambda m: None,
            middlewares=[dl],
            name="n",
            brokers=[UNREACHABLE],
            topics=["t"],
            config=SECURITY,
        )
    assert PASSWORD not in str(info.value)
    dl = DeadLetter(timeout_s=1.0)  # the consumer's own properties build a producer
    KeyedConsumer(
        handler=lambda m: None,
        middlewares=[dl],
        name="n",
        brokers=[UNREACHABLE],
        topics=["t"],
        config=SECURITY,
    )
    assert dl._source.current() is not None


# -- callbacks in config ---------------------------------------------------------------------------


class TokenSource:
    """A token source whose repr would show its secret."""

    def __init__(self) -> None:
        self.secret = PASSWORD
        self.calls = 0

    def __repr__(self) -> str:
        return f"TokenSource(secret={self.secret!r})"

    def token(self, config: str) -> tuple[str, float]:
        self.calls += 1
        return "t", time.time() + 60


@pytest.mark.timeout(10)
def test_each_callback_property_takes_its_object_and_shows_only_its_name() -> None:
    source = TokenSource()
    logger = logging.getLogger("test.librdkafka")
    callbacks: dict[str, Any] = {
        "oauth_cb": source.token,
        "error_cb": print,
        "stats_cb": lambda s: None,
        "throttle_cb": lambda e: None,
        "logger": logger,
    }
    assert set(callbacks) == set(CALLBACK_PROPERTIES)
    cfg = _settings(**callbacks, **{"sasl.mechanism": "OAUTHBEARER", "security.protocol": "SASL_PLAINTEXT"})
    # the client gets the objects themselves
    conf = cfg.librdkafka()
    assert all(conf[k] is v for k, v in callbacks.items())
    # validation built a librdkafka client without them: oauth_cb was not called (no token fetched)
    assert source.calls == 0
    # shown and dumped by name only: no repr of the object (which holds a secret), JSON-serializable
    shown = [
        repr(cfg),
        str(cfg),
        cfg.model_dump_json(),
        json.dumps(cfg.model_dump(mode="json")),
        str(cfg.model_dump()),
        json.dumps(redact(cfg.config)),
    ]
    assert all(PASSWORD not in s and "0x" not in s for s in shown), shown
    assert all("<callable TokenSource.token>" in s for s in shown), shown
    assert all("<logger test.librdkafka>" in s for s in shown)
    # and kept through override()
    assert cfg.override(concurrency=2).librdkafka()["oauth_cb"] == source.token


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "config,needle",
    [
        ({"sasl.password": oauth_cb}, "'sasl.password' takes no callable"),
        ({"on_delivery": oauth_cb}, "'on_delivery' takes no callable"),
        ({"oauth_cb": "my_module.token"}, "'oauth_cb' takes a callable, got a str"),
        ({"error_cb": 3}, "'error_cb' takes a callable, got a int"),
        ({"logger": print}, "'logger' takes a logging.Logger"),
        ({"stats_cb": logging.getLogger("x")}, "'stats_cb' takes a callable, got a Logger"),
    ],
    ids=[
        "secret-property",
        "other-property",
        "string-for-oauth_cb",
        "number-for-error_cb",
        "function-for-logger",
        "logger-for-stats_cb",
    ],
)
def test_a_callable_where_none_is_taken_or_none_where_one_is_is_refused(
    config: dict[str, Any], needle: str
) -> None:
    with pytest.raises(ValidationError) as info:
        _settings(**config)
    assert [e["loc"][0] for e in info.value.errors()] == ["config"]
    assert needle in str(info.value)


@pytest.mark.timeout(10)
def test_a_callback_from_the_environment_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEYEDCONSUMER_CONFIG", json.dumps({"oauth_cb": "pkg.mod:token"}))
    with pytest.raises(ValidationError, match="'oauth_cb' takes a callable"):
        ConsumerConfig(name="n", topics=["t"])


# -- error_cb: the engine's and the user's ----------------------------------------------------------


@pytest.mark.timeout(20)
def test_the_engines_error_cb_and_the_users_both_run(caplog: pytest.LogCaptureFixture) -> None:
    # given the real client on an address where nothing answers, with a user error_cb that raises
    engine: list[KafkaClientError] = []
    user: list[KafkaError] = []
    got = threading.Event()

    def user_cb(err: KafkaError) -> None:
        user.append(err)
        got.set()
        raise RuntimeError("user callback failed")

    cfg = ConsumerConfig(
        name="n",
        brokers=[UNREACHABLE],
        topics=["t"],
        config={"error_cb": user_cb, "log_level": 0, "reconnect.backoff.ms": 10},
    )
    client = connect(cfg.librdkafka(), engine.append)
    try:
        # when librdkafka reports the unreachable broker (served by the poll)
        deadline = time.monotonic() + 15
        while not got.is_set() and time.monotonic() < deadline:
            client.poll_batch(10, 0.2)
        # then both callbacks got it, and the user's exception was logged, not raised
        assert user and engine, (user, engine)
        assert engine[0].code == user[0].name()
        assert "the error_cb given in config raised" in caplog.text
    finally:
        client.close(timeout_s=5)


# -- stats_cb -> Metrics -----------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_metrics_serve_the_figures_of_librdkafka_statistics() -> None:
    metrics = Metrics()
    report = {
        "name": "rdkafka#consumer-1",
        "type": "consumer",
        "replyq": 3,
        "rxmsgs": 120,
        "rxmsg_bytes": 4096,
        "cgrp": {"rebalance_cnt": 2},
        "brokers": {
            "b:9092/1": {"nodeid": 1, "nodename": "b:9092", "rtt": {"avg": 2500}},
            "GroupCoordinator": {"nodeid": -1, "nodename": "", "rtt": {"avg": 0}},
        },
        "topics": {
            "orders": {
                "partitions": {
                    "0": {"consumer_lag": 7},
                    "1": {"consumer_lag": -1},
                    "-1": {"consumer_lag": -1},
                }
            }
        },
    }
    metrics.stats_cb(json.dumps(report))
    metrics.stats_cb("not json")  # ignored
    values = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for m in metrics.registry.collect()
        for s in m.samples
        if "librdkafka" in s.name
    }
    client = ("client", "rdkafka#consumer-1")
    assert values == {
        ("keyedconsumer_librdkafka_replyq", (client,)): 3.0,
        ("keyedconsumer_librdkafka_rx_messages_total", (client,)): 120.0,
        ("keyedconsumer_librdkafka_rx_bytes_total", (client,)): 4096.0,
        ("keyedconsumer_librdkafka_rebalances_total", (client,)): 2.0,
        ("keyedconsumer_librdkafka_broker_rtt_seconds", (("broker", "b:9092"), client)): 0.0025,
        (
            "keyedconsumer_librdkafka_consumer_lag",
            (client, ("messaging_destination_name", "orders"), ("messaging_destination_partition_id", "0")),
        ): 7.0,
    }
    # and it is a callback the config takes
    assert _settings(stats_cb=metrics.stats_cb).librdkafka()["stats_cb"] == metrics.stats_cb
