"""A consumer group seen from outside, through :mod:`keyedconsumer.kafka.admin`: its offsets and lag
per partition (``keyedconsumer inspect``, the dashboard's group pages) and the topics it consumes
(where a replay of its dead letters may write).

Library code below both faces (:mod:`keyedconsumer.cli`, :mod:`keyedconsumer.web`).
"""

from __future__ import annotations

import time
from typing import Any

from .kafka import admin
from .offsets import FinishedOffsets

__all__ = ["group_rows", "consumed_topics"]


def group_rows(
    conf: dict[str, Any], group: str, topics: list[str], timeout_s: float, max_ages: int | None = None
) -> tuple[admin.GroupDescription, list[dict[str, Any]]]:
    """A group's description and, per partition, its committed, start and end offsets, lag, the
    offsets finished above the committed one (from the commit metadata) and the age of the record at
    the committed offset (where lag > 0; only for the ``max_ages`` partitions with the most lag when
    given: each age reads a record).

    Parameters
    ----------
    conf:
        librdkafka properties.
    group:
        The consumer group id.
    topics:
        The topics to show; empty: every partition the group committed or is assigned.
    timeout_s:
        Bound of each broker answer, in seconds.
    max_ages:
        Read the age of the oldest unfinished record for at most this many partitions.

    Returns
    -------
    ``(description, rows)``; each row: ``topic``, ``partition``, ``committed_offset`` (``None``:
    none), ``start_offset``, ``end_offset``, ``lag`` (``None`` without a committed offset),
    ``finished_above``, ``oldest_unfinished_age_s`` (seconds or ``None``).

    Raises
    ------
    KafkaClientError
        The brokers did not answer, or a topic in ``topics`` does not exist.
    """
    desc = admin.describe_group(conf, group, timeout_s)
    if topics:
        counts = admin.topic_partitions(conf, topics, timeout_s)
        tps = [(t, p) for t in topics for p in range(counts[t])]
        committed = admin.committed_offsets(conf, group, tps, timeout_s)
    else:
        committed = admin.committed_offsets(conf, group, None, timeout_s)
        tps = sorted(set(committed) | set(desc.assigned))
    marks = admin.watermark_offsets(conf, tps, timeout_s)
    rows: list[dict[str, Any]] = []
    for tp in tps:
        c = committed.get(tp)
        offset = c.offset if c is not None else None
        start, end = marks[tp]
        lag = max(0, end - offset) if offset is not None else None
        finished = (
            FinishedOffsets.decode(offset, c.metadata) if c is not None and offset is not None else None
        )
        rows.append(
            {
                "topic": tp[0],
                "partition": tp[1],
                "committed_offset": offset,
                "start_offset": start,
                "end_offset": end,
                "lag": lag,
                "finished_above": finished.count if finished is not None else 0,
                "oldest_unfinished_age_s": None,
            }
        )
    lagging = sorted((r for r in rows if r["lag"]), key=lambda r: -r["lag"])
    behind = {(r["topic"], r["partition"]): r["committed_offset"] for r in lagging[:max_ages]}
    stamps = admin.record_timestamps(conf, behind, min(timeout_s, 5.0))
    now_ms = time.time() * 1000
    for r in rows:
        ts = stamps.get((r["topic"], r["partition"]))
        if ts is not None:
            r["oldest_unfinished_age_s"] = round(max(0.0, now_ms - ts) / 1000, 3)
    return desc, rows


def consumed_topics(conf: dict[str, Any], group: str, timeout_s: float = 10.0) -> set[str]:
    """The topics consumer group ``group`` consumes: those it has committed offsets for, and those
    assigned to its members now (a group that never committed and has no member consumes nothing
    that can be seen from outside).

    Raises
    ------
    KafkaClientError
        The brokers did not answer within ``timeout_s`` seconds.
    """
    committed = admin.committed_offsets(conf, group, None, timeout_s)
    assigned = admin.describe_group(conf, group, timeout_s).assigned
    return {t for t, _ in committed} | {t for t, _ in assigned}
