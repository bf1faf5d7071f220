"""Per-partition offset tracking: the first offset not yet done.

Rule (xkafka proposal, seed 003): the offset stored for a partition is the first offset that was
received and is not done, or ``last received + 1`` when all are done. It is computed from the offsets
actually received, never from ``previous + 1``, so offsets that never arrive (transaction markers,
compacted records) cannot hold the watermark back (case C3).
"""

from __future__ import annotations

from collections import deque

__all__ = ["OffsetTracker"]

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

    def oldest_received_s(self) -> float | None:
        """When the first unfinished offset was received (``time.monotonic()`` s), or ``None``."""
        return self._since[0] if self._since else None

    @property
    def pending(self) -> int:
        """Number of received offsets not yet done."""
        return len(self._pending) - len(self._done)

    def __repr__(self) -> str:
        return f"OffsetTracker(watermark={self.watermark()}, pending={self.pending})"
