"""Bad options fail at construction with a pydantic error naming the field."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from keyedconsumer import ConsumerConfig, KeyedConsumer


def handler(msg: object) -> None:
    pass


def fields(exc: ValidationError) -> set[str]:
    return {str(e["loc"][0]) for e in exc.errors()}


@pytest.mark.parametrize(
    "field,value",
    [
        ("concurrency", 0),
        ("concurrency", -3),
        ("concurrency", True),  # a boolean where an integer belongs
        ("max_in_flight", 0),
        ("max_in_flight", False),
        ("ordering", "random"),
        ("manual_commit", 1),  # an integer where a boolean belongs
        ("shutdown_timeout_s", math.nan),
        ("poll_timeout_s", math.inf),
        ("topics", []),
        ("name", ""),
        ("no_such_option", 1),
    ],
)
def test_bad_value_names_the_field(field: str, value: object) -> None:
    opts: dict[str, object] = {"name": "n", "topics": ["t"], field: value}
    with pytest.raises(ValidationError) as info:
        KeyedConsumer(handler=handler, **opts)
    assert field in fields(info.value)


@pytest.mark.parametrize(
    "prop", ["enable.auto.offset.store", "group.id", "bootstrap.servers", "enable.auto.commit"]
)
def test_owned_librdkafka_properties_are_refused(prop: str) -> None:
    with pytest.raises(ValidationError) as info:
        ConsumerConfig(name="n", topics=["t"], config={prop: "x"})
    assert "config" in fields(info.value) and prop in str(info.value)


def test_defaults_and_librdkafka_dict() -> None:
    cfg = ConsumerConfig(name="orders", topics=["orders"])
    assert cfg.group == "orders" and cfg.concurrency == 1 and cfg.ordering == "key"
    conf = cfg.librdkafka()
    assert conf["enable.auto.offset.store"] is False
    assert conf["enable.auto.commit"] is True
    assert conf["partition.assignment.strategy"] == "cooperative-sticky"
    manual = ConsumerConfig(name="o", topics=["o"], manual_commit=True, config={"group.protocol": "consumer"})
    conf = manual.librdkafka()
    assert conf["enable.auto.commit"] is False
    assert "partition.assignment.strategy" not in conf  # KIP-848 rejects client-side assignors


def test_each_consumer_has_a_client_id_naming_it_unless_config_gives_one() -> None:
    # librdkafka's default is "rdkafka" for every client: a KeyedApp's routes (unique names) would
    # be indistinguishable members of their group (tests/integration/test_app_members.py)
    a, b = (ConsumerConfig(name=n, group_id="billing", topics=["t"]) for n in ("payments", "refunds"))
    assert (a.librdkafka()["client.id"], b.librdkafka()["client.id"]) == (
        "keyedconsumer-payments",
        "keyedconsumer-refunds",
    )
    mine = ConsumerConfig(name="payments", topics=["t"], config={"client.id": "billing-svc"})
    assert mine.librdkafka()["client.id"] == "billing-svc"


def test_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEYEDCONSUMER_NAME", "from-env")
    monkeypatch.setenv("KEYEDCONSUMER_TOPICS", "a,b")
    monkeypatch.setenv("KEYEDCONSUMER_CONCURRENCY", "16")
    monkeypatch.setenv("KEYEDCONSUMER_BROKERS", '["h1:9092", "h2:9092"]')
    cfg = ConsumerConfig()
    assert (cfg.name, cfg.topics, cfg.concurrency, cfg.brokers) == (
        "from-env",
        ["a", "b"],
        16,
        ["h1:9092", "h2:9092"],
    )
    assert ConsumerConfig(concurrency=2).concurrency == 2  # keyword arguments win


def test_secrets_never_in_repr() -> None:
    cfg = ConsumerConfig(name="n", topics=["t"], config={"sasl.password": "hunter2", "sasl.username": "u"})
    assert "hunter2" not in repr(cfg) and "hunter2" not in str(cfg)


def test_handler_must_be_callable() -> None:
    with pytest.raises(TypeError):
        KeyedConsumer(handler="nope", name="n", topics=["t"])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "config,needle",
    [({"no.such.property": 1}, "no.such.property"), ({"session.timeout.ms": "abc"}, "session.timeout.ms")],
)
def test_librdkafka_rejects_unknown_property_at_construction(config: dict[str, object], needle: str) -> None:
    with pytest.raises(ValidationError) as info:
        ConsumerConfig(name="n", topics=["t"], config=config)
    assert "config" in fields(info.value) and needle in str(info.value)


def test_secrets_never_in_validation_errors() -> None:
    with pytest.raises(ValidationError) as info:
        ConsumerConfig(name="n", topics=["t"], config={"sasl.password": "hunter2", "no.such": 1})
    assert "hunter2" not in str(info.value)


# -- group protocols (issue 7 §4) -------------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["classic", "consumer", "CONSUMER"])
def test_librdkafka_accepts_the_engine_dict_under_both_protocols(protocol: str) -> None:
    from keyedconsumer.kafka.properties import check_config

    cfg = ConsumerConfig(name="n", topics=["t"], config={"group.protocol": protocol})
    conf = cfg.librdkafka()
    check_config(conf)  # raises ValueError with librdkafka's message if an option is rejected
    assert ("partition.assignment.strategy" in conf) is (protocol == "classic")


@pytest.mark.parametrize(
    "prop,value",
    [
        ("session.timeout.ms", 30000),
        ("heartbeat.interval.ms", 3000),
        ("partition.assignment.strategy", "range"),
    ],
)
def test_options_the_consumer_protocol_rejects_fail_at_construction(prop: str, value: object) -> None:
    ConsumerConfig(name="n", topics=["t"], config={prop: value})  # fine under the classic protocol
    with pytest.raises(ValidationError) as info:
        ConsumerConfig(name="n", topics=["t"], config={"group.protocol": "consumer", prop: value})
    assert "config" in fields(info.value) and prop in str(info.value)


# -- settings= and keyword options together (issue 12 §8) ------------------------------------------


def test_keyword_options_override_the_settings_object() -> None:
    # given a settings object and, next to it, keyword options
    cfg = ConsumerConfig(name="orders", topics=["orders"], concurrency=4, max_in_flight=100)
    consumer = KeyedConsumer(handler=handler, settings=cfg, concurrency=64, ordering="partition")
    # then the keywords win, the rest comes from the settings object, which is left unchanged
    got = consumer.config
    assert (got.concurrency, got.ordering, got.max_in_flight, got.name, got.topics) == (
        64,
        "partition",
        100,
        "orders",
        ["orders"],
    )
    assert (cfg.concurrency, cfg.ordering) == (4, "key")


@pytest.mark.parametrize("field,value", [("concurrency", 0), ("ordering", "random"), ("no_such_option", 1)])
def test_keyword_options_next_to_settings_are_validated_again(field: str, value: object) -> None:
    cfg = ConsumerConfig(name="orders", topics=["orders"])
    with pytest.raises(ValidationError) as info:
        KeyedConsumer(handler=handler, settings=cfg, **{field: value})
    assert fields(info.value) == {field}


def test_a_new_name_next_to_settings_moves_the_group_only_when_the_group_followed_the_name() -> None:
    follows = ConsumerConfig(name="a", topics=["t"])
    assert KeyedConsumer(handler=handler, settings=follows, name="b").config.group == "b"
    pinned = ConsumerConfig(name="a", group_id="g", topics=["t"])
    assert KeyedConsumer(handler=handler, settings=pinned, name="b").config.group == "g"
    same = ConsumerConfig(name="a", group_id="a", topics=["t"])  # given explicitly, even if equal to the name
    assert KeyedConsumer(handler=handler, settings=same, name="b").config.group == "a"
