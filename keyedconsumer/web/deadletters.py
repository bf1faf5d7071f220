"""Dead letters as the dashboard shows them: the latest records of a dead-letter topic with their
failure headers, whether each was replayed (the replay marker of ``keyedconsumer dead-letter
replay``), and the filters by time, key and error.

Reading uses :class:`keyedconsumer.kafka.admin.TopicReader` (it never joins a group nor commits);
the marker is :class:`keyedconsumer.cli.marker.ReplayMarker`, read from the marker group's
committed offsets. A topic's records are read at most once per ``cache_s`` seconds.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import importlib
import threading
import time
from typing import Any

from ..cli.marker import ReplayMarker
from ..cli.output import _show_key
from ..cli.replay import marker_group_of
from ..kafka import admin

__all__ = ["DeadLetter", "DeadLetterReader", "Filters"]

#: Characters of a value or header shown (the rest is cut, and says so).
MAX_SHOWN = 4096
#: Records read from one topic at most (fewer per partition on a topic of many partitions).
MAX_READ = 5000


def _text(raw: bytes | None) -> str | None:
    if raw is None:
        return None
    text = raw[:MAX_SHOWN].decode("utf-8", "replace")
    return text if len(raw) <= MAX_SHOWN else f"{text}... ({len(raw)} bytes)"


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


@dataclasses.dataclass(frozen=True)
class DeadLetter:
    """One dead-letter record as shown: its place, key, value, headers and failure headers (as text:
    everything here is shown escaped, never trusted)."""

    partition: int
    offset: int
    key: str | None
    value: str | None
    headers: list[tuple[str, str | None]]
    error: str | None
    exception: str | None
    cause: str | None
    attempts: int | None
    original_topic: str | None
    original_partition: int | None
    original_offset: int | None
    failed_at_ms: int | None
    stacktrace: str | None
    replayed: bool

    @property
    def failed_at(self) -> str:
        if self.failed_at_ms is None:
            return "-"
        return dt.datetime.fromtimestamp(self.failed_at_ms / 1000, dt.timezone.utc).strftime(
            "%Y-%m-%d %H:%M:%SZ"
        )


@dataclasses.dataclass(frozen=True)
class Filters:
    """Key and error substrings (case-insensitive) and a failure-time window (ms since the epoch)."""

    key: str = ""
    error: str = ""
    since_ms: int | None = None
    until_ms: int | None = None

    def match(self, d: DeadLetter) -> bool:
        if self.key and self.key.lower() not in (d.key or "").lower():
            return False
        if self.error and self.error.lower() not in f"{d.error or ''} {d.exception or ''}".lower():
            return False
        when = d.failed_at_ms
        if self.since_ms is not None and (when is None or when < self.since_ms):
            return False
        return not (self.until_ms is not None and (when is None or when > self.until_ms))


class DeadLetterReader:
    """Reads the latest ``limit`` records of each partition of a dead-letter topic, at most
    :data:`MAX_READ` in all (cached).

    Parameters
    ----------
    conf:
        librdkafka properties.
    limit:
        Records read per partition (the newest).
    cache_s:
        A topic is read again only this many seconds after its last read (or after :meth:`forget`).
    timeout_s:
        Bound of each broker answer.
    """

    def __init__(
        self, conf: dict[str, Any], *, limit: int = 200, cache_s: float = 5.0, timeout_s: float = 10.0
    ) -> None:
        self.conf, self.limit, self.cache_s, self.timeout_s = conf, limit, cache_s, timeout_s
        dlt: Any = importlib.import_module("keyedconsumer.middleware.dead_letter")  # its header names
        self.h: Any = dlt
        self._cache: dict[str, tuple[float, list[DeadLetter]]] = {}
        self._lock = threading.Lock()

    def forget(self, topic: str) -> None:
        """Read ``topic`` again on the next call (after a replay changed its marker)."""
        with self._lock:
            self._cache.pop(topic, None)

    def records(self, topic: str) -> list[DeadLetter]:
        """The topic's latest records, newest failure first.

        Raises
        ------
        KafkaClientError
            The topic does not exist (``code="UNKNOWN_TOPIC_OR_PART"``), or no answer from the brokers.
        """
        with self._lock:
            hit = self._cache.get(topic)
            if hit is not None and time.monotonic() - hit[0] < self.cache_s:
                return hit[1]
            rows = self._read(topic)
            self._cache[topic] = (time.monotonic(), rows)
            return rows

    def _read(self, topic: str) -> list[DeadLetter]:
        reader = admin.TopicReader(self.conf, topic, marker_group_of(topic), self.timeout_s)
        try:
            markers = {
                p: ReplayMarker.decode(c.offset, c.metadata)
                for p, c in reader.committed(stable=False).items()
            }
            per = max(1, min(self.limit, MAX_READ // max(1, len(reader.partitions))))
            start = {p: max(reader.start_offsets[p], reader.end_offsets[p] - per) for p in reader.partitions}
            rows = [self._row(r, markers[r.partition]) for r in reader.read(start)]
        finally:
            reader.close()
        rows.sort(key=lambda d: (d.failed_at_ms or 0, d.partition, d.offset), reverse=True)
        return rows

    def _row(self, record: admin.Record, marker: ReplayMarker) -> DeadLetter:
        h = self.h

        def header(name: str) -> str | None:
            for k, v in reversed(record.headers):
                if k == name and v is not None:
                    return v.decode("utf-8", "replace")
            return None

        return DeadLetter(
            partition=record.partition,
            offset=record.offset,
            key=_show_key(record.key),
            value=_text(record.value),
            headers=[(k, _text(v)) for k, v in record.headers if k not in (h.H_STACKTRACE,)],
            error=header(h.H_MESSAGE),
            exception=header(h.H_FQCN),
            cause=header(h.H_CAUSE_FQCN),
            attempts=_int(header(h.H_ATTEMPTS)),
            original_topic=header(h.H_TOPIC),
            original_partition=_int(header(h.H_PARTITION)),
            original_offset=_int(header(h.H_OFFSET)),
            failed_at_ms=_int(header(h.H_FAILED_AT)) or record.timestamp_ms,
            stacktrace=header(h.H_STACKTRACE),
            replayed=marker.is_replayed(record.offset),
        )
