"""``keyedconsumer run``'s settings: flags > environment > TOML file > defaults, layered by
pydantic-settings' sources, every option reachable from each layer, errors naming the field and the
layer. Nothing connects: ``--print-settings`` prints the validated settings and exits."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from keyedconsumer import ConsumerConfig
from keyedconsumer.cli import app
from keyedconsumer.cli.layers import SEQUENCER_KEYS, layered

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()
HANDLER = "json:dumps"  # any importable callable: nothing runs


def invoke(
    *args: str, env: dict[str, str] | None = None, toml: str | None = None, tmp: Path | None = None
) -> Any:
    extra: list[str] = []
    if toml is not None:
        assert tmp is not None
        (tmp / "kc.toml").write_text(toml)
        extra = ["--config", str(tmp / "kc.toml")]
    result = runner.invoke(
        app, ["run", HANDLER, "--app-dir", str(ROOT), "--print-settings", *extra, *args], env=env
    )
    assert "Traceback" not in result.output, result.output
    return result


def printed(
    *args: str, env: dict[str, str] | None = None, toml: str | None = None, tmp: Path | None = None
) -> dict[str, Any]:
    result = invoke(*args, env=env, toml=toml, tmp=tmp)
    assert result.exit_code == 0, result.output
    data: dict[str, Any] = json.loads(result.stdout)
    return data


BASE = ("-g", "g", "-t", "t")

# -- precedence, one representative field of each kind ----------------------------------------------------

#: (field shown by --print-settings, flag args, environment, TOML line, the default, the three values)
CASES = {
    "number": (
        "concurrency",
        ["--concurrency", "16"],
        {"KEYEDCONSUMER_CONCURRENCY": "8"},
        "concurrency = 4",
        1,
        (16, 8, 4),
    ),
    "bool": (
        "conflate",
        ["--no-conflate"],
        {"KEYEDCONSUMER_CONFLATE": "true"},
        "conflate = false",
        False,
        (False, True, False),
    ),
    "duration": (
        "handler_timeout_s",
        ["--handler-timeout-s", "1.5"],
        {"KEYEDCONSUMER_HANDLER_TIMEOUT_S": "2.5"},
        "handler_timeout_s = 3.5",
        None,
        (1.5, 2.5, 3.5),
    ),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", sorted(CASES))
def test_each_layer_beats_the_ones_below_it(kind: str, tmp_path: Path) -> None:
    field, flag, env, line, default, (from_flag, from_env, from_file) = CASES[kind]
    # given no layer: the default
    assert printed(*BASE)[field] == default
    # given only the TOML file: its value
    assert printed(*BASE, toml=line + "\n", tmp=tmp_path)[field] == from_file
    # given the environment too: the environment's
    assert printed(*BASE, env=env, toml=line + "\n", tmp=tmp_path)[field] == from_env
    # given a flag too: the flag's
    assert printed(*BASE, *flag, env=env, toml=line + "\n", tmp=tmp_path)[field] == from_flag


@pytest.mark.timeout(30)
def test_tables_merge_property_by_property_each_from_the_highest_layer(tmp_path: Path) -> None:
    # given librdkafka properties and sequencer options in all three layers, overlapping
    toml = (
        '[config]\n"client.id" = "file"\n"socket.timeout.ms" = 12345\n"debug" = "broker"\n'
        "[sequencer]\nlease_ttl_s = 20.0\nmax_drains = 5\nscheduler = false\n"
    )
    env = {
        "KEYEDCONSUMER_CONFIG": '{"client.id": "env", "debug": "topic"}',
        "KEYEDCONSUMER_SEQUENCER__LEASE_TTL_S": "12",
        "KEYEDCONSUMER_SEQUENCER__MAX_DRAINS": "7",
    }
    flags = ["-X", "client.id=flag", "--sequencer-lease-ttl-s", "8", "--redis", "redis://127.0.0.1:1/0"]
    s = printed(*BASE, *flags, env=env, toml=toml, tmp=tmp_path)
    # then each property comes from the highest layer that sets it, and none is lost
    assert s["config"] == {"client.id": "flag", "debug": "topic", "socket.timeout.ms": 12345}
    assert (s["sequencer"]["lease_ttl_s"], s["sequencer"]["max_drains"], s["sequencer"]["scheduler"]) == (
        8.0,
        7,
        False,
    )
    assert s["sequencer"]["max_parked_total"] == 1_000_000  # a default


@pytest.mark.timeout(30)
def test_the_sequencer_options_as_one_json_variable_merge_with_the_per_option_ones() -> None:
    env = {
        "KEYEDCONSUMER_SEQUENCER": '{"max_drains": 9, "lease_ttl_s": 30}',
        "KEYEDCONSUMER_SEQUENCER__LEASE_TTL_S": "12",
    }
    s = printed(*BASE, "--redis", "redis://127.0.0.1:1/0", env=env)
    assert (s["sequencer"]["max_drains"], s["sequencer"]["lease_ttl_s"]) == (9, 12.0)


@pytest.mark.timeout(30)
def test_secrets_follow_the_precedence_and_are_never_shown(tmp_path: Path) -> None:
    secrets = {"flag": "Fl4g-pw-x9", "environment": "Env-pw-y8", "file": "F1le-pw-z7"}
    toml_path = tmp_path / "kc.toml"
    toml_path.write_text(
        f'group = "g"\ntopics = ["t"]\nredis = "redis://:{secrets["file"]}@h:6379/0"\n'
        f'[config]\n"sasl.password" = "{secrets["file"]}"\n'
    )
    env = {
        "KEYEDCONSUMER_CONFIG": json.dumps({"sasl.password": secrets["environment"]}),
        "KEYEDCONSUMER_REDIS": f"redis://:{secrets['environment']}@h:6379/0",
    }
    flags = {"config": {"sasl.password": secrets["flag"]}, "redis": f"redis://:{secrets['flag']}@h:6379/0"}
    layers = [("file", {}, {}), ("environment", env, {}), ("flag", env, flags)]
    for winner, environment, given in layers:
        with pytest.MonkeyPatch.context() as mp:
            for k, v in environment.items():
                mp.setenv(k, v)
            values = layered(given, toml_path)
            # then the secret of the highest layer is the one librdkafka and redis-py get
            assert values.consumer_config().properties()["sasl.password"] == secrets[winner]
            assert values.run_options().redis == f"redis://:{secrets[winner]}@h:6379/0"
    # and --print-settings shows none of them
    args = ["-X", f"sasl.password={secrets['flag']}", "--redis", f"redis://:{secrets['flag']}@h:6379/0"]
    for extra in ([], args):
        result = invoke("--config", str(toml_path), *extra, env=env if extra else None)
        assert result.exit_code == 0, result.output
        assert not any(pw in result.output for pw in secrets.values()), result.output
        assert json.loads(result.stdout)["config"]["sasl.password"] == "***"


# -- errors name the field and the layer ----------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("flags", "env", "toml", "expected"),
    [
        (["--concurrency", "0"], {}, None, "concurrency (from flag --concurrency)"),
        (
            [],
            {"KEYEDCONSUMER_CONCURRENCY": "0"},
            None,
            "concurrency (from environment KEYEDCONSUMER_CONCURRENCY)",
        ),
        ([], {}, "concurrency = 0", "concurrency (from file "),
        ([], {}, "conflate = 1", "conflate (from file "),
        (["--poll-timeout-s", "0"], {}, None, "poll_timeout_s (from flag --poll-timeout-s)"),
        (
            [],
            {"KEYEDCONSUMER_HANDLER_TIMEOUT_S": "soon"},
            None,
            "handler_timeout_s (from environment KEYEDCONSUMER_HANDLER_TIMEOUT_S)",
        ),
        (
            [],
            {"KEYEDCONSUMER_RETRY_ATTEMPTS": "0"},
            None,
            "retry_attempts (from environment KEYEDCONSUMER_RETRY_ATTEMPTS)",
        ),
        (
            ["--redis", "redis://h/0"],
            {"KEYEDCONSUMER_SEQUENCER__LEASE_TTL_S": "0"},
            None,
            "sequencer.lease_ttl_s (from environment KEYEDCONSUMER_SEQUENCER__LEASE_TTL_S)",
        ),
        (
            ["--redis", "redis://h/0", "--sequencer-max-drains", "0"],
            {},
            None,
            "sequencer.max_drains (from flag --sequencer-max-drains)",
        ),
        (["--redis", "redis://h/0"], {}, "[sequencer]\nlease_ttl = 5", "sequencer.lease_ttl (from file "),
        (
            ["--sequencer-max-drains", "3"],
            {},
            None,
            "Redis sequencer options need --redis (flag --sequencer-max-drains)",
        ),
        ([], {}, '[config]\n"no.such.property" = 1', "config (from file "),
        ([], {}, "concurrancy = 4", "concurrancy (from file "),
        (
            [],
            {"KEYEDCONSUMER_SEQUENCER__LEASE_TTL": "5"},
            None,
            "KEYEDCONSUMER_SEQUENCER__LEASE_TTL: unknown environment variable",
        ),
    ],
)
def test_a_bad_value_names_the_field_and_its_layer(
    flags: list[str], env: dict[str, str], toml: str | None, expected: str, tmp_path: Path
) -> None:
    result = invoke(*BASE, *flags, env=env, toml=toml, tmp=tmp_path)
    assert result.exit_code == 2, result.output
    assert expected in result.output, result.output


# -- every option from every layer ---------------------------------------------------------------------

#: A valid value, not the default, of every ConsumerConfig field.
CONSUMER_VALUES: dict[str, Any] = {
    "name": "n-x",
    "brokers": ["h1:9092", "h2:9092"],
    "topics": ["t1", "t2"],
    "group_id": "g-x",
    "concurrency": 3,
    "ordering": "partition",
    "conflate": True,
    "manual_commit": True,
    "max_in_flight": 5,
    "max_in_flight_bytes": 4096,
    "batch_size": 7,
    "poll_timeout_s": 0.5,
    "handler_timeout_s": 2.5,
    "shutdown_timeout_s": 3.5,
    "revoke_timeout_s": 4.5,
    "startup_timeout_s": 5.5,
    "auto_offset_reset": "latest",
    "commit_metadata_max_bytes": 100,
    "require_topics": True,
    "event_loop": "asyncio",
    "handler_batch_size": 9,
    "handler_batch_linger_s": 0.25,
    "config": {"client.id": "x"},
}
#: The exactly-once options: a valid value, not the default, of each (checked in a pass of their
#: own: ``transactional`` refuses ``manual_commit``, which the table above sets).
TRANSACTION_VALUES: dict[str, Any] = {
    "transactional": True,
    "transactional_id": "tx-1",
    "transaction_interval_s": 0.5,
    "transaction_timeout_s": 20.0,
    "produce_timeout_s": 7.0,
}
#: A valid value, not the default, of every Redis sequencer option.
SEQUENCER_VALUES: dict[str, Any] = {
    "lease_ttl_s": 8.0,
    "renew_interval_s": 2.0,
    "lease_linger_s": 0.5,
    "socket_timeout_s": 1.5,
    "require_durable": False,
    "max_parked_per_key": 11,
    "max_parked_bytes_per_key": 2048,
    "max_parked_total": 12,
    "max_parked_bytes_total": 4096,
    "seen_retention_s": 100.0,
    "quarantine_on_dead_letter": True,
    "max_drains": 3,
    "instance_timeout_s": 30.0,
    "scheduler": False,
}
REDIS = "redis://127.0.0.1:1/0"


def _toml_value(v: Any) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else json.dumps(v)


def _text(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return ",".join(v)
    return json.dumps(v) if isinstance(v, dict) else str(v)


def _flags(name: str, v: Any, prefix: str = "") -> list[str]:
    flag = "--" + prefix + name.replace("_", "-")
    if name == "topics":
        return ["-t", ",".join(v)]
    if name == "brokers":
        return ["-b", ",".join(v)]
    if name == "config":
        return [a for k, x in v.items() for a in ("-X", f"{k}={x}")]
    if name == "manual_commit":
        return ["--manual-commit" if v else "--auto-commit"]
    if isinstance(v, bool):
        return [flag if v else "--no-" + flag[2:]]
    return [flag, str(v)]


def _check(shown: dict[str, Any]) -> None:
    for name, v in CONSUMER_VALUES.items():
        assert shown[name] == v, name
    for name, v in SEQUENCER_VALUES.items():
        assert shown["sequencer"][name] == v, name


@pytest.mark.timeout(60)
def test_every_option_is_reachable_from_every_layer(tmp_path: Path) -> None:
    # the tables name every option: a new field needs a value here (and gets a flag, a variable, a key)
    assert set(CONSUMER_VALUES) | set(TRANSACTION_VALUES) == set(ConsumerConfig.model_fields)
    assert set(SEQUENCER_VALUES) == set(SEQUENCER_KEYS)
    base = ["run", HANDLER, "--app-dir", str(ROOT), "--print-settings", "--redis", REDIS]

    def shown(args: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
        result = runner.invoke(app, [*base, *args], env=env)
        assert result.exit_code == 0, result.output
        data: dict[str, Any] = json.loads(result.stdout)
        return data

    # from the TOML file
    lines = [f"{k} = {_toml_value(v)}" for k, v in CONSUMER_VALUES.items() if k != "config"]
    lines += ["[config]", *(f'"{k}" = {_toml_value(v)}' for k, v in CONSUMER_VALUES["config"].items())]
    lines += ["[sequencer]", *(f"{k} = {_toml_value(v)}" for k, v in SEQUENCER_VALUES.items())]
    (tmp_path / "all.toml").write_text("\n".join(lines) + "\n")
    _check(shown(["--config", str(tmp_path / "all.toml")]))
    # from the environment
    env = {f"KEYEDCONSUMER_{k.upper()}": _text(v) for k, v in CONSUMER_VALUES.items()}
    env.update({f"KEYEDCONSUMER_SEQUENCER__{k.upper()}": _text(v) for k, v in SEQUENCER_VALUES.items()})
    _check(shown([], env))
    # from flags
    args = [a for k, v in CONSUMER_VALUES.items() for a in _flags(k, v)]
    args += [a for k, v in SEQUENCER_VALUES.items() for a in _flags(k, v, "sequencer-")]
    _check(shown(args))


@pytest.mark.timeout(60)
def test_every_exactly_once_option_is_reachable_from_every_layer(tmp_path: Path) -> None:
    base = ["run", HANDLER, "--app-dir", str(ROOT), "--print-settings", "--group", "g-tx", "-t", "t1"]

    def check(args: list[str], env: dict[str, str] | None = None) -> None:
        result = runner.invoke(app, [*base, *args], env=env)
        assert result.exit_code == 0, result.output
        shown = json.loads(result.stdout)
        for name, v in TRANSACTION_VALUES.items():
            assert shown[name] == v, name

    (tmp_path / "tx.toml").write_text(
        "".join(f"{k} = {_toml_value(v)}\n" for k, v in TRANSACTION_VALUES.items())
    )
    check(["--config", str(tmp_path / "tx.toml")])
    check([], {f"KEYEDCONSUMER_{k.upper()}": _text(v) for k, v in TRANSACTION_VALUES.items()})
    check([a for k, v in TRANSACTION_VALUES.items() for a in _flags(k, v)])


# -- a KeyedApp: the layers go over the app's shared options, under each route's own -----------------


@pytest.mark.timeout(30)
def test_an_app_takes_the_layers_over_its_own_options_and_under_its_routes_options(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spec = "tests.unit.cli_settings_app:app"
    caplog.set_level(logging.INFO, "keyedconsumer.cli")

    def routes(*args: str, env: dict[str, str] | None = None) -> Any:
        return runner.invoke(app, ["run", spec, "--app-dir", str(ROOT), "--print-settings", *args], env=env)

    # given no layer: the app's own options
    result = routes()
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)
    assert shown["plain"]["brokers"] == ["127.0.0.1:1"] and shown["plain"]["group_id"] == "billing"
    assert shown["plain"]["config"] == {"client.id": "app", "linger.ms": 7}
    # given a flag, the environment and a file
    (tmp_path / "kc.toml").write_text('batch_size = 9\nconcurrency = 5\n[config]\n"client.id" = "file"\n')
    result = routes(
        "--concurrency",
        "3",
        "--config",
        str(tmp_path / "kc.toml"),
        "--group",
        "ops",
        "--brokers",
        "kafka-1:9092",
        env={"KEYEDCONSUMER_BATCH_SIZE": "11"},
    )
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)
    # then a route's own option beats the flag; the flag applies where no route sets it; env beats file
    assert (shown["fast"]["concurrency"], shown["plain"]["concurrency"]) == (16, 3)
    assert shown["fast"]["batch_size"] == shown["plain"]["batch_size"] == 11
    # the layers beat the app's own options (brokers, group, librdkafka properties one by one) ...
    assert shown["plain"]["brokers"] == shown["fast"]["brokers"] == ["kafka-1:9092"]
    assert (shown["fast"]["group_id"], shown["plain"]["group_id"]) == ("ops", "ops")
    assert shown["plain"]["config"] == {"client.id": "file", "linger.ms": 7}
    # ... but not a route's own: the remote route keeps its cluster and its client.id
    assert shown["remote"]["brokers"] == ["10.0.0.1:9092"]
    assert shown["remote"]["config"] == {"client.id": "remote", "linger.ms": 7}
    # the routes keep their topics
    assert (shown["fast"]["topics"], shown["plain"]["topics"]) == (["payments"], ["refunds"])
    assert "route fast sets its own concurrency: the flag --concurrency does not apply to it" in caplog.text
    assert "route remote sets its own brokers: the flag --brokers does not apply to it" in caplog.text
    assert "route remote sets its own config.client.id: the file" in caplog.text
    assert "the flag --brokers replaces the app's own brokers" in caplog.text
    assert "the flag --group replaces the app's own group_id" in caplog.text
    # and a bad setting names the field and its layer, before the app's module is imported (its
    # routes read the same variables), also where a route's own option replaces it
    bad = routes("--batch-size", "0")
    assert bad.exit_code == 2 and "batch_size (from flag --batch-size)" in bad.output, bad.output
    bad = routes(env={"KEYEDCONSUMER_BATCH_SIZE": "abc"})
    assert bad.exit_code == 2, bad.output
    assert "invalid setting batch_size (from environment KEYEDCONSUMER_BATCH_SIZE)" in bad.output, bad.output
    assert "importing" not in bad.output, bad.output
    bad = routes(env={"KEYEDCONSUMER_CONCURRENCY": "abc"})  # route fast sets its own concurrency
    assert bad.exit_code == 2 and "concurrency (from environment KEYEDCONSUMER_CONCURRENCY)" in bad.output
    # routes' topics from a flag are refused
    bad = routes("-t", "other")
    assert bad.exit_code == 2 and "is a KeyedApp" in bad.output and "topics" in bad.output, bad.output
