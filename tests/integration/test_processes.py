"""``keyedconsumer run --processes N`` against the real broker: N children in one consumer group under
one supervisor (``python -m keyedconsumer``, a subprocess), observed through the file each handler
appends to (tests/integration/procs/multi_handlers.py: ``<pid> <partition> <offset> <key> <value>``),
the supervisor's log, its endpoints, and the group's committed offsets.

Records carry ``<key>:<n>``, n counting up per key. **Per-key order, at least once**: when a key's
n-th record is handled, its (n-1)-th has been handled before (by this child or another), and every
record is handled. The children write their lines with O_APPEND, so the file's order is the order
in which the handlers finished.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from .kafkautil import committed, end_offsets, log_lines, produce, wait_until

pytestmark = [pytest.mark.kafka]
ROOT = Path(__file__).resolve().parents[2]
HANDLERS = "tests.integration.procs.multi_handlers"
# a member killed with SIGKILL leaves its partitions stuck until its session times out: 6 s (the
# broker's group.min.session.timeout.ms), not librdkafka's 45 s
FAST_SESSION = ["-X", "session.timeout.ms=6000"]


class Supervised:
    """``keyedconsumer run ... --processes N`` as a subprocess, its output in a file (a pipe nobody
    reads would block the children once full)."""

    def __init__(self, args: list[str], log: Path, tmp: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        self.out = tmp / f"supervisor-{uuid.uuid4().hex[:6]}.out"
        with open(self.out, "w") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "keyedconsumer", "run", *args],
                cwd=ROOT,
                env={**os.environ, "KC_CLI_LOG": str(log), "PYTHONUNBUFFERED": "1", **(env or {})},
                stdout=f,
                stderr=subprocess.STDOUT,
            )

    @property
    def output(self) -> str:
        return self.out.read_text()

    def rows(self) -> list[tuple[int, int, int, str, str]]:
        out = []
        for line in log_lines(self.log):
            pid, p, o, key, value = line.split(" ", 4)
            out.append((int(pid), int(p), int(o), key, value))
        return out

    def handled(self) -> set[tuple[int, int]]:
        return {(p, o) for _, p, o, _, _ in self.rows()}

    def stop(self, timeout_s: float = 90.0) -> int:
        """SIGTERM to the supervisor; its exit code."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(
                f"the supervisor did not stop within {timeout_s} s of SIGTERM:\n{self.output[-4000:]}"
            )

    def kill(self) -> None:
        """Teardown: the supervisor and its children (by their pids, from the log), if still running."""
        for pid in [int(x) for x in _children(self.output)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def _children(output: str) -> list[str]:
    return [
        line.rsplit("(pid ", 1)[1].rstrip(")") for line in output.splitlines() if " started (pid " in line
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get_json(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def records(keys: int, per_key: int, partitions: int, start: int = 0) -> list[tuple[bytes, bytes, int]]:
    """``per_key`` records of each key, numbered from ``start``; key j on partition j % partitions."""
    return [
        (f"k{j}".encode(), f"k{j}:{n}".encode(), j % partitions)
        for n in range(start, start + per_key)
        for j in range(keys)
    ]


def assert_each_key_in_order_at_least_once(rows: list[tuple[int, int, int, str, str]], expected: int) -> None:
    seen: dict[str, set[int]] = defaultdict(set)
    for pid, p, o, key, value in rows:
        n = int(value.split(":")[1])
        assert n == 0 or n - 1 in seen[key], f"{key}:{n} (child {pid}, {p}@{o}) before {key}:{n - 1}"
        seen[key].add(n)
    assert sum(len(v) for v in seen.values()) == expected
    assert all(v == set(range(len(v))) for v in seen.values())


def wait_ready(health: str, timeout_s: float, sup: Supervised, assigned: int | None = None) -> dict[str, Any]:
    """Wait until ``/readyz`` answers 200 (every child has partitions) and, when given, every child
    has ``assigned`` partitions (the group's rebalances are over); the body."""
    body: dict[str, Any] = {}

    def ready() -> bool:
        nonlocal body
        if sup.proc.poll() is not None:
            return True
        try:
            code, body = get_json(f"{health}/readyz")
        except (OSError, ValueError):
            return False
        if assigned is not None and any(
            (c["report"] or {}).get("assigned_partitions") != assigned for c in body["children"]
        ):
            return False
        return code == 200

    assert wait_until(ready, timeout_s) and sup.proc.poll() is None, (body, sup.output[-4000:])
    return body


def supervisor_threads_and_maps(pid: int) -> tuple[int, str]:
    return len(os.listdir(f"/proc/{pid}/task")), Path(f"/proc/{pid}/maps").read_text()


# -- N children in one group ----------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_n_processes_share_the_group_keep_each_keys_order_and_one_sigterm_drains_them_all(
    kafka_bootstrap: str, new_topic: Callable[..., str], tmp_path: Path
) -> None:
    # given a topic of 6 partitions, and a supervisor of 3 children with one health and one metrics endpoint
    topic, partitions = new_topic(6), 6
    group = f"procs-{uuid.uuid4().hex[:8]}"
    health_port, metrics_port = free_port(), free_port()
    sup = Supervised(
        [
            f"{HANDLERS}:handle",
            *("--topic", topic, "--group", group, "--brokers", kafka_bootstrap, "--concurrency", "8"),
            *("--processes", "3", "--health-port", str(health_port), "--metrics-port", str(metrics_port)),
        ],
        tmp_path / "handled.log",
        tmp_path,
    )
    try:
        health = f"http://127.0.0.1:{health_port}"
        # when every child has its partitions (ready), 1,200 records of 30 keys are produced
        body = wait_ready(health, 120, sup, assigned=partitions // 3)
        assert [c["state"] for c in body["children"]] == ["running"] * 3, body
        n = 1200
        produce(kafka_bootstrap, topic, records(keys=30, per_key=40, partitions=partitions))
        assert wait_until(lambda: len(sup.handled()) >= n or sup.proc.poll() is not None, 120), sup.output[
            -4000:
        ]
        # then the three children each handled records, of partitions of their own
        rows = sup.rows()
        by_pid: dict[int, set[int]] = defaultdict(set)
        for pid, p, _, _, _ in rows:
            by_pid[pid].add(p)
        assert len(by_pid) == 3, by_pid
        assert sum(len(ps) for ps in by_pid.values()) == partitions, by_pid

        # and one /metrics counts the messages of all of them
        def counted() -> float:
            text = (
                urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
            )
            return sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("messaging_client_consumed_messages_total{")
            )

        assert wait_until(lambda: counted() == len(sup.rows()), 30), (counted(), len(sup.rows()))
        # and the supervisor runs one thread and has no Kafka library loaded
        threads, maps = supervisor_threads_and_maps(sup.proc.pid)
        assert threads == 1 and "rdkafka" not in maps and "confluent_kafka" not in maps
        # when the supervisor gets one SIGTERM
        code = sup.stop()
    finally:
        sup.kill()
    # then every child drained and exited 0, the supervisor exited 0, the offsets reached the end
    out = sup.output
    assert code == 0, out[-4000:]
    assert out.count("stopped: exit code 0") == 3 and "Traceback" not in out, out[-4000:]
    assert committed(kafka_bootstrap, group, topic, partitions) == end_offsets(
        kafka_bootstrap, topic, partitions
    )
    assert_each_key_in_order_at_least_once(sup.rows(), n)


@pytest.mark.timeout(300)
def test_a_child_killed_with_sigkill_is_restarted_and_no_record_is_lost_or_out_of_order(
    kafka_bootstrap: str, new_topic: Callable[..., str], tmp_path: Path
) -> None:
    # given 3 children on 6 partitions, each handler 20 ms, two at a time per child
    topic, partitions = new_topic(6), 6
    group = f"procs-kill-{uuid.uuid4().hex[:8]}"
    health_port = free_port()
    sup = Supervised(
        [
            f"{HANDLERS}:handle",
            *("--topic", topic, "--group", group, "--brokers", kafka_bootstrap, "--concurrency", "2"),
            *("--processes", "3", "--health-port", str(health_port), *FAST_SESSION),
        ],
        tmp_path / "handled.log",
        tmp_path,
        env={"KC_SLEEP_MS": "20"},
    )
    try:
        health = f"http://127.0.0.1:{health_port}"
        wait_ready(health, 120, sup, assigned=partitions // 3)
        n = 1800
        produce(kafka_bootstrap, topic, records(keys=30, per_key=60, partitions=partitions))
        # when one child has handled records and is killed with SIGKILL mid-way
        assert wait_until(lambda: len(sup.handled()) >= 300, 120), sup.output[-4000:]
        victim = sup.rows()[-1][0]
        os.kill(victim, signal.SIGKILL)
        # then the supervisor starts another in its slot, which joins the group (all ready again)
        assert wait_until(lambda: f"(pid {victim}) ended after" in sup.output, 30), sup.output[-4000:]
        assert "killed by SIGKILL" in sup.output
        body = wait_ready(health, 120, sup)
        assert sorted(c["restarts"] for c in body["children"]) == [0, 0, 1], body
        assert victim not in {c["pid"] for c in body["children"]}
        # and every record is handled, at least once
        assert wait_until(lambda: len(sup.handled()) >= n or sup.proc.poll() is not None, 180), (
            len(sup.handled()),
            sup.output[-4000:],
        )
        wait_ready(health, 120, sup, assigned=partitions // 3)  # the restart's rebalances are over
        code = sup.stop()
    finally:
        sup.kill()
    # then it stopped cleanly, committed to the end, and each key went in order
    assert code == 0, sup.output[-4000:]
    assert committed(kafka_bootstrap, group, topic, partitions) == end_offsets(
        kafka_bootstrap, topic, partitions
    )
    assert_each_key_in_order_at_least_once(sup.rows(), n)


@pytest.mark.timeout(240)
def test_a_keyed_app_runs_in_n_processes_and_each_child_runs_its_shutdown_hook(
    kafka_bootstrap: str, new_topic: Callable[..., str], tmp_path: Path
) -> None:
    # given a KeyedApp of two routes (tests/integration/procs/cli_app.py), two topics of 2 partitions
    topics = [new_topic(2), new_topic(2)]
    group = f"procs-app-{uuid.uuid4().hex[:8]}"
    env = {
        "KC_CLI_BROKERS": kafka_bootstrap,
        "KC_CLI_GROUP": group,
        "KC_CLI_TOPIC1": topics[0],
        "KC_CLI_TOPIC2": topics[1],
    }
    log = tmp_path / "handled.log"
    health_port = free_port()
    # when `keyedconsumer run module:app --processes 2` runs, each child with one partition of each
    # topic (the group settled: a stop during a rebalance may leave the last commit unconfirmed), then
    # 200 records are produced to each topic, and once all were handled, SIGTERM
    sup = Supervised(
        ["tests.integration.procs.cli_app:app", "--processes", "2", "--health-port", str(health_port)],
        log,
        tmp_path,
        env,
    )

    def rows() -> list[str]:
        return log_lines(log)

    try:
        wait_ready(f"http://127.0.0.1:{health_port}", 120, sup, assigned=2)
        for t in topics:
            produce(kafka_bootstrap, t, [(f"k{i % 20}".encode(), str(i).encode(), None) for i in range(200)])
        assert wait_until(lambda: len(rows()) >= 400 or sup.proc.poll() is not None, 120), sup.output[-4000:]
        code = sup.stop()
    finally:
        sup.kill()
    # then it exited 0, each child ran the app's shutdown hook, and both topics are committed to the end
    assert code == 0, sup.output[-4000:]
    assert sum(1 for r in rows() if r.startswith("shutdown ")) == 2, rows()[-5:]
    for t in topics:
        assert committed(kafka_bootstrap, group, t, 2) == end_offsets(kafka_bootstrap, t, 2)


@pytest.mark.timeout(300)
def test_a_child_that_keeps_crashing_makes_the_supervisor_give_up_and_exit_1(
    kafka_bootstrap: str, new_topic: Callable[..., str], tmp_path: Path
) -> None:
    # given a record that fails every time, with no dead-letter topic: each child stops and exits 1
    topic = new_topic(1)
    produce(kafka_bootstrap, topic, [(b"k", b"ok", None), (b"k", b"poison", None)])
    group = f"procs-crash-{uuid.uuid4().hex[:8]}"
    # when a supervisor of one child runs it
    sup = Supervised(
        [
            f"{HANDLERS}:poison",
            "--topic",
            topic,
            "--group",
            group,
            "--brokers",
            kafka_bootstrap,
            "--processes",
            "1",
        ],
        tmp_path / "handled.log",
        tmp_path,
    )
    try:
        code = sup.proc.wait(timeout=240)
    finally:
        sup.kill()
    # then it restarted the child with back-off until 5 failed starts in a row, then gave up: exit 1
    out = sup.output
    assert code == 1, out[-4000:]
    assert "child 0 failed to start 5 times in a row" in out and "giving up" in out, out[-4000:]
    assert (
        [line for line in out.splitlines() if "restarts in" in line][-1]
        .split("restarts in ")[1]
        .startswith("8 s")
    )
    poison_tries = [r for r in sup.rows() if r[4] == "poison"]
    assert len(poison_tries) == 5 and len({r[0] for r in poison_tries}) == 5  # one try per child
    # and the committed offset never passed the poison record
    assert committed(kafka_bootstrap, group, topic, 1)[0] in (None, 0, 1)
