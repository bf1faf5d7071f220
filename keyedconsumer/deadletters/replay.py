"""Replay dead letters: re-publish the records of a dead-letter topic once, in Kafka transactions
that also move the replay marker (:mod:`.marker`).

Each record keeps its key, value and headers minus the failure headers (``kafka_dlt-*``) and goes
where :mod:`.targets` sends it (an allowed topic, the key's partition now) or stays pending with the
reason. Records are read up to the end offsets seen at start. Records and marker are written in one
transaction per batch: after a crash mid-replay the open batch is aborted and the next replay sends
it again; readers with ``isolation.level=read_committed`` see every record once. A replay started
while another runs on the same marker group fences the older one off (its next commit fails).

Library code below both faces: ``keyedconsumer dead-letter replay`` and the dashboard's replay.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

from ..errors import KafkaClientError, PublishError
from ..formatting import show_key
from ..kafka import admin
from .marker import ReplayMarker, marker_group_of
from .records import Failure, replay_headers
from .targets import Planner, ReplayTargets, Target

__all__ = ["ReplayJob", "run_replay", "replay_selected", "plan_selected", "MAX_SELECTED"]

log = logging.getLogger("keyedconsumer.deadletters")

#: Records one :func:`replay_selected` or :func:`plan_selected` call takes at most.
MAX_SELECTED = 10_000


@dataclasses.dataclass
class ReplayJob:
    """One replay run: which records to send (and the result, filled by :func:`run_replay`).

    Parameters
    ----------
    conf:
        librdkafka properties.
    dlq:
        The dead-letter topic.
    targets:
        Where records may go (:class:`~.targets.ReplayTargets`).
    keys:
        Replay only records with one of these keys (empty: any key).
    since_ms:
        Replay only records that failed at or after this time (ms since the epoch).
    only:
        Replay only the records at these ``(partition, offset)`` (``None``: every record).
    expected:
        ``{(partition, offset): (topic, partition or None)}`` confirmed by a person: a record whose
        target is not that any more, or was not confirmed, is not sent (``None``: no confirmation).
    timeout_s:
        Bound of each broker answer, and of starting and committing a transaction (seconds).

    ``rows`` lists each record sent (or, in a dry run, to send: ``key`` as text, ``key_b64`` the key's
    bytes when they are not UTF-8), ``refused`` each record left pending
    for want of a target (with ``reason``); ``counts``: ``sent``, ``already_replayed``,
    ``not_matching``, ``no_target``; ``full``: partitions whose marker could hold no more skipped
    records (the rest of them was not examined).
    """

    conf: dict[str, Any]
    dlq: str
    targets: ReplayTargets
    keys: frozenset[bytes] = frozenset()
    since_ms: int | None = None
    only: frozenset[tuple[int, int]] | None = None
    expected: dict[tuple[int, int], tuple[str, int | None]] | None = None
    timeout_s: float = 30.0
    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    refused: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    counts: dict[str, int] = dataclasses.field(
        default_factory=lambda: {"sent": 0, "already_replayed": 0, "not_matching": 0, "no_target": 0}
    )
    full: set[int] = dataclasses.field(default_factory=set)

    def __post_init__(self) -> None:
        self.planner = Planner(self.conf, self.dlq, self.targets, self.timeout_s)

    def matches(self, record: admin.Record) -> bool:
        if self.only is not None and (record.partition, record.offset) not in self.only:
            return False
        if self.keys and record.key not in self.keys:
            return False
        if self.since_ms is not None:
            when = Failure.of(record).failed_at_ms
            if when is None or when < self.since_ms:
                return False
        return True

    def target(self, record: admin.Record) -> Target:
        """The record's target, refused when a person confirmed another one."""
        target = self.planner.target(record)
        if self.expected is None or target.refused is not None:
            return target
        confirmed = self.expected.get((record.partition, record.offset))
        if confirmed is None:
            return dataclasses.replace(target, refused=f"its target {target.text()} was not confirmed")
        if confirmed != (target.topic, target.partition):
            shown = Target(confirmed[0], confirmed[1]).text()
            return dataclasses.replace(
                target, refused=f"its target is {target.text()} now, not {shown} as confirmed"
            )
        return target

    def row(self, record: admin.Record, target: Target) -> dict[str, Any]:
        failure = Failure.of(record)
        return {
            "dlq_partition": record.partition,
            "dlq_offset": record.offset,
            "key": show_key(record.key),
            "key_b64": _b64_unless_text(record.key),
            "topic": target.topic,
            "partition": target.partition,
            "offset": None,
            "moved_from": target.moved_from,
            "failed_at_ms": failure.failed_at_ms,
            "exception": failure.exception,
        }

    def result(self, group: str, error: str | None) -> dict[str, Any]:
        """``replay --json``'s fields."""
        return {
            **self.counts,
            "marker_full_partitions": sorted(self.full),
            "error": error,
            "records": self.rows,
            "refused": self.refused,
            "marker_group": group,
        }


def _b64_unless_text(key: bytes | None) -> str | None:
    """The key in base64 when it is not UTF-8 (``key`` shows its bad bytes as ``\\xNN``), else ``None``."""
    if key is None:
        return None
    try:
        key.decode("utf-8")
    except UnicodeDecodeError:
        return base64.b64encode(key).decode()
    return None


def run_replay(job: ReplayJob, group: str, dry_run: bool = False, batch_size: int = 500) -> str | None:
    """Run ``job`` with its marker in consumer group ``group``; ``dry_run``: read the marker, send and
    mark nothing.

    Returns
    -------
    The error that ended it early (``None``: it ran to the end; ``job`` holds what was sent).

    Raises
    ------
    KafkaClientError
        The dead-letter topic does not exist, or the brokers did not answer before anything was sent.
    """
    reader = admin.TopicReader(job.conf, job.dlq, group, job.timeout_s)
    publisher = None
    error: str | None = None
    try:
        if not dry_run:  # first: it fences off an older replay, and aborts what a crashed one left open
            publisher = admin.TransactionalPublisher(
                {**job.conf, "partitioner": job.targets.partitioner}, group, job.timeout_s
            )
        # a dry run does not wait for (nor abort) a transaction a crashed replay left open
        markers = {
            p: ReplayMarker.decode(c.offset, c.metadata)
            for p, c in reader.committed(stable=not dry_run).items()
        }
        start = {p: max(m.committed_offset, reader.start_offsets[p]) for p, m in markers.items()}
        try:
            _replay_records(job, reader, publisher, markers, start, batch_size)
        except (KafkaClientError, PublishError) as exc:
            error = str(exc)
    finally:
        if publisher is not None:
            publisher.close()
        reader.close()
    return error


def _replay_records(
    job: ReplayJob,
    reader: admin.TopicReader,
    publisher: admin.TransactionalPublisher | None,
    markers: dict[int, ReplayMarker],
    start: dict[int, int],
    batch_size: int,
) -> None:
    batch: list[tuple[admin.Record, dict[str, Any]]] = []
    changed: set[int] = set()

    def flush() -> None:
        if not batch:
            return
        if publisher is not None:
            publisher.begin()
            for record, row in batch:
                publisher.send(
                    row["topic"], record.key, record.value, replay_headers(record), row["partition"]
                )
            offsets = {(job.dlq, p): (markers[p].committed_offset, markers[p].encode()) for p in changed}
            delivered = publisher.commit(offsets, reader)
            for (_, row), (partition, offset) in zip(batch, delivered, strict=True):
                row["partition"], row["offset"] = partition, offset
        job.rows.extend(row for _, row in batch)
        job.counts["sent"] += len(batch)
        batch.clear()
        changed.clear()

    def leave(record: admin.Record, count: str) -> bool:
        """Mark the record pending; ``False`` when its partition's marker is full."""
        if not markers[record.partition].mark(record.offset, replayed=False):
            job.full.add(record.partition)
            return False
        job.counts[count] += 1
        changed.add(record.partition)
        return True

    for record in reader.read(start):
        p = record.partition
        if p in job.full:
            continue
        if markers[p].is_replayed(record.offset):
            job.counts["already_replayed"] += 1
            continue
        if not job.matches(record):
            leave(record, "not_matching")
            continue
        target = job.target(record)
        if target.refused is not None:
            if leave(record, "no_target"):
                job.refused.append(
                    {
                        "dlq_partition": p,
                        "dlq_offset": record.offset,
                        "key": show_key(record.key),
                        "topic": target.topic,
                        "reason": target.refused,
                    }
                )
                log.warning("%s[%d]@%d left pending: %s", job.dlq, p, record.offset, target.refused)
            continue
        if not markers[p].mark(record.offset, replayed=True):
            job.full.add(p)
            continue
        changed.add(p)
        batch.append((record, job.row(record, target)))
        if len(batch) >= batch_size:
            flush()
    flush()


def _selected(records: set[tuple[int, int]]) -> frozenset[tuple[int, int]]:
    if not 1 <= len(records) <= MAX_SELECTED:
        raise ValueError(f"select 1 to {MAX_SELECTED} records")
    return frozenset(records)


def replay_selected(
    conf: dict[str, Any],
    dlq: str,
    records: set[tuple[int, int]],
    targets: ReplayTargets,
    *,
    expected: dict[tuple[int, int], tuple[str, int | None]] | None = None,
    marker_group: str | None = None,
    timeout_s: float = 30.0,
) -> dict[str, Any]:
    """Replay the dead letters at ``records`` (``(partition, offset)`` pairs of ``dlq``) as
    ``keyedconsumer dead-letter replay`` does (one transaction per batch, the same replay marker):
    the others stay pending for a later replay; a record replayed before is not sent again; with
    ``expected`` (what a person confirmed), one whose target is not ``expected[(partition, offset)]``
    is not sent.

    Returns
    -------
    :meth:`ReplayJob.result`: ``sent``, ``already_replayed``, ``not_matching``, ``no_target``,
    ``marker_full_partitions``, ``error``, ``records``, ``refused``, ``marker_group``.

    Raises
    ------
    ValueError
        No record or more than :data:`MAX_SELECTED`.
    KafkaClientError
        The topic does not exist, or the brokers did not answer.
    """
    group = marker_group or marker_group_of(dlq)
    job = ReplayJob(conf, dlq, targets, only=_selected(records), expected=expected, timeout_s=timeout_s)
    error = run_replay(job, group)
    return job.result(group, error)


def plan_selected(
    conf: dict[str, Any],
    dlq: str,
    records: set[tuple[int, int]],
    targets: ReplayTargets,
    *,
    marker_group: str | None = None,
    timeout_s: float = 30.0,
) -> list[dict[str, Any]]:
    """Where a replay of the dead letters at ``records`` would send each, without sending anything:
    what a person confirms.

    Returns
    -------
    One dict per record found, in ``(partition, offset)`` order: ``dlq_partition``, ``dlq_offset``,
    ``key`` (text), ``topic``, ``partition`` (``None``: the producer's partitioner picks),
    ``refused`` (why it would not be sent, or ``None``), ``moved_from``, ``replayed`` (sent before:
    a replay skips it), ``target`` (the target as one line of text).

    Raises
    ------
    ValueError
        No record or more than :data:`MAX_SELECTED`.
    KafkaClientError
        The topic does not exist, or the brokers did not answer.
    """
    wanted = _selected(records)
    group = marker_group or marker_group_of(dlq)
    reader = admin.TopicReader(conf, dlq, group, timeout_s)
    planner = Planner(conf, dlq, targets, timeout_s)
    out: list[dict[str, Any]] = []
    try:
        markers = {p: ReplayMarker.decode(c.offset, c.metadata) for p, c in reader.committed(False).items()}
        for record in _read_only(reader, wanted):
            target = planner.target(record)
            out.append(
                {
                    "dlq_partition": record.partition,
                    "dlq_offset": record.offset,
                    "key": show_key(record.key),
                    "topic": target.topic,
                    "partition": target.partition,
                    "refused": target.refused,
                    "moved_from": target.moved_from,
                    "replayed": markers[record.partition].is_replayed(record.offset),
                    "target": target.text(),
                }
            )
    finally:
        reader.close()
    return sorted(out, key=lambda r: (r["dlq_partition"], r["dlq_offset"]))


def _read_only(reader: admin.TopicReader, wanted: frozenset[tuple[int, int]]) -> Iterator[admin.Record]:
    """The records at ``wanted`` (those that exist), read from the lowest wanted offset of each
    partition and no further than the last one wanted."""
    start: dict[int, int] = {}
    last: dict[int, int] = {}
    for p, o in wanted:
        if p in reader.start_offsets:
            start[p], last[p] = min(o, start.get(p, o)), max(o, last.get(p, o))
    todo = {p for p in start if start[p] < reader.end_offsets[p]}
    records = reader.read(start)
    try:
        for record in records:
            if (record.partition, record.offset) in wanted:
                yield record
            if record.offset >= last[record.partition]:
                todo.discard(record.partition)
                if not todo:
                    return
    finally:
        records.close()  # stops the reader's fetching now
