"""The ``keyedconsumer`` command against the real broker and Redis.

``run`` is started as a subprocess (``python -m keyedconsumer``) and stopped with SIGTERM;
``inspect`` and ``dead-letter replay`` run in-process with typer's CliRunner where no signal is
needed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from typer.testing import CliRunner

from keyedconsumer import KeyedConsumer, Message, RedisSequencer
from keyedconsumer.cli import app, parse_since

from .kafkautil import committed, end_offsets, log_lines, produce, read_all, wait_until

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


# -- helpers --------------------------------------------------------------------------------------------


def create_topic(bootstrap: str, name: str, partitions: int) -> str:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)])[name].result(
        timeout=30
    )
    return name


def cli(*args: str, env: dict[str, str] | None = None) -> Any:
    result = runner.invoke(app, list(args), env=env)
    assert "Traceback" not in result.output, result.output
    return result


def cli_json(*args: str) -> dict[str, Any]:
    result = cli(*args, "--json")
    assert result.exit_code == 0, result.output
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def start_run(args: list[str], log: Path, extra_env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    env = {**os.environ, "KC_CLI_LOG": str(log), "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    return subprocess.Popen(
        [sys.executable, "-m", "keyedconsumer", "run", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def read_log(log: Path) -> list[tuple[str, int, int, str, str]]:
    out = []
    for line in log_lines(log):
        kind, p, o, key, value = line.split(" ", 4)
        out.append((kind, int(p), int(o), key, value))
    return out


def stop(proc: subprocess.Popen[str], timeout_s: float = 30.0) -> tuple[int, str]:
    proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the CLI did not stop within {timeout_s} s after SIGTERM:\n{err[-3000:]}")
    return proc.returncode, out + err


def produce_dead_letters(bootstrap: str, dlq: str, records: list[dict[str, Any]]) -> None:
    """Write records as DeadLetter does: the original headers plus kafka_dlt-* failure headers."""
    p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True, "linger.ms": 5})
    for r in records:
        headers = list(r.get("headers", [])) + [
            ("kafka_dlt-original-topic", r["topic"].encode()),
            ("kafka_dlt-original-partition", str(r.get("partition", 0)).encode()),
            ("kafka_dlt-original-offset", str(r.get("offset", 0)).encode()),
            ("kafka_dlt-exception-fqcn", b"builtins.ValueError"),
            ("kafka_dlt-failed-at", str(r["failed_at_ms"]).encode()),
        ]
        while True:
            try:
                p.produce(
                    dlq, key=r["key"], value=r["value"], headers=headers, partition=r.get("dlq_partition", 0)
                )
                break
            except BufferError:
                p.poll(0.1)
    assert p.flush(60) == 0


def read_committed_records(
    bootstrap: str, topic: str, expect: int, isolation: str = "read_committed"
) -> list[Any]:
    c = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"reader-{uuid.uuid4().hex}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "isolation.level": isolation,
        }
    )
    c.subscribe([topic])
    out: list[Any] = []
    deadline = time.monotonic() + 30
    try:
        while len(out) < expect and time.monotonic() < deadline:
            out.extend(m for m in c.consume(500, 0.5) if m.error() is None)
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            out.extend(m for m in c.consume(500, 0.2) if m.error() is None)
    finally:
        c.close()
    return out


# -- run: a subprocess, stopped with SIGTERM ------------------------------------------------------------


@pytest.mark.kafka
@pytest.mark.timeout(120)
@pytest.mark.parametrize("handler", ["handle", "handle_async"])
def test_run_consumes_then_sigterm_drains_and_commits(
    kafka_bootstrap: str, new_topic: Callable[..., str], tmp_path: Path, handler: str
) -> None:
    # given 600 records over 3 partitions
    topic = new_topic(3)
    n = 600
    produce(kafka_bootstrap, topic, [(f"k{i % 40}".encode(), str(i).encode(), None) for i in range(n)])
    group = f"cli-run-{uuid.uuid4().hex[:8]}"
    log = tmp_path / "handled.log"
    # when the CLI runs the handler (sync or async) until every record was handled, then gets SIGTERM
    proc = start_run(
        [
            f"tests.integration.procs.cli_handlers:{handler}",
            "--topic",
            topic,
            "--group",
            group,
            "--concurrency",
            "16",
            "--ordering",
            "key",
            "--brokers",
            kafka_bootstrap,
        ],
        log,
    )
    try:
        assert wait_until(
            lambda: len({(r[1], r[2]) for r in read_log(log)}) >= n or proc.poll() is not None, 60
        )
    finally:
        code, output = stop(proc)
    # then it exited 0, without a traceback, every record was handled, and the offsets are at the end
    assert code == 0, output[-3000:]
    assert "Traceback" not in output
    assert len({(r[1], r[2]) for r in read_log(log)}) == n
    assert committed(kafka_bootstrap, group, topic, 3) == end_offsets(kafka_bootstrap, topic, 3)


@pytest.mark.kafka
@pytest.mark.timeout(120)
def test_run_module_app_runs_every_route_then_sigterm_drains_commits_and_runs_shutdown(
    kafka_bootstrap: str, new_topic: Callable[..., str], tmp_path: Path
) -> None:
    # given two topics of 200 records each, and a KeyedApp with a route for each (one group)
    topics = [new_topic(2), new_topic(2)]
    for t in topics:
        produce(kafka_bootstrap, t, [(f"k{i % 20}".encode(), str(i).encode(), None) for i in range(200)])
    group = f"cli-app-{uuid.uuid4().hex[:8]}"
    log = tmp_path / "handled.log"
    env = {
        "KC_CLI_BROKERS": kafka_bootstrap,
        "KC_CLI_GROUP": group,
        "KC_CLI_TOPIC1": topics[0],
        "KC_CLI_TOPIC2": topics[1],
    }
    # when `keyedconsumer run module:app` runs it until every record was handled, then gets SIGTERM
    proc = start_run(["tests.integration.procs.cli_app:app", "--health-port", "0"], log, env)
    try:
        assert wait_until(lambda: len(read_log(log)) >= 400 or proc.poll() is not None, 60)
    finally:
        code, output = stop(proc)
    # then it exited 0, both routes handled all, the offsets are at the end, the shutdown hook ran last
    assert code == 0, output[-3000:]
    rows = read_log(log)
    assert rows[-1][0] == "shutdown" and len(rows) - 1 >= 400, rows[-3:]  # the log names no topic: counted
    assert "health on http://127.0.0.1:" in output  # --health-port serves every route's health
    for t in topics:
        assert committed(kafka_bootstrap, group, t, 2) == end_offsets(kafka_bootstrap, t, 2)
    # and what belongs to the routes (topics, the handler's middleware) is refused as a flag, not ignored
    bad = start_run(
        ["tests.integration.procs.cli_app:app", "--topic", "x", "--retry-attempts", "2"], log, env
    )
    out, err = bad.communicate(timeout=60)
    assert bad.returncode == 2 and "is a KeyedApp" in err and "topics" in err and "retry_attempts" in err, err


@pytest.mark.kafka
@pytest.mark.timeout(240)
def test_a_flag_beats_the_environment_which_beats_the_toml_file_for_the_group_and_concurrency(
    kafka_bootstrap: str, new_topic: Callable[..., str], tmp_path: Path
) -> None:
    # given 80 records over 2 partitions, and a group and a concurrency in each of the three layers
    topic = new_topic(2)
    n = 80
    produce(kafka_bootstrap, topic, [(f"k{i % 20}".encode(), str(i).encode(), None) for i in range(n)])
    uid = uuid.uuid4().hex[:8]
    groups = {layer: f"cli-layers-{layer}-{uid}" for layer in ("flag", "environment", "file")}
    toml = tmp_path / "kc.toml"
    toml.write_text(
        f'handler = "tests.integration.procs.cli_handlers:handle_counting"\ngroup = "{groups["file"]}"\n'
        f'topics = ["{topic}"]\nbrokers = ["{kafka_bootstrap}"]\nconcurrency = 2\n'
    )
    env = {"KEYEDCONSUMER_GROUP": groups["environment"], "KEYEDCONSUMER_CONCURRENCY": "3"}
    flags = ["--group", groups["flag"], "--concurrency", "4"]
    runs = [("flag", flags, env, 4), ("environment", [], env, 3), ("file", [], {}, 2)]
    for i, (winner, args, extra_env, concurrency) in enumerate(runs):
        log = tmp_path / f"handled-{winner}.log"
        # when `keyedconsumer run --config kc.toml` runs with these layers until all records were handled
        proc = start_run(["--config", str(toml), *args], log, extra_env)
        try:
            assert wait_until(
                lambda: len({(r[1], r[2]) for r in read_log(log)}) >= n or proc.poll() is not None,  # noqa: B023
                90,
            )
        finally:
            code, output = stop(proc)
        # then the winning layer's group consumed and committed everything, with its concurrency
        assert code == 0, output[-3000:]
        assert f"as group {groups[winner]} with " in output and f"(concurrency={concurrency}," in output, (
            output[-3000:]
        )
        assert len({(r[1], r[2]) for r in read_log(log)}) == n
        assert max(int(r[4].rsplit("|", 1)[1]) for r in read_log(log)) <= concurrency
        assert committed(kafka_bootstrap, groups[winner], topic, 2) == end_offsets(kafka_bootstrap, topic, 2)
        # and the groups of the lower layers (not run yet) committed nothing
        for lower, *_ in runs[i + 1 :]:
            assert committed(kafka_bootstrap, groups[lower], topic, 2) == {0: None, 1: None}, lower


@pytest.mark.kafka
@pytest.mark.timeout(120)
def test_run_serves_health_and_metrics_and_logs_json(
    kafka_bootstrap: str, new_topic: Callable[..., str], tmp_path: Path
) -> None:
    import json as jsonlib
    import socket
    import urllib.request

    # given a topic of 50 records, and free ports
    topic = new_topic(1)
    produce(kafka_bootstrap, topic, [(f"k{i % 5}".encode(), str(i).encode(), None) for i in range(50)])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        metrics_port = s.getsockname()[1]
    log = tmp_path / "handled.log"
    # when the CLI runs with JSON logs, health endpoints on any free port, and metrics
    proc = start_run(
        [
            "tests.integration.procs.cli_handlers:handle",
            "--topic",
            topic,
            "--group",
            f"cli-ops-{uuid.uuid4().hex[:8]}",
            "--brokers",
            kafka_bootstrap,
            "--log-format",
            "json",
            "--health-port",
            "0",
            "--metrics-port",
            str(metrics_port),
        ],
        log,
    )
    lines: list[dict[str, Any]] = []
    try:
        assert wait_until(lambda: len(read_log(log)) >= 50 or proc.poll() is not None, 60)
        assert proc.poll() is None
        # then readiness and metrics answer over HTTP
        health_url = None
        deadline = time.monotonic() + 20
        while health_url is None and time.monotonic() < deadline:
            line = proc.stderr.readline() if proc.stderr else ""
            if line.strip():
                lines.append(jsonlib.loads(line))  # every log line is one JSON object
                if lines[-1]["message"].startswith("health on "):
                    health_url = lines[-1]["message"].split()[2].rsplit("/", 1)[0]
        assert health_url is not None, lines
        ready = jsonlib.loads(urllib.request.urlopen(f"{health_url}/readyz", timeout=10).read())
        assert ready["ready"] is True and ready["assigned_partitions"] == 1
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        assert "messaging_client_consumed_messages_total" in text and "keyedconsumer_partition_lag" in text
    finally:
        code, output = stop(proc)
    assert code == 0, output[-3000:]
    for line in output.splitlines():
        if line.strip():
            assert {"asctime", "levelname", "name", "message"} <= set(jsonlib.loads(line)), line


@pytest.mark.kafka
@pytest.mark.timeout(60)
def test_run_failure_exits_1_without_secrets_or_traceback(kafka_bootstrap: str, tmp_path: Path) -> None:
    # given brokers that do not answer, a SASL password and a Redis URL with a password
    proc = start_run(
        [
            "tests.integration.procs.cli_handlers:handle",
            "--topic",
            "t",
            "--group",
            "g",
            "--brokers",
            "127.0.0.1:1",
            "-X",
            "sasl.password=hunter2-pw",
            "-X",
            "sasl.username=me",
            "--redis",
            "redis://:s3cret-pw@127.0.0.1:6379/0",
        ],
        tmp_path / "log",
        extra_env={"KEYEDCONSUMER_STARTUP_TIMEOUT_S": "2"},
    )
    out, err = proc.communicate(timeout=45)
    # then it fails with one clear line and exit code 1, and no secret appears anywhere
    assert proc.returncode == 1, err
    assert "no answer from the brokers" in err
    assert "redis://:***@127.0.0.1:6379/0" in err  # the startup line names the Redis URL, redacted
    for secret in ("hunter2-pw", "s3cret-pw"):
        assert secret not in out + err
    assert "Traceback" not in out + err


# -- bad input: exit code 2, one line, no traceback ---------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("spec", "extra", "expected"),
    [
        ("nocolon", [], "expected 'package.module:function'"),
        ("no.such.module:handle", [], "no module named 'no'"),
        ("tests.integration.procs.cli_handlers:missing", [], "has no attribute 'missing'"),
        ("tests.integration.procs.cli_handlers:NOT_CALLABLE", [], "is not callable"),
        ("tests.integration.procs.cli_handlers:Message", [], "is a class"),
        ("tests.integration.procs.cli_handlers:handle", ["--concurrency", "0"], "concurrency"),
        (
            "tests.integration.procs.cli_handlers:handle",
            ["--ordering", "sideways"],
            "'sideways' is not one of",
        ),
        (
            "tests.integration.procs.cli_handlers:handle",
            ["--concurrency", "many"],
            "Invalid value for '--concurrency'",
        ),
        ("tests.integration.procs.cli_handlers:handle", ["-X", "no-equals-sign"], "-X expects KEY=VALUE"),
        (
            "tests.integration.procs.cli_handlers:handle",
            ["-X", "no.such.property=1"],
            "No such configuration property",
        ),
        ("tests.integration.procs.cli_handlers:handle", ["--retry-attempts", "0"], "retry_attempts"),
        (
            "tests.integration.procs.cli_handlers:handle",
            ["--redis", "redis://:pw@h/0", "--ordering", "none"],
            "sequencer",
        ),
        ("tests.integration.procs.cli_handlers:handle", ["--redis", "http://h/0"], "expected a redis://"),
        ("tests.integration.procs.cli_handlers:handle", ["--park"], "--park needs --redis"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_2(spec: str, extra: list[str], expected: str) -> None:
    result = cli("run", spec, "--topic", "t", "--group", "g", "--app-dir", str(ROOT), *extra)
    assert result.exit_code == 2, result.output
    assert expected in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception


@pytest.mark.timeout(30)
def test_settings_precedence_flags_env_toml_defaults(tmp_path: Path) -> None:
    # given a TOML file, environment variables and flags that disagree
    toml = tmp_path / "kc.toml"
    toml.write_text(
        'handler = "tests.integration.procs.cli_handlers:handle"\n'
        'group = "g-toml"\ntopics = ["t-toml"]\nconcurrency = 4\nordering = "partition"\nmax_in_flight = 77\n'
        '[config]\n"client.id" = "toml"\n"socket.timeout.ms" = 12345\n"sasl.password" = "toml-secret"\n'
    )
    base = ["run", "--app-dir", str(ROOT), "--config", str(toml), "--print-settings"]

    def settings(*args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
        result = cli(*base, *args, env=env)
        assert result.exit_code == 0, result.output
        assert "toml-secret" not in result.output
        data: dict[str, Any] = json.loads(result.stdout)
        return data

    env = {"KEYEDCONSUMER_CONCURRENCY": "8", "KEYEDCONSUMER_CONFIG": '{"client.id": "env"}'}
    # when only the TOML file is given, then its values win over the defaults
    s = settings()
    assert (s["concurrency"], s["ordering"], s["max_in_flight"], s["name"], s["topics"]) == (
        4,
        "partition",
        77,
        "g-toml",
        ["t-toml"],
    )
    assert s["config"] == {"client.id": "toml", "socket.timeout.ms": 12345, "sasl.password": "***"}
    assert s["batch_size"] == 500  # a default
    # when the environment sets some, it wins over the TOML file (librdkafka properties merge one by one)
    s = settings(env=env)
    assert (s["concurrency"], s["ordering"]) == (8, "partition")
    assert s["config"]["client.id"] == "env" and s["config"]["socket.timeout.ms"] == 12345
    # when flags are given, they win over both
    s = settings("--concurrency", "16", "-X", "client.id=flag", "--group", "g-flag", "-t", "a,b", env=env)
    assert (s["concurrency"], s["config"]["client.id"], s["name"], s["group_id"], s["topics"]) == (
        16,
        "flag",
        "g-flag",
        "g-flag",
        ["a", "b"],
    )


@pytest.mark.timeout(30)
def test_flags_beat_environment_variables_even_where_they_set_other_fields(tmp_path: Path) -> None:
    handler = "tests.integration.procs.cli_handlers:handle"

    def settings(*args: str, env: dict[str, str]) -> dict[str, Any]:
        result = cli("run", handler, "--app-dir", str(ROOT), "--print-settings", *args, env=env)
        assert result.exit_code == 0, result.output
        data: dict[str, Any] = json.loads(result.stdout)
        return data

    env = {
        "KEYEDCONSUMER_GROUP_ID": "g-env",
        "KEYEDCONSUMER_NAME": "n-env",
        "KEYEDCONSUMER_TOPICS": "t-env",
        "KEYEDCONSUMER_BROKERS": "envhost:9092",
        "KEYEDCONSUMER_REDIS": "redis://envhost:6379/0",
        "KEYEDCONSUMER_CONCURRENCY": "8",
    }
    # given environment variables for every setting, when flags are given too, then every flag wins:
    # --group sets the name and the group id, which the environment sets as two variables
    s = settings(
        "--group",
        "g-flag",
        "-t",
        "t-flag",
        "--brokers",
        "flaghost:9092",
        "--redis",
        "redis://flaghost:6379/0",
        "--concurrency",
        "16",
        env=env,
    )
    assert (s["name"], s["group_id"], s["namespace"]) == ("g-flag", "g-flag", "g-flag")
    assert (s["topics"], s["brokers"], s["redis"], s["concurrency"]) == (
        ["t-flag"],
        ["flaghost:9092"],
        "redis://flaghost:6379/0",
        16,
    )
    # when no flag is given, then the environment decides, group_id over name for the group id
    s = settings(env=env)
    assert (s["name"], s["group_id"], s["topics"], s["brokers"], s["concurrency"]) == (
        "n-env",
        "g-env",
        ["t-env"],
        ["envhost:9092"],
        8,
    )
    # and the environment beats the TOML file, whichever of group / group_id / name each one sets
    toml = tmp_path / "kc.toml"
    toml.write_text('group_id = "g-toml"\nname = "n-toml"\ntopics = ["t-toml"]\n')
    s = settings("--config", str(toml), env={"KEYEDCONSUMER_GROUP": "g-env"})
    assert (s["name"], s["group_id"], s["topics"]) == ("g-env", "g-env", ["t-toml"])
    s = settings("--config", str(toml), env={})
    assert (s["name"], s["group_id"]) == ("n-toml", "g-toml")


@pytest.mark.timeout(60)
def test_no_secret_in_print_settings_or_in_error_output() -> None:
    sasl, redis_pw = "Qx9v-sasl-Pa55", "Rz7w-redis-Pa55"
    base = [
        "run",
        "tests.integration.procs.cli_handlers:handle",
        "-t",
        "t",
        "-g",
        "g",
        "--app-dir",
        str(ROOT),
    ]
    printed = [
        (
            [
                "-X",
                f"sasl.password={sasl}",
                "-X",
                "sasl.username=u",
                "--redis",
                f"redis://:{redis_pw}@127.0.0.1:6379/0",
            ],
            {},
        ),
        (
            ["--redis", f"redis://127.0.0.1:6379/0?password={redis_pw}"],
            {"KEYEDCONSUMER_CONFIG": json.dumps({"sasl.password": sasl})},
        ),
    ]
    for args, env in printed:
        result = cli(*base, *args, "--print-settings", env=env)
        assert result.exit_code == 0, result.output
        assert sasl not in result.output and redis_pw not in result.output, result.output
        shown = json.loads(result.stdout)
        assert shown["config"]["sasl.password"] == "***" and "127.0.0.1:6379" in shown["redis"]
    refused = [
        (
            ["-X", f"sasl.password={sasl}", "-X", "security.protocol=NOPE"],
            {},
        ),  # the config field itself fails
        (["-X", f"sasl.password={sasl}", "--concurrency", "0"], {}),  # another field fails
        ([], {"KEYEDCONSUMER_CONFIG": json.dumps({"sasl.password": sasl, "no.such.property": 1})}),
        ([], {"KEYEDCONSUMER_SASL_PASSWORD": sasl}),  # an unknown variable: its value is not shown
        (["--redis", f"redis://:{redis_pw}@127.0.0.1:6379/0", "--ordering", "none"], {}),
        (["--redis", f"http://:{redis_pw}@127.0.0.1:6379/0"], {}),
    ]
    for args, env in refused:  # refused before anything connects (nothing answers at 127.0.0.1:1 anyway)
        result = cli(*base, *args, "-b", "127.0.0.1:1", env={"KEYEDCONSUMER_STARTUP_TIMEOUT_S": "1", **env})
        assert result.exit_code == 2, result.output
        assert sasl not in result.output and redis_pw not in result.output, result.output


@pytest.mark.timeout(30)
def test_unknown_toml_setting_is_refused(tmp_path: Path) -> None:
    toml = tmp_path / "kc.toml"
    toml.write_text("concurrancy = 4\n")
    result = cli("run", "json:dumps", "-t", "t", "-g", "g", "--config", str(toml))
    assert (
        result.exit_code == 2
        and "concurrancy (from file " in result.output
        and "unknown setting" in result.output
    )


@pytest.mark.timeout(30)
def test_unknown_environment_variable_is_refused_and_the_cli_own_ones_are_not(tmp_path: Path) -> None:
    base = [
        "run",
        "tests.integration.procs.cli_handlers:handle",
        "-t",
        "t",
        "--app-dir",
        str(ROOT),
        "--print-settings",
    ]
    # given the command line's own variables (not ConsumerConfig fields): accepted
    own = {
        "KEYEDCONSUMER_GROUP": "g-env",
        "KEYEDCONSUMER_NAMESPACE": "ns",
        "KEYEDCONSUMER_RETRY_ATTEMPTS": "2",
        "KEYEDCONSUMER_CONFIG_FILE": str(tmp_path / "none.toml"),
    }
    (tmp_path / "none.toml").write_text("")
    result = cli(*base, env=own)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["name"] == "g-env"
    # when a variable is misspelt, then it is refused naming it, exit code 2
    result = cli(*base, "-g", "g", env={"KEYEDCONSUMER_CONCURENCY": "8"})
    assert result.exit_code == 2, result.output
    assert "KEYEDCONSUMER_CONCURENCY" in result.output and "KEYEDCONSUMER_CONCURRENCY" in result.output


# -- inspect --------------------------------------------------------------------------------------------


@pytest.mark.kafka
@pytest.mark.timeout(60)
def test_inspect_json_shows_committed_end_lag_and_age(
    kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    # given 10 records on partition 0 and 4 on partition 1, produced a few seconds ago
    topic = new_topic(2)
    produce(
        kafka_bootstrap,
        topic,
        [(b"k", str(i).encode(), 0) for i in range(10)] + [(b"k", b"x", 1) for _ in range(4)],
    )
    time.sleep(1.5)
    # and a group that committed 3 on partition 0 (7 behind) and 4 on partition 1 (caught up)
    group = f"cli-inspect-{uuid.uuid4().hex[:8]}"
    c = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": group})
    c.commit(offsets=[TopicPartition(topic, 0, 3), TopicPartition(topic, 1, 4)], asynchronous=False)
    c.close()
    # when inspecting it, with and without --topic
    for args in (["--topic", topic], []):
        data = cli_json("inspect", "--group", group, "--brokers", kafka_bootstrap, *args)
        # then each partition shows its committed offset, end offset, lag and the age of the record at the
        # committed offset where the lag is above 0
        rows = {(r["topic"], r["partition"]): r for r in data["partitions"]}
        assert set(rows) == {(topic, 0), (topic, 1)}
        p0, p1 = rows[(topic, 0)], rows[(topic, 1)]
        assert (p0["committed_offset"], p0["end_offset"], p0["lag"]) == (3, 10, 7)
        assert (p1["committed_offset"], p1["end_offset"], p1["lag"]) == (4, 4, 0)
        assert 1.0 <= p0["oldest_unfinished_age_s"] < 60
        assert p1["oldest_unfinished_age_s"] is None
        assert data["total_lag"] == 7 and data["group"] == group and data["redis"] is None
        assert data["state"] == "empty" and data["members"] == 0
    # and the table form says the same
    result = cli("inspect", "--group", group, "--brokers", kafka_bootstrap, "--topic", topic)
    assert result.exit_code == 0, result.output
    assert "total lag: 7" in result.output


@pytest.mark.kafka
@pytest.mark.timeout(30)
def test_inspect_unreachable_brokers_exit_1(kafka_bootstrap: str) -> None:
    result = cli(
        "inspect", "--group", "g", "--brokers", "127.0.0.1:1", "--timeout", "2", "-X", "sasl.password=pw-xyz"
    )
    assert result.exit_code == 1
    assert "no answer from the brokers" in result.output and "pw-xyz" not in result.output


@pytest.mark.kafka
@pytest.mark.redis
@pytest.mark.timeout(90)
def test_inspect_with_redis_shows_a_held_lease(
    kafka_bootstrap: str, redis_url: str, new_topic: Callable[..., str], start: Callable[[KeyedConsumer], Any]
) -> None:
    # given a consumer with the Redis sequencer whose handler of key "held" blocks (so its lease is held)
    topic = new_topic(1)
    group = f"cli-redis-{uuid.uuid4().hex[:8]}"
    namespace = f"ns{uuid.uuid4().hex[:8]}"
    entered, release = threading.Event(), threading.Event()

    def handle(msg: Message) -> None:
        if msg.key == b"held":
            entered.set()
            release.wait(30)

    produce(kafka_bootstrap, topic, [(b"held", b"1", 0), (b"held", b"2", 0), (b"other", b"3", 0)])
    running = start(
        KeyedConsumer(
            name=group,
            handler=handle,
            brokers=[kafka_bootstrap],
            topics=[topic],
            concurrency=4,
            sequencer=RedisSequencer(redis_url, namespace, lease_ttl_s=5.0),
        )
    )
    try:
        assert entered.wait(30)
        # when inspecting the group with --redis
        data = cli_json(
            "inspect",
            "--group",
            group,
            "--topic",
            topic,
            "--brokers",
            kafka_bootstrap,
            "--redis",
            redis_url,
            "--namespace",
            namespace,
        )
        # then the Redis part lists the held lease with its owner, TTL and fencing token
        info = data["redis"]
        assert set(info) >= {"leases", "parked", "scheduled", "instances"}
        held = [le for le in info["leases"] if le["key"] == "held"]
        assert len(held) == 1, info
        assert held[0]["fencing_token"] >= 1 and 0 < held[0]["ttl_ms"] <= 5000 and held[0]["owner"]
        assert isinstance(info["scheduled"], int)
        # and the table form renders it
        result = cli(
            "inspect",
            "--group",
            group,
            "--topic",
            topic,
            "--brokers",
            kafka_bootstrap,
            "--redis",
            redis_url,
            "--namespace",
            namespace,
        )
        assert result.exit_code == 0, result.output
        assert "leased keys" in result.output and "held" in result.output
    finally:
        release.set()
    assert running.stop(30)


@pytest.mark.kafka
@pytest.mark.timeout(60)
def test_inspect_redis_tables_render_every_part(
    kafka_bootstrap: str, new_topic: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # given a Redis namespace with a lease, a parked key, scheduled messages and an instance
    import keyedconsumer.cli.inspect as inspect_command

    now = time.time()
    info = {
        "leases": [{"key": "acct-1", "owner": "inst-a:7", "ttl_ms": 4000, "fencing_token": 12}],
        "parked": [{"key": "acct-2", "depth": 3, "next_due_s": now + 30}],
        "scheduled": 5,
        "instances": [{"id": "inst-a", "last_seen_s": now - 2}],
    }
    seen: list[tuple[str, str]] = []

    def fake(url: str, namespace: str) -> dict[str, Any]:
        seen.append((url, namespace))
        return info

    monkeypatch.setattr(inspect_command, "inspect_redis", fake)  # the rendering is what is tested
    topic = new_topic(1)
    # when inspecting with --redis (a password in the URL, no --namespace)
    args = [
        "inspect",
        "--group",
        "g-tables",
        "--topic",
        topic,
        "--brokers",
        kafka_bootstrap,
        "--redis",
        "redis://:pw-in-url@127.0.0.1:6379/0",
    ]
    result = cli(*args)
    # then every part is shown, the namespace defaults to the group, and the password is not printed
    assert result.exit_code == 0, result.output
    for text in ("acct-1", "inst-a:7", "acct-2", "scheduled messages: 5", "inst-a", "parked keys (1)"):
        assert text in result.output
    assert "pw-in-url" not in result.output
    assert seen[0] == ("redis://:pw-in-url@127.0.0.1:6379/0", "g-tables")
    assert cli_json(*args)["redis"] == info


# -- dead-letter replay ---------------------------------------------------------------------------------


@pytest.mark.kafka
@pytest.mark.timeout(180)
def test_poison_to_dead_letter_then_replay_once(kafka_bootstrap: str, tmp_path: Path) -> None:
    # given a topic with 24 good records and 6 poison ones (keys a, a, b, c, c, c) with an own header
    topic = create_topic(kafka_bootstrap, f"orders-{uuid.uuid4().hex[:8]}", 2)
    dlq = create_topic(kafka_bootstrap, f"{topic}.dlq", 2)
    fixed = create_topic(kafka_bootstrap, f"{topic}-fixed", 2)
    poison_keys = [b"a", b"a", b"b", b"c", b"c", b"c"]
    p = Producer({"bootstrap.servers": kafka_bootstrap, "acks": "all"})
    for i in range(24):
        p.produce(topic, key=f"g{i % 5}".encode(), value=f"good-{i}".encode(), headers=[("trace", b"t")])
    for i, k in enumerate(poison_keys):
        p.produce(topic, key=k, value=f"poison-{i}".encode(), headers=[("trace", f"p{i}".encode())])
    assert p.flush(30) == 0
    group = f"cli-dlq-{uuid.uuid4().hex[:8]}"
    log = tmp_path / "handled.log"
    # when the CLI runs a handler that fails poison records, with a dead-letter topic and 2 attempts
    proc = start_run(
        [
            "tests.integration.procs.cli_handlers:poison",
            "--topic",
            topic,
            "--group",
            group,
            "-c",
            "4",
            "--brokers",
            kafka_bootstrap,
            "--dead-letter-topic",
            dlq,
            "--retry-attempts",
            "2",
        ],
        log,
    )
    try:
        assert wait_until(
            lambda: sum(end_offsets(kafka_bootstrap, dlq, 2).values()) >= 6 or proc.poll() is not None, 90
        )
        assert wait_until(lambda: sum(1 for r in read_log(log) if r[0] == "ok") >= 24, 30)
    finally:
        code, output = stop(proc)
    assert code == 0, output[-3000:]
    # then each poison record was tried twice and dead-lettered, and the group is at the end
    fails = [r for r in read_log(log) if r[0] == "fail"]
    assert len(fails) == 12 and len({(r[1], r[2]) for r in fails}) == 6
    assert committed(kafka_bootstrap, group, topic, 2) == end_offsets(kafka_bootstrap, topic, 2)
    dead = read_all(kafka_bootstrap, dlq, 6)
    assert sorted(m.key() for m in dead) == sorted(poison_keys)
    marker_group = f"keyedconsumer-replay.{dlq}"

    # when replaying with --dry-run, then it lists the 6 records but sends and marks nothing
    data = cli_json(
        "dead-letter", "replay", "--from", dlq, "--to", fixed, "--dry-run", "--brokers", kafka_bootstrap
    )
    assert data["sent"] == 6 and data["dry_run"] and {r["offset"] for r in data["records"]} == {None}
    assert sum(end_offsets(kafka_bootstrap, fixed, 2).values()) == 0  # not even a transaction marker
    assert set(committed(kafka_bootstrap, marker_group, dlq, 2).values()) == {None}

    # when replaying only key "a" to the fixed-up topic, then exactly the two "a" records are sent
    data = cli_json(
        "dead-letter", "replay", "--from", dlq, "--to", fixed, "--key", "a", "--brokers", kafka_bootstrap
    )
    assert data["sent"] == 2 and [r["key"] for r in data["records"]] == ["a", "a"]
    assert data["not_matching"] == 4
    assert sorted(m.key() for m in read_committed_records(kafka_bootstrap, fixed, 2)) == [b"a", b"a"]

    # when replaying the rest, then the 4 others are sent, the "a" ones are not sent again
    data = cli_json("dead-letter", "replay", "--from", dlq, "--to", fixed, "--brokers", kafka_bootstrap)
    assert (
        data["sent"] == 4 and data["already_replayed"] <= 2
    )  # (those below the marker's offset are not even read)
    assert sorted(r["key"] for r in data["records"]) == ["b", "c", "c", "c"]

    # when replaying again, then nothing is sent (the marker is at the end offsets: nothing left to read)
    data = cli_json("dead-letter", "replay", "--from", dlq, "--to", fixed, "--brokers", kafka_bootstrap)
    assert (data["sent"], data["records"]) == (0, [])
    assert {p: o or 0 for p, o in committed(kafka_bootstrap, marker_group, dlq, 2).items()} == end_offsets(
        kafka_bootstrap, dlq, 2
    )

    # and the fixed-up topic holds each poison record once: key, value, own headers kept, failure headers gone
    out = read_committed_records(kafka_bootstrap, fixed, 6)
    assert sorted((m.key(), m.value()) for m in out) == sorted(
        zip(poison_keys, [f"poison-{i}".encode() for i in range(6)], strict=True)
    )
    for m in out:
        names = [k for k, _ in m.headers() or []]
        assert names == ["trace"], names
        assert dict(m.headers())["trace"] == b"p" + m.value().split(b"-")[1]
    # and per key the replayed order is the original order
    for k in (b"a", b"c"):
        values = [m.value() for m in sorted(out, key=lambda m: (m.partition(), m.offset())) if m.key() == k]
        assert values == sorted(values, key=lambda v: int(v.split(b"-")[1]))

    # when replaying to the original topic (the group consumes it) under another marker, with the
    # partitioner the topic's producer used, each record goes to its key's partition: its original one
    data = cli_json(
        "dead-letter",
        "replay",
        "--from",
        dlq,
        "--group",
        group,
        "--partitioner",
        "consistent_random",
        "--marker-group",
        f"other-{group}",
        "--brokers",
        kafka_bootstrap,
    )
    assert data["sent"] == 6 and {r["topic"] for r in data["records"]} == {topic}
    originals = {
        (m.partition(), m.offset()): int(dict(m.headers())["kafka_dlt-original-partition"]) for m in dead
    }
    for r in data["records"]:
        assert r["partition"] == originals[(r["dlq_partition"], r["dlq_offset"])]
    back = read_committed_records(kafka_bootstrap, topic, 36)
    assert sorted(m.value() for m in back if m.value().startswith(b"poison")) == sorted(
        [f"poison-{i}".encode() for i in range(6)] * 2
    )


@pytest.mark.kafka
@pytest.mark.timeout(90)
def test_replay_since_and_bad_input(kafka_bootstrap: str) -> None:
    # given a dead-letter topic with records that failed an hour ago and just now
    topic = create_topic(kafka_bootstrap, f"pay-{uuid.uuid4().hex[:8]}", 1)
    dlq = create_topic(kafka_bootstrap, f"{topic}.dlq", 1)
    now_ms = int(time.time() * 1000)
    produce_dead_letters(
        kafka_bootstrap,
        dlq,
        [
            {"topic": topic, "key": b"old", "value": b"1", "failed_at_ms": now_ms - 3_600_000},
            {"topic": topic, "key": b"new", "value": b"2", "failed_at_ms": now_ms},
        ],
    )
    base = ["dead-letter", "replay", "--from", dlq, "--allow-topic", topic, "--brokers", kafka_bootstrap]
    # when replaying --since 10 minutes ago (ISO, and epoch ms), then only the new record is taken
    since_iso = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now_ms / 1000 - 600))
    for since in (since_iso, str(now_ms - 600_000)):
        data = cli_json(*base, "--since", since, "--dry-run")
        assert [r["key"] for r in data["records"]] == ["new"] and data["not_matching"] == 1
    data = cli_json(*base, "--since", since_iso)
    assert [r["key"] for r in data["records"]] == ["new"]
    # and the old one stays pending for a later replay
    data = cli_json(*base)
    assert [r["key"] for r in data["records"]] == ["old"] and data["already_replayed"] == 1
    assert cli_json(*base)["sent"] == 0
    # bad input: one line, exit code 2
    for args, expected in (
        (["--since", "yesterday"], "expected an ISO 8601 time"),
        (["--to", dlq], "--to is the dead-letter topic itself"),
        (["--to", f"missing-{uuid.uuid4().hex}"], "does not exist"),
        (["--batch-size", "0"], "--batch-size"),
    ):
        result = cli(*base, *args)
        assert result.exit_code == 2, (args, result.output)
        assert expected in result.output
    result = cli(
        "dead-letter",
        "replay",
        "--from",
        f"missing-{uuid.uuid4().hex}",
        "--allow-topic",
        topic,
        "--brokers",
        kafka_bootstrap,
    )
    assert result.exit_code == 1 and "does not exist" in result.output


@pytest.mark.kafka
@pytest.mark.timeout(180)
def test_replay_killed_mid_way_then_rerun_sends_each_record_once(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    # given a dead-letter topic of 5,000 records
    topic = create_topic(kafka_bootstrap, f"bulk-{uuid.uuid4().hex[:8]}", 1)
    dlq = create_topic(kafka_bootstrap, f"{topic}.dlq", 2)
    fixed = create_topic(kafka_bootstrap, f"{topic}-fixed", 2)
    n = 5_000
    produce_dead_letters(
        kafka_bootstrap,
        dlq,
        [
            {
                "topic": topic,
                "key": f"k{i % 100}".encode(),
                "value": str(i).encode(),
                "failed_at_ms": 1,
                "dlq_partition": i % 2,
            }
            for i in range(n)
        ],
    )
    marker_group = f"keyedconsumer-replay.{dlq}"
    # when a replay in small batches is SIGKILLed after it marked some batches but before the end
    args = ["dead-letter", "replay", "--from", dlq, "--to", fixed, "--brokers", kafka_bootstrap]
    proc = subprocess.Popen(
        [sys.executable, "-m", "keyedconsumer", *args, "--batch-size", "10", "--json"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )

    seen = [0]

    def marked() -> int:
        seen[0] = sum(o or 0 for o in committed(kafka_bootstrap, marker_group, dlq, 2).values())
        return seen[0]

    try:
        assert wait_until(lambda: marked() > 0 or proc.poll() is not None, 60, 0.02)
    finally:
        proc.kill()
        proc.communicate(timeout=30)
    # (the marker cannot be read now: the killed replay's open transaction holds it until aborted)
    assert 0 < seen[0] < n, "the replay was not killed mid-way"
    # and the replay is run again
    data = cli_json(*args)
    # then consumers reading committed records see every record exactly once
    assert 0 < data["sent"] < n
    out = read_committed_records(kafka_bootstrap, fixed, n)
    values = sorted(int(m.value()) for m in out)
    assert values == list(range(n))


@pytest.mark.kafka
@pytest.mark.timeout(180)
def test_a_second_replay_fences_off_a_running_one(kafka_bootstrap: str) -> None:
    # given a dead-letter topic of 3,000 records and a slow replay (one record per transaction) running
    topic = create_topic(kafka_bootstrap, f"fence-{uuid.uuid4().hex[:8]}", 1)
    dlq = create_topic(kafka_bootstrap, f"{topic}.dlq", 1)
    fixed = create_topic(kafka_bootstrap, f"{topic}-fixed", 1)
    n = 3_000
    produce_dead_letters(
        kafka_bootstrap,
        dlq,
        [{"topic": topic, "key": b"k", "value": str(i).encode(), "failed_at_ms": 1} for i in range(n)],
    )
    marker_group = f"keyedconsumer-replay.{dlq}"
    args = ["dead-letter", "replay", "--from", dlq, "--to", fixed, "--brokers", kafka_bootstrap]
    first = subprocess.Popen(
        [sys.executable, "-m", "keyedconsumer", *args, "--batch-size", "1"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert wait_until(
            lambda: (
                (committed(kafka_bootstrap, marker_group, dlq, 1)[0] or 0) > 0 or first.poll() is not None
            ),
            60,
            0.02,
        )
        assert first.poll() is None, "the first replay ended before the second started"
        # when a second replay of the same dead-letter topic starts
        data = cli_json(*args)
    finally:
        try:
            out, err = first.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            first.kill()
            out, err = first.communicate()
    # then the first one stops with an error (fenced), and readers of committed records see each record once
    assert first.returncode == 1, err
    assert "fenced" in err.lower() and "Traceback" not in err, err[-4000:]
    assert data["sent"] > 0
    values = sorted(int(m.value()) for m in read_committed_records(kafka_bootstrap, fixed, n))
    assert values == list(range(n))


# -- --since (no broker) --------------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_parse_since() -> None:
    assert parse_since("1700000000000") == 1_700_000_000_000
    assert parse_since("2023-11-14T22:13:20Z") == 1_700_000_000_000
    assert parse_since("2023-11-14T22:13:20") == 1_700_000_000_000  # no offset: UTC
    assert parse_since("2023-11-15T00:13:20+02:00") == 1_700_000_000_000
