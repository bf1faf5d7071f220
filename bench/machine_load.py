"""The machine's load around each benchmark run, and the busy-loop process of ``--noise``.

Used by bench/run.py (project venv); standard library only.

- :func:`load_record` is stored with every run: the 1-minute load average before and after it, the
  core count, the cores other work kept busy just before it (:func:`cores_busy`, measured while the
  bench runs nothing), and ``busy`` when that exceeded :data:`BUSY_CORES` (the run shared the
  machine with other work: "busy: not comparable" in the tables), unless it ran in the noisy pass,
  whose load is expected. The load average is not the test: it lags by a minute, so the bench's own
  previous run (one to two cores for 10 s) leaves it near the core count of a 2-core machine.
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


#: a run is busy when other work kept more than this many cores busy just before it: a CPU-bound
#: neighbour takes one (the noisy pass's busy loop: 0.89-0.92); an idle broker and the bench's own
#: process about 0.05
BUSY_CORES = 0.5
#: seconds :func:`cores_busy` watches before each run
BUSY_WINDOW_S = 1.0


def _cpu_jiffies() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs since boot (``/proc/stat`` line ``cpu``; idle and iowait
    are not busy)."""
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    total = sum(f[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
    return total - f[3] - f[4], total


def cores_busy(window_s: float = BUSY_WINDOW_S) -> float | None:
    """Cores busy over the next ``window_s`` seconds, the whole machine (``/proc/stat``): called while
    the bench runs nothing, it is the other work's share (plus the idle broker's). ``None`` where
    there is no ``/proc/stat``."""
    a = _cpu_jiffies()
    time.sleep(window_s)
    b = _cpu_jiffies()
    if a is None or b is None or b[1] <= a[1]:
        return None
    return round((b[0] - a[0]) / (b[1] - a[1]) * cores(), 2)


def load_record(before: list[float], noise: bool, others: float | None = None) -> dict[str, Any]:
    """What a run stores about the machine's load: ``loadavg_before`` (taken by the caller before the
    run started), ``loadavg_after`` (now), ``cores``, ``other_cores`` (:func:`cores_busy` taken by
    the caller just before the run); ``noise: True`` for a run of the noisy pass, else ``busy: True``
    when ``other_cores`` exceeded :data:`BUSY_CORES`."""
    out: dict[str, Any] = {"loadavg_before": before, "loadavg_after": loadavg(), "cores": cores()}
    out["other_cores"] = others
    if noise:
        out["noise"] = True
    elif others is not None and others > BUSY_CORES:
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
    """After a noisy pass: wait, up to ``limit_s``, until other work keeps no more than
    :data:`BUSY_CORES` busy (:func:`cores_busy`; the busy loop was stopped, so at once unless
    something else runs), so that the quiet pass after it starts quiet. Returns what it waited, the
    cores then busy and the load average."""
    t0 = time.perf_counter()
    busy = cores_busy()
    while busy is not None and busy > BUSY_CORES and time.perf_counter() - t0 < limit_s:
        busy = cores_busy()
    return {"cool_down_s": round(time.perf_counter() - t0, 1), "other_cores": busy, "loadavg": loadavg()}
