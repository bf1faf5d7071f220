"""``keyedconsumer dead-letter replay``: re-publish dead-lettered records once, in transactions."""

from __future__ import annotations

import datetime as dt
import importlib
import logging
from typing import TYPE_CHECKING, Annotated, Any

import pydantic
import typer
from rich.table import Table

from ..errors import KafkaClientError, PublishError
from .errors import CliError
from .marker import ReplayMarker
from .output import _out_console, _print_json, _reports_errors, _setup_logging, _show_key
from .settings import BrokersOpt, ConfigOpt, PropsOpt, TimeoutOpt, ToolLogLevelOpt, _client_conf, _Level

if TYPE_CHECKING:  # imported where used: `keyedconsumer run --processes` forks before Kafka is loaded
    from ..kafka import admin

log = logging.getLogger("keyedconsumer.cli")


def parse_since(text: str) -> int:
    """``--since``: epoch milliseconds, or an ISO 8601 time (a time without an offset is UTC).

    Returns
    -------
    Milliseconds since the epoch.

    Raises
    ------
    CliError
        (exit code 2) Neither form.
    """
    text = text.strip()
    if text.isdigit():
        return int(text)
    try:  # pydantic's ISO 8601 parser: "Z", offsets, dates, fractions of a second
        when = _DATETIME.validate_python(text)
    except pydantic.ValidationError:
        raise CliError(
            f"--since {text!r}: expected an ISO 8601 time (2026-11-30T12:00:00Z) or epoch milliseconds", 2
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return int(when.timestamp() * 1000)


_DATETIME = pydantic.TypeAdapter(dt.datetime)


def _header(record: admin.Record, name: str) -> str | None:
    for k, v in reversed(record.headers):
        if k == name and v is not None:
            return v.decode("utf-8", "replace")
    return None


def _int_header(record: admin.Record, name: str) -> int | None:
    value = _header(record, name)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


class _Replay:
    """One replay run: which records to send where, the markers, the batches."""

    def __init__(
        self,
        conf: dict[str, Any],
        dlq: str,
        to: str | None,
        keys: set[bytes],
        since_ms: int | None,
        timeout_s: float,
        only: set[tuple[int, int]] | None = None,
    ) -> None:
        dlt: Any = importlib.import_module("keyedconsumer.middleware.dead_letter")  # its header names
        self.h_topic: str = dlt.H_TOPIC
        self.h_partition: str = dlt.H_PARTITION
        self.h_failed_at: str = dlt.H_FAILED_AT
        self.h_fqcn: str = dlt.H_FQCN
        self.prefix: str = dlt.PREFIX
        self.conf, self.dlq, self.to, self.keys, self.since_ms, self.timeout_s = (
            conf,
            dlq,
            to,
            keys,
            since_ms,
            timeout_s,
        )
        self.only = only  # (partition, offset) of the records to replay; None: every record
        self.partition_counts: dict[str, int | None] = {}
        self.rows: list[dict[str, Any]] = []
        self.counts = {"sent": 0, "already_replayed": 0, "not_matching": 0, "no_target": 0}
        self.full: set[int] = set()

    def target(self, record: admin.Record) -> tuple[str | None, int | None, str | None]:
        """``(topic, partition or None, reason it cannot be sent or None)``."""
        original = _header(record, self.h_topic)
        topic = self.to or original
        if topic is None:
            return None, None, f"no {self.h_topic} header (give --to)"
        if topic == self.dlq:
            return None, None, "its target is the dead-letter topic itself"
        count = self.partitions_of(topic)
        if count is None:
            return None, None, f"target topic {topic!r} does not exist"
        partition = _int_header(record, self.h_partition) if topic == original else None
        return topic, (partition if partition is not None and 0 <= partition < count else None), None

    def partitions_of(self, topic: str) -> int | None:
        """The partition count of ``topic`` (``None``: it does not exist), asked once per topic."""
        if topic not in self.partition_counts:
            try:
                from ..kafka import admin

                self.partition_counts[topic] = admin.topic_partitions(self.conf, [topic], self.timeout_s)[
                    topic
                ]
            except KafkaClientError as exc:
                if exc.code != "UNKNOWN_TOPIC_OR_PART":
                    raise
                self.partition_counts[topic] = None
        return self.partition_counts[topic]

    def matches(self, record: admin.Record) -> bool:
        if self.only is not None and (record.partition, record.offset) not in self.only:
            return False
        if self.keys and record.key not in self.keys:
            return False
        if self.since_ms is not None:
            when = _int_header(record, self.h_failed_at)
            when = when if when is not None else record.timestamp_ms
            if when is None or when < self.since_ms:
                return False
        return True

    def row(self, record: admin.Record, topic: str, partition: int | None) -> dict[str, Any]:
        failed_at = _int_header(record, self.h_failed_at)
        return {
            "dlq_partition": record.partition,
            "dlq_offset": record.offset,
            "key": _show_key(record.key),
            "topic": topic,
            "partition": partition,
            "offset": None,
            "failed_at_ms": failed_at,
            "exception": _header(record, self.h_fqcn),
        }

    def headers(self, record: admin.Record) -> list[tuple[str, bytes | None]]:
        return [(k, v) for k, v in record.headers if not k.startswith(self.prefix)]


@_reports_errors
def replay(
    from_topic: Annotated[
        str, typer.Option("--from", metavar="TOPIC", help="The dead-letter topic.", show_default=False)
    ],
    to: Annotated[
        str | None,
        typer.Option(
            metavar="TOPIC",
            help="Target topic; default: each record's kafka_dlt-original-topic header.",
            show_default=False,
        ),
    ] = None,
    key: Annotated[
        list[str] | None,
        typer.Option("--key", metavar="KEY", help="Replay only records with this key (UTF-8; repeatable)."),
    ] = None,
    since: Annotated[
        str | None,
        typer.Option(
            metavar="TIME",
            help="Replay only records that failed at or after this time: ISO 8601 (UTC if no offset) "
            "or epoch ms; kafka_dlt-failed-at, else the record timestamp.",
            show_default=False,
        ),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Show what would be sent; send and mark nothing.")
    ] = False,
    marker_group: Annotated[
        str | None,
        typer.Option(
            metavar="GROUP",
            help="Consumer group holding the replay marker "
            "(default keyedconsumer-replay.<dead-letter topic>).",
            show_default=False,
        ),
    ] = None,
    batch_size: Annotated[int, typer.Option(metavar="N", help="Records per transaction (1-10000).")] = 500,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable JSON on stdout.")] = False,
    brokers: BrokersOpt = None,
    props: PropsOpt = None,
    config_file: ConfigOpt = None,
    timeout_s: TimeoutOpt = 30.0,
    log_level: ToolLogLevelOpt = _Level.WARNING,
) -> None:
    """Re-publish dead-lettered records to their original topic (or --to), once.

    Each record keeps its key, value and headers, minus the failure headers (kafka_dlt-*); it goes to
    its original partition when the target is its original topic, else the partitioner picks by key.
    Records are read up to the end offsets seen at start.

    Replaying twice sends nothing twice: a marker in the consumer group keyedconsumer-replay.<dlq>
    (committed offsets plus metadata) records which records were replayed, whatever the target.
    Records and marker are written in one Kafka transaction per batch: after a crash or kill
    mid-replay, the open batch is aborted and sent again by the next replay; consumers with
    isolation.level=read_committed (librdkafka's default) see every record once, consumers reading
    uncommitted records may see the aborted batch's records too. A replay started while another
    runs on the same marker fences the older one off (its next commit fails).

    Records not matching --key/--since stay pending and a later replay sends them. --dry-run reads
    the marker but sends and marks nothing.
    """
    _setup_logging(log_level.value)
    conf, _ = _client_conf(brokers, props or [], config_file)
    if not 1 <= batch_size <= 10_000:
        raise CliError("--batch-size must be in 1..10000", 2)
    if timeout_s <= 0:
        raise CliError("--timeout must be > 0", 2)
    if to is not None and to == from_topic:
        raise CliError("--to is the dead-letter topic itself", 2)
    since_ms = parse_since(since) if since is not None else None
    group = marker_group or marker_group_of(from_topic)
    job = _Replay(conf, from_topic, to, {k.encode() for k in key or []}, since_ms, timeout_s)
    if to is not None and job.partitions_of(to) is None:
        raise CliError(f"target topic {to!r} does not exist", 2)
    error = _run(job, group, dry_run, batch_size)
    _replay_report(job, group, dry_run, as_json, error)
    if error is not None:
        raise CliError(error, 1)
    if job.full or job.counts["no_target"]:
        raise CliError("some records were left behind (see above)", 1)


def marker_group_of(dlq: str) -> str:
    """The default consumer group holding the replay marker of dead-letter topic ``dlq``."""
    return f"keyedconsumer-replay.{dlq}"


def _run(job: _Replay, group: str, dry_run: bool, batch_size: int) -> str | None:
    """Run a replay job; the error that ended it early (``None``: it ran to the end)."""
    from ..kafka import admin

    reader = admin.TopicReader(job.conf, job.dlq, group, job.timeout_s)
    publisher = None
    error: str | None = None
    try:
        if not dry_run:  # first: it fences off an older replay, and aborts what a crashed one left open
            publisher = admin.TransactionalPublisher(job.conf, group, job.timeout_s)
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


def replay_selected(
    conf: dict[str, Any],
    dlq: str,
    records: set[tuple[int, int]],
    *,
    to: str | None = None,
    marker_group: str | None = None,
    timeout_s: float = 30.0,
) -> dict[str, Any]:
    """Replay the dead letters at ``records`` (``(partition, offset)`` pairs of ``dlq``) exactly as
    ``keyedconsumer dead-letter replay`` does (one transaction per batch, the same replay marker):
    the others stay pending for a later replay; a record replayed before is not sent again.

    Returns
    -------
    ``{"sent", "already_replayed", "not_matching", "no_target", "marker_full_partitions", "error",
    "records", "marker_group"}`` as in ``replay --json``.

    Raises
    ------
    KafkaClientError
        The topic does not exist, or the brokers did not answer.
    """
    group = marker_group or marker_group_of(dlq)
    job = _Replay(conf, dlq, to, set(), None, timeout_s, only=set(records))
    error = _run(job, group, False, 500)
    return {
        **job.counts,
        "marker_full_partitions": sorted(job.full),
        "error": error,
        "records": job.rows,
        "marker_group": group,
    }


def _replay_records(
    job: _Replay,
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
                publisher.send(row["topic"], record.key, record.value, job.headers(record), row["partition"])
            offsets = {(job.dlq, p): (markers[p].committed_offset, markers[p].encode()) for p in changed}
            delivered = publisher.commit(offsets, reader)
            for (_, row), (partition, offset) in zip(batch, delivered, strict=True):
                row["partition"], row["offset"] = partition, offset
        for _, row in batch:
            job.rows.append(row)
        job.counts["sent"] += len(batch)
        batch.clear()
        changed.clear()

    for record in reader.read(start):
        p = record.partition
        marker = markers[p]
        if p in job.full:
            continue
        if marker.is_replayed(record.offset):
            job.counts["already_replayed"] += 1
            continue
        if not job.matches(record):
            if not marker.mark(record.offset, replayed=False):
                job.full.add(p)
                continue
            job.counts["not_matching"] += 1
            changed.add(p)
            continue
        topic, partition, reason = job.target(record)
        if topic is None:
            if not marker.mark(record.offset, replayed=False):
                job.full.add(p)
                continue
            job.counts["no_target"] += 1
            log.warning("%s[%d]@%d left behind: %s", job.dlq, p, record.offset, reason)
            changed.add(p)
            continue
        if not marker.mark(record.offset, replayed=True):
            job.full.add(p)
            continue
        changed.add(p)
        batch.append((record, job.row(record, topic, partition)))
        if len(batch) >= batch_size:
            flush()
    flush()


def _replay_report(
    job: _Replay, group: str, dry_run: bool, as_json: bool, error: str | None, limit: int = 200
) -> None:
    if as_json:
        _print_json(
            {
                "dead_letter_topic": job.dlq,
                "marker_group": group,
                "dry_run": dry_run,
                **job.counts,
                "marker_full_partitions": sorted(job.full),
                "error": error,
                "records": job.rows,
            }
        )
        return
    console = _out_console()
    if job.rows:
        verb = "would send" if dry_run else "sent"
        table = Table(title=f"{job.dlq}: {verb} {len(job.rows)} record(s)")
        for col in ("from", "key", "to", "failed at", "exception"):
            table.add_column(col)
        for row in job.rows[:limit]:
            where = row["topic"] + ("" if row["partition"] is None else f"[{row['partition']}]")
            if row["offset"] is not None:
                where += f"@{row['offset']}"
            failed = row["failed_at_ms"]
            failed_text = (
                "-"
                if failed is None
                else dt.datetime.fromtimestamp(failed / 1000, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")
            )
            exc = (row["exception"] or "-").rsplit(".", 1)[-1]
            table.add_row(
                f"{row['dlq_partition']}@{row['dlq_offset']}", row["key"] or "(null)", where, failed_text, exc
            )
        console.print(table)
        if len(job.rows) > limit:
            console.print(f"... and {len(job.rows) - limit} more (--json lists all)")
    c = job.counts
    head = f"dry run: would send {c['sent']}, nothing sent or marked" if dry_run else f"sent {c['sent']}"
    console.print(
        f"{head}; already replayed {c['already_replayed']}; not matching --key/--since {c['not_matching']} "
        f"(left for a later replay); without a target {c['no_target']}. Marker group: {group}"
    )
    if job.full:
        console.print(
            f"partition(s) {sorted(job.full)}: the replay marker cannot hold more skipped records; the rest "
            "of them was not examined: replay without --key/--since to clear the skipped records",
            style="yellow",
        )
