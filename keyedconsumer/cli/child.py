"""The child's side of ``keyedconsumer run --processes N``: what a forked child does besides consuming.

:class:`ChildLink` is made in the child right after the fork, before the handler is imported and
before any client exists (librdkafka's threads do not survive a fork: each child builds its own).
It

- takes SIGTERM and SIGINT until the consumer runs: a signal that comes while the handler is
  imported or the consumer built is kept, and stops the consumer as soon as it is attached
  (``KeyedConsumer.stop()`` before ``run()`` makes that run stop at once; :mod:`keyedconsumer.signals`
  owns the signals while it runs);
- watches the supervisor once a second: when its parent is no longer the supervisor (killed with
  SIGKILL), the child stops gracefully (drains and commits) and exits, never left running alone;
- with a health endpoint, sends the supervisor its :class:`~keyedconsumer.health.HealthReport`
  once a second, one JSON object a line, on its pipe.

:func:`run_child` runs the child's work and gives its exit code, which the child exits with
(``os._exit``: the supervisor's ``atexit`` handlers and ``finally`` blocks are not the child's).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import typer

from ..health import Health

__all__ = ["ChildLink", "run_child", "REPORT_INTERVAL_S"]

log = logging.getLogger("keyedconsumer.cli.supervisor")

#: Seconds between two looks at the supervisor (and two health reports).
REPORT_INTERVAL_S = 1.0


class ChildLink:
    """One forked child's link to its supervisor (see the module documentation).

    Parameters
    ----------
    slot:
        Which of the N children this is (0 to N - 1), for the logs.
    report_fd:
        The write end of the pipe the supervisor reads this child's health reports from; closed by
        :meth:`close`.
    supervisor_pid:
        The supervisor's process id: a different parent means it is gone.
    health:
        Send health reports (the supervisor serves a health endpoint).
    """

    def __init__(self, slot: int, report_fd: int, supervisor_pid: int, *, health: bool) -> None:
        self.slot = slot
        self._fd = report_fd
        self._supervisor_pid = supervisor_pid
        self._health = health
        self._source: Any = None  # the KeyedConsumer or KeyedApp, once attached
        self._stop_requested = False
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="keyedconsumer-child-link", daemon=True)

    def install_signals(self) -> None:
        """SIGTERM and SIGINT request a stop (:meth:`request_stop`) until a consumer owns them."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.request_stop()

    def request_stop(self) -> None:
        """Stop the attached consumer, or the one attached later. Safe from a signal handler and
        from any thread (lock-free: a consumer's ``stop()`` may be called twice)."""
        self._stop_requested = True
        source = self._source
        if source is not None:
            source.stop()

    def attach(self, source: Any) -> None:
        """The consumer (or app) this child runs, before its ``run()``: stopped at once when a stop
        was requested, and the subject of the health reports."""
        self._source = source
        if self._stop_requested:
            source.stop()

    def start(self) -> None:
        """Start watching the supervisor (before the handler is imported)."""
        if not self._thread.is_alive():
            self._thread.start()

    def _watch(self) -> None:
        health = None
        while not self._closed.wait(REPORT_INTERVAL_S):
            if os.getppid() != self._supervisor_pid:
                if not self._stop_requested:
                    log.warning("child %d: the supervisor is gone: stopping", self.slot)
                self.request_stop()
                continue
            source = self._source
            if not self._health or source is None:
                continue
            if health is None:
                health = Health(source)
            self._send(health.check().to_dict())

    def _send(self, report: dict[str, Any]) -> None:
        data = (json.dumps(report) + "\n").encode()
        try:
            while data:
                data = data[os.write(self._fd, data) :]
        except OSError:  # the supervisor is gone (EPIPE) or the link closed: the parent check stops us
            pass

    def close(self) -> None:
        """Stop watching and close the pipe."""
        self._closed.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(2 * REPORT_INTERVAL_S)
        try:
            os.close(self._fd)
        except OSError:
            pass


def run_child(work: Callable[[ChildLink], None], link: ChildLink) -> int:
    """Run ``work(link)`` (the ``run`` command's consumer) in this child; its exit code: 0 when it
    returned, the code of a ``typer.Exit`` / ``SystemExit`` it raised (a ``CliError`` reported as
    one line by then), 1 for any other exception (logged)."""
    code = 1
    try:
        link.start()
        work(link)
        code = 0
    except typer.Exit as exc:
        code = exc.exit_code
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        log.exception("child %d failed", link.slot)
    finally:
        link.close()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    return code
