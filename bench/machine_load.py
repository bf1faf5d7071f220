"""The machine's load around each benchmark run, and the busy-loop process of ``--noise``.

Used by bench/run.py (project venv); standard library only.

- :func:`load_record` is stored with every run: the 1-minute load average before and after it, the
  core count, and ``busy`` when the load before exceeded the cores (the run shared the machine with
  other work: "busy: not comparable" in the tables), unless it ran in the noisy pass, whose load is
  expected.
- :class:`BusyLoop` is the CPU-bound neighbour of a noisy pass: one process spinning in pure Python
  (one core's worth of CPU, not pinned: the scheduler places it like any other process). It exits on
  its own if the bench dies without stopping it (it checks that its parent is still the one that
  started it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

#: the busy loop: spin in chunks of a million iterations while its parent (the pid in argv[1], the
#: bench that started it) lives; orphaned, its parent pid changes and it stops
BUSY_CODE = (
    "import os, sys\n"
    "parent = int(sys.argv[1])\n"
    "while os.getppid() == parent:\n"
    "    for _ in range(1_000_000):\n"
    "        pass\n"
)


def loadavg() -> list[float]:
    """The 1-, 5- and 15-minute load averages (``/proc/loadavg``); [] where there is none."""
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def cores() -> int:
    return os.cpu_count() or 1


def load_record(before: list[float], noise: bool) -> dict[str, Any]:
    """What a run stores about the machine's load: ``loadavg_before`` (taken by the caller before the
    run started), ``loadavg_after`` (now), ``cores``; ``noise: True`` for a run of the noisy pass,
    else ``busy: True`` when the 1-minute load before exceeded the core count."""
    out: dict[str, Any] = {"loadavg_before": before, "loadavg_after": loadavg(), "cores": cores()}
    if noise:
        out["noise"] = True
    elif before and before[0] > out["cores"]:
        out["busy"] = True
    return out


def _cpu_seconds(pid: int) -> float | None:
    """utime + stime of one process (``/proc/<pid>/stat``), in seconds."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class BusyLoop:
    """A CPU-bound process beside the noisy pass: ``with BusyLoop() as b: ...``; ``b.record`` then
    holds its wall seconds, CPU seconds and the cores it used (CPU / wall: about 1 when it got a whole
    core)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.t0 = 0.0
        self.record: dict[str, Any] = {}

    def __enter__(self) -> BusyLoop:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", BUSY_CODE, str(os.getpid())],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.t0 = time.perf_counter()
        self.record = {"pid": self.proc.pid, "loadavg_start": loadavg()}
        return self

    def __exit__(self, *exc: object) -> None:
        proc = self.proc
        if proc is None:
            return
        wall = time.perf_counter() - self.t0
        cpu = _cpu_seconds(proc.pid)
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        self.proc = None
        self.record.update(
            seconds=round(wall, 1),
            cpu_s=None if cpu is None else round(cpu, 1),
            cores_used=None if cpu is None or not wall else round(cpu / wall, 2),
            loadavg_end=loadavg(),
        )


def cool_down(limit_s: float) -> dict[str, Any]:
    """After a noisy pass: wait, up to ``limit_s``, for the 1-minute load average to fall back to the
    core count (it lags the busy loop by about a minute), so that the quiet pass after it is not
    marked busy for the noise it was meant to be without. Returns what it waited and the load then."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        la = loadavg()
        if not la or la[0] <= cores():
            break
        time.sleep(min(2.0, max(0.0, limit_s - (time.perf_counter() - t0))))
    return {"cool_down_s": round(time.perf_counter() - t0, 1), "loadavg": loadavg()}
