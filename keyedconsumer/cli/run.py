"""``keyedconsumer run``: consume topics with a handler until SIGTERM or SIGINT."""

from __future__ import annotations

import functools
import importlib
import logging
from enum import Enum
from typing import TYPE_CHECKING, Annotated, Any
from urllib.parse import urlsplit

import pydantic
import typer

from .. import signals
from ..app import KeyedApp
from ..config import ENV_PREFIX, ConsumerConfig, redact
from ..consumer import KeyedConsumer
from ..errors import KeyedConsumerError, PublishError
from ..health import Health
from ..sequencing import RedisSequencer, redact_url
from ..sequencing.config import CLUSTER_SCHEMES, RedisSequencerConfig
from .errors import CliError
from .flags import with_every_setting
from .handler import load_handler
from .help import FAILURES, HANDLER, KAFKA, OUTPUT, PROCESSING, REDIS
from .layers import RUN_KEYS, Layered, RunOptions, layered
from .output import _Format, _print_json, _reports_errors, _setup_logging
from .settings import BrokersOpt, ConfigOpt, PropsOpt, _Level, _parse_properties, _resolve_run, _secrets
from .supervisor import supervise

if TYPE_CHECKING:
    from .child import ChildLink

log = logging.getLogger("keyedconsumer.cli")


class _Ordering(str, Enum):
    KEY = "key"
    PARTITION = "partition"
    NONE = "none"


class _Reset(str, Enum):
    EARLIEST = "earliest"
    LATEST = "latest"


def _effective(settings: ConsumerConfig, options: RunOptions, sequencer: dict[str, Any]) -> dict[str, Any]:
    data = settings.model_dump()
    data["config"] = redact(settings.config)
    data.update(
        handler=options.handler,
        redis=redact_url(options.redis) if options.redis else None,
        namespace=(options.namespace or settings.group) if options.redis else None,
        dead_letter_topic=options.dead_letter_topic,
        retry_attempts=options.retry_attempts,
        park=options.park,
        processes=options.processes,
        sequencer=None,
    )
    if options.redis:
        config = RedisSequencerConfig.model_validate(
            {"url": options.redis, "namespace": data["namespace"], **sequencer}
        )
        data["sequencer"] = config.model_dump(exclude={"url", "namespace"})
    return data


#: The settings ``run`` spells out as flags of its own; :func:`with_every_setting` adds the others.
_SPELLED_OUT = {
    "topics",
    "brokers",
    "concurrency",
    "ordering",
    "manual_commit",
    "max_in_flight",
    "auto_offset_reset",
    "shutdown_timeout_s",
    "config",
}


def _middlewares(settings: ConsumerConfig, options: RunOptions) -> list[Any]:
    if options.dead_letter_topic is None and options.retry_attempts is None and not options.park:
        return []
    middleware: Any = importlib.import_module("keyedconsumer.middleware")  # installed from ./middleware

    out: list[Any] = []
    if options.dead_letter_topic is not None:
        # the consumer's brokers and connection properties: the consumer binds it (bind_settings)
        out.append(middleware.DeadLetter(topic=options.dead_letter_topic))
    out.append(middleware.Retry(max_attempts=options.retry_attempts or 3, park=options.park))
    return out


@with_every_setting(_SPELLED_OUT)
@_reports_errors
@signals.guard()  # SIGTERM/SIGINT stop the run cleanly from the command's first line to its last
def run(
    handler: Annotated[
        str | None,
        typer.Argument(
            metavar="MODULE:FUNCTION",
            help="The handler, package.module:function (sync or async def), or module:app (a KeyedApp); "
            "or 'handler' in TOML / env.",
            show_default=False,
        ),
    ] = None,
    topic: Annotated[
        list[str] | None,
        typer.Option(
            "--topic",
            "-t",
            rich_help_panel=HANDLER,
            metavar="TOPIC",
            help="Topic to consume (repeatable, or comma-separated).",
        ),
    ] = None,
    group: Annotated[
        str | None,
        typer.Option(
            "--group",
            "-g",
            rich_help_panel=HANDLER,
            metavar="GROUP",
            help="Consumer group id.",
            show_default=False,
        ),
    ] = None,
    concurrency: Annotated[
        int | None,
        typer.Option(
            "--concurrency", "-c", rich_help_panel=HANDLER, metavar="N", help="Handlers at once (default 1)."
        ),
    ] = None,
    ordering: Annotated[
        _Ordering | None, typer.Option(rich_help_panel=HANDLER, help="key | partition | none (default key).")
    ] = None,
    brokers: BrokersOpt = None,
    redis: Annotated[
        str | None,
        typer.Option(
            rich_help_panel=REDIS,
            metavar="URL",
            help="redis:// URL: per-key leases across instances (Redis sequencer).",
            show_default=False,
        ),
    ] = None,
    namespace: Annotated[
        str | None,
        typer.Option(
            rich_help_panel=REDIS,
            metavar="NS",
            help="Redis namespace (default: the group).",
            show_default=False,
        ),
    ] = None,
    dead_letter_topic: Annotated[
        str | None,
        typer.Option(
            rich_help_panel=FAILURES,
            metavar="TOPIC",
            help="Dead-letter topic ({topic} = the message's topic): DeadLetter, then Retry.",
            show_default=False,
        ),
    ] = None,
    retry_attempts: Annotated[
        int | None,
        typer.Option(
            rich_help_panel=FAILURES,
            metavar="N",
            help="Attempts per message before it fails (default 3 with a dead-letter topic).",
        ),
    ] = None,
    park: Annotated[
        bool | None,
        typer.Option(
            "--park/--no-park",
            rich_help_panel=FAILURES,
            help="Retrying keys wait parked in Redis (needs --redis).",
        ),
    ] = None,
    manual_commit: Annotated[
        bool | None,
        typer.Option(
            "--manual-commit/--auto-commit",
            rich_help_panel=KAFKA,
            help="Commit synchronously at each offset advance.",
        ),
    ] = None,
    max_in_flight: Annotated[
        int | None,
        typer.Option(
            rich_help_panel=PROCESSING,
            metavar="N",
            help="Buffered + running messages before fetching pauses.",
        ),
    ] = None,
    auto_offset_reset: Annotated[
        _Reset | None,
        typer.Option(rich_help_panel=KAFKA, help="Where a group without committed offsets starts."),
    ] = None,
    shutdown_timeout_s: Annotated[
        float | None,
        typer.Option(
            rich_help_panel=PROCESSING, metavar="SECONDS", help="Seconds a stop waits for running handlers."
        ),
    ] = None,
    props: PropsOpt = None,
    config_file: ConfigOpt = None,
    app_dir: Annotated[
        str,
        typer.Option(
            rich_help_panel=HANDLER,
            metavar="DIR",
            help="Directory put first on the Python path to import the handler.",
        ),
    ] = ".",
    log_level: Annotated[
        _Level, typer.Option(rich_help_panel=OUTPUT, help="Log level (stderr).")
    ] = _Level.INFO,
    log_format: Annotated[
        _Format, typer.Option(rich_help_panel=OUTPUT, help="text, or json: one JSON object per line.")
    ] = _Format.TEXT,
    health_port: Annotated[
        int | None,
        typer.Option(
            rich_help_panel=OUTPUT,
            metavar="PORT",
            help="Serve /livez, /readyz, /healthz on this port (0: any free one).",
            show_default=False,
        ),
    ] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            rich_help_panel=OUTPUT,
            metavar="PORT",
            help="Serve Prometheus /metrics on this port (needs keyedconsumer[metrics]).",
            show_default=False,
        ),
    ] = None,
    http_addr: Annotated[
        str,
        typer.Option(
            rich_help_panel=OUTPUT, metavar="ADDR", help="Address the health and metrics endpoints listen on."
        ),
    ] = "127.0.0.1",
    print_settings: Annotated[
        bool,
        typer.Option(
            "--print-settings",
            rich_help_panel=OUTPUT,
            help="Print the effective settings as JSON (secrets hidden) and exit.",
        ),
    ] = False,
    processes: Annotated[
        int | None,
        typer.Option(
            metavar="N",
            help="Run N processes of the handler under a supervisor that restarts them (docs/processes.md).",
            show_default=False,
        ),
    ] = None,
    more_settings: dict[str, Any] | None = None,
) -> None:
    """Consume topics with a handler until SIGTERM or SIGINT, which drain gracefully.

    On SIGTERM/SIGINT nothing new starts, running handlers finish (up to the shutdown timeout), the
    finished offsets are committed and the process exits 0. A message that fails with nothing to
    handle it (no dead-letter topic) stops the consumer the same way and exits 1.

    Every setting comes from its flag, else its KEYEDCONSUMER_<SETTING> environment variable
    (KEYEDCONSUMER_SEQUENCER__<OPTION> for a sequencer option), else the TOML file of --config, else
    its default. For MODULE:APP (a KeyedApp) they go over the app's own options (KeyedApp(brokers=...))
    and under each route's (@app.handler(..., concurrency=16)).
    """
    _setup_logging(log_level.value, log_format.value)
    topics = [t.strip() for flag in topic or [] for t in flag.split(",") if t.strip()] or None
    flags: dict[str, Any] = {
        "handler": handler,
        "group": group,
        "redis": redis,
        "namespace": namespace,
        "dead_letter_topic": dead_letter_topic,
        "retry_attempts": retry_attempts,
        "park": park,
        "topics": topics,
        "brokers": brokers,
        "concurrency": concurrency,
        "ordering": ordering.value if ordering else None,
        "manual_commit": manual_commit,
        "max_in_flight": max_in_flight,
        "auto_offset_reset": auto_offset_reset.value if auto_offset_reset else None,
        "shutdown_timeout_s": shutdown_timeout_s,
        "config": _parse_properties(props or []),
        "processes": processes,
        **(more_settings or {}),
    }
    layers = layered(flags, config_file)
    if layers.values.get("processes") is not None and not print_settings:
        # in each child: the path below, its errors reported as one line and an exit code
        work = functools.partial(
            _reports_errors(_consume), layers, app_dir, False, None, metrics_port, http_addr
        )
        supervise(
            layers.values["processes"],
            work,
            health_port=health_port,
            metrics_port=metrics_port,
            http_addr=http_addr,
        )
        return
    _consume(layers, app_dir, print_settings, health_port, metrics_port, http_addr)


def _consume(
    layers: Layered,
    app_dir: str,
    print_settings: bool,
    health_port: int | None,
    metrics_port: int | None,
    http_addr: str,
    link: ChildLink | None = None,
) -> None:
    """``run`` once the settings are layered: in this process, or in a child of ``--processes``
    (``link``: its link to the supervisor, which serves the health and metrics endpoints)."""
    spec = layers.values.get("handler")
    if not spec:
        raise CliError(
            f"no handler: give package.module:function, {ENV_PREFIX}HANDLER, or 'handler' in the TOML file", 2
        )
    layers.check_consumer_values()
    target = load_handler(spec, app_dir)
    if isinstance(target, KeyedApp):
        _run_app(spec, target, layers, print_settings, health_port, metrics_port, http_addr, link)
        return
    settings, options, sequencer_options = _resolve_run(layers)
    if options.park and not options.redis:
        raise CliError("--park needs --redis (parked keys wait in Redis)", 2)
    fn = target
    if print_settings:
        _print_json(_effective(settings, options, sequencer_options))
        return
    sequencer = None
    if options.redis:
        if urlsplit(options.redis).scheme not in ("redis", "rediss", "unix", *CLUSTER_SCHEMES):
            raise CliError(
                f"--redis {redact_url(options.redis)!r}: expected a redis://, rediss://, unix:// or "
                "redis+cluster:// URL",
                2,
            )
        sequencer = RedisSequencer(
            url=options.redis, namespace=options.namespace or settings.group, **sequencer_options
        )
    middlewares = _middlewares(settings, options)
    metrics: Any = None
    if metrics_port is not None:
        try:
            metrics = importlib.import_module("keyedconsumer.middleware").Metrics(
                http_port=metrics_port if link is None else None, http_addr=http_addr
            )
        except ImportError:
            raise CliError(
                "--metrics-port needs prometheus-client: pip install 'keyedconsumer[metrics]'", 2
            ) from None
        middlewares.insert(0, metrics)
    try:
        consumer = KeyedConsumer(handler=fn, middlewares=middlewares, settings=settings, sequencer=sequencer)
    except PublishError as exc:
        raise CliError(f"dead-letter publisher: {exc}", 2) from None
    except (TypeError, ValueError) as exc:
        raise CliError(str(exc), 2) from None
    log.info(
        "consuming %s as group %s with %s (concurrency=%d, ordering=%s, brokers=%s%s%s)",
        ",".join(settings.topics),
        settings.group,
        options.handler,
        settings.concurrency,
        settings.ordering,
        ",".join(settings.brokers),
        f", dead letters to {options.dead_letter_topic}" if options.dead_letter_topic else "",
        f", redis {redact_url(options.redis)}" if options.redis else "",
    )
    if metrics is not None:
        metrics.bind(consumer)
        if link is None:
            log.info("metrics on http://%s:%d/metrics", http_addr, metrics_port)
    _run_serving_health(consumer.run, consumer, health_port, http_addr, link)


def _run_serving_health(
    run: Any, source: Any, health_port: int | None, http_addr: str, link: ChildLink | None = None
) -> None:
    """``run()`` (a consumer's or an app's), with ``/livez``, ``/readyz``, ``/healthz`` of
    ``source`` served meanwhile when ``health_port`` is given (in a child of ``--processes``: given
    to ``link``, whose supervisor serves them); its errors as CLI errors (exit 1)."""
    if link is not None:
        link.attach(source)
    health: Any = None
    if health_port is not None:
        health = Health(source)
        bound = health.serve(health_port, addr=http_addr)
        log.info("health on http://%s:%d/livez, /readyz, /healthz", http_addr, bound)
    try:
        run()
    except KeyedConsumerError as exc:
        raise CliError(f"stopped: {exc}", 1) from None
    except Exception as exc:  # e.g. Redis refused as not durable; --log-level DEBUG shows the traceback
        log.debug("run failed", exc_info=True)
        raise CliError(f"stopped: {type(exc).__name__}: {exc}", 1) from None
    finally:
        if health is not None:
            health.close()
    log.info("stopped")


def _run_app(
    spec: str,
    app: KeyedApp,
    layers: Layered,
    print_settings: bool,
    health_port: int | None,
    metrics_port: int | None,
    http_addr: str,
    link: ChildLink | None = None,
) -> None:
    """``keyedconsumer run module:app``: run a :class:`~keyedconsumer.KeyedApp` as its routes say.

    The consumer settings of the flags, the environment and the TOML file (layered as for a
    handler) go **over the app's shared options and under each route's own**
    (``KeyedApp.apply_settings``): ``--brokers`` beats ``KeyedApp(brokers=...)`` (logged), a route's
    ``concurrency=16`` beats ``--concurrency 4``, which applies to the routes that set none; each
    setting a route replaces is logged as a warning. ``--group`` is the group of the routes that
    name none (over ``KeyedApp(group_id=...)``). Topics, the handler's middleware
    (``--dead-letter-topic``, ``--retry-attempts``, ``--park``) and the sequencer (``--redis``,
    ``--namespace``, ``--sequencer-*``) belong to the routes: given as flags or in the TOML file they
    are refused (exit 2); from the environment (which ``inspect`` and ``web`` share) they are
    ignored, and logged. ``--health-port`` serves the health of every route together
    (``Health(app)``), ``--metrics-port`` adds ``Metrics`` to every route (message counters and
    durations; the per-partition gauges need ``Metrics.bind`` of one consumer)."""
    routes_own = sorted((RUN_KEYS - {"handler", "group", "processes"}) | {"sequencer", "topics"})
    refused = [k for k in routes_own if k in layers.values and layers.origin.get(k) in ("flag", "file")]
    if refused:
        named = ", ".join(layers.where((k,)) for k in refused)
        raise CliError(
            f"{spec} is a KeyedApp: its routes carry their own {', '.join(refused)}; remove {named}", 2
        )
    ignored = [k for k in routes_own if k in layers.values]
    if ignored:
        log.info(
            "%s is a KeyedApp: %s from the environment do not apply to it",
            spec,
            ", ".join(layers.where((k,)) for k in ignored),
        )
    defaults = layers.consumer_values(without=("name", "topics"))
    _secrets.add_config(defaults.get("config") or {})
    try:
        replaced = app.apply_settings(defaults)
    except pydantic.ValidationError as exc:
        raise CliError(f"{layers.explain(exc)} ({exc.title})", 2) from None
    for route, option in replaced:
        if route is None:
            log.info("the %s replaces the app's own %s", layers.where((option.split(".")[0],)), option)
            continue
        log.warning(
            "route %s sets its own %s: the %s does not apply to it",
            route,
            option,
            layers.where((option.split(".")[0],)),
        )
    if print_settings:
        _print_json(
            {
                r.settings.name: {**r.settings.model_dump(), "config": redact(r.settings.config)}
                for r in app.routes
            }
        )
        return
    log.info(
        "running %s: %s",
        spec,
        ", ".join(f"{r.settings.name} <- {','.join(r.settings.topics)}" for r in app.routes),
    )
    if metrics_port is not None:
        try:
            app.use(
                importlib.import_module("keyedconsumer.middleware").Metrics(
                    http_port=metrics_port if link is None else None, http_addr=http_addr
                )
            )
        except ImportError:
            raise CliError(
                "--metrics-port needs prometheus-client: pip install 'keyedconsumer[metrics]'", 2
            ) from None
        if link is None:
            log.info("metrics on http://%s:%d/metrics (messages of every route)", http_addr, metrics_port)
    _run_serving_health(app.run, app, health_port, http_addr, link)
