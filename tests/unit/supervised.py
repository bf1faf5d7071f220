"""A supervisor of children that run no consumer, for tests/unit/test_processes.py (run as a script:
it forks, so never inside the pytest process).

    python tests/unit/supervised.py <mode> <processes> <log file>

Each child appends ``<event> <slot> <pid>`` lines to the log file (O_APPEND) and, by ``mode``:

- ``wait``: ``start``, then waits until its link asks it to stop, then ``stop`` and returns (exit 0);
- ``crash``: ``start``, then exits 1 at once (a child that keeps dying);
- ``bad``: exits 2 (bad input);
- ``wait-then-crash``: as ``wait``, but exits 3 instead of returning when stopped.

The supervisor's restart back-off is 0.05 s (doubling to 0.4 s) so that the tests are fast; it
exits with the supervisor's exit code.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

import typer

from keyedconsumer.cli.child import ChildLink
from keyedconsumer.cli.restarts import RestartPolicy
from keyedconsumer.cli.supervisor import Supervisor


class _Stoppable:
    def __init__(self) -> None:
        self.stopped = threading.Event()

    def stop(self) -> None:
        self.stopped.set()


def _log(path: str, event: str, slot: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{event} {slot} {os.getpid()}\n".encode())
    finally:
        os.close(fd)


def main() -> int:
    mode, processes, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    def work(link: ChildLink) -> None:
        _log(path, "start", link.slot)
        if mode == "bad":
            raise typer.Exit(2)
        if mode == "crash":
            raise typer.Exit(1)
        source: Any = _Stoppable()
        link.attach(source)
        source.stopped.wait()
        _log(path, "stop", link.slot)
        if mode == "wait-then-crash":
            raise typer.Exit(3)

    policy = RestartPolicy(backoff_s=0.05, backoff_max_s=0.4, stable_after_s=5.0, max_failed_starts=4)
    return Supervisor(processes, work, policy=policy).run()


if __name__ == "__main__":
    sys.exit(main())
