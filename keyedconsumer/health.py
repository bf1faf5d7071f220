"""Health of a running consumer: liveness, readiness and stalled partitions, optionally over HTTP.

- **Live**: the poll loop is running: ``consumer.polled_at_s`` (when the loop last returned from a
  poll) is at most ``live_within_s`` old. The loop returns every ``poll_timeout_s`` when idle; a
  rebalance callback runs inside a poll and may hold it for up to ``revoke_timeout_s``, so keep
  ``live_within_s`` above that. Not live before the first poll and once the loop stopped.
- **Ready**: live, at least one partition is assigned (``consumer.assignment``), no plain
  handler runs past ``handler_timeout_s`` (``consumer.overrunning``), no message waits for a
  service that does not answer (``unavailable()`` of the source and of the ``dependencies`` given,
  e.g. a ``Typed`` middleware whose schema registry is out), and the sequencer's store answers
  (``consumer.store_available``: Redis down, or answering ``READONLY`` in a failover, is not
  ready). A member with nothing assigned (more members than partitions) is live but not ready.
- **Stalled partition**: its lag is above zero while its stored offset has not moved for
  ``stall_after_s`` (from ``consumer.partition_status()``; this object remembers when each
  partition's ``stored_offset`` last changed). Before anything was stored for the assignment the
  lag is not known; the partition then counts as stalled only when it has unfinished messages.
  A stalled partition is typically a key whose handler hangs or keeps failing: the offset is held
  at its message while the partition's other keys go on.
- **Healthy**: live and no stalled partition.

:meth:`Health.check` samples the consumer; call it from a probe, a metrics scrape or a timer (the
HTTP endpoints call it on every request). Offsets never move back, so two samples with the same
stored offset mean it did not move in between, however far apart they are.

``Health.serve(port)`` answers ``GET /livez``, ``/readyz`` and ``/healthz`` with ``200`` or ``503``
and the JSON of :meth:`HealthReport.to_dict`, from a daemon thread (stdlib ``http.server``).

:class:`ProcessesHealth` is the health of the N children of ``keyedconsumer run --processes N``,
from the reports each child sends its supervisor (see its documentation); the supervisor serves it
with :func:`request_handler` from its own loop (it runs no thread, so that it can fork).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from .consumer import PartitionStatus

__all__ = [
    "Health",
    "HealthReport",
    "StalledPartition",
    "HealthSource",
    "Dependency",
    "unavailable_of",
    "ProcessesHealth",
    "ProcessesReport",
    "request_handler",
]

log = logging.getLogger("keyedconsumer.health")


class HealthSource(Protocol):
    """What :class:`Health` reads of a consumer (a :class:`~keyedconsumer.KeyedConsumer` is one, and
    a :class:`~keyedconsumer.KeyedApp`). An ``overrunning`` attribute (int), when present, counts
    handler runs past their time limit: above 0, not ready. An ``unavailable()`` method, when
    present, is a :class:`Dependency`'s (a ``KeyedApp`` asks its middleware). A ``store_available``
    attribute (bool), when present and ``False``, means the sequencer's store does not answer: not
    ready."""

    @property
    def polled_at_s(self) -> float: ...

    @property
    def assignment(self) -> list[tuple[str, int]]: ...

    def partition_status(self) -> list[PartitionStatus]: ...


class Dependency(Protocol):
    """Something messages need besides Kafka, e.g. a :class:`~keyedconsumer.middleware.Typed`
    middleware (its schema registry): ``unavailable()`` lists why messages wait for it now, one
    reason each (``[]``: none waits)."""

    def unavailable(self) -> list[str]: ...


def unavailable_of(sources: Iterable[object]) -> list[str]:
    """The reasons of every source's ``unavailable()`` (a :class:`Dependency`'s; sources without
    one are skipped), each once, in order."""
    reasons: list[str] = []
    for source in sources:
        ask = getattr(source, "unavailable", None)
        if callable(ask):
            reasons.extend(str(r) for r in ask())
    return list(dict.fromkeys(reasons))


@dataclasses.dataclass(frozen=True)
class StalledPartition:
    """A partition whose stored offset has not moved for ``stalled_for_s`` seconds while it lags.

    ``lag`` is ``None`` when nothing was stored yet for this assignment (the partition then has
    ``unfinished`` messages received and none finished).
    """

    topic: str
    partition: int
    stored_offset: int | None
    lag: int | None
    unfinished: int
    oldest_unfinished_age_s: float
    stalled_for_s: float


@dataclasses.dataclass(frozen=True)
class HealthReport:
    """One sample of a consumer's health (see the module documentation for the definitions)."""

    live: bool
    ready: bool
    polled_ago_s: float | None
    assigned_partitions: int
    stalled: tuple[StalledPartition, ...]
    overrunning: int = 0  # plain handler runs past handler_timeout_s, still running
    unavailable: tuple[str, ...] = ()  # why messages wait for a service now (a schema registry)
    store_available: bool = True  # the sequencer's store (Redis) answered its last call

    @property
    def healthy(self) -> bool:
        """Live and no stalled partition."""
        return self.live and not self.stalled

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data."""
        return {
            "live": self.live,
            "ready": self.ready,
            "healthy": self.healthy,
            "polled_ago_s": None if self.polled_ago_s is None else round(self.polled_ago_s, 3),
            "assigned_partitions": self.assigned_partitions,
            "stalled": [dataclasses.asdict(s) for s in self.stalled],
            "overrunning_handlers": self.overrunning,
            "unavailable": list(self.unavailable),
            "store_available": self.store_available,
        }


class Health:
    """Liveness, readiness and stall detection of one consumer.

    Parameters
    ----------
    consumer:
        The :class:`~keyedconsumer.KeyedConsumer` (or anything with ``polled_at_s``,
        ``assignment`` and ``partition_status()``).
    stall_after_s:
        Seconds a lagging partition's stored offset may stand still before it counts as stalled.
        Keep it above your longest handler run plus its retry back-off.
    live_within_s:
        The poll loop counts as running when it returned from a poll at most this many seconds ago.
    clock:
        Monotonic seconds; must be the clock of ``consumer.polled_at_s`` (``time.monotonic``).
        Tests pass a fake one.
    dependencies:
        :class:`Dependency` objects (a ``Typed`` middleware of the consumer): not ready while one
        says messages wait for it. A ``KeyedApp`` source asks its own middleware; a
        ``KeyedConsumer`` does not know its middleware's services, so pass them here.

    Raises
    ------
    ValueError
        A bound that is not a positive number.
    """

    def __init__(
        self,
        consumer: HealthSource,
        *,
        stall_after_s: float = 60.0,
        live_within_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        dependencies: Sequence[Dependency] = (),
    ) -> None:
        if not (stall_after_s > 0 and live_within_s > 0):
            raise ValueError(
                f"stall_after_s and live_within_s must be > 0, got {stall_after_s!r}, {live_within_s!r}"
            )
        self.consumer = consumer
        self.dependencies: tuple[Dependency, ...] = tuple(dependencies)
        self.stall_after_s = float(stall_after_s)
        self.live_within_s = float(live_within_s)
        self._clock = clock
        self._lock = threading.Lock()
        #: (topic, partition) -> (stored offset last seen, when it was first seen with that value)
        self._since: dict[tuple[str, int], tuple[int | None, float]] = {}
        self._stalled: set[tuple[str, int]] = set()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- sampling -----------------------------------------------------------------------------------

    def check(self) -> HealthReport:
        """Sample the consumer now. Safe from any thread."""
        c = self.consumer
        polled = c.polled_at_s
        assigned = len(c.assignment)
        statuses = c.partition_status()
        with self._lock:
            now = self._clock()
            polled_ago_s = now - polled if polled > 0 else None
            live = polled_ago_s is not None and polled_ago_s <= self.live_within_s
            stalled = self._track(statuses, now)
        overrunning = int(getattr(c, "overrunning", 0))
        unavailable = tuple(unavailable_of([c, *self.dependencies]))
        store = bool(getattr(c, "store_available", True))
        ready = live and assigned > 0 and not overrunning and not unavailable and store
        return HealthReport(live, ready, polled_ago_s, assigned, stalled, overrunning, unavailable, store)

    def _track(self, statuses: Sequence[PartitionStatus], now: float) -> tuple[StalledPartition, ...]:
        since = self._since
        seen: set[tuple[str, int]] = set()
        out: list[StalledPartition] = []
        for st in statuses:
            tp = (st.topic, st.partition)
            seen.add(tp)
            prev = since.get(tp)
            if prev is None or prev[0] != st.stored_offset:
                since[tp] = prev = (st.stored_offset, now)
            still_s = now - prev[1]
            if st.stored_offset is None:
                lag, waiting = None, st.unfinished > 0  # the lag is unknown before the first store
            else:
                lag = st.lag
                waiting = lag is not None and lag > 0
            if waiting and still_s >= self.stall_after_s:
                out.append(
                    StalledPartition(
                        st.topic,
                        st.partition,
                        st.stored_offset,
                        lag,
                        st.unfinished,
                        st.oldest_unfinished_age_s,
                        still_s,
                    )
                )
        for tp in [tp for tp in since if tp not in seen]:  # no longer assigned
            del since[tp]
        now_stalled = {(s.topic, s.partition) for s in out}
        for s in out:
            if (s.topic, s.partition) not in self._stalled:
                log.warning(
                    "stalled: %s[%d] stored offset %s unchanged for %.1f s with lag %s",
                    s.topic,
                    s.partition,
                    s.stored_offset,
                    s.stalled_for_s,
                    s.lag,
                )
        for topic, partition in self._stalled - now_stalled:
            log.info("no longer stalled: %s[%d]", topic, partition)
        self._stalled = now_stalled
        return tuple(out)

    def live(self) -> bool:
        """The poll loop returned from a poll within ``live_within_s``."""
        return self.check().live

    def ready(self) -> bool:
        """Live, with at least one partition assigned, no handler overrunning, no service awaited,
        the store answering."""
        return self.check().ready

    def stalled(self) -> tuple[StalledPartition, ...]:
        """The partitions stalled now."""
        return self.check().stalled

    # -- HTTP ---------------------------------------------------------------------------------------

    def serve(self, port: int = 0, *, addr: str = "127.0.0.1") -> int:
        """Serve ``/livez``, ``/readyz`` and ``/healthz`` on ``addr:port`` from a daemon thread.

        Each answers ``200`` when its condition holds (live; ready; healthy), else ``503``, with
        the report as JSON. Other paths answer ``404``.

        Returns
        -------
        int
            The port bound (useful with ``port=0``, which picks a free one).

        Raises
        ------
        RuntimeError
            Already serving.
        OSError
            The address cannot be bound.
        """
        if self._server is not None:
            raise RuntimeError("this Health is already serving")
        server = ThreadingHTTPServer((addr, port), request_handler(self))
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="keyedconsumer-health", daemon=True)
        self._thread.start()
        return int(server.server_address[1])

    def close(self) -> None:
        """Stop serving (if serving)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None

    def __repr__(self) -> str:
        return f"Health(stall_after_s={self.stall_after_s:g}, live_within_s={self.live_within_s:g})"


@dataclasses.dataclass(frozen=True)
class ProcessesReport:
    """One sample of the health of a supervisor's children (:class:`ProcessesHealth`).

    ``children``: per slot, ``{"slot", "pid", "state", "restarts", "report_age_s", "report"}``:
    ``state`` is ``"starting"`` (no report yet), ``"running"``, or ``"down"`` (between a child's end
    and its restart, or stopped); ``report`` is the child's last :meth:`HealthReport.to_dict`.
    """

    live: bool
    ready: bool
    healthy: bool
    stopping: bool
    children: tuple[dict[str, Any], ...]

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data."""
        return {
            "live": self.live,
            "ready": self.ready,
            "healthy": self.healthy,
            "stopping": self.stopping,
            "processes": len(self.children),
            "children": list(self.children),
        }


@dataclasses.dataclass
class _Child:
    pid: int | None = None
    started_at: float = 0.0
    starts: int = 0
    report: dict[str, Any] | None = None
    reported_at: float = 0.0


class ProcessesHealth:
    """The health of the N children of one supervisor (``keyedconsumer run --processes N``), from the
    :class:`HealthReport` each child sends once a second (:meth:`reported`).

    A child's report is **fresh** while at most ``live_within_s`` old (a child that stopped sending,
    frozen or gone, has none).

    - **Live**: every running child is live: its fresh report says live, or it started less than
      ``live_within_s`` ago and has not reported yet (it imports the handler and joins the group).
      A slot waiting for its child's restart does not count: the supervisor restarts it; when it
      gives up, it exits non-zero.
    - **Ready**: not stopping, and every one of the N children runs with a fresh report that says
      ready (so, as for one process, a child with no partition assigned, when there are more
      processes than partitions, keeps the whole not ready).
    - **Healthy**: live, and no fresh report shows a stalled partition.

    Not thread-safe: the supervisor's loop owns it.

    Parameters
    ----------
    processes:
        N, the slots.
    live_within_s:
        Seconds a report stays fresh, and a starting child counts as live; as :class:`Health`'s.
    clock:
        Monotonic seconds (tests pass a fake one).
    """

    def __init__(
        self, processes: int, *, live_within_s: float = 30.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.live_within_s = float(live_within_s)
        self._clock = clock
        self._children = [_Child() for _ in range(processes)]
        self._stopping = False

    def started(self, slot: int, pid: int) -> None:
        """The child ``pid`` started in ``slot``."""
        c = self._children[slot]
        c.pid, c.started_at, c.report, c.starts = pid, self._clock(), None, c.starts + 1

    def reported(self, slot: int, pid: int, report: dict[str, Any]) -> None:
        """The child ``pid`` of ``slot`` sent ``report`` (a :meth:`HealthReport.to_dict`); ignored
        when that child is no longer the slot's."""
        c = self._children[slot]
        if c.pid == pid:
            c.report, c.reported_at = report, self._clock()

    def ended(self, slot: int, pid: int) -> None:
        """The child ``pid`` of ``slot`` exited."""
        c = self._children[slot]
        if c.pid == pid:
            c.pid, c.report = None, None

    def stopping(self) -> None:
        """The supervisor is stopping its children: not ready from now on."""
        self._stopping = True

    def check(self) -> ProcessesReport:
        """Sample the children now."""
        now = self._clock()
        live = ready = True
        stalled = False
        children = []
        for slot, c in enumerate(self._children):
            fresh = c.report if c.report is not None and now - c.reported_at <= self.live_within_s else None
            if c.pid is None:
                state = "down"
                ready = False
            elif c.report is None:
                state = "starting"
                live = live and now - c.started_at <= self.live_within_s
                ready = False
            else:
                state = "running"
                live = live and fresh is not None and bool(fresh.get("live"))
                ready = ready and fresh is not None and bool(fresh.get("ready"))
                stalled = stalled or bool(fresh and fresh.get("stalled"))
            children.append(
                {
                    "slot": slot,
                    "pid": c.pid,
                    "state": state,
                    "restarts": max(0, c.starts - 1),
                    "report_age_s": round(now - c.reported_at, 3) if c.report is not None else None,
                    "report": c.report,
                }
            )
        ready = ready and live and not self._stopping
        return ProcessesReport(live, ready, live and not stalled, self._stopping, tuple(children))


class _Report(Protocol):
    @property
    def live(self) -> bool: ...

    @property
    def ready(self) -> bool: ...

    @property
    def healthy(self) -> bool: ...

    def to_dict(self) -> dict[str, Any]: ...


class _Checker(Protocol):
    def check(self) -> _Report: ...


_ROUTES: dict[str, Callable[[_Report], bool]] = {
    "/livez": lambda r: r.live,
    "/readyz": lambda r: r.ready,
    "/healthz": lambda r: r.healthy,
}


def request_handler(health: _Checker, *, timeout_s: float | None = None) -> type[BaseHTTPRequestHandler]:
    """The ``http.server`` request handler of ``/livez``, ``/readyz`` and ``/healthz``: each calls
    ``health.check()`` (a :class:`Health`, a :class:`ProcessesHealth`) and answers ``200`` when its
    condition holds, else ``503``, with the report's JSON; other paths ``404``. ``timeout_s``: how
    long a request may take to arrive (a server that answers from its own loop bounds a slow client)."""

    class _Handler(BaseHTTPRequestHandler):
        timeout = timeout_s

        def do_GET(self) -> None:
            route = _ROUTES.get(self.path.split("?", 1)[0].rstrip("/") or "/")
            if route is None:
                self._send(404, {"error": "not found", "paths": sorted(_ROUTES)})
                return
            report = health.check()
            self._send(200 if route(report) else 503, report.to_dict())

        def _send(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("health http: " + format, *args)

    return _Handler
