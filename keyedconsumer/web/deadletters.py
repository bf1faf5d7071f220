"""Dead letters as the dashboard shows them: the latest records of a dead-letter topic, or a search
of it (by exact key, error text, failure time), with their failure headers and whether each was
replayed (the replay marker of ``keyedconsumer dead-letter replay``).

Every byte of a dead letter is attacker-controlled. Here it becomes :class:`Shown` values: text when
it is valid UTF-8 without control characters, else a hex view; each cut to :data:`MAX_SHOWN_BYTES`
and saying so. The templates escape whatever they put in a page.

Reading uses :class:`keyedconsumer.kafka.admin.TopicReader` (it never joins a group nor commits);
the marker is :class:`keyedconsumer.deadletters.ReplayMarker`, read from the marker group's committed
offsets. A listing is read at most once per ``cache_s`` seconds (a search: per :data:`SEARCH_CACHE_S`).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
import unicodedata
from typing import Any

from ..deadletters import Failure, ReplayMarker, marker_group_of
from ..deadletters.records import H
from ..formatting import utc_text
from ..kafka import admin

__all__ = ["DeadLetter", "DeadLetterReader", "Filters", "Listing", "Shown"]

#: Bytes of a key, value or header shown (the rest is cut, and says so).
MAX_SHOWN_BYTES = 4096
#: Characters of a failure header (error message, stack trace) shown.
MAX_SHOWN_CHARS = 4096
#: Records read from one topic when no filter is given (the newest of each partition).
MAX_READ = 5000
#: Records a search (any filter given) examines in one topic at most: the newest of each partition.
MAX_SCAN = 100_000
#: Matching records a listing keeps (the newest failures).
MAX_MATCHES = 5000
#: Characters a listing keeps at most (what its records show, hex views included): with
#: :data:`MAX_LISTINGS`, the bound of the dashboard's memory for dead letters, whatever they hold.
MAX_LISTING_CHARS = 8_000_000
#: Listings kept at once (the most recently read).
MAX_LISTINGS = 4
#: Headers of one record shown (the others are counted).
MAX_SHOWN_HEADERS = 100
#: Seconds a search's result is kept (a search reads up to :data:`MAX_SCAN` records).
SEARCH_CACHE_S = 30.0
#: Bytes per line of a hex view.
HEX_WIDTH = 16
#: Bytes of the longest key a row links to a search of (its bytes go in the link's URL).
MAX_LINKED_KEY_BYTES = 1024

#: Characters that change how the text around them is shown (bidirectional controls): a key holding
#: them could look like another key.
_BIDI = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def _plain(text: str) -> bool:
    return not any((unicodedata.category(c) == "Cc" and c not in "\t\n\r") or c in _BIDI for c in text)


def hex_view(raw: bytes) -> str:
    """``raw`` as lines of :data:`HEX_WIDTH` bytes: offset, bytes in hex, printable ASCII (else ``.``)."""
    lines = []
    for at in range(0, len(raw), HEX_WIDTH):
        chunk = raw[at : at + HEX_WIDTH]
        ascii_ = "".join(chr(b) if 0x20 <= b < 0x7F else "." for b in chunk)
        lines.append(f"{at:08x}  {chunk.hex(' '):<{HEX_WIDTH * 3 - 1}}  |{ascii_}|")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Shown:
    """Bytes as a page shows them: ``text`` (the bytes as UTF-8) or, when they are not valid UTF-8
    or hold control characters, ``hex`` (a hex view); the first :data:`MAX_SHOWN_BYTES` of ``size``
    bytes in all (``cut``)."""

    text: str
    hex: bool
    size: int
    cut: bool

    @classmethod
    def of(cls, raw: bytes) -> Shown:
        head, cut = raw[:MAX_SHOWN_BYTES], len(raw) > MAX_SHOWN_BYTES
        try:
            text = head.decode("utf-8")
        except UnicodeDecodeError as exc:
            if not (cut and exc.reason == "unexpected end of data"):
                return cls(hex_view(head), True, len(raw), cut)
            text = head[: exc.start].decode("utf-8")  # the cut split a character: still text
        if not _plain(text):
            return cls(hex_view(head), True, len(raw), cut)
        return cls(text, False, len(raw), cut)

    @property
    def one_line(self) -> str:
        """For a table cell: the text, or the bytes in hex without spaces (cut to 64 bytes)."""
        if not self.hex:
            return self.text
        raw = "".join(line[10 : 10 + HEX_WIDTH * 3 - 1].replace(" ", "") for line in self.text.splitlines())
        return f"0x{raw[:128]}" + ("..." if len(raw) > 128 or self.cut else "")


def _cut(text: str | None, limit: int = MAX_SHOWN_CHARS) -> str | None:
    if text is None or len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


@dataclasses.dataclass(frozen=True)
class DeadLetter:
    """One dead-letter record as shown: its place, key, value and headers (:class:`Shown`, ``None``
    where null), its failure headers as text (cut), whether it was replayed. ``key_hex``: the key's
    bytes in hex, for a link to a search of the key (``None`` for a key over
    :data:`MAX_LINKED_KEY_BYTES`); ``repeated``: failure headers given more than once."""

    partition: int
    offset: int
    key: Shown | None
    key_hex: str | None
    value: Shown | None
    headers: list[tuple[Shown, Shown | None]]
    error: str | None
    exception: str | None
    cause: str | None
    attempts: int | None
    original_topic: str | None
    original_partition: int | None
    original_offset: int | None
    failed_at_ms: int | None
    stacktrace: str | None
    repeated: tuple[str, ...]
    replayed: bool
    more_headers: int = 0

    @property
    def failed_at(self) -> str:
        return utc_text(self.failed_at_ms)

    @functools.cached_property
    def size(self) -> int:
        """Characters it shows (for the listing's memory bound)."""
        shown = [self.key, self.value, *(s for h in self.headers for s in h)]
        texts = [self.error, self.exception, self.cause, self.original_topic, self.stacktrace]
        return sum(len(x.text) for x in shown if x is not None) + sum(len(t) for t in texts if t) + 200

    @classmethod
    def of(cls, record: admin.Record, failure: Failure, replayed: bool, stack_header: str) -> DeadLetter:
        shown_headers = [(k, v) for k, v in record.headers if k != stack_header]
        return cls(
            partition=record.partition,
            offset=record.offset,
            key=None if record.key is None else Shown.of(record.key),
            key_hex=record.key.hex()
            if record.key is not None and len(record.key) <= MAX_LINKED_KEY_BYTES
            else None,
            value=None if record.value is None else Shown.of(record.value),
            headers=[
                (Shown.of(k.encode("utf-8", "surrogatepass")), None if v is None else Shown.of(v))
                for k, v in shown_headers[:MAX_SHOWN_HEADERS]
            ],
            more_headers=max(0, len(shown_headers) - MAX_SHOWN_HEADERS),
            error=_cut(failure.error),
            exception=_cut(failure.exception, 500),
            cause=_cut(failure.cause, 500),
            attempts=failure.attempts,
            original_topic=_cut(failure.original_topic, 500),
            original_partition=failure.original_partition,
            original_offset=failure.original_offset,
            failed_at_ms=failure.failed_at_ms,
            stacktrace=_cut(failure.stacktrace),
            repeated=failure.repeated,
            replayed=replayed,
        )


@dataclasses.dataclass(frozen=True)
class Filters:
    """A search: the exact ``key`` (bytes; ``None``: any key), an ``error`` substring
    (case-insensitive, in the message or the exception class), a failure-time window (ms since the
    epoch, inclusive)."""

    key: bytes | None = None
    error: str = ""
    since_ms: int | None = None
    until_ms: int | None = None

    @property
    def given(self) -> bool:
        return (
            self.key is not None or bool(self.error) or self.since_ms is not None or self.until_ms is not None
        )

    def match(self, record: admin.Record, failure: Failure) -> bool:
        if self.key is not None and record.key != self.key:
            return False
        if (
            self.error
            and self.error.lower() not in f"{failure.error or ''} {failure.exception or ''}".lower()
        ):
            return False
        when = failure.failed_at_ms
        if self.since_ms is not None and (when is None or when < self.since_ms):
            return False
        return not (self.until_ms is not None and (when is None or when > self.until_ms))


@dataclasses.dataclass(frozen=True)
class Listing:
    """What a page shows of a topic: ``rows`` (matching, newest failure first, at most
    :data:`MAX_MATCHES`), ``examined`` (records read), ``total`` (records in the topic), ``more``
    (matches beyond ``rows`` were dropped)."""

    rows: list[DeadLetter]
    examined: int
    total: int
    more: bool = False

    @property
    def complete(self) -> bool:
        """Every record of the topic was examined."""
        return self.examined >= self.total


class DeadLetterReader:
    """Reads the newest records of a dead-letter topic (``limit`` per partition, :data:`MAX_READ` in
    all), or searches its newest :data:`MAX_SCAN` (cached).

    Parameters
    ----------
    conf:
        librdkafka properties.
    limit:
        Records read per partition (the newest) when no filter is given.
    cache_s:
        A listing is read again only this many seconds after its last read (or after :meth:`forget`).
    timeout_s:
        Bound of each broker answer.
    """

    def __init__(
        self, conf: dict[str, Any], *, limit: int = 200, cache_s: float = 5.0, timeout_s: float = 10.0
    ) -> None:
        self.conf, self.limit, self.cache_s, self.timeout_s = conf, limit, cache_s, timeout_s
        self._cache: dict[tuple[str, Filters], tuple[float, Listing]] = {}
        self._lock = threading.Lock()

    def forget(self, topic: str) -> None:
        """Read ``topic`` again on the next call (after a replay changed its marker)."""
        with self._lock:
            self._cache = {k: v for k, v in self._cache.items() if k[0] != topic}

    def records(self, topic: str, filters: Filters | None = None) -> Listing:
        """The topic's newest records, or (``filters`` given) those of its newest :data:`MAX_SCAN`
        that match, newest failure first.

        Raises
        ------
        KafkaClientError
            The topic does not exist (``code="UNKNOWN_TOPIC_OR_PART"``), or no answer from the brokers.
        """
        filters = filters or Filters()
        keep_s = max(self.cache_s, SEARCH_CACHE_S) if filters.given else self.cache_s
        with self._lock:
            hit = self._cache.get((topic, filters))
            if hit is not None and time.monotonic() - hit[0] < keep_s:
                return hit[1]
            listing = self._read(topic, filters)
            now = time.monotonic()
            kept = sorted(self._cache.items(), key=lambda kv: kv[1][0])[-(MAX_LISTINGS - 1) :]
            self._cache = {k: v for k, v in kept if now - v[0] < SEARCH_CACHE_S}
            self._cache[(topic, filters)] = (now, listing)
            return listing

    def _read(self, topic: str, filters: Filters) -> Listing:
        reader = admin.TopicReader(self.conf, topic, marker_group_of(topic), self.timeout_s)
        stack = str(H.H_STACKTRACE)
        try:
            markers = {
                p: ReplayMarker.decode(c.offset, c.metadata)
                for p, c in reader.committed(stable=False).items()
            }
            budget = MAX_SCAN if filters.given else min(MAX_READ, self.limit * len(reader.partitions))
            per = max(1, budget // max(1, len(reader.partitions)))
            start = {p: max(reader.start_offsets[p], reader.end_offsets[p] - per) for p in reader.partitions}
            total = sum(reader.end_offsets[p] - reader.start_offsets[p] for p in reader.partitions)
            examined = sum(reader.end_offsets[p] - start[p] for p in reader.partitions)
            rows: list[DeadLetter] = []
            size, found = 0, 0
            for r in reader.read(start):
                failure = Failure.of(r)
                if not filters.match(r, failure):
                    continue
                found += 1
                row = DeadLetter.of(r, failure, markers[r.partition].is_replayed(r.offset), stack)
                rows.append(row)
                size += row.size
                if len(rows) >= 2 * MAX_MATCHES or size >= 2 * MAX_LISTING_CHARS:  # keep the newest
                    rows = _newest(rows)
                    size = sum(d.size for d in rows)
        finally:
            reader.close()
        rows = _newest(rows)
        return Listing(rows, examined, total, more=found > len(rows))


def _newest(rows: list[DeadLetter]) -> list[DeadLetter]:
    """The newest failures, at most :data:`MAX_MATCHES` and :data:`MAX_LISTING_CHARS`."""
    rows.sort(key=lambda d: (d.failed_at_ms or 0, d.partition, d.offset), reverse=True)
    out: list[DeadLetter] = []
    size = 0
    for d in rows[:MAX_MATCHES]:
        size += d.size
        if size > MAX_LISTING_CHARS and out:
            break
        out.append(d)
    return out
