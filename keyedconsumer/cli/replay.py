"""``keyedconsumer dead-letter replay``: re-publish dead-lettered records once, in transactions (the
library's :mod:`keyedconsumer.deadletters.replay`)."""

from __future__ import annotations

import dataclasses
import getpass
import logging
import socket
import sys
from enum import Enum
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from ..action_audit import ActionAudit, action_records, replay_fields
from ..config import ENV_PREFIX
from ..deadletters.marker import marker_group_of
from ..formatting import TIME_FORMS, parse_time, utc_text
from ..kafka.partitioners import DEFAULT_PARTITIONER, PARTITIONERS
from .errors import CliError
from .output import _out_console, _print_json, _reports_errors, _setup_logging
from .settings import (
    BrokersOpt,
    ConfigOpt,
    PropsOpt,
    TimeoutOpt,
    ToolLogLevelOpt,
    _client_conf,
    _env_or_toml,
    _Level,
)

if TYPE_CHECKING:  # they load librdkafka: imported where used (a supervisor forks before that)
    from ..deadletters.replay import ReplayJob
    from ..deadletters.targets import ReplayTargets

log = logging.getLogger("keyedconsumer.cli")

__all__ = ["replay", "parse_since", "marker_group_of", "Partitioner", "replay_targets"]


class Partitioner(str, Enum):
    """librdkafka's key partitioners (:data:`keyedconsumer.kafka.partitioners.PARTITIONERS`), as a
    choice of the command line."""

    murmur2_random = "murmur2_random"
    murmur2 = "murmur2"
    consistent_random = "consistent_random"
    consistent = "consistent"
    fnv1a_random = "fnv1a_random"
    fnv1a = "fnv1a"


def parse_since(text: str, flag: str = "--since") -> int:
    """``--since`` / ``--until``: epoch milliseconds, or an ISO 8601 time (a time without an offset is
    UTC), as milliseconds since the epoch.

    Raises
    ------
    CliError
        (exit code 2) Neither form.
    """
    try:
        return parse_time(text)
    except ValueError:
        raise CliError(f"{flag} {text.strip()!r}: expected {TIME_FORMS}", 2) from None


def replay_targets(
    conf: dict[str, Any],
    *,
    to: str | None,
    groups: list[str],
    allow_topics: list[str],
    partitioner: str | None,
    repartitioned: bool,
    timeout_s: float,
) -> ReplayTargets:
    """The targets the operator allows (``--to``, or the topics ``--group`` consumes and
    ``--allow-topic``), with the producers' partitioner (``--partitioner``, else the librdkafka
    ``partitioner`` property of the settings, else ``murmur2_random``).

    Raises
    ------
    CliError
        (exit code 2) Neither ``--to``, ``--group`` nor ``--allow-topic``; an unknown partitioner.
    KafkaClientError
        The brokers did not answer.
    """
    from ..deadletters.targets import ReplayTargets, allowed_topics

    name = partitioner or str(conf.get("partitioner") or DEFAULT_PARTITIONER)
    if name not in PARTITIONERS:
        raise CliError(f"partitioner {name!r}: expected one of {', '.join(PARTITIONERS)}", 2)
    if to is not None:
        return ReplayTargets(to=to, partitioner=name, repartitioned=repartitioned)
    if not groups and not allow_topics:
        raise CliError(
            "say where the dead letters may go back to: --group (the consumer group whose dead letters "
            f"they are; also {ENV_PREFIX}GROUP or 'group' in the TOML file), --allow-topic, or --to",
            2,
        )
    allowed, because = allowed_topics(conf, groups, allow_topics, timeout_s)
    return ReplayTargets(allowed=allowed, because=because, partitioner=name, repartitioned=repartitioned)


GroupsOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--group",
        "-g",
        metavar="GROUP",
        help="The consumer group whose dead letters these are (repeatable): a record goes back to its "
        f"original topic only if such a group consumes it. Default: {ENV_PREFIX}GROUP or the TOML file's "
        "group.",
        show_default=False,
    ),
]
AllowTopicOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--allow-topic",
        metavar="TOPIC",
        help="A topic a record may go back to besides those of --group (repeatable).",
        show_default=False,
    ),
]
PartitionerOpt = Annotated[
    Partitioner | None,
    typer.Option(
        metavar="NAME",
        help="The target's producers' partitioner (librdkafka's partitioner property): a record goes to "
        "its key's partition under it. Default: -X partitioner, else murmur2_random (the Java "
        "producer's default); librdkafka-based producers default to consistent_random.",
        show_default=False,
    ),
]
RepartitionedOpt = Annotated[
    bool,
    typer.Option(
        "--repartitioned",
        help="The original topics gained partitions since the records failed: send a record whose "
        "key's partition changed to the key's partition now (by default it is left pending).",
    ),
]


@_reports_errors
def replay(
    from_topic: Annotated[
        str, typer.Option("--from", metavar="TOPIC", help="The dead-letter topic.", show_default=False)
    ],
    to: Annotated[
        str | None,
        typer.Option(
            metavar="TOPIC",
            help="Send every record to this topic (default: each record's original topic, if allowed).",
            show_default=False,
        ),
    ] = None,
    group: GroupsOpt = None,
    allow_topic: AllowTopicOpt = None,
    partitioner: PartitionerOpt = None,
    repartitioned: RepartitionedOpt = False,
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
        bool,
        typer.Option("--dry-run", help="Show where each record would go; send and mark nothing."),
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
    yes: Annotated[
        bool,
        typer.Option(
            "--yes",
            "-y",
            help="Send without asking. On a terminal the replay first shows where each record would go "
            "and asks; elsewhere (a script, --json) it does not ask.",
        ),
    ] = False,
    audit_topic: Annotated[
        str | None,
        typer.Option(
            "--audit-topic",
            metavar="TOPIC",
            help="Write the replay to this audit topic (the Audit middleware's; who, each record's "
            "target, each left pending; `keyedconsumer audit --outcome ACTION` reads it).",
            show_default=False,
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable JSON on stdout.")] = False,
    brokers: BrokersOpt = None,
    props: PropsOpt = None,
    config_file: ConfigOpt = None,
    timeout_s: TimeoutOpt = 30.0,
    log_level: ToolLogLevelOpt = _Level.WARNING,
) -> None:
    """Re-publish dead-lettered records to their original topic (or --to), once.

    A record's headers are written by whoever may write to the dead-letter topic, so a record goes
    back to the topic its header names only if that topic is consumed by --group (the consumer group
    whose dead letters these are) or listed with --allow-topic; --to sends every record to one topic.
    Each record goes to the partition its key has in the target now, under --partitioner; a record
    whose key's partition is not the one it came from is left pending (see --repartitioned). Each
    keeps its key, value and headers, minus the failure headers (kafka_dlt-*). Records are read up to
    the end offsets seen at start; --dry-run shows where each would go.

    Replaying twice sends nothing twice: a marker in the consumer group keyedconsumer-replay.<dlq>
    (committed offsets plus metadata) records which records were replayed, whatever the target.
    Records and marker are written in one Kafka transaction per batch: after a crash or kill
    mid-replay, the open batch is aborted and sent again by the next replay; consumers with
    isolation.level=read_committed (librdkafka's default) see every record once, consumers reading
    uncommitted records may see the aborted batch's records too. A replay started while another
    runs on the same marker fences the older one off (its next commit fails).

    Records not matching --key/--since, and records left without a target (with the reason), stay
    pending and a later replay sends them. --dry-run reads the marker but sends and marks nothing. On
    a terminal the replay shows where each record would go and asks first (--yes does not ask); it
    then sends exactly those records to exactly those targets. With --audit-topic the replay is
    written to the audit trail, as the dashboard's replays are.
    """
    _setup_logging(log_level.value)
    conf, settings = _client_conf(brokers, props or [], config_file)
    if not 1 <= batch_size <= 10_000:
        raise CliError("--batch-size must be in 1..10000", 2)
    if timeout_s <= 0:
        raise CliError("--timeout must be > 0", 2)
    if to is not None and to == from_topic:
        raise CliError("--to is the dead-letter topic itself", 2)
    since_ms = parse_since(since) if since is not None else None
    groups = group or ([g] if (g := _env_or_toml("group", settings)) else [])
    targets = replay_targets(
        conf,
        to=to,
        groups=groups,
        allow_topics=allow_topic or [],
        partitioner=partitioner.value if partitioner is not None else None,
        repartitioned=repartitioned,
        timeout_s=timeout_s,
    )
    from ..deadletters.replay import ReplayJob, run_replay

    marker = marker_group or marker_group_of(from_topic)
    keys = frozenset(k.encode() for k in key or [])
    job = ReplayJob(conf, from_topic, targets, keys, since_ms, timeout_s=timeout_s)
    if to is not None and job.planner.partitions_of(to) is None:
        raise CliError(f"target topic {to!r} does not exist", 2)
    if not (dry_run or yes or as_json) and sys.stdin.isatty():
        plan = _plan(job, marker, batch_size)
        if not plan.rows:  # nothing to send: the report says why
            _exit_code(plan, None)
            return
        if not typer.confirm(f"Send these {len(plan.rows)} record(s) to the targets shown?", default=False):
            raise CliError("nothing sent: not confirmed", 1)
        # exactly those records to exactly those targets (one whose target changed meanwhile stays
        # pending); those left pending in the plan are examined again, and left pending again
        chosen = {(r["dlq_partition"], r["dlq_offset"]): (r["topic"], r["partition"]) for r in plan.rows}
        pending = {(r["dlq_partition"], r["dlq_offset"]) for r in plan.refused}
        job = dataclasses.replace(job, only=frozenset(chosen) | pending, expected=chosen)
    error = run_replay(job, marker, dry_run, batch_size)
    _replay_report(job, marker, dry_run, as_json, error)
    if audit_topic is not None and not dry_run:
        problem = _audit(conf, audit_topic, job, marker, error, timeout_s)
        if problem is not None:
            raise CliError(f"the replay is NOT in the audit trail: {problem}", 1)
    _exit_code(job, error)


def _exit_code(job: ReplayJob, error: str | None) -> None:
    """Raise the replay's exit: 1 when it failed or left records behind."""
    if error is not None:
        raise CliError(error, 1)
    if job.full or job.counts["no_target"]:
        raise CliError("some records were left behind (see above)", 1)


def _plan(job: ReplayJob, marker: str, batch_size: int) -> ReplayJob:
    """A dry run of ``job``, reported: where each record would go.

    Raises
    ------
    CliError
        (exit code 1) The dry run failed.
    """
    from ..deadletters.replay import run_replay

    plan = dataclasses.replace(job, rows=[], refused=[], counts=dict(job.counts), full=set())
    error = run_replay(plan, marker, True, batch_size)
    _replay_report(plan, marker, True, False, error)
    if error is not None:
        raise CliError(error, 1)
    return plan


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no user name in the environment nor the password database
        return "unknown"


def _audit(
    conf: dict[str, Any], topic: str, job: ReplayJob, marker: str, error: str | None, timeout_s: float
) -> str | None:
    """Write the replay's records to the audit topic; why not, or ``None``."""
    fields, sent = replay_fields(job.dlq, None, job.result(marker, error))
    c = job.counts
    ok = error is None and not job.full and not c["no_target"]
    message = f"{job.dlq}: replayed {c['sent']}; left pending {c['no_target']}" + (
        f"; error: {error}" if error else ""
    )
    audit = ActionAudit(conf, topic, timeout_s=timeout_s, source="cli")
    try:
        return audit.write(
            action_records(
                "replay",
                f"cli {getpass.getuser()}",
                socket.gethostname(),
                "done" if ok else "failed",
                message,
                fields,
                sent,
            )
        )
    finally:
        audit.close(timeout_s)


def _replay_report(
    job: ReplayJob, group: str, dry_run: bool, as_json: bool, error: str | None, limit: int = 200
) -> None:
    if as_json:
        _print_json({"dead_letter_topic": job.dlq, "dry_run": dry_run, **job.result(group, error)})
        return
    console = _out_console()
    if job.rows:
        verb = "would send" if dry_run else "sent"
        table = Table(title=f"{job.dlq}: {verb} {len(job.rows)} record(s)")
        for col in ("from", "key", "to", "failed at", "exception"):
            table.add_column(col)
        for row in job.rows[:limit]:
            where = f"{row['topic']}[{'any' if row['partition'] is None else row['partition']}]"
            if row["offset"] is not None:
                where += f"@{row['offset']}"
            if row["moved_from"] is not None:
                where += f" (came from [{row['moved_from']}])"
            exc = (row["exception"] or "-").rsplit(".", 1)[-1]
            table.add_row(
                f"{row['dlq_partition']}@{row['dlq_offset']}",
                Text(row["key"] or "(null)"),
                Text(where),
                utc_text(row["failed_at_ms"]),
                Text(exc),
            )
        console.print(table)
        if len(job.rows) > limit:
            console.print(f"... and {len(job.rows) - limit} more (--json lists all)")
    for r in job.refused[:limit]:
        console.print(
            Text(f"left pending {r['dlq_partition']}@{r['dlq_offset']} (key {r['key']}): {r['reason']}"),
            style="yellow",
        )
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
