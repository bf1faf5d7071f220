"""The status of the assigned partitions, as the owner publishes it for other threads (health
checks, metrics, ``keyedconsumer inspect``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from .partitions import Partition

__all__ = ["PartitionStatus", "statuses"]


@dataclasses.dataclass(frozen=True)
class PartitionStatus:
    """The state of one assigned partition.

    ``first_unfinished_offset``: the offset the engine would store now (``None`` before any
    message); ``stored_offset``: the last offset stored (or committed, with manual commit);
    ``unfinished``: received messages not done; ``oldest_unfinished_age_s``: seconds since the
    oldest of them was received (0 when none); ``end_offset``: the partition's high watermark as
    last seen; ``lag``: ``end_offset - stored_offset`` (before the first store of the assignment,
    ``end_offset - first_unfinished_offset``; ``None`` while either is unknown).
    """

    topic: str
    partition: int
    first_unfinished_offset: int | None
    stored_offset: int | None
    unfinished: int
    oldest_unfinished_age_s: float
    end_offset: int | None
    lag: int | None


def statuses(parts: Iterable[Partition], now: float) -> list[PartitionStatus]:
    """The :class:`PartitionStatus` of each of ``parts`` at ``now`` (monotonic seconds; owner thread)."""
    out = []
    for part in parts:
        tracker = part.tracker
        wm = tracker.watermark()
        since = tracker.oldest_received_s()
        base = part.stored if part.stored is not None else wm  # nothing stored yet: where it is
        high = part.high
        out.append(
            PartitionStatus(
                topic=part.topic,
                partition=part.partition,
                first_unfinished_offset=wm,
                stored_offset=part.stored,
                unfinished=tracker.pending,
                oldest_unfinished_age_s=(now - since) if since is not None else 0.0,
                end_offset=high,
                lag=max(0, high - base) if high is not None and base is not None else None,
            )
        )
    return out
