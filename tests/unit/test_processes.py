"""``keyedconsumer run --processes N`` without Kafka: the restart policy, the children's combined
health, the supervisor's loop (forking children that run no consumer, in a subprocess), the
setting's layers, and that the supervisor's imports load no Kafka library. The runs against the
broker are in tests/integration/test_processes.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from keyedconsumer.cli import app
from keyedconsumer.cli.restarts import RestartPolicy
from keyedconsumer.health import ProcessesHealth

pytestmark = [pytest.mark.timeout(60)]
ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


# -- the restart policy --------------------------------------------------------------------------------


def test_back_off_doubles_per_failed_start_up_to_its_cap_and_the_supervisor_gives_up_at_the_limit() -> None:
    p = RestartPolicy(backoff_s=1.0, backoff_max_s=5.0, stable_after_s=60.0, max_failed_starts=5)
    failed, delays = 0, []
    for _ in range(4):  # four children that each died after 2 s
        failed = p.failed_starts(failed, ran_s=2.0)
        assert not p.gives_up(failed)
        delays.append(p.backoff_for(failed))
    assert delays == [1.0, 2.0, 4.0, 5.0]
    assert p.gives_up(p.failed_starts(failed, ran_s=2.0))  # the fifth in a row


def test_a_child_that_ran_long_resets_its_slots_count() -> None:
    p = RestartPolicy(backoff_s=1.0, stable_after_s=60.0, max_failed_starts=2)
    failed = p.failed_starts(0, ran_s=1.0)
    assert failed == 1 and p.backoff_for(failed) == 1.0
    failed = p.failed_starts(failed, ran_s=60.0)  # ran a minute: not a failed start
    assert failed == 0 and not p.gives_up(failed) and p.backoff_for(failed) == 1.0


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(backoff_s=0),
        dict(backoff_s=5, backoff_max_s=1),
        dict(stable_after_s=0),
        dict(max_failed_starts=0),
    ],
)
def test_a_bad_restart_policy_is_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="RestartPolicy"):
        RestartPolicy(**kwargs)


# -- the children's combined health --------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def report(live: bool = True, ready: bool = True, stalled: list[Any] | None = None) -> dict[str, Any]:
    return {"live": live, "ready": ready, "healthy": live and not stalled, "stalled": stalled or []}


def test_ready_only_when_every_child_runs_and_says_ready() -> None:
    clock = Clock()
    h = ProcessesHealth(2, live_within_s=30.0, clock=clock)
    # given two children started, none reported yet: live (starting), not ready
    h.started(0, 100)
    h.started(1, 101)
    r = h.check()
    assert (r.live, r.ready) == (True, False)
    assert [c["state"] for c in r.children] == ["starting", "starting"]
    # when one reports ready: still not ready; when both do: ready and healthy
    h.reported(0, 100, report())
    assert not h.check().ready
    h.reported(1, 101, report())
    r = h.check()
    assert (r.live, r.ready, r.healthy) == (True, True, True)
    # when one says not ready (no partition): the whole is not ready, still live
    h.reported(1, 101, report(ready=False))
    assert (h.check().live, h.check().ready) == (True, False)


def test_a_child_that_ended_is_down_and_its_restart_counts() -> None:
    clock = Clock()
    h = ProcessesHealth(2, clock=clock)
    for slot, pid in ((0, 100), (1, 101)):
        h.started(slot, pid)
        h.reported(slot, pid, report())
    # when child 1 ends: live (the supervisor restarts it), not ready
    h.ended(1, 101)
    r = h.check()
    assert (r.live, r.ready) == (True, False) and r.children[1]["state"] == "down"
    # a late report of the dead child is ignored; its successor counts one restart
    h.reported(1, 101, report())
    assert h.check().children[1]["state"] == "down"
    h.started(1, 102)
    h.reported(1, 102, report())
    r = h.check()
    assert r.ready and r.children[1]["restarts"] == 1 and r.children[1]["pid"] == 102


def test_stale_or_not_live_reports_make_it_not_live_and_a_stall_not_healthy() -> None:
    clock = Clock()
    h = ProcessesHealth(1, live_within_s=30.0, clock=clock)
    h.started(0, 100)
    clock.now += 31  # started 31 s ago, never reported: not live
    assert not h.check().live
    h.reported(0, 100, report(stalled=[{"topic": "t", "partition": 0}]))
    r = h.check()
    assert (r.live, r.ready, r.healthy) == (True, True, False)
    clock.now += 31  # its last report is 31 s old: a frozen child
    assert (h.check().live, h.check().ready) == (False, False)
    h.reported(0, 100, report(live=False, ready=False))
    assert not h.check().live


def test_not_ready_while_stopping() -> None:
    h = ProcessesHealth(1, clock=Clock())
    h.started(0, 100)
    h.reported(0, 100, report())
    h.stopping()
    r = h.check()
    assert (r.live, r.ready, r.stopping) == (True, False, True) and r.to_dict()["processes"] == 1


# -- the supervisor's loop, with children that run no consumer ---------------------------------------


def supervise(mode: str, processes: int, log: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "unit" / "supervised.py"), mode, str(processes), str(log)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def events(log: Path) -> list[tuple[str, int, int]]:
    if not log.exists():
        return []
    return [(e, int(s), int(p)) for e, s, p in (line.split() for line in log.read_text().splitlines())]


def wait_for(cond: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_one_sigterm_stops_every_child_and_the_supervisor_exits_0(tmp_path: Path) -> None:
    log = tmp_path / "events"
    proc = supervise("wait", 3, log)
    try:
        # given three children running
        assert wait_for(lambda: len(events(log)) == 3, 30), events(log)
        # when the supervisor gets one SIGTERM
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    # then every child was asked to stop and returned, and the supervisor exited 0
    assert proc.returncode == 0, err
    assert sorted(s for e, s, _ in events(log) if e == "stop") == [0, 1, 2], events(log)
    assert "SIGTERM received: stopping 3 children gracefully" in err


def test_a_killed_child_is_started_again(tmp_path: Path) -> None:
    log = tmp_path / "events"
    proc = supervise("wait", 2, log)
    try:
        assert wait_for(lambda: len(events(log)) == 2, 30), events(log)
        # when child 0 is killed
        victim = next(p for e, s, p in events(log) if s == 0)
        os.kill(victim, signal.SIGKILL)
        # then slot 0 gets a new child
        assert wait_for(lambda: len([1 for e, s, _ in events(log) if e == "start" and s == 0]) == 2, 30)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert f"child 0 (pid {victim}) ended after" in err and "killed by SIGKILL" in err, err
    assert sorted(s for e, s, _ in events(log) if e == "stop") == [0, 1]


def test_a_child_that_keeps_dying_makes_the_supervisor_give_up_and_exit_1(tmp_path: Path) -> None:
    log = tmp_path / "events"
    proc = supervise("crash", 2, log)
    out, err = proc.communicate(timeout=30)
    # then one slot failed to start 4 times in a row (the limit): the supervisor gave up, exit 1
    assert proc.returncode == 1, err
    assert "failed to start 4 times in a row" in err and "giving up" in err, err
    starts = [s for e, s, _ in events(log) if e == "start"]
    assert max(starts.count(0), starts.count(1)) == 4, starts


def test_a_child_with_bad_input_stops_everything_with_exit_2(tmp_path: Path) -> None:
    proc = supervise("bad", 2, tmp_path / "events")
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 2, err
    assert "exited 2 (bad input, above): stopping" in err
    assert len(events(tmp_path / "events")) <= 2  # never started again


def test_a_child_that_fails_its_stop_makes_the_exit_code_1(tmp_path: Path) -> None:
    log = tmp_path / "events"
    proc = supervise("wait-then-crash", 2, log)
    try:
        assert wait_for(lambda: len(events(log)) == 2, 30), events(log)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    assert "did not stop cleanly: exit code 3" in err


def test_a_child_stops_by_itself_when_the_supervisor_is_killed(tmp_path: Path) -> None:
    log = tmp_path / "events"
    proc = supervise("wait", 2, log)
    try:
        assert wait_for(lambda: len(events(log)) == 2, 30), events(log)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
        # then each orphan notices within about a second and stops
        assert wait_for(lambda: len([1 for e, _, _ in events(log) if e == "stop"]) == 2, 20), events(log)
    finally:
        proc.kill()


# -- the setting, and the supervisor's imports ---------------------------------------------------------


def run_cli(*args: str, env: dict[str, str] | None = None) -> Any:
    result = runner.invoke(
        app, ["run", "json:dumps", "-g", "g", "-t", "t", "--print-settings", *args], env=env
    )
    assert "Traceback" not in result.output, result.output
    return result


def test_processes_comes_from_a_flag_the_environment_or_the_toml_file(tmp_path: Path) -> None:
    (tmp_path / "kc.toml").write_text("processes = 4\n")
    toml = ["--config", str(tmp_path / "kc.toml")]
    assert json.loads(run_cli(*toml).stdout)["processes"] == 4
    assert json.loads(run_cli(*toml, env={"KEYEDCONSUMER_PROCESSES": "3"}).stdout)["processes"] == 3
    shown = run_cli(*toml, "--processes", "2", env={"KEYEDCONSUMER_PROCESSES": "3"}).stdout
    assert json.loads(shown)["processes"] == 2
    assert json.loads(run_cli().stdout)["processes"] is None  # default: no supervisor


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        (
            ["--processes", "0"],
            None,
            "processes (from flag --processes): Input should be greater than or equal to 1",
        ),
        (
            [],
            {"KEYEDCONSUMER_PROCESSES": "257"},
            "processes (from environment KEYEDCONSUMER_PROCESSES): Input should be less",
        ),
        (
            [],
            {"KEYEDCONSUMER_PROCESSES": "two"},
            "processes (from environment KEYEDCONSUMER_PROCESSES): Input should be a valid integer",
        ),
    ],
)
def test_a_bad_processes_value_names_the_field_and_its_layer(
    args: list[str], env: dict[str, str] | None, expected: str
) -> None:
    result = run_cli(*args, env=env)
    assert result.exit_code == 2 and expected in result.output, result.output


def test_an_app_takes_processes_from_a_flag() -> None:
    # --processes is the command's, not a route's: a KeyedApp does not refuse it
    result = runner.invoke(
        app,
        [
            "run",
            "tests.unit.cli_settings_app:app",
            "--app-dir",
            str(ROOT),
            "--processes",
            "2",
            "--print-settings",
        ],
    )
    assert result.exit_code == 0, result.output


def test_the_package_and_the_cli_load_no_kafka_library_on_import() -> None:
    code = (
        "import sys, keyedconsumer, keyedconsumer.cli, keyedconsumer.cli.supervisor, keyedconsumer.health; "
        "print(sorted(m for m in sys.modules if m.startswith('confluent_kafka')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_a_handler_that_does_not_import_makes_the_supervisor_exit_2_once_its_children_did() -> None:
    # the supervisor imports nothing of the handler: its children do, after the fork
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "keyedconsumer",
            "run",
            "no_such_module:handle",
            "-g",
            "g",
            "-t",
            "t",
            "--processes",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert out.returncode == 2, out.stderr
    assert "cannot import handler module 'no_such_module'" in out.stderr
    assert "error: a child could not start (bad input, above)" in out.stderr and "Traceback" not in out.stderr


def test_the_metrics_directory_of_the_environment_is_wiped_of_its_db_files_and_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from keyedconsumer.cli.endpoints import MetricsDir

    # given PROMETHEUS_MULTIPROC_DIR with the files of an earlier run, and a file of someone else's
    (tmp_path / "counter_4711.db").write_bytes(b"old")
    (tmp_path / "notes.txt").write_text("mine")
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    # when the supervisor sets it up, then ends
    d = MetricsDir()
    d.close()
    # then the old values are gone (prometheus-client: wiped between runs), the rest and the directory stay
    assert not d.owned and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_without_a_metrics_directory_the_supervisor_makes_one_and_removes_it() -> None:
    code = (
        "import os; from keyedconsumer.cli.endpoints import MetricsDir; d = MetricsDir(); "
        "assert d.owned and os.environ['PROMETHEUS_MULTIPROC_DIR'] == str(d.path) and d.path.is_dir(); "
        "d.close(); print(d.path.exists())"
    )
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr
