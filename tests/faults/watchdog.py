"""Cleans up after an orchestrator that died without cleaning up (killed, or a native crash).

    python -m tests.faults.watchdog ORCHESTRATOR_PID RUN_DIR

Started by the orchestrator in a session of its own. Once the orchestrator is gone: SIGKILLs the
harness processes listed in ``RUN_DIR/pids.txt`` (only those whose command line is still a
``tests.faults`` program), and stops the harness's own Kafka and Redis (``scripts/services down``
with the harness's run dir and ports, from ``run.json``) if that run dir still exists; for a cluster
run, SIGKILLs its cluster's nodes and removes its hosts (:func:`tests.faults.hosted.cleanup`). After a
normal end there is nothing left to do.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from pathlib import Path

from . import hosted
from .common import load_json
from .services import Services


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def main() -> int:
    orch, run_dir = int(sys.argv[1]), Path(sys.argv[2])
    while alive(orch):
        time.sleep(1.0)
    pids = run_dir / "pids.txt"
    if pids.exists():
        for line in pids.read_text().split():
            pid = int(line)
            if pid == os.getpid():
                continue
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if b"tests.faults." in cmd:
                try:
                    os.kill(pid, signal.SIGCONT)
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    cfg = load_json(run_dir / "run.json")
    if cfg.get("cluster"):  # the cluster run: its nodes, the handler's Redis, its hosts
        hosted.cleanup(cfg)
        return 0
    svc_dir = Path(cfg["services_dir"])
    if svc_dir.exists():
        svc = Services(svc_dir, tuple(cfg["ports"]), durable_redis=not cfg.get("nondurable_redis"))  # type: ignore[arg-type]
        try:
            svc.down()
        finally:
            shutil.rmtree(svc_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
