"""``keyedconsumer inspect``: a consumer group's offsets and lag, and its Redis sequencer state."""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..config import ENV_PREFIX
from ..formatting import age as _age
from ..sequencing import inspect_redis, redact_url
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
    _secrets,
)


def _inspect_redis(url: str, namespace: str) -> dict[str, Any]:
    """Leases, parked keys, scheduled messages and live instances of a namespace."""
    try:
        result = inspect_redis(url, namespace)
    except ImportError:
        raise CliError("--redis needs the redis package: pip install 'keyedconsumer[redis]'", 2) from None
    except ValueError as exc:
        raise CliError(f"--namespace: {exc}", 2) from None
    except Exception as exc:  # StoreUnavailable and friends
        raise CliError(f"Redis {redact_url(url)} did not answer: {exc}", 1) from None
    return result


def _last_error_text(err: dict[str, Any] | None, now_s: float) -> Text:
    """A parked key's last error for the table: attacker-influenced text, so a :class:`Text` (no Rich
    markup; control characters, terminal escapes included, are stripped), on one line, cut to 200
    characters (``--json`` has all of it)."""
    if not err:
        return Text("-")
    ago = f", {_age(max(0.0, now_s - err['time_s']))} ago" if err.get("time_s") is not None else ""
    line = f"{err['type']}: {err['message']}".replace("\r", " ").replace("\n", " ")
    more = "..." if len(line) > 200 else ""
    return Text(f"{line[:200]}{more} ({err.get('at')}, attempt {err.get('attempt')}{ago})")


def _redis_tables(info: dict[str, Any], console: Console, now_s: float, limit: int = 50) -> None:
    leases = Table(title=f"leased keys ({len(info.get('leases', []))})")
    for col in ("key", "owner", "ttl ms", "fencing token"):
        leases.add_column(col, justify="right" if col in ("ttl ms", "fencing token") else "left")
    for le in info.get("leases", [])[:limit]:
        leases.add_row(str(le["key"]), str(le["owner"]), str(le["ttl_ms"]), str(le["fencing_token"]))
    parked = Table(title=f"parked keys ({len(info.get('parked', []))})")
    for col in ("key", "depth", "next due", "last error"):
        parked.add_column(col, justify="right" if col in ("depth", "next due") else "left")
    for pk in info.get("parked", [])[:limit]:
        due = pk.get("next_due_s")
        when = (
            "-"
            if due is None
            else (f"in {_age(due - now_s)}" if due >= now_s else f"{_age(now_s - due)} overdue")
        )
        parked.add_row(str(pk["key"]), str(pk["depth"]), when, _last_error_text(pk.get("last_error"), now_s))
    instances = Table(title=f"live instances ({len(info.get('instances', []))})")
    instances.add_column("instance")
    instances.add_column("last seen", justify="right")
    for inst in info.get("instances", [])[:limit]:
        instances.add_row(str(inst["id"]), f"{_age(max(0.0, now_s - inst['last_seen_s']))} ago")
    for table in (leases, parked, instances):
        console.print(table)
    console.print(f"scheduled messages: {info.get('scheduled', 0)}")
    if info.get("scheduler"):
        console.print(f"scheduler: {info['scheduler']}")
    if info.get("quarantined"):
        console.print(f"quarantined keys: {', '.join(str(k) for k in info['quarantined'][:limit])}")
    if len(info.get("leases", [])) > limit or len(info.get("parked", [])) > limit:
        console.print(f"(first {limit} rows shown; --json lists all)")


@_reports_errors
def inspect_group(
    group: Annotated[
        str | None,
        typer.Option("--group", "-g", metavar="GROUP", help="Consumer group id.", show_default=False),
    ] = None,
    topic: Annotated[
        list[str] | None,
        typer.Option(
            "--topic",
            "-t",
            metavar="TOPIC",
            help="Topic (repeatable); default: every partition the group committed or is assigned.",
        ),
    ] = None,
    redis: Annotated[
        str | None,
        typer.Option(metavar="URL", help="redis:// URL of the Redis sequencer.", show_default=False),
    ] = None,
    namespace: Annotated[
        str | None,
        typer.Option(metavar="NS", help="Redis namespace (default: the group).", show_default=False),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable JSON on stdout.")] = False,
    brokers: BrokersOpt = None,
    props: PropsOpt = None,
    config_file: ConfigOpt = None,
    timeout_s: TimeoutOpt = 10.0,
    log_level: ToolLogLevelOpt = _Level.WARNING,
) -> None:
    """Show a consumer group's committed offset, end offset and lag per partition.

    The oldest unfinished message's age cannot be seen from outside the consuming process; what is
    shown is the age of the record at the committed offset (now minus its timestamp) where lag > 0:
    that record is the oldest one the group has not finished. A partition without a committed offset
    shows no lag ("-": where the group starts depends on its auto.offset.reset). With --redis it also
    shows the leased keys, parked keys with their depth and last error, scheduled messages and live instances.
    """
    _setup_logging(log_level.value)
    conf, toml = _client_conf(brokers, props or [], config_file)
    group = group or _env_or_toml("group", toml)
    if not group:
        raise CliError(
            f"no consumer group: pass --group, set {ENV_PREFIX}GROUP, or 'group' in the TOML file", 2
        )
    if timeout_s <= 0:
        raise CliError("--timeout must be > 0", 2)
    _secrets.add_url(redis)
    topics = [t.strip() for flag in topic or [] for t in flag.split(",") if t.strip()]
    from ..groups import group_rows  # loads librdkafka: a supervisor imports this module before it forks

    desc, rows = group_rows(conf, group, topics, timeout_s)
    info = _inspect_redis(redis, namespace or group) if redis else None
    total = sum(r["lag"] for r in rows if r["lag"] is not None)
    if as_json:
        _print_json(
            {
                "group": group,
                "state": desc.state,
                "members": desc.members,
                "partitions": rows,
                "total_lag": total,
                "redis": info,
            }
        )
        return
    console = _out_console()
    table = Table(title=f"group {group}: {desc.state}, {desc.members} member(s)")
    for col in ("topic", "partition", "committed", "end", "lag", "oldest unfinished age*"):
        table.add_column(col, justify="left" if col == "topic" else "right")
    for r in rows:
        committed = "-" if r["committed_offset"] is None else str(r["committed_offset"])
        lag = "-" if r["lag"] is None else str(r["lag"])
        table.add_row(
            r["topic"],
            str(r["partition"]),
            committed,
            str(r["end_offset"]),
            lag,
            _age(r["oldest_unfinished_age_s"]),
        )
    console.print(table)
    if not rows:
        console.print(
            f"group {group} has no committed offsets and no assigned partitions (give --topic to see lag)"
        )
    console.print(f"total lag: {total}   * age of the record at the committed offset (now - its timestamp)")
    if info is not None:
        _redis_tables(info, console, float(info.get("now_s") or time.time()))  # the Redis server's clock
