"""``keyedconsumer run --processes N``: a supervisor that forks N children, each consuming in the group.

The pre-fork model of gunicorn's arbiter and Karafka's swarm mode, on one host: the supervisor reads
the settings, binds the health and metrics endpoints, and forks; **it imports no Kafka library and
runs no thread** (librdkafka's threads, and any lock another thread holds, do not survive a fork),
so each child imports the handler and builds its own clients after the fork (:mod:`.child`). The
supervisor is one loop (a ``selectors`` wait on a self-pipe of signals, the children's report pipes
and the endpoints' sockets) that owns every child:

- **A child that ends** without being asked to is started again after a back-off, and the
  supervisor gives up (stops the others gracefully, exits 1) when one slot keeps failing to start;
  a child that exits 2 (bad input) makes it stop and exit 2 at once: the rule is
  :class:`~keyedconsumer.cli.restarts.RestartPolicy`'s.
- **SIGTERM or SIGINT** (each one, again) is passed on to every child as SIGTERM: each drains and
  commits as one ``keyedconsumer run`` does (within its ``run()`` bound); the supervisor exits 0 once
  every child exited 0 (else 1).
- **Health and metrics**: one endpoint each for all the children (:mod:`.endpoints`).

A child whose supervisor is gone (SIGKILL) stops gracefully by itself within about a second.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import HTTPServer
from types import FrameType
from typing import Any

from ..health import ProcessesHealth
from .child import ChildLink, run_child
from .endpoints import MetricsDir, health_server, metrics_server
from .errors import CliError
from .restarts import BAD_INPUT_EXIT_CODE, RestartPolicy

__all__ = ["Supervisor", "supervise"]

log = logging.getLogger("keyedconsumer.cli.supervisor")

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_SIGNALS = (*_STOP_SIGNALS, signal.SIGCHLD)
#: The longest wait of the loop, seconds: children are reaped at least this often.
_TICK_S = 1.0
#: A report line longer than this (bytes) is dropped: a child's report is a few KB.
_MAX_REPORT_BYTES = 1 << 20


@dataclass
class _Slot:
    index: int
    pid: int | None = None
    started_at: float = 0.0
    start_at: float | None = None  # when its next child starts (None: not to be started)
    failed_starts: int = 0
    reports: int | None = None  # the read end of its child's report pipe
    pending: bytes = b""
    stop_code: int | None = None  # the exit code of its child that the stop ended


class Supervisor:
    """The loop that forks, watches and stops N children (see the module documentation).

    Parameters
    ----------
    processes:
        N, >= 1.
    work:
        What each child runs after the fork, given its :class:`~keyedconsumer.cli.child.ChildLink`:
        builds and runs the consumer (``run``'s own path); it returns when the consumer stopped and
        raises ``typer.Exit`` (a reported ``CliError``) for an exit code.
    policy:
        Back-off and give-up rule.
    health:
        The children's health, fed from their reports (when the health endpoint is served).
    servers:
        Bound HTTP servers to serve from the loop (``handle_request()`` when readable).
    metrics_dir:
        The children's ``PROMETHEUS_MULTIPROC_DIR``: a child that ends is marked dead there.
    clock:
        Monotonic seconds.
    """

    def __init__(
        self,
        processes: int,
        work: Callable[[ChildLink], None],
        *,
        policy: RestartPolicy | None = None,
        health: ProcessesHealth | None = None,
        servers: tuple[HTTPServer, ...] = (),
        metrics_dir: MetricsDir | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if processes < 1:
            raise ValueError(f"processes must be >= 1, got {processes!r}")
        self._work = work
        self._policy = policy or RestartPolicy()
        self._health = health
        self._servers = servers
        self._metrics_dir = metrics_dir
        self._clock = clock
        self._slots = [_Slot(i) for i in range(processes)]
        self._by_pid: dict[int, _Slot] = {}
        self._signals: list[int] = []
        self._stopping = False
        self._give_up_code: int | None = None
        self._selector = selectors.DefaultSelector()
        self._wakeup: tuple[int, int] | None = None
        self._previous: dict[int, Any] = {}

    # -- the loop ----------------------------------------------------------------------------------

    def run(self) -> int:
        """Start the children and supervise them until they all stopped; the exit code: 0 when every
        child drained and exited 0 after a SIGTERM/SIGINT, 1 when one did not or the supervisor gave
        up, 2 when a child reported bad input."""
        if "confluent_kafka" in sys.modules:  # imported by a module of the caller's: fork anyway
            log.warning("confluent_kafka is loaded in the supervisor: fork with care (no client may exist)")
        self._install_signals()
        try:
            for server in self._servers:
                self._selector.register(server.socket, selectors.EVENT_READ, server)
            now = self._clock()
            for slot in self._slots:
                slot.start_at = now
            while True:
                self._handle_signals()
                self._reap()
                if self._stopping and not self._by_pid:
                    break
                if not self._stopping:
                    self._start_due()
                self._wait()
        finally:
            self._close()
        return self._exit_code()

    def _wait(self) -> None:
        now = self._clock()
        due = [s.start_at for s in self._slots if s.pid is None and s.start_at is not None]
        timeout = min([_TICK_S, *(max(0.0, t - now) for t in due)]) if not self._stopping else _TICK_S
        for key, _ in self._selector.select(timeout):
            if key.data == "wakeup":
                self._drain_wakeup()
            elif isinstance(key.data, HTTPServer):
                key.data.handle_request()
            elif isinstance(key.data, _Slot):
                self._read_reports(key.data)

    def _exit_code(self) -> int:
        if self._give_up_code is not None:
            return self._give_up_code
        failed = [s for s in self._slots if s.stop_code not in (None, 0)]
        for s in failed:
            log.error("child %d did not stop cleanly: %s", s.index, _describe(s.stop_code))
        return 1 if failed else 0

    # -- signals -----------------------------------------------------------------------------------

    def _install_signals(self) -> None:
        r, w = os.pipe()
        for fd in (r, w):
            os.set_blocking(fd, False)
        self._wakeup = (r, w)
        self._selector.register(r, selectors.EVENT_READ, "wakeup")
        signal.set_wakeup_fd(w)
        for sig in _SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signals.append(signum)  # handled by the loop; the wakeup fd ends its wait

    def _drain_wakeup(self) -> None:
        assert self._wakeup is not None
        try:
            while os.read(self._wakeup[0], 512):
                pass
        except BlockingIOError:
            pass

    def _handle_signals(self) -> None:
        while self._signals:
            sig = self._signals.pop(0)
            if sig in _STOP_SIGNALS:
                self._stop(f"{signal.Signals(sig).name} received")

    # -- children ----------------------------------------------------------------------------------

    def _start_due(self) -> None:
        now = self._clock()
        for slot in self._slots:
            if slot.pid is None and slot.start_at is not None and slot.start_at <= now:
                self._spawn(slot)

    def _spawn(self, slot: _Slot) -> None:
        r, w = os.pipe()
        supervisor = os.getpid()
        # a signal between the fork and the child's own handlers would run ours in the child
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
        try:
            pid = os.fork()
        except OSError as exc:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            os.close(r)
            os.close(w)
            log.error("child %d: fork failed: %s", slot.index, exc)
            slot.started_at = self._clock()
            self._failed(slot, "the fork failed")
            return
        if pid == 0:  # the child: never returns
            code = 1
            try:
                os.close(r)
                self._forget_in_child()
                link = ChildLink(slot.index, w, supervisor, health=self._health is not None)
                link.install_signals()
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
                code = run_child(self._work, link)
            finally:
                os._exit(code)
        os.close(w)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        os.set_blocking(r, False)
        slot.pid, slot.started_at, slot.start_at, slot.reports, slot.pending = (
            pid,
            self._clock(),
            None,
            r,
            b"",
        )
        self._by_pid[pid] = slot
        self._selector.register(r, selectors.EVENT_READ, slot)
        if self._health is not None:
            self._health.started(slot.index, pid)
        log.info("child %d started (pid %d)", slot.index, pid)

    def _forget_in_child(self) -> None:
        """In a new child: drop what belongs to the supervisor (its signal handlers, its wakeup pipe,
        the endpoints' sockets, the other children's pipes)."""
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        self._selector.close()
        if self._wakeup is not None:
            for fd in self._wakeup:
                os.close(fd)
        for server in self._servers:
            server.socket.close()
        for other in self._slots:
            if other.reports is not None:
                os.close(other.reports)

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            slot = self._by_pid.pop(pid, None)
            if slot is not None:
                self._ended(slot, pid, os.waitstatus_to_exitcode(status))

    def _ended(self, slot: _Slot, pid: int, code: int) -> None:
        if slot.reports is not None:
            self._read_reports(slot)
            self._close_reports(slot)
        slot.pid = None
        if self._health is not None:
            self._health.ended(slot.index, pid)
        if self._metrics_dir is not None:
            self._metrics_dir.mark_dead(pid)
        ran_s = self._clock() - slot.started_at
        if self._stopping:
            slot.stop_code = code
            log.info("child %d (pid %d) stopped: %s", slot.index, pid, _describe(code))
            return
        if code == BAD_INPUT_EXIT_CODE:
            log.error("child %d (pid %d) exited 2 (bad input, above): stopping", slot.index, pid)
            self._give_up(BAD_INPUT_EXIT_CODE)
            return
        log.warning("child %d (pid %d) ended after %.1f s: %s", slot.index, pid, ran_s, _describe(code))
        self._failed(slot, _describe(code), ran_s)

    def _failed(self, slot: _Slot, why: str, ran_s: float = 0.0) -> None:
        p = self._policy
        slot.failed_starts = p.failed_starts(slot.failed_starts, ran_s)
        if p.gives_up(slot.failed_starts):
            log.error(
                "child %d failed to start %d times in a row (each ran less than %g s; last: %s): giving up",
                slot.index,
                slot.failed_starts,
                p.stable_after_s,
                why,
            )
            self._give_up(1)
            return
        delay_s = p.backoff_for(slot.failed_starts)
        slot.start_at = self._clock() + delay_s
        log.warning(
            "child %d restarts in %g s (failed starts in a row: %d of %d)",
            slot.index,
            delay_s,
            slot.failed_starts,
            p.max_failed_starts,
        )

    def _give_up(self, code: int) -> None:
        if self._give_up_code is None:
            self._give_up_code = code
        self._stop("giving up")

    def _stop(self, why: str) -> None:
        """Stop every child gracefully (SIGTERM, again on each call) and start none."""
        if not self._stopping:
            self._stopping = True
            if self._health is not None:
                self._health.stopping()
            log.info("%s: stopping %d children gracefully", why, len(self._by_pid))
        for slot in self._slots:
            slot.start_at = None
        for pid in list(self._by_pid):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:  # ended, not reaped yet: the loop reaps it
                pass

    # -- reports -----------------------------------------------------------------------------------

    def _read_reports(self, slot: _Slot) -> None:
        assert slot.reports is not None
        try:
            data = os.read(slot.reports, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # the child closed it: it ends (the loop reaps it)
            self._close_reports(slot)
            return
        lines = (slot.pending + data).split(b"\n")
        slot.pending = lines[-1] if len(lines[-1]) <= _MAX_REPORT_BYTES else b""
        complete = [ln for ln in lines[:-1] if ln.strip()]
        if complete and self._health is not None and slot.pid is not None:
            try:
                report = json.loads(complete[-1])
            except ValueError:
                log.warning("child %d sent a health report that is not JSON: ignored", slot.index)
                return
            if isinstance(report, dict):
                self._health.reported(slot.index, slot.pid, report)

    def _close_reports(self, slot: _Slot) -> None:
        if slot.reports is not None:
            self._selector.unregister(slot.reports)
            os.close(slot.reports)
            slot.reports = None

    def _close(self) -> None:
        signal.set_wakeup_fd(-1)
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        for slot in self._slots:
            self._close_reports(slot)
        for server in self._servers:
            server.server_close()
        self._selector.close()
        if self._wakeup is not None:
            for fd in self._wakeup:
                os.close(fd)
            self._wakeup = None
        if self._metrics_dir is not None:
            self._metrics_dir.close()


def _describe(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def supervise(
    processes: int,
    work: Callable[[ChildLink], None],
    *,
    health_port: int | None,
    metrics_port: int | None,
    http_addr: str,
    policy: RestartPolicy | None = None,
) -> None:
    """Run ``work`` in ``processes`` forked children until SIGTERM/SIGINT (``keyedconsumer run
    --processes N``), serving one health endpoint (``health_port``) and one metrics endpoint
    (``metrics_port``) for all of them on ``http_addr``.

    Raises
    ------
    CliError
        (exit code 2) An endpoint cannot be bound, prometheus-client is missing for metrics, or a
        child reported bad input; (exit code 1) the supervisor gave up on a child that kept dying,
        or a child did not stop cleanly.
    """
    metrics_dir = MetricsDir() if metrics_port is not None else None
    health = ProcessesHealth(processes) if health_port is not None else None
    servers: list[HTTPServer] = []
    try:
        if health is not None and health_port is not None:
            servers.append(health_server(health, health_port, http_addr))
            bound = servers[-1].server_address[1]
            log.info("health on http://%s:%d/livez, /readyz, /healthz (every child)", http_addr, bound)
        if metrics_dir is not None and metrics_port is not None:
            servers.append(metrics_server(metrics_dir, metrics_port, http_addr))
            bound = servers[-1].server_address[1]
            log.info("metrics on http://%s:%d/metrics (every child)", http_addr, bound)
    except OSError as exc:
        for server in servers:
            server.server_close()
        if metrics_dir is not None:
            metrics_dir.close()
        raise CliError(f"cannot serve on {http_addr}: {exc}", 2) from None
    log.info("supervisor (pid %d): running %d processes", os.getpid(), processes)
    code = Supervisor(
        processes, work, policy=policy, health=health, servers=tuple(servers), metrics_dir=metrics_dir
    ).run()
    if code == BAD_INPUT_EXIT_CODE:
        raise CliError("a child could not start (bad input, above)", code)
    if code:
        raise CliError("stopped: the children did not all run or stop cleanly (above)", code)
    log.info("stopped")
