"""``keyedconsumer audit``: find the audit records (``keyedconsumer.middleware.Audit``) of a key, an
offset or a time range."""

from __future__ import annotations

import datetime as dt
import json
import zlib
from collections.abc import Iterator
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from ..errors import KafkaClientError
from .errors import CliError
from .output import _out_console, _reports_errors, _setup_logging
from .replay import parse_since
from .settings import BrokersOpt, ConfigOpt, PropsOpt, TimeoutOpt, ToolLogLevelOpt, _client_conf, _Level

#: The consumer group name the reader uses (it never joins it nor commits).
READER_GROUP = "keyedconsumer-audit-reader"
#: The outcomes of audit records: the Audit middleware's, and ``ACTION`` for the dashboard's actions
#: (``keyedconsumer web --audit-topic``).
OUTCOMES = ("SUCCESS", "SKIP", "FAIL", "RETRY", "PARKED", "DEAD_LETTERED", "CONFLATED", "ACTION")


def partition_of_key(key: bytes, partitions: int) -> int:
    """The partition librdkafka's default partitioner (``consistent_random``: CRC-32 of the key,
    modulo the partition count) gives a non-null key: where a key's audit records are."""
    return zlib.crc32(key) % partitions


def find(
    conf: dict[str, Any],
    topic: str,
    *,
    key: str | None = None,
    source_topic: str | None = None,
    partition: int | None = None,
    offset: int | None = None,
    outcome: str | None = None,
    since_ms: int | None = None,
    until_ms: int | None = None,
    timeout_s: float = 30.0,
) -> Iterator[dict[str, Any]]:
    """The audit records of ``topic`` matching every filter given, in the audit topic's order per
    partition (a key's records are on one partition: only that one is read).

    Raises
    ------
    KafkaClientError
        The audit topic does not exist, or the brokers did not answer within ``timeout_s``.
    """
    from ..kafka import admin  # here: `keyedconsumer run --processes` forks before Kafka is loaded

    reader = admin.TopicReader(conf, topic, READER_GROUP, timeout_s)
    try:
        parts = reader.partitions
        if key is not None:
            parts = [partition_of_key(key.encode(), len(parts))]
        start = {p: reader.start_offsets[p] for p in parts}
        if since_ms is not None:
            by_time = admin.offsets_for_times(conf, topic, parts, since_ms, timeout_s)
            start = {p: o for p, o in by_time.items() if o is not None}
        for rec in reader.read(start):
            try:
                doc = json.loads(rec.value or b"")
            except ValueError:
                continue  # not an audit record
            if not isinstance(doc, dict):
                continue
            if key is not None and doc.get("key") != key:
                continue
            if source_topic is not None and doc.get("topic") != source_topic:
                continue
            if partition is not None and doc.get("partition") != partition:
                continue
            if offset is not None and doc.get("offset") != offset:
                continue
            if outcome is not None and doc.get("outcome") != outcome.upper():
                continue
            t = doc.get("time_ms")
            if since_ms is not None and isinstance(t, int) and t < since_ms:
                continue
            if until_ms is not None and isinstance(t, int) and t > until_ms:
                continue
            yield doc
    finally:
        reader.close()


@_reports_errors
def audit(
    topic: Annotated[
        str, typer.Option("--topic", metavar="TOPIC", help="The audit topic.")
    ] = "keyedconsumer.audit",
    key: Annotated[
        str | None, typer.Option("--key", metavar="KEY", help="Records of this message key (UTF-8).")
    ] = None,
    source_topic: Annotated[
        str | None, typer.Option("--source-topic", metavar="TOPIC", help="Records of messages of this topic.")
    ] = None,
    partition: Annotated[
        int | None, typer.Option("--partition", metavar="N", help="... of this partition.")
    ] = None,
    offset: Annotated[int | None, typer.Option("--offset", metavar="N", help="... at this offset.")] = None,
    outcome: Annotated[
        str | None,
        typer.Option(
            metavar="OUTCOME", help=f"{', '.join(OUTCOMES[:-1])} or {OUTCOMES[-1]} (a dashboard action)."
        ),
    ] = None,
    since: Annotated[
        str | None,
        typer.Option(metavar="TIME", help="From this time (ISO 8601, or epoch ms).", show_default=False),
    ] = None,
    until: Annotated[
        str | None,
        typer.Option(metavar="TIME", help="Up to this time (ISO 8601, or epoch ms).", show_default=False),
    ] = None,
    limit: Annotated[int, typer.Option(metavar="N", help="Show at most N records (the first found).")] = 1000,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line on stdout.")] = False,
    brokers: BrokersOpt = None,
    props: PropsOpt = None,
    config_file: ConfigOpt = None,
    timeout_s: TimeoutOpt = 30.0,
    log_level: ToolLogLevelOpt = _Level.WARNING,
) -> None:
    """Find what happened to messages: the audit records of a key, an offset or a time range.

    Reads the audit topic written by the Audit middleware (one record per attempt: outcome, error,
    attempt, duration, instance), without joining a group or committing. With --key only the key's
    partition of the audit topic is read. Exit 0 with the records found (none is not an error).
    """
    _setup_logging(log_level.value)
    conf, _ = _client_conf(brokers, props or [], config_file)
    if limit < 1:
        raise CliError("--limit must be >= 1", 2)
    if outcome is not None and outcome.upper() not in OUTCOMES:
        raise CliError(f"--outcome {outcome!r}: expected {', '.join(OUTCOMES[:-1])} or {OUTCOMES[-1]}", 2)
    since_ms = parse_since(since) if since is not None else None
    until_ms = parse_since(until) if until is not None else None
    try:
        found: list[dict[str, Any]] = []
        for doc in find(
            conf,
            topic,
            key=key,
            source_topic=source_topic,
            partition=partition,
            offset=offset,
            outcome=outcome,
            since_ms=since_ms,
            until_ms=until_ms,
            timeout_s=timeout_s,
        ):
            found.append(doc)
            if len(found) >= limit:
                break
    except KafkaClientError as exc:
        raise CliError(f"reading {topic}: {exc}", 1) from None
    if as_json:
        for doc in found:
            print(json.dumps(doc, separators=(",", ":")))
        return
    table = Table(title=f"{topic}: {len(found)} record(s)")
    for col in (
        "time (UTC)",
        "key",
        "topic[partition]@offset",
        "attempt",
        "outcome",
        "ms",
        "error",
        "instance",
    ):
        table.add_column(col)
    for d in found:
        when = dt.datetime.fromtimestamp(d.get("time_ms", 0) / 1000, dt.timezone.utc).isoformat(
            timespec="milliseconds"
        )
        error = f"{d.get('error_type', '')}: {d.get('error', '')}" if d.get("error_type") else ""
        if d.get("outcome") == "ACTION":  # a dashboard action: what, by whom, the result
            error = f"{d.get('action')} by {d.get('session')} ({d.get('client')}): {d.get('result')}: {d.get('message', '')}"
        key_text = (
            d.get("key") if d.get("key") is not None else (f"b64:{d['key_b64']}" if d.get("key_b64") else "-")
        )
        table.add_row(
            when,
            Text(str(key_text)),
            f"{d.get('topic')}[{d.get('partition')}]@{d.get('offset')}",
            str(d.get("attempt")),
            str(d.get("outcome")),
            str(d.get("duration_ms")),
            Text(error[:120]),
            str(d.get("instance", "")),
        )
    _out_console().print(table)
