"""Shutdown order and signals of ``keyedconsumer run`` (issue 25, item 20), against the real broker.

The process runs ``tests.integration.procs.shutdown_app:app`` (two routes in one group, a plain and
an ``async def`` handler, one message at a time per partition) and logs each handler's start and
end, and its ``on_shutdown`` hook's time and the group's committed offsets read then:

- ``on_shutdown`` runs after the last handler ended and after the final commit;
- a sub-second ``shutdown_timeout_s`` is honoured: the handlers running at SIGTERM finish and are
  committed, and a hung one is left behind after that long, not at once;
- two signals 50 ms apart, or SIGTERM then SIGINT, stop once and cleanly (exit 0, one shutdown);
- a signal while the process imports the app (no consumer registered yet) stops it cleanly;
- as PID 1 of a PID namespace (``unshare --pid --fork``, where the kernel drops a signal the
  process has no handler for), SIGTERM stops it, also during the import.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from .kafkautil import committed, log_lines, produce, wait_until

pytestmark = [pytest.mark.kafka]

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.integration.procs.shutdown_app:app"


class Run:
    """``keyedconsumer run`` of the shutdown app as a subprocess (optionally PID 1 of its own PID
    namespace), its log parsed."""

    def __init__(self, env: dict[str, str], args: list[str], log: Path, pid1: bool = False) -> None:
        self.log = log
        cmd = [sys.executable, "-m", "keyedconsumer", "run", APP, *args]
        if pid1:
            cmd = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", *cmd]
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env={**os.environ, **env, "KC_SD_LOG": str(log), "PYTHONUNBUFFERED": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.pid = self._inner_pid() if pid1 else self.proc.pid

    def _inner_pid(self) -> int:
        """The pid (in this namespace) of unshare's child: PID 1 of the new namespace."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        assert wait_until(lambda: children.read_text().split() != [], 10, 0.01), "unshare forked nothing"
        return int(children.read_text().split()[0])

    def rows(self) -> list[list[str]]:
        return [line.split() for line in log_lines(self.log)]

    def count(self, kind: str) -> int:
        return sum(1 for r in self.rows() if r[0] == kind)

    def signal(self, *signums: int, gap_s: float = 0.05) -> float:
        """Send the signals, ``gap_s`` apart; returns when the first was sent (monotonic s)."""
        sent = time.monotonic()
        for i, signum in enumerate(signums):
            if i:
                time.sleep(gap_s)
            os.kill(self.pid, signum)
        return sent

    def wait(self, timeout_s: float = 60.0) -> tuple[int, str]:
        try:
            out, err = self.proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
            pytest.fail(f"keyedconsumer run did not end within {timeout_s} s:\n{err[-3000:]}")
        return self.proc.returncode, out + err


@pytest.fixture
def setup(kafka_bootstrap: str, new_topic: Callable[..., str], tmp_path: Path) -> Callable[..., Run]:
    """``setup(work_s, *args, records=40, hang_at=None, import_s=0, pid1=False) -> Run``: two
    topics of 2 partitions with ``records`` each (the record at offset ``hang_at`` of partition 0 of
    the first topic hangs its handler), and the app started on them."""

    def go(
        work_s: float,
        *args: str,
        records: int = 40,
        hang_at: int | None = None,
        import_s: float = 0.0,
        pid1: bool = False,
    ) -> Run:
        topics = [new_topic(2), new_topic(2)]
        for n, t in enumerate(topics):
            values = [
                b"hang" if n == 0 and i // 2 == hang_at and i % 2 == 0 else b"v" for i in range(records)
            ]
            produce(kafka_bootstrap, t, [(f"k{i}".encode(), values[i], i % 2) for i in range(records)])
        env = {
            "KC_SD_BROKERS": kafka_bootstrap,
            "KC_SD_GROUP": f"sd-{uuid.uuid4().hex[:8]}",
            "KC_SD_TOPIC1": topics[0],
            "KC_SD_TOPIC2": topics[1],
            "KC_SD_WORK_S": str(work_s),
            "KC_SD_IMPORT_S": str(import_s),
        }
        run = Run(env, list(args), tmp_path / f"log-{uuid.uuid4().hex[:6]}", pid1=pid1)
        run.env = env  # type: ignore[attr-defined]
        run.topics = topics  # type: ignore[attr-defined]
        return run

    return go


def _check_stopped_before_the_start(run: Run, code: int, output: str) -> None:
    """Exit 0, no traceback, nothing consumed, no hook run: the startup hooks had not run, so neither
    do the shutdown hooks (``KeyedApp.on_shutdown``: they run when every startup hook ran)."""
    assert code == 0, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert [r for r in run.rows() if r[0] != "import"] == []


def _check_stopped_cleanly(run: Run, kafka_bootstrap: str, code: int, output: str) -> dict[str, int]:
    """Exit 0, no traceback, one shutdown hook run, after every handler's end; every handler run that
    started ended (none left behind), and the final commit (made before the hook: the hook read the
    same offsets as the test reads now) covers every partition up to its last ended message. Returns
    the committed offsets."""
    assert code == 0, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    rows = run.rows()
    shutdowns = [r for r in rows if r[0] == "shutdown"]
    assert len(shutdowns) == 1, shutdowns
    assert rows[-1][0] == "shutdown", rows[-3:]
    hook_t = float(shutdowns[0][2])
    ends = [r for r in rows if r[0] == "end"]
    assert all(float(r[4]) < hook_t for r in ends)
    started = {(r[1], int(r[2]), int(r[3])) for r in rows if r[0] == "start"}
    ended = {(r[1], int(r[2]), int(r[3])) for r in ends}
    assert started == ended, sorted(started - ended)
    seen_by_hook: dict[str, int] = json.loads(shutdowns[0][1])
    now: dict[str, int] = {}
    for t in run.topics:  # type: ignore[attr-defined]
        for p, off in committed(kafka_bootstrap, run.env["KC_SD_GROUP"], t, 2).items():  # type: ignore[attr-defined]
            now[f"{t}:{p}"] = off if off is not None else -1001
            last = max((o for (tt, pp, o) in ended if tt == t and pp == p), default=-1)
            assert now[f"{t}:{p}"] == last + 1 or (last == -1 and off is None), (t, p, off, last)
    assert seen_by_hook == now, (seen_by_hook, now)
    return now


@pytest.mark.timeout(120)
def test_on_shutdown_runs_after_the_last_handler_and_the_final_commit(kafka_bootstrap: str, setup) -> None:  # type: ignore[no-untyped-def]
    # given the app running handlers of 0.2 s on 4 partitions
    run = setup(0.2)
    assert wait_until(lambda: run.count("end") >= 8, 60), run.rows()[-5:]
    # when SIGTERM comes while handlers run
    run.signal(signal.SIGTERM)
    code, output = run.wait()
    # then the hook ran once, after the last handler ended and after the final commit
    _check_stopped_cleanly(run, kafka_bootstrap, code, output)


@pytest.mark.timeout(120)
def test_a_sub_second_shutdown_timeout_lets_running_handlers_finish_and_commits_them(
    kafka_bootstrap: str, setup
) -> None:  # type: ignore[no-untyped-def]
    # given handlers of 0.25 s and shutdown_timeout_s=0.6
    run = setup(0.25, "--shutdown-timeout-s", "0.6")
    assert wait_until(lambda: run.count("end") >= 8 and run.count("start") > run.count("end"), 60)
    # when SIGTERM comes while handlers run
    run.signal(signal.SIGTERM)
    code, output = run.wait()
    # then each handler running then finished and was committed (0.6 s is not 0 s), cleanly
    _check_stopped_cleanly(run, kafka_bootstrap, code, output)


@pytest.mark.timeout(120)
def test_a_sub_second_shutdown_timeout_leaves_a_hung_handler_behind_after_that_long(
    kafka_bootstrap: str, setup
) -> None:  # type: ignore[no-untyped-def]
    # given a handler that hangs (60 s) at offset 2 of a partition, and shutdown_timeout_s=0.5
    run = setup(0.02, "--shutdown-timeout-s", "0.5", hang_at=2)
    hang = lambda r: r[0] == "start" and r[1] == run.topics[0] and r[2] == "0" and r[3] == "2"  # noqa: E731
    assert wait_until(lambda: any(hang(r) for r in run.rows()), 60)  # the plain route's, not the other's
    time.sleep(0.3)  # the other partitions run on meanwhile
    # when SIGTERM comes
    sent = run.signal(signal.SIGTERM)
    code, output = run.wait()
    took_s = time.monotonic() - sent
    # then the stop waited for it about 0.5 s (not 0), left it behind, and ended within the bound
    assert code == 0 and "Traceback" not in output, output[-3000:]
    assert "still running after shutdown_timeout_s=0.5" in output, output[-3000:]
    assert 0.5 <= took_s < 0.5 + 10 + 5, took_s  # SHUTDOWN_MARGIN_S, and the process's exit
    # and its offset was not committed past it
    assert committed(kafka_bootstrap, run.env["KC_SD_GROUP"], run.topics[0], 2)[0] == 2


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "signals",
    [(signal.SIGTERM, signal.SIGTERM), (signal.SIGTERM, signal.SIGINT)],
    ids=["term-term", "term-int"],
)
def test_two_signals_50_ms_apart_stop_once_and_cleanly(
    kafka_bootstrap: str, setup, signals: tuple[int, int]
) -> None:  # type: ignore[no-untyped-def]
    run = setup(0.1)
    assert wait_until(lambda: run.count("end") >= 8, 60)
    run.signal(*signals, gap_s=0.05)
    code, output = run.wait()
    _check_stopped_cleanly(run, kafka_bootstrap, code, output)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "signals", [(signal.SIGTERM,), (signal.SIGTERM, signal.SIGINT)], ids=["term", "term-int"]
)
def test_a_signal_while_the_app_is_imported_stops_the_process_cleanly(
    kafka_bootstrap: str, setup, signals: tuple[int, ...]
) -> None:  # type: ignore[no-untyped-def]
    # given the process importing the app (slow: 5 s), no consumer registered yet
    run = setup(0.05, import_s=5.0)
    assert wait_until(lambda: run.count("import") == 1, 60)
    # when the signals come then
    sent = run.signal(*signals)
    code, output = run.wait()
    # then it stops cleanly once the import is over, without consuming anything or running a hook
    assert time.monotonic() - sent < 5 + 15
    _check_stopped_before_the_start(run, code, output)


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.timeout(150)
@pytest.mark.parametrize("when", ["running", "importing"])
def test_as_pid_1_sigterm_stops_it_cleanly(kafka_bootstrap: str, setup, when: str) -> None:  # type: ignore[no-untyped-def]
    if not _unshare_works():
        msg = "needs `unshare --pid --fork --mount-proc` (util-linux, root or user namespaces)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(msg)
        pytest.skip(msg)
    # given `keyedconsumer run` as PID 1 of its own PID namespace
    run = setup(0.1, import_s=5.0 if when == "importing" else 0.0, pid1=True)
    if when == "running":
        assert wait_until(lambda: run.count("end") >= 8, 60)
    else:
        assert wait_until(lambda: run.count("import") == 1, 60)
    # when it gets SIGTERM (the kernel drops it for PID 1 unless a handler is installed)
    run.signal(signal.SIGTERM)
    code, output = run.wait(45)
    # then it stops cleanly, as any process would
    if when == "running":
        _check_stopped_cleanly(run, kafka_bootstrap, code, output)
    else:
        _check_stopped_before_the_start(run, code, output)
