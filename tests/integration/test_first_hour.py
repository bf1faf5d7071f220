"""The first hour of a new user (issue 26), on the real broker: what ``keyedconsumer run`` and
``keyedconsumer web`` print and how they end when the user gets something wrong.

Each command runs as a subprocess (``python -m keyedconsumer``), as the user runs it:

- a wrong broker address, refused SASL credentials: a few log lines, every one JSON with
  ``--log-format json`` (librdkafka's own lines included), the repeats counted, no asyncio traceback,
  no startup hook run, and the last line the one error;
- a subscribed topic that does not exist: the warning names it and the closest existing topic,
  readiness stays false; ``--require-topics`` makes it an error at start;
- ``--brokers`` beats the brokers hard-coded in ``KeyedApp(...)``; the stop's log lines say which
  commit was confirmed and which was only sent;
- ``keyedconsumer web`` exits 0 on SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from .kafkautil import log_lines, produce, wait_until

pytestmark = pytest.mark.kafka

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.integration.procs.first_hour_app:app"
HANDLER = "tests.integration.procs.cli_handlers:handle"
#: The most lines a failed start may log, the error included: the command's first line, the first
#: of each kind of client error (librdkafka's line and the error_cb report, each once), their counts
#: at the close, the error. Before issue 26: ~390 lines in 10 s against an unreachable address.
MOST_LINES = 10


@pytest.fixture
def kc(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """``kc(*args, env=...) -> Popen``: ``keyedconsumer <args>`` in a subprocess (stdout and stderr
    piped, text); every one still running is killed at teardown."""
    procs: list[subprocess.Popen[str]] = []

    def start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "keyedconsumer", *args],
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)


def app_env(tmp_path: Path, brokers: str, topic: str = "fh-orders") -> dict[str, str]:
    return {
        "KC_FH_BROKERS": brokers,
        "KC_FH_GROUP": f"fh-{uuid.uuid4().hex[:8]}",
        "KC_FH_TOPIC": topic,
        "KC_FH_LOG": str(tmp_path / "app.log"),
    }


def app_log(tmp_path: Path) -> list[str]:
    path = tmp_path / "app.log"
    return log_lines(path)


def json_lines(stderr: str) -> list[dict[str, Any]]:
    """Every line of ``stderr`` as the JSON object it must be."""
    out = []
    for line in stderr.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pytest.fail(f"a line that is not JSON: {line!r}\n--- stderr:\n{stderr}")
    return out


def assert_one_clear_error(stderr: str, error: str) -> list[dict[str, Any]]:
    lines = json_lines(stderr)
    assert len(lines) <= MOST_LINES, stderr
    assert "Task exception was never retrieved" not in stderr and "Traceback" not in stderr, stderr
    last = lines[-1]
    assert (last["levelname"], last["name"]) == ("ERROR", "keyedconsumer.cli"), stderr
    assert last["message"].startswith("error: stopped: " + error), stderr
    assert not [x for x in lines[:-1] if x["message"].startswith("error:")], stderr
    return lines


# -- a wrong broker address, refused credentials --------------------------------------------------------


@pytest.mark.timeout(90)
def test_unreachable_brokers_log_a_few_json_lines_and_end_with_the_error_before_any_startup_hook(
    tmp_path: Path, kc: Callable[..., subprocess.Popen[str]]
) -> None:
    # given an app whose code names an address nobody listens on
    proc = kc(
        "run", APP, "--log-format", "json", "--startup-timeout-s", "5", env=app_env(tmp_path, "127.0.0.1:1")
    )
    # when it runs
    _, stderr = proc.communicate(timeout=60)
    # then it fails with a few JSON lines, librdkafka's among them, the repeats counted, one error last
    assert proc.returncode == 1, stderr
    lines = assert_one_clear_error(stderr, "no answer from the brokers within 5 s")
    librdkafka = [x for x in lines if x["name"] == "keyedconsumer.kafka.librdkafka"]
    assert librdkafka and "Connection refused" in librdkafka[0]["message"], stderr
    assert any("more like it in the last" in x["message"] for x in lines), stderr
    # and the brokers were asked before the startup hooks: none ran
    assert "startup" not in app_log(tmp_path)


@pytest.mark.timeout(90)
def test_unreachable_brokers_with_a_dead_letter_producer_log_a_few_json_lines(
    tmp_path: Path, kc: Callable[..., subprocess.Popen[str]]
) -> None:
    # given a handler with a dead-letter topic (a producer too) and an address nobody listens on
    args = [
        "run",
        HANDLER,
        "-t",
        "fh-x",
        "-g",
        f"fh-{uuid.uuid4().hex[:8]}",
        "--dead-letter-topic",
        "fh-x.dlq",
    ]
    proc = kc(
        *args,
        *("--brokers", "127.0.0.1:1", "--log-format", "json", "--startup-timeout-s", "5"),
        env={"KC_CLI_LOG": str(tmp_path / "handled.log")},
    )
    _, stderr = proc.communicate(timeout=60)
    # then the producer's librdkafka lines are JSON log lines too, counted like the consumer's
    assert proc.returncode == 1, stderr
    assert_one_clear_error(stderr, "no answer from the brokers within 5 s")


@pytest.mark.timeout(90)
def test_refused_sasl_credentials_log_a_few_json_lines_and_end_with_the_error(
    tmp_path: Path, kc: Callable[..., subprocess.Popen[str]], sasl_bootstrap: str
) -> None:
    # given an app on the SASL listener with a user that does not exist (SCRAM refuses it)
    password = uuid.uuid4().hex
    sasl = {
        "security.protocol": "SASL_PLAINTEXT",
        "sasl.mechanism": "SCRAM-SHA-256",
        "sasl.username": f"nobody-{uuid.uuid4().hex[:8]}",
        "sasl.password": password,
    }
    props = [a for k, v in sasl.items() for a in ("-X", f"{k}={v}")]
    proc = kc("run", APP, *props, "--log-format", "json", env=app_env(tmp_path, sasl_bootstrap))
    # when it runs: it fails at once (not at startup_timeout_s), with a few JSON lines and one error
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1, stderr
    assert_one_clear_error(stderr, "authentication with the brokers failed")
    assert password not in stderr
    assert "startup" not in app_log(tmp_path)


# -- a subscribed topic that does not exist ---------------------------------------------------------------


def free_port() -> int:
    # below the ephemeral range: a port from bind(0) can be taken by an outgoing connection
    # before the server starts on it
    from tests.faults.services import stable_free_port

    return stable_free_port()


def get_json(url: str) -> tuple[int, dict[str, Any]]:
    """``(status, JSON body)`` of a GET; ``(0, {})`` while nothing listens."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except OSError:
        return 0, {}


@pytest.mark.timeout(120)
def test_a_missing_topic_is_named_with_the_closest_existing_one_and_readiness_stays_false(
    tmp_path: Path,
    kc: Callable[..., subprocess.Popen[str]],
    new_topic: Callable[..., str],
    kafka_bootstrap: str,
) -> None:
    # given an existing topic and a subscription to a misspelt name of it
    existing = new_topic(prefix="fh-orders")
    missing = existing.replace("fh-orders", "fh-order", 1)
    port = free_port()
    args = ["run", HANDLER, "-t", missing, "-g", f"fh-{uuid.uuid4().hex[:8]}", "--brokers", kafka_bootstrap]
    proc = kc(*args, "--health-port", str(port), env={"KC_CLI_LOG": str(tmp_path / "handled.log")})
    # when it runs: it waits for the topic, live and not ready, and the log says why
    assert wait_until(lambda: get_json(f"http://127.0.0.1:{port}/livez")[0] == 200, 60)
    status, report = get_json(f"http://127.0.0.1:{port}/readyz")
    assert (status, report["ready"], report["assigned_partitions"]) == (503, False, 0), report
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert f"subscribed topic {missing!r} does not exist (did you mean {existing!r}?)" in stderr, stderr
    assert stderr.count("does not exist") == 1, stderr  # librdkafka's own report of it is not repeated
    # and with --require-topics it is an error at start
    strict = kc(*args, "--require-topics", env={"KC_CLI_LOG": str(tmp_path / "handled.log")})
    _, stderr = strict.communicate(timeout=60)
    assert strict.returncode == 1, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: stopped: subscribed topic {missing!r} does not exist"), stderr
    assert f"did you mean {existing!r}?" in last


# -- --brokers over KeyedApp(brokers=...); what the stop says of its commits -----------------------------


@pytest.mark.timeout(120)
def test_the_brokers_flag_beats_the_apps_hard_coded_brokers_and_the_stop_says_what_was_confirmed(
    tmp_path: Path,
    kc: Callable[..., subprocess.Popen[str]],
    new_topic: Callable[..., str],
    kafka_bootstrap: str,
) -> None:
    # given an app whose code names an address nobody listens on, and its topics on the real broker
    topic = new_topic(partitions=2, prefix="fh-orders")
    new_topic_named(kafka_bootstrap, topic + "-payments")
    produce(kafka_bootstrap, topic, [(b"k1", b"v", None), (b"k2", b"v", None)])
    env = app_env(tmp_path, "127.0.0.1:1", topic)
    # when it runs with --brokers: the flag wins (the code's address is never tried)
    proc = kc("run", APP, "--brokers", kafka_bootstrap, env=env)
    assert wait_until(lambda: len([x for x in app_log(tmp_path) if x.startswith("handled")]) == 2, 60)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert app_log(tmp_path)[0] == "startup"
    assert "127.0.0.1:1" not in stderr, stderr
    assert "the flag --brokers replaces the app's own brokers" in stderr, stderr
    # and the stop's lines say what is known: the final commit confirmed, the revoke's only sent
    lines = stderr.splitlines()
    assert any("stopping: committed [" in x and "(confirmed)" in x for x in lines), stderr
    assert any(
        "revoked [" in x
        and "at close: the final commit's offsets sent once more, answer not awaited: [(" in x
        for x in lines
    ), stderr
    # (before: "revoke commit of [...] sent without waiting for the answer", then "revoked [...], committed [...]")
    assert not any("revoked [" in x and "committed [" in x for x in lines), stderr
    assert not any("sent without waiting" in x for x in lines), stderr


def new_topic_named(bootstrap: str, name: str) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(name, num_partitions=1, replication_factor=1)])[name].result(timeout=30)


# -- keyedconsumer web ---------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_web_exits_0_on_sigterm(kc: Callable[..., subprocess.Popen[str]], kafka_bootstrap: str) -> None:
    pytest.importorskip("uvicorn")
    port = free_port()
    proc = kc("web", "--port", str(port), "--brokers", kafka_bootstrap)

    def answers() -> bool:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2)
            return True
        except urllib.error.HTTPError:
            return True
        except OSError:
            return False

    assert wait_until(answers, 60)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, (proc.returncode, stderr)
    assert "dashboard stopped" in stderr
    assert time.monotonic() - start < 30
