"""What the dashboard shows of Kafka and Redis, gathered by one background thread.

Every ``interval_s`` seconds the sampler asks the brokers (through :mod:`keyedconsumer.kafka.admin`
and :func:`keyedconsumer.groups.group_rows`, as ``keyedconsumer inspect`` does) and Redis
(:func:`keyedconsumer.sequencing.inspect_redis`) once, whatever the number of open pages: a page
only reads the latest snapshot. It keeps each group's committed and end offsets over the last
``history_s`` seconds for the throughput chart, and when each partition's committed offset last
moved, for the stalled flag.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from collections import deque
from typing import Any

from ..errors import KafkaClientError
from ..groups import group_rows
from ..kafka import TP, admin
from ..sequencing import inspect_redis, redact_url

__all__ = ["GroupSnapshot", "Snapshot", "Sampler", "is_dead_letter_topic"]

log = logging.getLogger("keyedconsumer.web")

#: Topic names taken for dead-letter topics when none are given: ``orders.dlq``, ``orders-DLT``, ...
DEAD_LETTER_NAME = re.compile(r"(?i)([._-](dlq|dlt)|dead[._-]?letters?)$")
#: Groups of our own tools, never listed: the replay markers and ``inspect``'s throw-away readers.
_TOOL_GROUPS = ("keyedconsumer-replay.", "keyedconsumer-inspect-")
#: Partitions whose oldest unfinished record's age is read at each sample (those with the most lag).
MAX_AGES = 50
#: Groups sampled in detail when none are given: the first ones listed, plus those opened lately.
MAX_LISTED_GROUPS = 20
#: Seconds a group opened in a page stays sampled in detail.
WATCH_S = 120.0
#: Seconds between reads of the topic list (a cluster's full metadata: the dearest request here).
TOPICS_EVERY_S = 30.0
#: Seconds between reads of the oldest unfinished records' timestamps (each reads a record).
AGES_EVERY_S = 10.0


def is_dead_letter_topic(name: str) -> bool:
    """True when ``name`` looks like a dead-letter topic (``DeadLetter``'s default is ``{topic}.dlq``)."""
    return bool(DEAD_LETTER_NAME.search(name))


@dataclasses.dataclass
class GroupSnapshot:
    """One consumer group as last sampled.

    ``rows``: per partition, ``inspect --json``'s fields plus ``stalled_for_s`` (seconds its
    committed offset has not moved while lag > 0; ``None`` when moving or caught up) and
    ``stalled``; ``history``: ``(time s, consumed/s, produced/s)`` over the last minutes.
    """

    group: str
    state: str = "unknown"
    members: tuple[admin.GroupMember, ...] = ()
    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    total_lag: int = 0
    stalled: int = 0
    error: str | None = None
    note: str | None = None
    history: list[tuple[float, float, float]] = dataclasses.field(default_factory=list)
    sampled_s: float = 0.0
    detailed: bool = True


@dataclasses.dataclass
class Snapshot:
    """Everything the pages show, as last sampled (``sampled_s``: wall-clock seconds; 0: never)."""

    groups: dict[str, GroupSnapshot] = dataclasses.field(default_factory=dict)
    kafka_error: str | None = None
    topics: dict[str, int] = dataclasses.field(default_factory=dict)
    dead_letter_topics: list[str] = dataclasses.field(default_factory=list)
    redis: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    redis_error: str | None = None
    sampled_s: float = 0.0


class _History:
    """A group's summed committed and end offsets over time, when each partition last moved, and
    the oldest unfinished records' timestamps as last read."""

    def __init__(self, history_s: float) -> None:
        self.points: deque[tuple[float, int, int]] = deque()
        self.moved: dict[TP, tuple[int | None, float]] = {}
        self.history_s = history_s
        self.ages_read_s = -AGES_EVERY_S  # monotonic time of the last read of the ages
        self.ages: dict[
            TP, tuple[float, float, int | None]
        ] = {}  # partition -> (age s, when read, committed then)

    def ages_due(self, now: float) -> bool:
        return now - self.ages_read_s >= AGES_EVERY_S

    def keep_ages(self, now: float, rows: list[dict[str, Any]], fresh: bool) -> None:
        """Remember ages just read (``fresh``), else show the last ones read, grown by the time since
        where the committed offset has not moved (the same record), as read where it has."""
        if fresh:
            self.ages_read_s = now
            self.ages = {
                (r["topic"], r["partition"]): (r["oldest_unfinished_age_s"], now, r["committed_offset"])
                for r in rows
                if r["oldest_unfinished_age_s"] is not None
            }
            return
        for r in rows:
            tp = (r["topic"], r["partition"])
            if r["lag"] and tp in self.ages:
                age, at, committed = self.ages[tp]
                same = committed == r["committed_offset"]
                r["oldest_unfinished_age_s"] = round(age + (now - at if same else 0.0), 3)

    def add(self, now: float, rows: list[dict[str, Any]]) -> None:
        committed = sum(r["committed_offset"] or 0 for r in rows)
        end = sum(r["end_offset"] for r in rows)
        self.points.append((now, committed, end))
        while self.points and self.points[0][0] < now - self.history_s:
            self.points.popleft()
        seen: dict[TP, tuple[int | None, float]] = {}
        for r in rows:
            tp = (r["topic"], r["partition"])
            before = self.moved.get(tp)
            since = before[1] if before is not None and before[0] == r["committed_offset"] else now
            seen[tp] = (r["committed_offset"], since)
        self.moved = seen

    def rates(self) -> list[tuple[float, float, float]]:
        """``(time, consumed/s, produced/s)`` between consecutive samples (negative steps, after a
        topic was deleted or a group reset, count as 0)."""
        pts = list(self.points)
        out = []
        for (t0, c0, e0), (t1, c1, e1) in zip(pts, pts[1:], strict=False):
            dt = max(t1 - t0, 1e-3)
            out.append((t1, max(0, c1 - c0) / dt, max(0, e1 - e0) / dt))
        return out

    def unmoved_s(self, tp: TP, now: float) -> float:
        seen = self.moved.get(tp)
        return 0.0 if seen is None else now - seen[1]


class Sampler:
    """Samples the groups, topics and Redis namespaces in a daemon thread.

    Parameters
    ----------
    conf:
        librdkafka properties (``bootstrap.servers`` and any pass-through properties).
    groups:
        The consumer groups to show; empty: every group the brokers list (our tools' groups aside).
    redis_url:
        The Redis sequencer's URL, or ``None``.
    namespaces:
        Redis namespaces to show; empty: one per group (the sequencer's default namespace).
    dead_letter_topics:
        Dead-letter topics; empty: the topics whose name looks like one (:func:`is_dead_letter_topic`).
    interval_s:
        Seconds between samples.
    timeout_s:
        Bound of each broker answer.
    stall_after_s:
        A partition with lag whose committed offset has not moved for this long is flagged stalled.
    history_s:
        Seconds of throughput history kept.
    """

    def __init__(
        self,
        conf: dict[str, Any],
        *,
        groups: list[str] | None = None,
        redis_url: str | None = None,
        namespaces: list[str] | None = None,
        dead_letter_topics: list[str] | None = None,
        interval_s: float = 5.0,
        timeout_s: float = 10.0,
        stall_after_s: float = 60.0,
        history_s: float = 900.0,
    ) -> None:
        self.conf = conf
        self.fixed_groups = list(groups or [])
        self.redis_url = redis_url
        self.fixed_namespaces = list(namespaces or [])
        self.fixed_dead_letter_topics = list(dead_letter_topics or [])
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.stall_after_s = stall_after_s
        self.history_s = history_s
        self._histories: dict[str, _History] = {}
        self._snapshot = Snapshot()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._watched: dict[str, float] = {}  # group -> when a page last showed it (monotonic)
        self._topics: tuple[float, dict[str, int]] | None = None  # (monotonic time read, topics)

    # -- the thread -------------------------------------------------------------------------------

    def start(self) -> None:
        """Start sampling (the first sample is taken at once)."""
        self._thread = threading.Thread(target=self._loop, name="keyedconsumer-web-sampler", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def watch(self, group: str) -> None:
        """A page shows ``group``: sample it in detail for the next :data:`WATCH_S` seconds (when no
        groups were given, only the first :data:`MAX_LISTED_GROUPS` listed are sampled otherwise)."""
        with self._lock:
            new = group not in self._watched
            self._watched[group] = time.monotonic()
        if new and not self.fixed_groups:
            self._wake.set()

    def refresh_soon(self) -> None:
        """Take the next sample now (after an action)."""
        self._wake.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except Exception:  # a sampler that dies leaves the pages frozen: log and go on
                log.exception("sampling failed")
            self._wake.wait(self.interval_s)
            self._wake.clear()

    def snapshot(self) -> Snapshot:
        """The latest snapshot (never blocks on the brokers or Redis)."""
        with self._lock:
            return self._snapshot

    # -- one sample -------------------------------------------------------------------------------

    def sample(self) -> Snapshot:
        """Take one sample now and make it the latest snapshot."""
        snap = Snapshot(sampled_s=time.time())
        groups = list(self.fixed_groups)
        listed: dict[str, str] = {}
        try:
            snap.topics = self._all_topics()
            if not groups:
                listed = {
                    g: st
                    for g, st in admin.list_groups(self.conf, self.timeout_s).items()
                    if not g.startswith(_TOOL_GROUPS)
                }
                with self._lock:
                    now = time.monotonic()
                    self._watched = {g: t for g, t in self._watched.items() if now - t < WATCH_S}
                    watched = set(self._watched)
                groups = [g for g in listed if g in watched] + [g for g in listed if g not in watched][
                    :MAX_LISTED_GROUPS
                ]
        except KafkaClientError as exc:
            snap.kafka_error = str(exc)
        snap.dead_letter_topics = self.fixed_dead_letter_topics or sorted(
            t for t in snap.topics if is_dead_letter_topic(t)
        )
        if snap.kafka_error is None:
            for group in groups:
                snap.groups[group] = self._group(group, snap.topics)
            for group, state in listed.items():
                if group not in snap.groups:
                    snap.groups[group] = GroupSnapshot(
                        group, state=state, detailed=False, sampled_s=snap.sampled_s
                    )
        for gone in set(self._histories) - set(groups):
            del self._histories[gone]
        if self.redis_url:
            snap.redis, snap.redis_error = self._redis(self.fixed_namespaces or groups[:MAX_LISTED_GROUPS])
        with self._lock:
            self._snapshot = snap
        return snap

    def _all_topics(self) -> dict[str, int]:
        now = time.monotonic()
        if self._topics is None or now - self._topics[0] >= TOPICS_EVERY_S:
            self._topics = (now, admin.all_topics(self.conf, self.timeout_s))
        return self._topics[1]

    def _group(self, group: str, topics: dict[str, int]) -> GroupSnapshot:
        out = GroupSnapshot(group, sampled_s=time.time())
        history = self._histories.setdefault(group, _History(self.history_s))
        fresh = history.ages_due(time.monotonic())
        max_ages = MAX_AGES if fresh else 0
        try:
            try:
                desc, rows = group_rows(self.conf, group, [], self.timeout_s, max_ages)
            except KafkaClientError as exc:
                if exc.code != "UNKNOWN_TOPIC_OR_PART":
                    raise
                # a topic the group committed to was deleted: show the topics that still exist
                committed = admin.committed_offsets(self.conf, group, None, self.timeout_s)
                had = sorted({t for t, _ in committed})
                gone = [t for t in had if t not in topics]
                desc, rows = group_rows(
                    self.conf, group, [t for t in had if t in topics], self.timeout_s, max_ages
                )
                out.note = f"topic(s) deleted: {', '.join(gone)}" if gone else None
                self._topics = None  # read the topics again next time
        except KafkaClientError as exc:
            out.error = str(exc)
            return out
        out.state, out.members, out.rows = desc.state, desc.member_list, rows
        now = time.monotonic()
        history.keep_ages(now, rows, fresh)
        history.add(now, rows)
        for r in rows:
            unmoved = history.unmoved_s((r["topic"], r["partition"]), now)
            r["stalled_for_s"] = round(unmoved, 1) if r["lag"] else None
            r["stalled"] = bool(r["lag"]) and unmoved >= self.stall_after_s
        out.total_lag = sum(r["lag"] or 0 for r in rows)
        out.stalled = sum(1 for r in rows if r["stalled"])
        wall = time.time() - now
        out.history = [(t + wall, c, e) for t, c, e in history.rates()]
        return out

    def _redis(self, namespaces: list[str]) -> tuple[dict[str, dict[str, Any]], str | None]:
        from ..sequencing.store import StoreUnavailable

        assert self.redis_url is not None
        out: dict[str, dict[str, Any]] = {}
        for ns in namespaces:
            try:
                out[ns] = inspect_redis(self.redis_url, ns)
            except ValueError as exc:  # a group name that cannot be a namespace
                out[ns] = {"error": str(exc)}
            except StoreUnavailable as exc:
                return out, f"Redis {redact_url(self.redis_url)} did not answer: {exc}"
        return out, None
