"""Per-partition offset tracking: the first offset not yet done.

Rule (the xkafka proposal, gojekfarm/xtools issue #25): the offset stored for a partition is the first offset that was
received and is not done, or ``last received + 1`` when all are done. It is computed from the offsets
actually received, never from ``previous + 1``, so offsets that never arrive (transaction markers,
compacted records) cannot hold the watermark back (KIP-98's transaction markers take offsets).
"""

from __future__ import annotations

import base64
import binascii
import bisect
import zlib
from collections import deque

__all__ = ["OffsetTracker", "FinishedOffsets", "encode_finished", "METADATA_PREFIX"]

#: Prefix of the commit metadata this package writes (other metadata is ignored when read).
METADATA_PREFIX = "kc1:"

#: Done offsets kept behind an unfinished head before they are compacted away.
COMPACT_MIN = 4096


class OffsetTracker:
    """Track received and done offsets of one partition. Not thread-safe: the caller locks.

    ``add`` is O(1) for offsets received in increasing order (the normal case); ``done`` is O(1);
    ``watermark`` is amortised O(1).
    """

    __slots__ = ("_pending", "_since", "_done", "_next", "_high")

    def __init__(self) -> None:
        self._pending: deque[int] = deque()
        self._since: deque[float] = deque()  # when each pending offset was received (monotonic s)
        self._done: set[int] = set()
        self._next: int | None = None  # last received offset + 1
        self._high = -1  # the highest offset done so far (-1: none)

    def add(self, offset: int, received_s: float = 0.0) -> bool:
        """Record a received offset (``received_s``: when, in ``time.monotonic()`` seconds).

        Returns
        -------
        ``True`` when the offset is new and now pending; ``False`` when it is at or below an offset
        already received (a re-delivery): it is not tracked again, so the watermark never moves back.
        """
        nxt = self._next
        if nxt is None or offset >= nxt:
            self._pending.append(offset)
            self._since.append(received_s)
            self._next = offset + 1
            return True
        return False

    def done(self, offset: int) -> None:
        """Mark a received offset done. Repeated calls are ignored; ``offset`` must have been added."""
        pending = self._pending
        if offset > self._high and pending and pending[0] <= offset < (self._next or 0):
            self._high = offset
        if pending and pending[0] == offset:
            pending.popleft()
            since = self._since
            since.popleft()
            done = self._done
            while pending and pending[0] in done:
                done.remove(pending.popleft())
                since.popleft()
        elif pending and pending[0] < offset < (self._next or 0):
            done = self._done
            done.add(offset)
            if len(done) > COMPACT_MIN and len(done) > 2 * (len(pending) - len(done)):
                self._compact()

    def _compact(self) -> None:
        """Drop done offsets behind an unfinished head, so memory follows the unfinished offsets
        (bounded by ``max_in_flight``), not every offset finished while one message is stuck."""
        done = self._done
        keep = [(o, t) for o, t in zip(self._pending, self._since, strict=True) if o not in done]
        self._pending = deque(o for o, _ in keep)
        self._since = deque(t for _, t in keep)
        done.clear()

    def watermark(self) -> int | None:
        """The offset to store: first offset not done, else last received + 1; ``None`` if empty."""
        if self._pending:
            return self._pending[0]
        return self._next

    @property
    def highest_done(self) -> int:
        """The highest offset marked done so far (-1 when none)."""
        return self._high

    def behind_done(self) -> bool:
        """True while an offset below the highest done one is not done: storing now would leave
        finished messages above the stored offset, to be run again after a rebalance or restart."""
        return bool(self._pending) and self._pending[0] < self._high

    def finished_runs(self) -> tuple[int, list[int]] | None:
        """The done offsets above the watermark, as runs: ``(watermark, [u0, f0, u1, f1, ...])``
        where ``u`` counts offsets not done and ``f`` offsets done (or never received: transaction
        markers), alternately from the watermark up to the highest done offset. ``None`` when no
        offset above the watermark is done. O(unfinished offsets)."""
        if not self.behind_done():
            return None
        pending, done, high = self._pending, self._done, self._high
        base = pending[0]
        runs: list[int] = []
        start = last = base
        for off in pending:
            if off > high:
                break
            if off in done:
                continue
            if off > last + 1:
                runs.append(last - start + 1)
                runs.append(off - last - 1)
                start = off
            last = off
        runs.append(last - start + 1)
        runs.append(high - last)
        return base, runs

    @property
    def received_end(self) -> int | None:
        """The last received offset + 1 (``None`` before the first)."""
        return self._next

    def oldest_received_s(self) -> float | None:
        """When the first unfinished offset was received (``time.monotonic()`` s), or ``None``."""
        return self._since[0] if self._since else None

    @property
    def pending(self) -> int:
        """Number of received offsets not yet done."""
        return len(self._pending) - len(self._done)

    def __repr__(self) -> str:
        return f"OffsetTracker(watermark={self.watermark()}, pending={self.pending})"


def _varints(values: list[int]) -> bytes:
    out = bytearray()
    for v in values:
        while True:
            b = v & 0x7F
            v >>= 7
            if v:
                out.append(b | 0x80)
            else:
                out.append(b)
                break
    return bytes(out)


def _encode(base: int, runs: list[int]) -> str:
    raw = _varints([base, *runs])
    return METADATA_PREFIX + base64.urlsafe_b64encode(zlib.compress(raw, 9)).decode().rstrip("=")


def encode_finished(tracker: OffsetTracker, max_bytes: int, inherited: FinishedOffsets | None = None) -> str:
    """Commit metadata naming the offsets done above ``tracker``'s watermark, so the partition's
    next owner skips them instead of running them again (the approach of Confluent's Parallel
    Consumer: Kafka stores a metadata string with each committed offset, up to the broker's
    ``offset.metadata.max.bytes``, 4096 by default).

    ``inherited``: the offsets the partition's previous owner finished (read from its commit
    metadata); those not received yet are named too, so a commit never names fewer finished offsets
    than the one before it.

    Returns ``""`` when nothing above the watermark is done or ``max_bytes`` is 0. When the runs do
    not fit in ``max_bytes`` (ASCII characters), only the first runs are kept: offsets left out run
    again (at-least-once), none is ever named done that is not.
    """
    found = tracker.finished_runs() if max_bytes > 0 else None
    if inherited is not None and max_bytes > 0:
        found = _with_inherited(tracker, found, inherited)
    if found is None:
        return ""
    base, runs = found
    text = _encode(base, runs)
    if len(text) <= max_bytes:
        return text
    lo, hi = 0, len(runs) // 2  # pairs (unfinished run, finished run) kept: lo fits, hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if len(_encode(base, runs[: 2 * mid])) <= max_bytes:
            lo = mid
        else:
            hi = mid
    return _encode(base, runs[: 2 * lo]) if lo else ""


def _with_inherited(
    tracker: OffsetTracker, found: tuple[int, list[int]] | None, inherited: FinishedOffsets
) -> tuple[int, list[int]] | None:
    """``found`` (the tracker's runs) with the inherited runs at or above the first offset not
    received yet added (what lies below is the tracker's to say: it marked them done on arrival)."""
    base, received_end = tracker.watermark(), tracker.received_end
    if base is None or received_end is None:
        return found
    spans: list[tuple[int, int]] = []
    if found is not None:
        pos = found[0]
        for i, n in enumerate(found[1]):
            if i % 2:
                spans.append((pos, pos + n))
            pos += n
    for start, end in inherited.spans():
        start = max(start, received_end)
        if start < end:
            if spans and spans[-1][1] >= start:
                spans[-1] = (spans[-1][0], max(spans[-1][1], end))
            else:
                spans.append((start, end))
    if not spans:
        return None
    runs: list[int] = []
    pos = base
    for start, end in spans:
        runs += [start - pos, end - start]  # the first unfinished run may be 0: base is done by inheritance
        pos = end
    return base, runs


class FinishedOffsets:
    """Offsets a partition's previous owner finished above its committed offset, read from the
    commit metadata :func:`encode_finished` wrote.

    Use :meth:`decode`; :meth:`covers` is O(log runs); ``end`` is the first offset past them.
    """

    __slots__ = ("_starts", "_ends", "end", "count")

    def __init__(self, base: int, runs: list[int]) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []  # exclusive
        pos = base
        self.count = 0
        for i, n in enumerate(runs):
            if i % 2:
                self._starts.append(pos)
                self._ends.append(pos + n)
                self.count += n
            pos += n
        self.end = pos

    @classmethod
    def decode(cls, committed: int, metadata: str | None) -> FinishedOffsets | None:
        """The finished offsets named by ``metadata`` committed with offset ``committed``; ``None``
        when it is not this package's, does not belong to that offset, or is malformed (then
        nothing is skipped: every message runs)."""
        if not metadata or not metadata.startswith(METADATA_PREFIX) or committed < 0:
            return None
        try:
            data = metadata[len(METADATA_PREFIX) :]
            packed = base64.urlsafe_b64decode(data + "=" * (-len(data) % 4))
            z = zlib.decompressobj()
            raw = z.decompress(packed, 1 << 20)
            if z.unconsumed_tail:
                return None
        except (binascii.Error, ValueError, zlib.error):
            return None
        values: list[int] = []
        v = shift = 0
        for b in raw:
            v |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                values.append(v)
                v = shift = 0
        if shift or len(values) < 3 or len(values) % 2 == 0 or values[0] != committed:
            return None
        runs = values[1:]
        if runs[0] < 0 or any(n <= 0 for n in runs[1:]):  # only the first run may be empty
            return None
        return cls(committed, runs)

    def spans(self) -> list[tuple[int, int]]:
        """The finished offsets as ``[(first, last + 1)]``, in order."""
        return list(zip(self._starts, self._ends, strict=True))

    def covers(self, offset: int) -> bool:
        """True when ``offset`` was finished by the previous owner."""
        i = bisect.bisect_right(self._starts, offset) - 1
        return i >= 0 and offset < self._ends[i]

    def __repr__(self) -> str:
        return f"FinishedOffsets(count={self.count}, end={self.end})"
