"""SASL/SSL settings pass through to librdkafka unchanged, and the SASL password shows nowhere.

No SASL broker is needed: librdkafka checks the properties when a client is built (an unknown
mechanism, or an ``ssl.ca.location`` that holds no certificate, fails there), so building the
clients proves that every property reached it. The CA file is a real PEM certificate made here
with the ``openssl`` command line.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer
from keyedconsumer.middleware import DeadLetter
from pydantic import ValidationError

from keyedconsumer import ConsumerConfig, KeyedConsumer, PublishError

PASSWORD = "Qx9v-scram-Pa55"  # distinctive, so a leak is found by a substring search
UNREACHABLE = "127.0.0.1:9"  # nothing answers: building a client contacts no real broker


@pytest.fixture
def ca_pem(tmp_path: Path) -> Path:
    """A self-signed CA certificate in PEM (what ``ssl.ca.location`` names)."""
    assert shutil.which("openssl"), "the openssl command line is needed to make the test CA"
    out = subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(tmp_path / "ca.key"),
            "-out",
            str(tmp_path / "ca.pem"),
            "-days",
            "2",
            "-subj",
            "/CN=test CA",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "ca.pem").read_text().startswith("-----BEGIN CERTIFICATE-----")
    return tmp_path / "ca.pem"


@pytest.fixture
def props(ca_pem: Path) -> dict[str, Any]:
    return {
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "u",
        "sasl.password": PASSWORD,
        "ssl.ca.location": str(ca_pem),
    }


@pytest.mark.timeout(10)
def test_every_security_property_reaches_librdkafka(props: dict[str, Any]) -> None:
    cfg = ConsumerConfig(name="n", brokers=[UNREACHABLE], topics=["t"], config=props)
    conf = cfg.librdkafka()
    assert {k: conf.get(k) for k in props} == props  # unchanged, the password included
    assert conf["bootstrap.servers"] == UNREACHABLE and conf["enable.auto.offset.store"] is False
    Consumer({**conf, "log_level": 0}).close()  # librdkafka takes the whole dict (SCRAM, the CA file)


@pytest.mark.timeout(10)
def test_the_same_properties_from_the_environment(
    props: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    monkeypatch.setenv("KEYEDCONSUMER_CONFIG", json.dumps(props))
    cfg = ConsumerConfig(name="n", topics=["t"])
    assert {k: cfg.librdkafka().get(k) for k in props} == props
    assert PASSWORD not in repr(cfg) and PASSWORD not in str(cfg)


@pytest.mark.timeout(10)
def test_password_in_no_repr_or_str(props: dict[str, Any]) -> None:
    cfg = ConsumerConfig(name="n", brokers=[UNREACHABLE], topics=["t"], config=props)
    consumer = KeyedConsumer(
        handler=lambda m: None, name="n", brokers=[UNREACHABLE], topics=["t"], config=props
    )
    shown = [
        repr(cfg),
        str(cfg),
        f"{cfg}",
        f"{cfg!r}",
        repr(consumer.config),
        str(consumer.config),
        repr(consumer),
    ]
    assert all(PASSWORD not in s for s in shown), [s for s in shown if PASSWORD in s]
    # only the secret is hidden: the rest stays readable
    assert "'sasl.password': '***'" in repr(cfg)
    assert "SCRAM-SHA-512" in repr(cfg) and "'sasl.username': 'u'" in repr(cfg)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "change,field,needle",
    [
        ({"no.such.property": 1}, "config", "no.such.property"),
        ({"sasl.mechanism": "SCRAM-SHA-1024"}, "config", "SCRAM-SHA-1024"),  # librdkafka: unsupported
        ({"ssl.ca.location": "NOT-PEM"}, "config", "ssl.ca.location"),  # a file without a certificate
        ({"group.id": "g"}, "config", "group.id"),  # owned by the engine
        ({}, "concurrency", "greater than or equal to 1"),  # another field fails next to the secret
    ],
    ids=["unknown-property", "bad-mechanism", "not-a-pem", "owned-property", "other-field"],
)
def test_password_in_no_validation_error(
    props: dict[str, Any], tmp_path: Path, change: dict[str, Any], field: str, needle: str
) -> None:
    if change.get("ssl.ca.location") == "NOT-PEM":
        (tmp_path / "not.pem").write_text("not a certificate\n")
        change = {"ssl.ca.location": str(tmp_path / "not.pem")}
    bad = {"sasl.password": PASSWORD, **props, **change}  # first: pydantic cuts long inputs short in str()
    concurrency = 0 if field == "concurrency" else 1
    with pytest.raises(ValidationError) as info:
        ConsumerConfig(name="n", brokers=[UNREACHABLE], topics=["t"], concurrency=concurrency, config=bad)
    err = info.value
    assert {str(e["loc"][0]) for e in err.errors()} == {field}
    assert needle in str(err)  # the error says what is wrong...
    # ...and never shows the password: pydantic would cut a long input short ("{'sasl.password': 'Qx9v-...")
    # so look for its start too, and for any input at all
    for text in (str(err), repr(err)):
        assert PASSWORD[:5] not in text and "input_value" not in text, text
    assert all(PASSWORD not in f"{e['loc']} {e['msg']} {e.get('ctx', '')}" for e in err.errors())
    assert PASSWORD not in str(err.errors(include_input=False))


@pytest.mark.timeout(10)
def test_dead_letter_producer_takes_the_same_properties(props: dict[str, Any]) -> None:
    # (the producer is built when the middleware is first composed without a consumer)
    dl = DeadLetter(brokers=[UNREACHABLE], producer_config=props, timeout_s=1.0)
    dl(lambda m: None)
    assert dl.published == 0
    del dl  # its producer only tries to reach 127.0.0.1:9 (librdkafka logs FAIL lines on stderr)
    # librdkafka really got them: the same properties with an unsupported mechanism are refused
    with pytest.raises(PublishError, match="SCRAM-SHA-1024") as info:
        DeadLetter(brokers=[UNREACHABLE], producer_config={**props, "sasl.mechanism": "SCRAM-SHA-1024"})(
            lambda m: None
        )
    assert PASSWORD not in str(info.value) and PASSWORD not in repr(info.value)


# -- no public surface shows a secret (issue 12 §8): ConsumerConfig and RedisSequencerConfig ---------


def surfaces_of_an_error(err: ValidationError) -> list[str]:
    """Every way a ValidationError is shown or read: ``errors()`` carries each input unless hidden."""
    return [
        str(err),
        repr(err),
        err.json(),
        str(err.errors()),
        repr(err.errors()),
        str(err.errors(include_input=False)),
        json.dumps(err.errors(), default=str),
    ]


def surfaces_of_a_model(model: Any) -> list[str]:
    return [
        repr(model),
        str(model),
        f"{model}",
        str(model.model_dump()),
        repr(model.model_dump()),
        model.model_dump_json(),
        json.dumps(model.model_dump(mode="json")),
        repr(model.__dict__),
    ]


@pytest.mark.timeout(10)
def test_password_on_no_surface_of_the_config_and_the_client_still_gets_it(props: dict[str, Any]) -> None:
    # given a config with a SASL password, and one made from it with keyword options next to it
    cfg = ConsumerConfig(name="n", brokers=[UNREACHABLE], topics=["t"], config=props)
    merged = KeyedConsumer(handler=lambda m: None, settings=cfg, concurrency=2).config
    for model in (cfg, merged):
        # then neither its repr, dumps, JSON, nor the pass-through dict shows the password
        shown = surfaces_of_a_model(model) + [
            str(model.config),
            repr(model.config),
            str(model.config["sasl.password"]),
            repr(model.config["sasl.password"]),
        ]
        assert all(PASSWORD not in s for s in shown), [s for s in shown if PASSWORD in s]
        # and the rest stays readable, while librdkafka gets the real value
        assert model.config["sasl.username"] == "u" and model.config["sasl.mechanism"] == "SCRAM-SHA-512"
        assert model.librdkafka()["sasl.password"] == PASSWORD
    assert merged.concurrency == 2


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "opts",
    [
        {"concurrency": 0},  # another field fails
        {"config": {"security.protocol": "NOPE"}},  # the config field itself fails, next to the password
        {"config": {"group.id": "g"}},  # an owned property next to the password
        {"name": None},  # a required field is missing: pydantic's input is the whole input
        {"no_such_option": 1},  # an unknown keyword
    ],
    ids=["other-field", "bad-librdkafka-value", "owned-property", "missing-field", "unknown-keyword"],
)
def test_password_in_no_surface_of_a_validation_error(props: dict[str, Any], opts: dict[str, Any]) -> None:
    kwargs: dict[str, Any] = {"name": "n", "brokers": [UNREACHABLE], "topics": ["t"]}
    kwargs.update(opts)
    kwargs["config"] = {**props, **opts.get("config", {})}
    if kwargs["name"] is None:
        del kwargs["name"]
    with pytest.raises(ValidationError) as info:
        ConsumerConfig(**kwargs)
    shown = surfaces_of_an_error(info.value)
    assert all(PASSWORD not in s for s in shown), [s for s in shown if PASSWORD in s]


@pytest.mark.timeout(10)
def test_password_from_the_environment_in_no_surface_of_a_validation_error(
    props: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KEYEDCONSUMER_CONFIG", json.dumps(props))
    with pytest.raises(ValidationError) as info:
        ConsumerConfig(topics=["t"])  # name missing: the input shown would hold the parsed config
    shown = surfaces_of_an_error(info.value)
    assert all(PASSWORD not in s for s in shown), [s for s in shown if PASSWORD in s]


REDIS_URLS = [
    f"redis://:{PASSWORD}@127.0.0.1:6379/0",
    f"redis://alice:{PASSWORD}@127.0.0.1:6379/0",
    f"redis://127.0.0.1:6379/0?password={PASSWORD}",
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("url", REDIS_URLS, ids=["password", "user-password", "query"])
def test_redis_password_on_no_surface_of_the_sequencer_config(url: str) -> None:
    from keyedconsumer import RedisSequencer

    seq = RedisSequencer(url, "ns")
    cfg = seq.config
    shown = surfaces_of_a_model(cfg) + [str(cfg.url), repr(cfg.url), repr(seq), str(seq)]
    assert all(PASSWORD not in s for s in shown), [s for s in shown if PASSWORD in s]
    assert "127.0.0.1:6379" in str(cfg.url)  # the rest of the URL stays readable
    assert cfg.url.get_secret_value() == url  # what redis-py gets


@pytest.mark.timeout(10)
@pytest.mark.parametrize("url", REDIS_URLS, ids=["password", "user-password", "query"])
@pytest.mark.parametrize(
    "opts",
    [
        {"namespace": "bad{ns}"},
        {"lease_ttl_s": 1.0, "renew_interval_s": 1.0},
        {"namespace": None},
        {"no_such": 1},
    ],
    ids=["bad-namespace", "ttl-not-above-three-renewals", "missing-namespace", "unknown-keyword"],
)
def test_redis_password_in_no_surface_of_a_validation_error(url: str, opts: dict[str, Any]) -> None:
    from keyedconsumer import RedisSequencerConfig

    kwargs: dict[str, Any] = {"url": url, "namespace": "ns", **opts}
    if kwargs["namespace"] is None:
        del kwargs["namespace"]
    with pytest.raises(ValidationError) as info:
        RedisSequencerConfig(**kwargs)
    shown = surfaces_of_an_error(info.value)
    assert all(PASSWORD not in s for s in shown), [s for s in shown if PASSWORD in s]


@pytest.mark.timeout(10)
def test_a_dead_letter_producer_built_from_the_config_gets_the_real_password(props: dict[str, Any]) -> None:
    # the config keeps the password as a SecretStr; a producer built from it still gets the value
    cfg = ConsumerConfig(name="n", brokers=[UNREACHABLE], topics=["t"], config=props)
    assert cfg.properties() == props
    # (confluent-kafka would take a SecretStr as its masked text: Publisher reveals it first)
    # (each producer is built when the middleware is first composed without a consumer)
    DeadLetter(brokers=[UNREACHABLE], producer_config=dict(cfg.config), timeout_s=1.0)(lambda m: None)
    DeadLetter(brokers=[UNREACHABLE], producer_config=cfg.properties(), timeout_s=1.0)(lambda m: None)
    with pytest.raises(PublishError, match="SCRAM-SHA-1024") as info:  # librdkafka really got them
        DeadLetter(brokers=[UNREACHABLE], producer_config={**cfg.config, "sasl.mechanism": "SCRAM-SHA-1024"})(
            lambda m: None
        )
    assert PASSWORD not in str(info.value) and PASSWORD not in repr(info.value)
