"""Bad configuration (issue 6): each bad option fails at construction with a clear error naming the
field, and no secret reaches an error message or a ``repr``.

Already covered elsewhere, and not repeated here:

=====================================================  ==========================================================
input                                                  test
=====================================================  ==========================================================
concurrency 0 / -3 / True, max_in_flight 0 / False,    ``tests/unit/test_config.py::test_bad_value_names_the_field``
manual_commit=1, shutdown_timeout_s NaN,
poll_timeout_s inf
unknown librdkafka property, bad librdkafka value      ``test_config.py::test_librdkafka_rejects_unknown_property_at_construction``
sasl.password in repr / in a validation error          ``test_config.py::test_secrets_never_in_repr``, ``::test_secrets_never_in_validation_errors``
lease TTL == 3 renewals, NaN TTL, bad namespace,       ``tests/integration/test_redis_sequencer.py::test_sequencer_settings_are_validated``
Redis password in the sequencer's repr
Retry NaN initial delay, inf max delay, bool attempts  ``tests/unit/test_middleware.py::test_bad_retry_settings_are_refused``
=====================================================  ==========================================================

The integration side (a wrong broker address at run time, Redis down at start, secrets in logs) is in
``tests/integration/test_bad_input.py``.
"""

from __future__ import annotations

import math
import typing
from typing import Any

import pytest
from keyedconsumer.middleware import Retry
from pydantic import ValidationError

from keyedconsumer import ConsumerConfig, KeyedConsumer, RedisSequencer, RetryLater

SECRET = "Hunter2-s3cret"
INT_FIELDS = ["concurrency", "max_in_flight", "max_in_flight_bytes", "batch_size"]
FLOAT_FIELDS = ["poll_timeout_s", "shutdown_timeout_s", "revoke_timeout_s", "startup_timeout_s"]


def fields(exc: ValidationError) -> set[str]:
    return {str(e["loc"][0]) for e in exc.errors() if e["loc"]}


def refused(**opts: Any) -> ValidationError:
    """The ``ValidationError`` of ``ConsumerConfig(name="n", topics=["t"], **opts)``."""
    with pytest.raises(ValidationError) as info:
        ConsumerConfig(**{"name": "n", "topics": ["t"], **opts})
    return info.value


# ------------------------------------------------------------------------------------------------
# concurrency <= 0 (from sources test_config.py does not try)
# ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(10)
@pytest.mark.parametrize("env", ["0", "-1", "1.5", "true", ""])
def test_concurrency_not_a_positive_integer_from_the_environment_names_the_field(
    env: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KEYEDCONSUMER_CONCURRENCY", env)
    err = refused()
    assert fields(err) == {"concurrency"}


@pytest.mark.timeout(10)
@pytest.mark.parametrize("value", [0.0, -0.5, 0.5, 100_001, None, "many"])
def test_concurrency_not_a_positive_integer_names_the_field(value: object) -> None:
    assert fields(refused(concurrency=value)) == {"concurrency"}


# ------------------------------------------------------------------------------------------------
# booleans for numbers
# ------------------------------------------------------------------------------------------------


def _numeric(annotation: object) -> bool:
    """Whether a field's type takes an int or a float (``float | None`` too)."""
    return annotation in (int, float) or any(a in (int, float) for a in typing.get_args(annotation))


#: Every numeric option of the config, read from the model: an option added later is covered too.
NUMBER_FIELDS = sorted(n for n, f in ConsumerConfig.model_fields.items() if _numeric(f.annotation))


@pytest.mark.timeout(10)
def test_the_numeric_options_are_read_from_the_model() -> None:
    assert set(INT_FIELDS + FLOAT_FIELDS + ["handler_timeout_s"]) <= set(NUMBER_FIELDS)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("field", NUMBER_FIELDS)
@pytest.mark.parametrize("value", [True, False])
def test_a_boolean_for_any_numeric_option_names_the_field(field: str, value: bool) -> None:
    # pydantic's lax mode would take True as 1 / 1.0 (a one-second startup timeout, a batch of
    # one); the doc promises (docs/configuration.md): "Booleans are refused for every numeric option"
    err = refused(**{field: value})
    assert fields(err) == {field} and "boolean" in str(err)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "field,opts",
    [
        ("conflate", {"conflate": True, "ordering": "none"}),
        ("transactional", {"transactional": True, "manual_commit": True}),
    ],
    ids=["conflate-without-order", "transactional-with-manual-commit"],
)
def test_a_rule_between_two_options_names_a_field(field: str, opts: dict[str, object]) -> None:
    # a ValidationError names the field (loc), also for a rule between two options
    assert fields(refused(**opts)) == {field}


@pytest.mark.timeout(10)
def test_a_refused_renew_interval_is_one_error_not_a_second_about_the_instance_timeout() -> None:
    # the instance timeout's rule would otherwise be judged against the default interval
    with pytest.raises(ValidationError) as info:
        RedisSequencer("redis://127.0.0.1:6379/0", "ns", renew_interval_s=0.001, instance_timeout_s=1.0)
    assert fields(info.value) == {"renew_interval_s"}


@pytest.mark.timeout(10)
@pytest.mark.parametrize("value", [0, 1, 1.0, 0.0])
def test_number_for_a_boolean_names_the_field(value: object) -> None:
    assert fields(refused(manual_commit=value)) == {"manual_commit"}


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "field,opts",
    [
        ("lease_ttl_s", {"lease_ttl_s": True}),
        ("socket_timeout_s", {"socket_timeout_s": True}),
        ("renew_interval_s", {"renew_interval_s": True, "lease_ttl_s": 10.0}),
        ("require_durable", {"require_durable": 1}),
    ],
    ids=["lease_ttl_s", "socket_timeout_s", "renew_interval_s", "require_durable"],
)
def test_sequencer_boolean_number_mix_up_names_the_field(field: str, opts: dict[str, object]) -> None:
    with pytest.raises(ValidationError) as info:
        RedisSequencer("redis://127.0.0.1:6379/0", "ns", **opts)
    assert fields(info.value) == {field}


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "opts",
    [{"initial_delay_s": True}, {"multiplier": True}, {"max_delay_s": True}, {"max_attempts": 2.5}],
    ids=["initial_delay_s", "multiplier", "max_delay_s", "max_attempts"],
)
def test_retry_boolean_or_fraction_for_a_number_is_refused(opts: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=next(iter(opts))):
        Retry(**opts)  # type: ignore[arg-type]


@pytest.mark.timeout(10)
def test_retry_later_boolean_delay_is_refused() -> None:
    with pytest.raises(ValueError, match="delay_s"):
        RetryLater(True)


# ------------------------------------------------------------------------------------------------
# NaN or infinite timeouts and back-off
# ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(10)
@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, "nan", "inf"])
def test_nan_or_infinite_timeout_names_the_field(field: str, value: object) -> None:
    assert fields(refused(**{field: value})) == {field}


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "kwargs",
    [
        {"initial_delay_s": math.inf},
        {"multiplier": math.inf},
        {"multiplier": math.nan},
        {"max_delay_s": math.nan},
        {"jitter": math.nan},
        {"max_delay_s": -math.inf},
    ],
)
def test_nan_or_infinite_back_off_is_refused_naming_the_setting(kwargs: dict[str, float]) -> None:
    (name,) = kwargs
    with pytest.raises(ValueError, match=name):
        Retry(**kwargs)  # type: ignore[arg-type]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("delay", [math.nan, math.inf, -math.inf, -1.0, "nan"])
def test_nan_infinite_or_negative_retry_later_delay_is_refused(delay: object) -> None:
    with pytest.raises(ValueError, match="delay_s"):
        RetryLater(delay)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------
# lease TTL against renewal interval
# ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "ttl,renew",
    [(3.0, 1.0), (2.9, 1.0), (1.0, 1.0), (1.0, 5.0), (0.3, 0.1)],
    ids=["exactly-three", "below-three", "equal", "renewal-above-ttl", "small-exactly-three"],
)
def test_lease_ttl_not_above_three_renewals_is_refused_naming_both(ttl: float, renew: float) -> None:
    with pytest.raises(ValidationError) as info:
        RedisSequencer("redis://127.0.0.1:6379/0", "ns", lease_ttl_s=ttl, renew_interval_s=renew)
    text = str(info.value)
    assert "lease_ttl_s" in text and "renew_interval_s" in text
    assert fields(info.value) == {"renew_interval_s"}


@pytest.mark.timeout(10)
def test_lease_ttl_just_above_three_renewals_is_accepted() -> None:
    s = RedisSequencer("redis://127.0.0.1:6379/0", "ns", lease_ttl_s=3.01, renew_interval_s=1.0)
    assert s.config.renew_interval_s == 1.0
    assert RedisSequencer("redis://127.0.0.1:6379/0", "ns", lease_ttl_s=2.0).config.renew_interval_s == 0.5


# ------------------------------------------------------------------------------------------------
# durations that reach Redis as milliseconds: below a meaningful minimum they are refused (PEXPIRE
# key 0 deletes the key: redis-py #4279); at it, accepted (tests/integration/test_redis_durations.py
# shows each minimum works against the real Redis)
# ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "field,opts",
    [
        ("lease_ttl_s", {"lease_ttl_s": 0.05}),
        ("lease_ttl_s", {"lease_ttl_s": 0.0009}),
        ("renew_interval_s", {"renew_interval_s": 0.0099}),
        ("renew_interval_s", {"renew_interval_s": 0.0009}),
        ("seen_retention_s", {"seen_retention_s": 0.999}),
        ("seen_retention_s", {"seen_retention_s": 0.0009}),
        ("instance_timeout_s", {"instance_timeout_s": 0.0}),
        ("instance_timeout_s", {"instance_timeout_s": -1.0}),
    ],
    ids=[
        "lease_ttl_s-0.05",
        "lease_ttl_s-0.0009",
        "renew_interval_s-0.0099",
        "renew_interval_s-0.0009",
        "seen_retention_s-0.999",
        "seen_retention_s-0.0009",
        "instance_timeout_s-0",
        "instance_timeout_s-negative",
    ],
)
def test_sequencer_duration_below_its_minimum_is_refused_naming_the_field(
    field: str, opts: dict[str, float]
) -> None:
    with pytest.raises(ValidationError) as info:
        RedisSequencer("redis://127.0.0.1:6379/0", "ns", **opts)
    assert fields(info.value) == {field}


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "ttl,renew,timeout",
    [(10.0, 2.5, 7.5), (10.0, 2.5, 0.0009), (10.0, None, 1.0), (0.0501, 0.01, 0.03)],
    ids=[
        "exactly-three-check-ins",
        "below-a-millisecond",
        "below-three-default-renewals",
        "smallest-exactly-three",
    ],
)
def test_instance_timeout_not_above_three_check_ins_is_refused_naming_it(
    ttl: float, renew: float | None, timeout: float
) -> None:
    with pytest.raises(ValidationError) as info:
        RedisSequencer(
            "redis://127.0.0.1:6379/0",
            "ns",
            lease_ttl_s=ttl,
            renew_interval_s=renew,
            instance_timeout_s=timeout,
        )
    text = str(info.value)
    assert "instance_timeout_s" in text and "renew_interval_s" in text
    assert fields(info.value) == {"instance_timeout_s"}


@pytest.mark.timeout(10)
def test_sequencer_durations_at_their_minimum_are_accepted() -> None:
    s = RedisSequencer(
        "redis://127.0.0.1:6379/0",
        "ns",
        lease_ttl_s=0.0501,
        renew_interval_s=0.01,
        seen_retention_s=1.0,
        instance_timeout_s=0.0301,
    )
    c = s.config
    assert (c.lease_ttl_s, c.renew_interval_s, c.seen_retention_s, c.instance_timeout_s) == (
        0.0501,
        0.01,
        1.0,
        0.0301,
    )
    # the defaults derived from the smallest lease TTL are accepted too
    d = RedisSequencer("redis://127.0.0.1:6379/0", "ns", lease_ttl_s=0.0501).config
    assert d.renew_interval_s is not None and d.renew_interval_s >= 0.01
    assert d.instance_timeout_s == pytest.approx(3 * 0.0501)


@pytest.mark.timeout(10)
def test_seconds_become_redis_milliseconds_rounded_up_and_at_least_one() -> None:
    from keyedconsumer.sequencing.durations import MAX_DUE_MS, at_ms, due_ms, redis_ms

    # a duration: never 0 (PEXPIRE key 0 deletes the key), never shorter than asked
    assert [redis_ms(s) for s in (0.0, 0.0000001, 0.0009, 0.001, 0.0011, 0.0501, 0.0509, 2.0, 604800.0)] == [
        1,
        1,
        1,
        1,
        2,
        51,
        51,
        2000,
        604_800_000,
    ]
    assert redis_ms(2.007) >= 2007
    for bad in (-0.001, math.nan, math.inf):
        with pytest.raises(ValueError):
            redis_ms(bad)
    # a due time: never earlier than now + the delay, capped far in the future
    assert due_ms(1000.0, 0.0) == 1000 and due_ms(1000.25, 0.0) == 1001 and due_ms(1000.0, 1e-9) == 1001
    assert due_ms(1000.0, 0.0004) == 1001 and due_ms(1000.0, 1.5) == 2500
    assert due_ms(1000.0, 1e300) == MAX_DUE_MS and due_ms(1000.0, math.inf) == MAX_DUE_MS
    for bad in (-0.001, math.nan):
        with pytest.raises(ValueError):
            due_ms(1000.0, bad)
    assert at_ms(1.0) == 1000 and at_ms(1.0001) == 1001 and at_ms(0.0) == 0
    for bad in (-1.0, math.nan, math.inf, 1e12):
        with pytest.raises(ValueError):
            at_ms(bad)


# ------------------------------------------------------------------------------------------------
# wrong broker addresses and topic names: refused at construction, naming the field
# ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "brokers",
    [
        [""],
        ["  "],
        ["127.0.0.1:99999"],
        ["127.0.0.1:0"],
        ["127.0.0.1:notaport"],
        ["host :9092"],
        [":9092"],
        ["127.0.0.1:9092", ""],
        ["[::1]x"],
    ],
)
def test_wrong_broker_address_names_the_field(brokers: list[str]) -> None:
    # librdkafka itself takes all of these: an empty or port-less-number entry only fails at run()
    # after startup_timeout_s, and 127.0.0.1:99999 silently becomes port 34463 (99999 mod 65536)
    err = refused(brokers=brokers)
    assert fields(err) == {"brokers"}


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "brokers",
    [
        ["127.0.0.1:9092"],
        ["localhost"],
        ["[::1]:9092"],
        ["::1"],
        ["SASL_SSL://kafka-1.example.com:9093"],
        ["h1:9092,h2:9092"],
        ["h1:9092, h2:9092"],
    ],
)
def test_valid_broker_addresses_are_accepted(brokers: list[str]) -> None:
    assert ConsumerConfig(name="n", topics=["t"], brokers=brokers).brokers == brokers


@pytest.mark.timeout(10)
@pytest.mark.parametrize("topic", ["", "bad topic!", "^[", "a" * 250, ".", "..", "t\u00e9"])
def test_impossible_topic_names_the_field(topic: str) -> None:
    # librdkafka refuses "" and "^[" only at subscribe() with a bare KafkaException, and subscribes to
    # "bad topic!" forever (UNKNOWN_TOPIC_OR_PART warnings)
    assert fields(refused(topics=[topic])) == {"topics"}


@pytest.mark.timeout(10)
@pytest.mark.parametrize("topic", ["orders", "a.b_c-D9", "^orders-.*", "a" * 249])
def test_legal_topic_names_and_regexes_are_accepted(topic: str) -> None:
    assert ConsumerConfig(name="n", topics=[topic]).topics == [topic]


# ------------------------------------------------------------------------------------------------
# secrets in errors and reprs
# ------------------------------------------------------------------------------------------------

SECRET_PROPS = [
    "sasl.password",
    "ssl.key.password",
    "ssl.keystore.password",
    "sasl.oauthbearer.client.secret",
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("prop", SECRET_PROPS)
def test_secret_librdkafka_properties_are_redacted_in_every_repr(prop: str) -> None:
    cfg = ConsumerConfig(name="n", topics=["t"], config={prop: SECRET, "sasl.username": "alice"})
    c = KeyedConsumer(handler=lambda m: None, settings=cfg)
    texts = [repr(cfg), str(cfg), repr(c), str(c), repr(c.config), f"{cfg!r}"]
    assert all(SECRET not in t for t in texts), [t for t in texts if SECRET in t]
    assert "alice" in repr(cfg)  # only secret values are hidden
    assert cfg.librdkafka()[prop] == SECRET  # and the client still gets it


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "config",
    [
        {"sasl.passwrod": SECRET},  # a typo'd secret property: unknown to librdkafka
        {"sasl.password": SECRET, "security.protocol": "NOPE"},
        {"ssl.key.pem": SECRET, "security.protocol": "SSL"},  # librdkafka fails to parse the "PEM"
        {"sasl.password": SECRET, "group.id": "g"},  # an owned property next to the secret
    ],
    ids=["typo", "bad-protocol", "bad-pem", "owned"],
)
def test_secret_never_in_a_config_error(config: dict[str, object]) -> None:
    err = refused(config=config)
    assert fields(err) == {"config"}
    assert SECRET not in str(err) and SECRET not in repr(err)
    assert all(SECRET not in str(e.get("ctx", "")) for e in err.errors())


@pytest.mark.timeout(10)
def test_secret_never_in_an_environment_parse_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEYEDCONSUMER_CONFIG", '{"sasl.password": "' + SECRET + '", ')  # broken JSON
    with pytest.raises(Exception) as info:
        ConsumerConfig(name="n", topics=["t"])
    assert "config" in str(info.value) and SECRET not in str(info.value) and SECRET not in repr(info.value)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "url",
    [
        "redis://:" + SECRET + "@127.0.0.1:6379/0",
        "redis://user:" + SECRET + "@127.0.0.1:6379/0",
        "rediss://user:" + SECRET.replace("-", "%2D") + "@127.0.0.1:6379/0",
        "unix://:" + SECRET + "@/tmp/redis.sock",
    ],
    ids=["password-only", "user-password", "rediss-escaped", "unix"],
)
def test_redis_password_in_the_url_never_in_a_repr_or_error(url: str) -> None:
    secret = SECRET.replace("-", "%2D") if "%2D" in url else SECRET
    s = RedisSequencer(url, "ns")
    assert (
        secret not in repr(s)
        and secret not in str(s)
        and secret not in repr(s.config)
        and secret not in str(s.config)
    )
    with pytest.raises(ValidationError) as info:
        RedisSequencer(url, "bad{ns}")
    assert secret not in str(info.value)


@pytest.mark.timeout(10)
def test_redis_password_as_a_url_query_argument_never_in_a_repr() -> None:
    # redis-py takes the password from the query string too: redis://host:6379/0?password=...
    s = RedisSequencer("redis://127.0.0.1:6379/0?password=" + SECRET, "ns")
    assert SECRET not in repr(s)


# ------------------------------------------------------------------------------------------------
# an unknown KEYEDCONSUMER_* environment variable (a typo) is refused like an unknown keyword
# ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(10)
@pytest.mark.parametrize("name", ["KEYEDCONSUMER_CONCURENCY", "keyedconsumer_concurency"])
def test_an_unknown_environment_variable_is_refused_naming_it(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(name, "4")
    err = refused()
    assert fields(err) == {name}
    assert "KEYEDCONSUMER_CONCURRENCY" in str(err)  # the likely meant one
    with pytest.raises(ValidationError) as info:
        KeyedConsumer(handler=lambda m: None, name="n", topics=["t"])
    assert fields(info.value) == {name}


@pytest.mark.timeout(10)
@pytest.mark.parametrize("name", ["KEYEDCONSUMER_SEQUENCER__LEASE_TTL", "KEYEDCONSUMER_SEQUENCER__URL"])
def test_an_unknown_sequencer_option_variable_is_refused_naming_it(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the sequencer's options are read as KEYEDCONSUMER_SEQUENCER__<OPTION>; its URL is --redis
    monkeypatch.setenv(name, "4")
    assert fields(refused()) == {name}


@pytest.mark.timeout(10)
def test_the_value_of_an_unknown_environment_variable_is_never_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEYEDCONSUMER_SASL_PASSWORD", SECRET)
    err = refused()
    assert fields(err) == {"KEYEDCONSUMER_SASL_PASSWORD"}
    for text in (str(err), repr(err), err.json(), str(err.errors()), str(err.errors(include_input=False))):
        assert SECRET not in text, text


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "name,value",
    [
        ("GROUP", "g"),
        ("HANDLER", "app:handle"),
        ("REDIS", "redis://127.0.0.1:6379/0"),
        ("NAMESPACE", "ns"),
        ("DEAD_LETTER_TOPIC", "t.dlq"),
        ("RETRY_ATTEMPTS", "3"),
        ("PARK", "true"),
        ("CONFIG_FILE", "/dev/null"),
        ("CONCURRENCY", "2"),
        ("CONFIG", "{}"),
        ("SEQUENCER", "{}"),
        ("SEQUENCER__LEASE_TTL_S", "5"),
        ("SEQUENCER__SCHEDULER", "false"),
    ],
)
def test_every_variable_the_package_reads_is_accepted(
    name: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the command line's own settings (RunOptions, --config) are not ConsumerConfig fields, but not typos
    monkeypatch.setenv("KEYEDCONSUMER_" + name, value)
    assert ConsumerConfig(name="n", topics=["t"]).name == "n"


@pytest.mark.timeout(10)
def test_the_list_of_environment_variables_names_every_one_the_package_reads() -> None:
    import pathlib
    import re

    from keyedconsumer.cli import RunOptions
    from keyedconsumer.config import ENVIRONMENT_VARIABLES

    assert {"KEYEDCONSUMER_" + f.upper() for f in ConsumerConfig.model_fields} <= ENVIRONMENT_VARIABLES
    assert {"KEYEDCONSUMER_" + f.upper() for f in RunOptions.model_fields} <= ENVIRONMENT_VARIABLES
    # every name spelled out in the package's sources (KEYEDCONSUMER_X, f"{ENV_PREFIX}X")
    package = pathlib.Path(__file__).resolve().parents[2] / "keyedconsumer"
    spelled = set()
    for path in package.rglob("*.py"):
        for name in re.findall(r"(?:KEYEDCONSUMER_|\{ENV_PREFIX\})([A-Z][A-Z_]*[A-Z])", path.read_text()):
            spelled.add("KEYEDCONSUMER_" + name)
    from keyedconsumer.config import SEQUENCER_ENV_PREFIX
    from keyedconsumer.sequencing import RedisSequencerConfig

    nested = {n for n in spelled if n.startswith(SEQUENCER_ENV_PREFIX)}  # the sequencer's options
    assert {n[len(SEQUENCER_ENV_PREFIX) :].lower() for n in nested} <= set(RedisSequencerConfig.model_fields)
    assert spelled - nested - ENVIRONMENT_VARIABLES == set()
    assert {"KEYEDCONSUMER_CONFIG_FILE", "KEYEDCONSUMER_GROUP", "KEYEDCONSUMER_BROKERS"} <= spelled
