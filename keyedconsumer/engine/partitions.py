"""The partitions assigned now: their offset trackers, their lanes, and assign / revoke / lost.

An assignment of a partition goes ``ACTIVE`` -> ``REVOKING`` (a revoke waits for its running
handlers; their results still count) -> ``CLOSED`` (nothing of it is stored again); a lost
partition goes to ``CLOSED`` at once. A partition assigned again is a new :class:`Partition`, but
its lanes outlive the old one while a head still runs, so a key whose message still runs cannot
start a second one. Pure data: the dispatcher's lock guards it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..kafka import TP
from ..offsets import FinishedOffsets, OffsetTracker, encode_finished
from .lanes import Lanes

if TYPE_CHECKING:
    from .delivery import Delivery

__all__ = ["Partition", "Partitions", "ACTIVE", "REVOKING", "CLOSED"]

ACTIVE, REVOKING, CLOSED = 0, 1, 2


class Partition:
    """One assignment of one partition: its offset tracker and what runs from it.

    Attributes
    ----------
    tracker:
        The offsets received and done (:class:`~keyedconsumer.offsets.OffsetTracker`).
    state:
        ``ACTIVE``, ``REVOKING`` or ``CLOSED``.
    running:
        Its messages taken by a worker and not finished.
    stored:
        The last offset stored (or committed) for this assignment.
    high:
        The partition's end offset (high watermark) as last seen.
    catching_up:
        Being revoked: only messages below the highest finished offset start.
    finished:
        The offsets its previous owner finished above its committed offset (its commit metadata):
        they count done when they arrive and do not run again.
    next_store_s:
        With offsets finished above its watermark, when it may be stored next (monotonic seconds;
        see :meth:`Partitions.advances`).
    """

    __slots__ = (
        "topic",
        "partition",
        "tracker",
        "state",
        "running",
        "stored",
        "high",
        "catching_up",
        "finished",
        "lanes",
        "next_store_s",
    )

    def __init__(self, tp: TP, lanes: Lanes, finished: FinishedOffsets | None = None) -> None:
        self.topic, self.partition = tp
        self.tracker = OffsetTracker()
        self.state = ACTIVE
        self.running = 0
        self.stored: int | None = None
        self.high: int | None = None
        self.catching_up = False
        self.finished = finished
        self.lanes = lanes
        self.next_store_s = 0.0

    @property
    def tp(self) -> TP:
        return (self.topic, self.partition)

    @property
    def active(self) -> bool:
        return self.state == ACTIVE

    def started(self, n: int = 1) -> None:
        """``n`` of its messages were taken by a worker."""
        self.running += n

    def ended(self, n: int = 1) -> None:
        """``n`` of its taken messages ended or were given back."""
        self.running -= n

    def mark_stored(self, offset: int | None) -> None:
        """``offset`` was stored (or committed) for it."""
        self.stored = offset

    def saw_high(self, offset: int | None) -> None:
        """Its end offset is ``offset`` (``None``: unknown)."""
        self.high = offset

    def catch_up(self, on: bool) -> None:
        """Being revoked: only messages below the highest finished offset start (``on``)."""
        self.catching_up = on

    def may_start(self, offset: int, stopping: bool) -> bool:
        """Whether a message at ``offset`` may start now (active; and, while the consumer stops or
        this partition is revoked, only below the highest finished offset)."""
        if self.state != ACTIVE:
            return False
        return not (stopping or self.catching_up) or offset < self.tracker.highest_done

    def __repr__(self) -> str:
        return f"Partition({self.topic}[{self.partition}], state={self.state}, {self.tracker!r})"


class Partitions:
    """The assigned partitions by ``(topic, partition)``, and their offsets to store or commit.

    Parameters
    ----------
    metadata_max_bytes:
        Bound of the commit metadata naming the offsets finished above the committed one
        (``commit_metadata_max_bytes``; 0: none).
    """

    def __init__(self, metadata_max_bytes: int = 0) -> None:
        self.metadata_max_bytes = metadata_max_bytes
        self.by_tp: dict[TP, Partition] = {}
        self._lanes: dict[TP, Lanes] = {}  # outlive an assignment while a head still runs
        self._dirty: set[Partition] = set()
        self.skipped_finished = 0  # messages not run: the previous owner had finished them

    def assign(self, tps: Iterable[TP], finished: dict[TP, FinishedOffsets] | None = None) -> None:
        """Start tracking newly assigned partitions; ``finished``: per partition, the offsets its
        previous owner finished above the committed offset (read from the commit metadata)."""
        for tp in tps:
            lanes = self._lanes.setdefault(tp, Lanes())
            self.by_tp[tp] = Partition(tp, lanes, (finished or {}).get(tp))

    def receive(self, topic: str, partition: int, offset: int, now: float) -> Partition | None:
        """Track a polled record. Returns its partition when it is to run; ``None`` when the
        partition is not assigned (any more), the offset was received before (a re-delivery), or
        the previous owner finished it (it counts done at once)."""
        part = self.by_tp.get((topic, partition))
        if part is None or not part.tracker.add(offset, now):
            return None
        fin = part.finished
        if fin is not None:
            if fin.covers(offset):
                part.tracker.done(offset)
                self._dirty.add(part)
                self.skipped_finished += 1
                return None
            if offset >= fin.end:
                part.finished = None
        return part

    @staticmethod
    def started(ds: Iterable[Delivery]) -> None:
        """The messages ``ds`` were taken by a worker: each counts running in its partition."""
        for d in ds:
            part = d.part
            if part is not None:
                part.running += 1

    def done(self, part: Partition, offset: int) -> None:
        """A message of ``part`` is done (ignored once the partition is closed)."""
        if part.state != CLOSED:
            part.tracker.done(offset)
            self._dirty.add(part)

    def done_many(self, part: Partition, offset: int) -> None:
        """A taken message of the active ``part`` is done and no longer runs (one step of a batch
        of outcomes: :meth:`done` and :meth:`Partition.ended` in one call)."""
        part.tracker.done(offset)
        part.running -= 1
        self._dirty.add(part)

    def skip_finished(self, part: Partition, offset: int) -> bool:
        """``offset`` of ``part`` was just received: ``True`` when its previous owner had finished
        it (named in the commit metadata: it counts done at once and does not run)."""
        fin = part.finished
        if fin is None:
            return False
        if fin.covers(offset):
            part.tracker.done(offset)
            self._dirty.add(part)
            self.skipped_finished += 1
            return True
        if offset >= fin.end:
            part.finished = None
        return False

    def begin_revoke(self, tps: Iterable[TP], lost: bool = False) -> list[Partition]:
        """Take the partitions out of the assignment: ``REVOKING`` (``CLOSED`` when ``lost``)."""
        out: list[Partition] = []
        for tp in tps:
            part = self.by_tp.pop(tp, None)
            if part is not None:
                part.state = CLOSED if lost else REVOKING
                self._dirty.discard(part)
                out.append(part)
        return out

    def get(self, tp: TP) -> Partition | None:
        """The assignment of ``tp`` now, or ``None``."""
        return self.by_tp.get(tp)

    def close(self, parts: Iterable[Partition]) -> None:
        for part in parts:
            part.state = CLOSED

    def active(self) -> list[Partition]:
        return [p for p in self.by_tp.values() if p.state == ACTIVE]

    def lanes_of(self) -> list[Lanes]:
        return list(self._lanes.values())

    def commit_offsets(self, parts: Iterable[Partition]) -> tuple[list[tuple[str, int, int]], dict[TP, str]]:
        """What to commit for ``parts`` (active or being revoked): ``([(topic, partition,
        first unfinished offset)], {tp: metadata})``, the metadata naming the offsets done above
        each (:func:`~keyedconsumer.offsets.encode_finished`, with what the previous owner finished
        and this one has not received yet)."""
        offsets: list[tuple[str, int, int]] = []
        meta: dict[TP, str] = {}
        for part in parts:
            if part.state == CLOSED:
                continue
            wm = part.tracker.watermark()
            if wm is None:
                continue
            offsets.append((part.topic, part.partition, wm))
            text = encode_finished(part.tracker, self.metadata_max_bytes, part.finished)
            if text:
                meta[part.tp] = text
        return offsets, meta

    def advances(self, now_s: float = 0.0, every_s: float = 0.0) -> list[tuple[Partition, int, str]]:
        """Active partitions whose first unfinished offset moved past what was stored:
        ``[(partition, offset, metadata)]`` (as :meth:`commit_offsets`), so every store and commit
        names at least what the one before it named.

        ``every_s`` (seconds; 0: every call) paces a partition with offsets finished above its
        watermark: its metadata costs O(its unfinished offsets) to encode, so it is reported at most
        once per ``every_s`` (from ``now_s``, monotonic seconds) and stays due until then. A
        partition with nothing finished above its watermark is reported at once (its metadata is
        empty)."""
        if not self._dirty:
            return []
        out = []
        due: list[Partition] = []
        for part in self._dirty:
            if part.state == ACTIVE:
                tracker = part.tracker
                wm = tracker.watermark()
                if wm is not None and (part.stored is None or wm > part.stored):
                    if every_s and tracker.behind_done():
                        if now_s < part.next_store_s:
                            due.append(part)
                            continue
                        part.next_store_s = now_s + every_s
                    out.append((part, wm, encode_finished(tracker, self.metadata_max_bytes, part.finished)))
        self._dirty.clear()
        self._dirty.update(due)
        return out

    def mark_dirty(self, parts: Iterable[Partition]) -> None:
        """Report ``parts`` again from :meth:`advances` (their store or commit failed)."""
        self._dirty.update(p for p in parts if p.state == ACTIVE)
