"""The replay marker: which records of a dead-letter partition were replayed, kept as ranges in the
marker group's committed-offset metadata (the committed offset plus ``offset.metadata.max.bytes``
of metadata, written in the replay's own Kafka transactions)."""

from __future__ import annotations

import logging

log = logging.getLogger("keyedconsumer.deadletters")

#: Marker format tag in the committed offset's metadata.
MARKER_TAG = "kcr1:"
#: Bound of the marker metadata in characters (Kafka's ``offset.metadata.max.bytes`` defaults to 4096).
MAX_MARKER_CHARS = 3000


def marker_group_of(dlq: str) -> str:
    """The default consumer group holding the replay marker of dead-letter topic ``dlq``."""
    return f"keyedconsumer-replay.{dlq}"


class ReplayMarker:
    """Which records of one dead-letter partition were replayed.

    Every offset below ``end`` is replayed except the ``pending`` ones (records examined but left for a
    later replay: not matching ``--key``/``--since``, or without a target). Stored in Kafka as the
    marker group's committed offset (the first pending offset, or ``end``) plus metadata
    ``kcr1:<end - offset>/<pending ranges>``; each range is ``<gap>`` or ``<gap>+<length - 1>``, the
    gap counted from the end of the range before (from the committed offset for the first).

    Parameters
    ----------
    end:
        First offset not examined yet.
    pending:
        Sorted, disjoint inclusive ``[first, last]`` offset ranges, all below ``end``.
    """

    def __init__(self, end: int, pending: list[list[int]] | None = None) -> None:
        self.end = end
        self.pending = pending or []

    @classmethod
    def decode(cls, offset: int | None, metadata: str) -> ReplayMarker:
        """The marker of a committed offset (``None``: nothing replayed) and its metadata. Metadata
        that is not a marker (``""``, another tool's) means: everything below ``offset`` replayed."""
        if offset is None:
            return cls(0)
        if not metadata.startswith(MARKER_TAG):
            return cls(offset)
        try:
            span, _, ranges = metadata[len(MARKER_TAG) :].partition("/")
            pending: list[list[int]] = []
            prev = offset
            for part in filter(None, ranges.split(";")):
                gap, _, extra = part.partition("+")
                first = prev + int(gap)
                last = first + int(extra or 0)
                if int(gap) < 0 or last < first:
                    raise ValueError(part)
                pending.append([first, last])
                prev = last + 1
            end = offset + int(span)
            if pending and (pending[0][0] != offset or pending[-1][1] >= end):
                raise ValueError(metadata)
            return cls(end, pending)
        except ValueError:
            log.warning(
                "unreadable replay marker %r at offset %d: treating every offset below it as replayed",
                metadata,
                offset,
            )
            return cls(offset)

    @property
    def committed_offset(self) -> int:
        """The offset to commit: the first pending offset, or ``end``."""
        return self.pending[0][0] if self.pending else self.end

    def encode(self) -> str:
        """The metadata to commit with :attr:`committed_offset` (``""`` when nothing is pending)."""
        if not self.pending:
            return ""
        parts, prev = [], self.committed_offset
        for first, last in self.pending:
            gap = first - prev
            parts.append(str(gap) if first == last else f"{gap}+{last - first}")
            prev = last + 1
        return f"{MARKER_TAG}{self.end - self.committed_offset}/{';'.join(parts)}"

    def _find(self, offset: int) -> int:
        lo, hi = 0, len(self.pending)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.pending[mid][1] < offset:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def is_replayed(self, offset: int) -> bool:
        """True if the record at ``offset`` was replayed already."""
        if offset >= self.end:
            return False
        i = self._find(offset)
        return not (i < len(self.pending) and self.pending[i][0] <= offset)

    def mark(self, offset: int, replayed: bool) -> bool:
        """Record that the (not yet replayed) record at ``offset`` was replayed now, or left pending.

        Offsets are marked in increasing order above ``end``; a record between ``end`` and
        ``offset`` does not exist (the records are read in order), so such gaps join the range
        before when it is pending. Returns ``False``, changing nothing, when the marker would grow
        beyond :data:`MAX_MARKER_CHARS`.
        """
        before = ([list(r) for r in self.pending], self.end)
        grew = False
        if offset >= self.end:
            if not replayed:
                if self.pending and self.pending[-1][1] == self.end - 1:
                    self.pending[-1][1] = offset
                else:
                    self.pending.append([offset, offset])
                    grew = True
            self.end = offset + 1
        elif replayed:
            i = self._find(offset)
            first, last = self.pending[i]
            if first == last:
                del self.pending[i]
            elif offset == first:
                self.pending[i][0] = offset + 1
            elif offset == last:
                self.pending[i][1] = offset - 1
            else:
                self.pending[i : i + 1] = [[first, offset - 1], [offset + 1, last]]
                grew = True
        if grew and len(self.encode()) > MAX_MARKER_CHARS:
            self.pending, self.end = before
            return False
        return True
