"""``keyedconsumer web``: serve the operations dashboard (:mod:`keyedconsumer.web`)."""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
from typing import Annotated, Any

import typer

from ..config import ENV_PREFIX
from ..kafka.partitioners import DEFAULT_PARTITIONER
from ..sequencing import redact_url
from .errors import CliError
from .layers import Layered
from .output import _reports_errors, _setup_logging
from .replay import AllowTopicOpt, Partitioner, PartitionerOpt, RepartitionedOpt
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

TOKEN_ENV = f"{ENV_PREFIX}WEB_TOKEN"
AUDIT_TOPIC_ENV = f"{ENV_PREFIX}WEB_AUDIT_TOPIC"
MIN_TOKEN_CHARS = 16


def _split(values: list[str] | None) -> list[str]:
    return [v.strip() for flag in values or [] for v in flag.split(",") if v.strip()]


def _hosts(flags: list[str] | None, settings: Layered) -> tuple[list[str], str]:
    """``--allowed-host`` (each flag may hold several, comma-separated), else the environment's or the
    TOML file's ``web_allowed_hosts`` (a list, or a comma-separated string); and where they came from."""
    if flags:
        return _split(flags), "flag --allowed-host"
    given = settings.values.get("web_allowed_hosts")
    if given is None:
        return [], "default"
    where = settings.where(("web_allowed_hosts",))
    if isinstance(given, str):
        return _split([given]), where
    if isinstance(given, list) and all(isinstance(h, str) for h in given):
        return _split(given), where
    raise CliError(f"invalid setting web_allowed_hosts (from {where}): expected a list of host names", 2)


@_reports_errors
def web(
    group: Annotated[
        list[str] | None,
        typer.Option(
            "--group",
            "-g",
            metavar="GROUP",
            help="Consumer group to show (repeatable); default: every group. A replay sends a dead "
            "letter back only to a topic one of these groups consumes, or to an --allow-topic.",
        ),
    ] = None,
    redis: Annotated[
        str | None,
        typer.Option(
            metavar="URL", help="redis:// URL of the Redis sequencer (keys view).", show_default=False
        ),
    ] = None,
    namespace: Annotated[
        list[str] | None,
        typer.Option(metavar="NS", help="Redis namespace (repeatable; default: each group's name)."),
    ] = None,
    dead_letter_topic: Annotated[
        list[str] | None,
        typer.Option(
            "--dead-letter-topic",
            metavar="TOPIC",
            help="Dead-letter topic (repeatable); default: topics named *.dlq, *-dlq, *.DLT, *dead-letter.",
        ),
    ] = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8080,
    allowed_host: Annotated[
        list[str] | None,
        typer.Option(
            "--allowed-host",
            metavar="HOST",
            help="A host name the dashboard answers for besides localhost, 127.0.0.1 and [::1] "
            "(repeatable; *.example.com for every name below; * for any): the name people reach it by, "
            f"e.g. its proxy's. Other Host headers get 400 (DNS rebinding). Env {ENV_PREFIX}WEB_ALLOWED_HOSTS "
            "(comma-separated) or web_allowed_hosts in the TOML file.",
            show_default=False,
        ),
    ] = None,
    enable_actions: Annotated[
        bool,
        typer.Option(
            "--enable-actions",
            help=f"Allow replaying dead letters, un-parking keys, cancelling scheduled messages (needs --token or {TOKEN_ENV}).",
        ),
    ] = False,
    token: Annotated[
        str | None,
        typer.Option(
            envvar=TOKEN_ENV,
            metavar="TOKEN",
            help=f"Access token for the actions, {MIN_TOKEN_CHARS}+ characters (prefer the environment variable {TOKEN_ENV}).",
            show_default=False,
            show_envvar=False,
        ),
    ] = None,
    audit_topic: Annotated[
        str | None,
        typer.Option(
            "--audit-topic",
            metavar="TOPIC",
            help=f"Write each action to this audit topic (the Audit middleware's, on the same brokers; `keyedconsumer audit --outcome ACTION` reads them; env {AUDIT_TOPIC_ENV}).",
            show_default=False,
        ),
    ] = None,
    refresh_s: Annotated[
        float,
        typer.Option("--refresh", metavar="SECONDS", help="Seconds between page refreshes and samples."),
    ] = 5.0,
    allow_topic: AllowTopicOpt = None,
    partitioner: PartitionerOpt = None,
    repartitioned: RepartitionedOpt = False,
    stall_after_s: Annotated[
        float,
        typer.Option(
            "--stall-after",
            metavar="SECONDS",
            help="Flag a partition with lag whose committed offset has not moved for this long.",
        ),
    ] = 60.0,
    brokers: BrokersOpt = None,
    props: PropsOpt = None,
    config_file: ConfigOpt = None,
    timeout_s: TimeoutOpt = 10.0,
    log_level: ToolLogLevelOpt = _Level.WARNING,
) -> None:
    """Serve the operations dashboard: consumer groups, Redis keys, dead letters, refreshed live.

    Read-only unless --enable-actions is given with an access token: then a person who signs in with
    the token may replay selected dead letters (as `dead-letter replay`, in transactions: only to
    topics --group consumes or --allow-topic lists, each to its key's partition now under
    --partitioner), un-park a key now and cancel a scheduled message; each action asks for
    confirmation (a replay shows each record's target topic and partition) and is logged to
    keyedconsumer.web.actions, and with --audit-topic written to that audit topic (who, what, which
    key and offsets, the result). Brokers and Redis are asked once per --refresh seconds, whatever the
    number of open pages. It answers only requests whose Host is a loopback name or --allowed-host.
    """
    _setup_logging(log_level.value)
    logging.getLogger("keyedconsumer.web.actions").setLevel(logging.INFO)
    try:
        import uvicorn

        from ..web import WebOptions, create_app
        from ..web.hosts import allowed_hosts
    except ImportError as exc:
        raise CliError(
            f"the dashboard needs the web extra: pip install 'keyedconsumer[web]' ({exc.name} is missing)", 2
        ) from None
    conf, toml = _client_conf(brokers, props or [], config_file)
    hosts, hosts_from = _hosts(allowed_host, toml)
    try:
        allowed = allowed_hosts(hosts)
    except ValueError as exc:
        raise CliError(f"invalid setting web_allowed_hosts (from {hosts_from}): {exc}", 2) from None
    partitioner_name = partitioner.value if partitioner is not None else str(conf.get("partitioner") or "")
    if partitioner_name and partitioner_name not in Partitioner.__members__:
        raise CliError(
            f"partitioner {partitioner_name!r}: expected one of {', '.join(Partitioner.__members__)}", 2
        )
    groups = _split(group) or _split([g] if (g := _env_or_toml("group", toml)) else None)
    redis = redis or _env_or_toml("redis", toml)
    audit_topic = audit_topic or os.environ.get(AUDIT_TOPIC_ENV) or None
    _secrets.add_url(redis)
    if token:
        _secrets.values.add(token)
    if enable_actions and (not token or len(token) < MIN_TOKEN_CHARS):
        raise CliError(
            f"--enable-actions needs an access token of {MIN_TOKEN_CHARS}+ characters: set {TOKEN_ENV}", 2
        )
    if refresh_s < 0.5 or stall_after_s <= 0 or timeout_s <= 0:
        raise CliError("--refresh must be >= 0.5 s, --stall-after and --timeout > 0", 2)
    if redis and importlib.util.find_spec("redis") is None:
        raise CliError("--redis needs the redis package: pip install 'keyedconsumer[redis]'", 2)
    options = WebOptions(
        conf,
        groups=groups,
        redis_url=redis,
        namespaces=_split(namespace),
        dead_letter_topics=_split(dead_letter_topic),
        actions=enable_actions,
        token=token if enable_actions else None,
        audit_topic=audit_topic or None,
        refresh_s=refresh_s,
        interval_s=refresh_s,
        stall_after_s=stall_after_s,
        timeout_s=timeout_s,
        allowed_hosts=hosts,
        allow_topics=_split(allow_topic),
        partitioner=partitioner_name or DEFAULT_PARTITIONER,
        repartitioned=repartitioned,
    )
    app = create_app(options)
    log = logging.getLogger("keyedconsumer.web")
    log.warning(
        "dashboard on http://%s:%d for hosts %s (%s; brokers %s%s)",
        host,
        port,
        ", ".join(allowed),
        (
            "actions enabled"
            + (f", written to the audit topic {audit_topic}" if audit_topic else ", logged only")
        )
        if enable_actions
        else "read-only",
        conf["bootstrap.servers"],
        f"; redis {redact_url(redis)}" if redis else "",
    )
    # SIGTERM and SIGINT stop the server gracefully and the command exits 0, as `run` does. uvicorn
    # restores the handlers it found and raises the signal again once it stopped (without a handler
    # of ours the process would die of it: exit 143): these take it, and the command returns.
    previous = {sig: signal.signal(sig, _stopped) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False, server_header=False)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    log.warning("dashboard stopped")


def _stopped(signum: int, frame: Any) -> None:
    """The signal uvicorn raises again after its graceful stop: nothing more to do."""
