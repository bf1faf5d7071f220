"""The ``keyedconsumer`` command: run a handler, inspect a consumer group, replay dead letters.

::

    keyedconsumer run app.handlers:handle --topic orders --group orders-processor --concurrency 64
    keyedconsumer inspect --group orders-processor [--topic orders] [--redis URL] [--json]
    keyedconsumer dead-letter replay --from orders.dlq [--to orders] [--key K] [--since TIME] [--dry-run]

**Settings** come from, highest precedence first: command-line flags, environment variables
``KEYEDCONSUMER_<SETTING>`` (``KEYEDCONSUMER_CONCURRENCY=64``, ``KEYEDCONSUMER_BROKERS=a:9092,b:9092``,
``KEYEDCONSUMER_CONFIG='{"security.protocol": "SASL_SSL"}'``), the TOML file given with ``--config``
(or ``KEYEDCONSUMER_CONFIG_FILE``), then the defaults. librdkafka properties (``-X key=value``, the
``KEYEDCONSUMER_CONFIG`` JSON object, the TOML ``[config]`` table) are merged property by property
with the same precedence.

**Exit codes**: 0 done (``run``: stopped by SIGTERM/SIGINT), 1 a failure at run time (a message
failed and nothing handled it, the brokers did not answer, a replay left records behind), 2 bad
input (an option, a setting, the handler). Errors are one line on stderr, without a traceback;
secret values (``-X`` properties whose name holds ``password``, ``secret``, ``token`` ...; the
password of a ``--redis`` URL) never appear in the output.
"""

from __future__ import annotations

import datetime as dt
import functools
import importlib
import inspect as pyinspect
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, TypeVar
from urllib.parse import parse_qs, urlsplit

import pydantic
import typer
from pydantic_settings import BaseSettings, SettingsConfigDict
from rich.console import Console
from rich.table import Table

from . import kafka
from .config import SECRET_WORDS, ConsumerConfig, redact
from .errors import KafkaClientError, KeyedConsumerError, PublishError
from .sequencing import redact_url

__all__ = ["main", "app", "load_handler", "ReplayMarker", "parse_since", "RunOptions"]

log = logging.getLogger("keyedconsumer.cli")

ENV_PREFIX = "KEYEDCONSUMER_"
DEFAULT_BROKERS = "127.0.0.1:9092"

app = typer.Typer(
    name="keyedconsumer",
    help="Run a keyed Kafka consumer, inspect a consumer group, replay dead-lettered records.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
dead_letter_app = typer.Typer(help="Dead-letter topics.", no_args_is_help=True)
app.add_typer(dead_letter_app, name="dead-letter")


# -- errors and output ------------------------------------------------------------------------------


class CliError(Exception):
    """A failure to report as one line on stderr, exiting with ``exit_code`` (1 run time, 2 input)."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class _Secrets:
    """Secret values seen in the settings; :meth:`scrub` replaces them in any text we print."""

    def __init__(self) -> None:
        self.values: set[str] = set()

    def add_config(self, config: dict[str, Any]) -> None:
        for k, v in config.items():
            if any(w in k.lower() for w in SECRET_WORDS) and str(v):
                self.values.add(str(v))

    def add_url(self, url: str | None) -> None:
        if url:
            try:
                parts = urlsplit(url)
                query = parse_qs(parts.query)
                passwords = [parts.password] + [
                    v for k, vs in query.items() if any(w in k.lower() for w in ("pass", "pwd", "secret", "token")) for v in vs
                ]
            except ValueError:
                return
            self.values.update(p for p in passwords if p)

    def scrub(self, text: str) -> str:
        for value in sorted(self.values, key=len, reverse=True):
            text = text.replace(value, "***")
        return text


_secrets = _Secrets()


class _ScrubFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if _secrets.values:
            text = record.getMessage()
            record.msg, record.args = _secrets.scrub(text), None
            if record.exc_info and record.exc_info[1] is not None:
                record.exc_text = _secrets.scrub(logging.Formatter().formatException(record.exc_info))
        return True


def _setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(_ScrubFilter())
    logging.basicConfig(level=level, handlers=[handler])  # no-op where logging is set up already (tests)
    # librdkafka's own log lines of the inspect / replay clients: only when debugging
    logging.getLogger("keyedconsumer.kafka.tools").setLevel(
        logging.DEBUG if level == "DEBUG" else logging.CRITICAL + 1
    )


def _err_console() -> Console:
    return Console(file=sys.stderr, highlight=False, soft_wrap=True)


def _out_console() -> Console:
    return Console(file=sys.stdout, highlight=False)


F = TypeVar("F", bound=Callable[..., Any])


def _reports_errors(fn: F) -> F:
    """Turn CliError, validation and client errors into one line on stderr and an exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except CliError as exc:
            message, code = str(exc), exc.exit_code
        except pydantic.ValidationError as exc:
            message, code = _validation_message(exc), 2
        except (KafkaClientError, PublishError) as exc:
            message, code = str(exc), 1
        except KeyboardInterrupt:
            message, code = "interrupted", 130
        _err_console().print(f"error: {_secrets.scrub(message)}", style="red", markup=False)
        raise typer.Exit(code)

    return wrapper  # type: ignore[return-value]


def _validation_message(exc: pydantic.ValidationError) -> str:
    # errors name fields only: every settings model hides its inputs (they may hold secrets)
    parts = []
    for e in exc.errors():
        where = ".".join(str(x) for x in e["loc"]) or exc.title
        parts.append(f"{where}: {e['msg']}")
    return "invalid setting " + "; ".join(parts)


def _print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False) + "\n")
    sys.stdout.flush()


def _show_key(key: bytes | None) -> str | None:
    return None if key is None else key.decode("utf-8", "backslashreplace")


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


# -- settings: flags > environment > TOML file > defaults -----------------------------------------------


class RunOptions(BaseSettings):
    """Settings of ``keyedconsumer run`` that are not :class:`~keyedconsumer.ConsumerConfig` fields.

    Parameters
    ----------
    handler:
        ``package.module:function`` (or ``module:object.attribute``).
    group:
        Consumer group id (also the consumer's ``name`` and the Redis namespace's default).
    redis:
        ``redis://`` URL: use the Redis sequencer (per-key leases across instances).
    namespace:
        Redis namespace (default: the group).
    dead_letter_topic:
        Dead-letter topic (``{topic}`` is replaced by the message's topic): wrap the handler in
        ``DeadLetter`` (outermost) and ``Retry``.
    retry_attempts:
        Attempts in all per message, >= 1 (with a dead-letter topic the default is 3; without one,
        ``Retry`` is used only when this is set).
    park:
        ``Retry(park=True)``: a retrying key waits parked in Redis, so its partition's offset moves
        on (needs ``redis``).
    """

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", hide_input_in_errors=True)

    handler: str | None = None
    group: str | None = pydantic.Field(default=None, min_length=1)
    redis: str | None = pydantic.Field(default=None, min_length=1, repr=False)
    namespace: str | None = pydantic.Field(default=None, min_length=1)
    dead_letter_topic: str | None = pydantic.Field(default=None, min_length=1)
    retry_attempts: int | None = pydantic.Field(default=None, ge=1, le=1000)
    park: bool = False


_RUN_KEYS = set(RunOptions.model_fields)
_CONSUMER_KEYS = set(ConsumerConfig.model_fields)


def _load_toml(path: Path | None) -> dict[str, Any]:
    """The settings of a TOML file (top-level keys: setting names; ``[config]``: librdkafka)."""
    if path is None:
        return {}
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise CliError("reading a TOML file needs Python 3.11+ or the 'tomli' package", 2) from None
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror}", 2) from None
    except tomllib.TOMLDecodeError as exc:
        raise CliError(f"{path} is not valid TOML: {exc}", 2) from None
    unknown = sorted(set(data) - _RUN_KEYS - _CONSUMER_KEYS)
    if unknown:
        known = ", ".join(sorted(_RUN_KEYS | _CONSUMER_KEYS))
        raise CliError(f"{path}: unknown setting(s) {', '.join(unknown)} (known: {known})", 2)
    if not isinstance(data.get("config", {}), dict):
        raise CliError(f"{path}: 'config' must be a table of librdkafka properties", 2)
    return data


def _env_set(field: str) -> bool:
    name = f"{ENV_PREFIX}{field}".upper()
    return any(k.upper() == name for k in os.environ)


def _parse_properties(props: Iterable[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for prop in props:
        key, sep, value = prop.partition("=")
        if not sep or not key.strip():
            raise CliError(f"-X expects KEY=VALUE (a librdkafka property), got {key.strip() or prop!r}", 2)
        out[key.strip()] = value
    return out


def _librdkafka_config(toml: dict[str, Any], props: Iterable[str]) -> dict[str, Any]:
    """TOML ``[config]`` < ``KEYEDCONSUMER_CONFIG`` (JSON object) < ``-X``, property by property."""
    merged: dict[str, Any] = dict(toml.get("config", {}))
    env = next((v for k, v in os.environ.items() if k.upper() == f"{ENV_PREFIX}CONFIG"), None)
    if env:
        try:
            from_env = json.loads(env)
        except json.JSONDecodeError:
            from_env = None
        if not isinstance(from_env, dict):
            raise CliError(f"{ENV_PREFIX}CONFIG must be a JSON object of librdkafka properties", 2)
        merged.update(from_env)
    merged.update(_parse_properties(props))
    _secrets.add_config(merged)
    return merged


def _layer(toml: dict[str, Any], flags: dict[str, Any], keys: set[str]) -> dict[str, Any]:
    """Values for ``keys``: a flag given wins; else a TOML value unless the environment sets it (the
    settings model reads the environment itself for what is not passed)."""
    out = {k: v for k, v in toml.items() if k in keys and not _env_set(k)}
    out.update({k: v for k, v in flags.items() if k in keys and v is not None})
    return out


def _brokers(flag: str | None, toml: dict[str, Any]) -> str:
    if flag:
        return flag
    env = next((v for k, v in os.environ.items() if k.upper() == f"{ENV_PREFIX}BROKERS"), None)
    value: Any = env or toml.get("brokers") or DEFAULT_BROKERS
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    text = str(value).strip()
    if text.startswith("["):
        try:
            return ",".join(str(b) for b in json.loads(text))
        except (json.JSONDecodeError, TypeError):
            raise CliError(
                f"{ENV_PREFIX}BROKERS is neither a JSON list nor comma-separated host:port", 2
            ) from None
    return text


def _client_conf(
    brokers: str | None, props: list[str], config_file: Path | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """librdkafka properties of the inspect / replay clients, and the TOML settings."""
    toml = _load_toml(config_file)
    config = _librdkafka_config(toml, props)
    conf = dict(config)
    conf["bootstrap.servers"] = _brokers(brokers, toml)
    return conf, toml


def _env_or_toml(field: str, toml: dict[str, Any]) -> Any:
    env = next((v for k, v in os.environ.items() if k.upper() == f"{ENV_PREFIX}{field}".upper()), None)
    return env if env is not None else toml.get(field)


# -- the handler ----------------------------------------------------------------------------------------


def load_handler(spec: str, app_dir: str | None = ".") -> Callable[..., Any]:
    """Import the handler named by ``spec``, ``package.module:function`` (``module:obj.attr`` also).

    Parameters
    ----------
    spec:
        Module path, a colon, and the attribute path of a callable (function, ``async def`` function,
        or an object with ``__call__``).
    app_dir:
        Directory put first on ``sys.path`` before importing (default: the working directory).

    Returns
    -------
    The callable.

    Raises
    ------
    CliError
        (exit code 2) A malformed spec, a module that cannot be found or fails while importing, a
        missing attribute, a class, or something not callable.
    """
    module_name, sep, attr = spec.partition(":")
    dotted_ok = all(p.isidentifier() for p in module_name.split(".")) and all(
        p.isidentifier() for p in attr.split(".")
    )
    if not sep or not dotted_ok:
        raise CliError(f"invalid handler {spec!r}: expected 'package.module:function'", 2)
    if app_dir is not None:
        path = os.path.abspath(app_dir)
        if path not in sys.path:
            sys.path.insert(0, path)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise CliError(
                f"cannot import handler module {module_name!r}: no module named {exc.name!r}", 2
            ) from None
        log.debug("importing %s failed", module_name, exc_info=True)
        raise CliError(
            f"importing handler module {module_name!r} failed: {type(exc).__name__}: {exc}", 2
        ) from None
    except (Exception, SystemExit) as exc:
        log.debug("importing %s failed", module_name, exc_info=True)
        raise CliError(
            f"importing handler module {module_name!r} failed: {type(exc).__name__}: {exc}", 2
        ) from None
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise CliError(f"module {module_name!r} has no attribute {attr!r}", 2) from None
    if pyinspect.isclass(obj):
        raise CliError(f"handler {spec!r} is a class: give a function or an instance with __call__", 2)
    if not callable(obj):
        raise CliError(f"handler {spec!r} is not callable (it is a {type(obj).__name__})", 2)
    return obj  # type: ignore[no-any-return]


# -- run ------------------------------------------------------------------------------------------------


class _Ordering(str, Enum):
    KEY = "key"
    PARTITION = "partition"
    NONE = "none"


class _Reset(str, Enum):
    EARLIEST = "earliest"
    LATEST = "latest"


class _Level(str, Enum):
    DEBUG = "DEBUG"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"


_BROKERS_HELP = f"Bootstrap servers, comma-separated (env {ENV_PREFIX}BROKERS; default {DEFAULT_BROKERS})."
_X_HELP = "A librdkafka property, passed through (repeatable); secret values are never printed."
_CONFIG_HELP = "TOML settings file (top-level keys: setting names; [config]: librdkafka properties)."

BrokersOpt = Annotated[
    str | None,
    typer.Option("--brokers", "-b", metavar="HOST:PORT,...", help=_BROKERS_HELP, show_default=False),
]
PropsOpt = Annotated[list[str] | None, typer.Option("-X", "--property", metavar="KEY=VALUE", help=_X_HELP)]
ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config",
        metavar="FILE",
        envvar=f"{ENV_PREFIX}CONFIG_FILE",
        help=_CONFIG_HELP,
        dir_okay=False,
        show_default=False,
    ),
]


def _resolve_run(
    flags: dict[str, Any], props: list[str], config_file: Path | None
) -> tuple[ConsumerConfig, RunOptions]:
    toml = _load_toml(config_file)
    options = RunOptions(**_layer(toml, flags, _RUN_KEYS))
    _secrets.add_url(options.redis)
    values = _layer(toml, flags, _CONSUMER_KEYS - {"config"})
    values["config"] = _librdkafka_config(toml, props)
    if options.group is not None:
        values["name"] = options.group
    elif "name" not in values and not _env_set("name"):
        raise CliError(
            f"no consumer group: pass --group, set {ENV_PREFIX}GROUP, or 'group' in the TOML file", 2
        )
    if "topics" not in values and not _env_set("topics"):
        raise CliError(f"no topic: pass --topic, set {ENV_PREFIX}TOPICS, or 'topics' in the TOML file", 2)
    try:
        settings = ConsumerConfig(**values)
    except pydantic.ValidationError as exc:
        raise CliError(_validation_message(exc), 2) from None
    return settings, options


def _effective(settings: ConsumerConfig, options: RunOptions) -> dict[str, Any]:
    data = settings.model_dump()
    data["config"] = redact(settings.config)
    data.update(
        handler=options.handler,
        redis=redact_url(options.redis) if options.redis else None,
        namespace=(options.namespace or settings.group) if options.redis else None,
        dead_letter_topic=options.dead_letter_topic,
        retry_attempts=options.retry_attempts,
        park=options.park,
    )
    return data


def _middlewares(settings: ConsumerConfig, options: RunOptions) -> list[Any]:
    if options.dead_letter_topic is None and options.retry_attempts is None and not options.park:
        return []
    middleware: Any = importlib.import_module("keyedconsumer.middleware")  # installed from ./middleware

    out: list[Any] = []
    if options.dead_letter_topic is not None:
        try:
            out.append(
                middleware.DeadLetter(
                    brokers=settings.brokers,
                    topic=options.dead_letter_topic,
                    producer_config=dict(settings.config),
                )
            )
        except (PublishError, ValueError) as exc:
            raise CliError(f"dead-letter publisher: {exc}", 2) from None
    out.append(middleware.Retry(max_attempts=options.retry_attempts or 3, park=options.park))
    return out


@app.command()
@_reports_errors
def run(
    handler: Annotated[
        str | None,
        typer.Argument(
            metavar="MODULE:FUNCTION",
            help="The handler, package.module:function (sync or async def); or 'handler' in TOML / env.",
            show_default=False,
        ),
    ] = None,
    topic: Annotated[
        list[str] | None,
        typer.Option(
            "--topic", "-t", metavar="TOPIC", help="Topic to consume (repeatable, or comma-separated)."
        ),
    ] = None,
    group: Annotated[
        str | None,
        typer.Option("--group", "-g", metavar="GROUP", help="Consumer group id.", show_default=False),
    ] = None,
    concurrency: Annotated[
        int | None, typer.Option("--concurrency", "-c", metavar="N", help="Handlers at once (default 1).")
    ] = None,
    ordering: Annotated[_Ordering | None, typer.Option(help="key | partition | none (default key).")] = None,
    brokers: BrokersOpt = None,
    redis: Annotated[
        str | None,
        typer.Option(
            metavar="URL",
            help="redis:// URL: per-key leases across instances (Redis sequencer).",
            show_default=False,
        ),
    ] = None,
    namespace: Annotated[
        str | None,
        typer.Option(metavar="NS", help="Redis namespace (default: the group).", show_default=False),
    ] = None,
    dead_letter_topic: Annotated[
        str | None,
        typer.Option(
            metavar="TOPIC",
            help="Dead-letter topic ({topic} = the message's topic): DeadLetter, then Retry.",
            show_default=False,
        ),
    ] = None,
    retry_attempts: Annotated[
        int | None,
        typer.Option(
            metavar="N", help="Attempts per message before it fails (default 3 with a dead-letter topic)."
        ),
    ] = None,
    park: Annotated[
        bool | None,
        typer.Option("--park/--no-park", help="Retrying keys wait parked in Redis (needs --redis)."),
    ] = None,
    manual_commit: Annotated[
        bool | None,
        typer.Option("--manual-commit/--auto-commit", help="Commit synchronously at each offset advance."),
    ] = None,
    max_in_flight: Annotated[
        int | None, typer.Option(metavar="N", help="Buffered + running messages before fetching pauses.")
    ] = None,
    auto_offset_reset: Annotated[
        _Reset | None, typer.Option(help="Where a group without committed offsets starts.")
    ] = None,
    shutdown_timeout_s: Annotated[
        float | None, typer.Option(metavar="SECONDS", help="Seconds a stop waits for running handlers.")
    ] = None,
    props: PropsOpt = None,
    config_file: ConfigOpt = None,
    app_dir: Annotated[
        str, typer.Option(metavar="DIR", help="Directory put first on the Python path to import the handler.")
    ] = ".",
    log_level: Annotated[_Level, typer.Option(help="Log level (stderr).")] = _Level.INFO,
    print_settings: Annotated[
        bool,
        typer.Option(
            "--print-settings", help="Print the effective settings as JSON (secrets hidden) and exit."
        ),
    ] = False,
) -> None:
    """Consume topics with a handler until SIGTERM or SIGINT, which drain gracefully.

    On SIGTERM/SIGINT nothing new starts, running handlers finish (up to the shutdown timeout), the
    finished offsets are committed and the process exits 0. A message that fails with nothing to
    handle it (no dead-letter topic) stops the consumer the same way and exits 1.
    """
    _setup_logging(log_level.value)
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
    }
    settings, options = _resolve_run(flags, props or [], config_file)
    if not options.handler:
        raise CliError(
            f"no handler: give package.module:function, {ENV_PREFIX}HANDLER, or 'handler' in the TOML file", 2
        )
    if options.park and not options.redis:
        raise CliError("--park needs --redis (parked keys wait in Redis)", 2)
    fn = load_handler(options.handler, app_dir)
    if print_settings:
        _print_json(_effective(settings, options))
        return
    from .consumer import KeyedConsumer
    from .sequencing import RedisSequencer

    sequencer = None
    if options.redis:
        if urlsplit(options.redis).scheme not in ("redis", "rediss", "unix"):
            raise CliError(
                f"--redis {redact_url(options.redis)!r}: expected a redis://, rediss:// or unix:// URL", 2
            )
        sequencer = RedisSequencer(url=options.redis, namespace=options.namespace or settings.group)
    try:
        consumer = KeyedConsumer(
            handler=fn, middlewares=_middlewares(settings, options), settings=settings, sequencer=sequencer
        )
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
    try:
        consumer.run()
    except KeyedConsumerError as exc:
        raise CliError(f"stopped: {exc}", 1) from None
    except Exception as exc:  # e.g. Redis refused as not durable; --log-level DEBUG shows the traceback
        log.debug("run failed", exc_info=True)
        raise CliError(f"stopped: {type(exc).__name__}: {exc}", 1) from None
    log.info("stopped")


# -- inspect --------------------------------------------------------------------------------------------


def _inspect_redis(url: str, namespace: str) -> dict[str, Any]:
    """Leases, parked keys, scheduled messages and live instances of a namespace."""
    from .sequencing import inspect_redis

    try:
        result = inspect_redis(url, namespace)
    except ImportError:
        raise CliError("--redis needs the redis package: pip install 'keyedconsumer[redis]'", 2) from None
    except ValueError as exc:
        raise CliError(f"--namespace: {exc}", 2) from None
    except Exception as exc:  # StoreUnavailable and friends
        raise CliError(f"Redis {redact_url(url)} did not answer: {exc}", 1) from None
    return result


def _group_rows(
    conf: dict[str, Any], group: str, topics: list[str], timeout_s: float
) -> tuple[kafka.GroupDescription, list[dict[str, Any]]]:
    desc = kafka.describe_group(conf, group, timeout_s)
    if topics:
        counts = kafka.topic_partitions(conf, topics, timeout_s)
        tps = [(t, p) for t in topics for p in range(counts[t])]
        committed = kafka.committed_offsets(conf, group, tps, timeout_s)
    else:
        committed = kafka.committed_offsets(conf, group, None, timeout_s)
        tps = sorted(set(committed) | set(desc.assigned))
    marks = kafka.watermark_offsets(conf, tps, timeout_s)
    rows: list[dict[str, Any]] = []
    for tp in tps:
        c = committed.get(tp)
        offset = c.offset if c is not None else None
        start, end = marks[tp]
        lag = max(0, end - offset) if offset is not None else None
        rows.append(
            {
                "topic": tp[0],
                "partition": tp[1],
                "committed_offset": offset,
                "start_offset": start,
                "end_offset": end,
                "lag": lag,
                "oldest_unfinished_age_s": None,
            }
        )
    behind = {(r["topic"], r["partition"]): r["committed_offset"] for r in rows if r["lag"]}
    stamps = kafka.record_timestamps(conf, behind, min(timeout_s, 5.0))
    now_ms = time.time() * 1000
    for r in rows:
        ts = stamps.get((r["topic"], r["partition"]))
        if ts is not None:
            r["oldest_unfinished_age_s"] = round(max(0.0, now_ms - ts) / 1000, 3)
    return desc, rows


def _redis_tables(info: dict[str, Any], console: Console, now_s: float, limit: int = 50) -> None:
    leases = Table(title=f"leased keys ({len(info.get('leases', []))})")
    for col in ("key", "owner", "ttl ms", "fencing token"):
        leases.add_column(col, justify="right" if col in ("ttl ms", "fencing token") else "left")
    for le in info.get("leases", [])[:limit]:
        leases.add_row(str(le["key"]), str(le["owner"]), str(le["ttl_ms"]), str(le["fencing_token"]))
    parked = Table(title=f"parked keys ({len(info.get('parked', []))})")
    for col in ("key", "depth", "next due"):
        parked.add_column(col, justify="right" if col != "key" else "left")
    for pk in info.get("parked", [])[:limit]:
        due = pk.get("next_due_s")
        when = (
            "-"
            if due is None
            else (f"in {_age(due - now_s)}" if due >= now_s else f"{_age(now_s - due)} overdue")
        )
        parked.add_row(str(pk["key"]), str(pk["depth"]), when)
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


@app.command("inspect")
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
    timeout_s: Annotated[
        float, typer.Option("--timeout", metavar="SECONDS", help="Seconds to wait for each broker answer.")
    ] = 10.0,
    log_level: Annotated[_Level, typer.Option(help="Log level (stderr).")] = _Level.WARNING,
) -> None:
    """Show a consumer group's committed offset, end offset and lag per partition.

    The oldest unfinished message's age cannot be seen from outside the consuming process; what is
    shown is the age of the record at the committed offset (now minus its timestamp) where lag > 0:
    that record is the oldest one the group has not finished. A partition without a committed offset
    shows no lag ("-": where the group starts depends on its auto.offset.reset). With --redis it also
    shows the leased keys, parked keys and their depth, scheduled messages and live instances.
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
    desc, rows = _group_rows(conf, group, topics, timeout_s)
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
        _redis_tables(info, console, time.time())


# -- dead-letter replay ---------------------------------------------------------------------------------

#: Marker format tag in the committed offset's metadata.
MARKER_TAG = "kcr1:"
#: Bound of the marker metadata in characters (Kafka's ``offset.metadata.max.bytes`` defaults to 4096).
MAX_MARKER_CHARS = 3000


class ReplayMarker:
    """Which records of one dead-letter partition were replayed.

    Every offset below ``end`` is replayed except the ``pending`` ones (records examined but left for a
    later replay: not matching ``--key``/``--since``, or without a target). Stored in Kafka as the
    marker group's committed offset (the first pending offset, or ``end``) plus metadata
    ``kcr1:<end - offset>/<pending ranges>``; each range is ``<gap>`` or ``<gap>+<length - 1>``, the
    gap counted from the end of the range before (from the committed offset for the first).

    Parameters
    ----------
    end:
        First offset not examined yet.
    pending:
        Sorted, disjoint inclusive ``[first, last]`` offset ranges, all below ``end``.
    """

    def __init__(self, end: int, pending: list[list[int]] | None = None) -> None:
        self.end = end
        self.pending = pending or []

    @classmethod
    def decode(cls, offset: int | None, metadata: str) -> ReplayMarker:
        """The marker of a committed offset (``None``: nothing replayed) and its metadata. Metadata
        that is not a marker (``""``, another tool's) means: everything below ``offset`` replayed."""
        if offset is None:
            return cls(0)
        if not metadata.startswith(MARKER_TAG):
            return cls(offset)
        try:
            span, _, ranges = metadata[len(MARKER_TAG) :].partition("/")
            pending: list[list[int]] = []
            prev = offset
            for part in filter(None, ranges.split(";")):
                gap, _, extra = part.partition("+")
                first = prev + int(gap)
                last = first + int(extra or 0)
                if int(gap) < 0 or last < first:
                    raise ValueError(part)
                pending.append([first, last])
                prev = last + 1
            end = offset + int(span)
            if pending and (pending[0][0] != offset or pending[-1][1] >= end):
                raise ValueError(metadata)
            return cls(end, pending)
        except ValueError:
            log.warning(
                "unreadable replay marker %r at offset %d: treating every offset below it as replayed",
                metadata,
                offset,
            )
            return cls(offset)

    @property
    def committed_offset(self) -> int:
        """The offset to commit: the first pending offset, or ``end``."""
        return self.pending[0][0] if self.pending else self.end

    def encode(self) -> str:
        """The metadata to commit with :attr:`committed_offset` (``""`` when nothing is pending)."""
        if not self.pending:
            return ""
        parts, prev = [], self.committed_offset
        for first, last in self.pending:
            gap = first - prev
            parts.append(str(gap) if first == last else f"{gap}+{last - first}")
            prev = last + 1
        return f"{MARKER_TAG}{self.end - self.committed_offset}/{';'.join(parts)}"

    def _find(self, offset: int) -> int:
        lo, hi = 0, len(self.pending)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.pending[mid][1] < offset:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def is_replayed(self, offset: int) -> bool:
        """True if the record at ``offset`` was replayed already."""
        if offset >= self.end:
            return False
        i = self._find(offset)
        return not (i < len(self.pending) and self.pending[i][0] <= offset)

    def mark(self, offset: int, replayed: bool) -> bool:
        """Record that the (not yet replayed) record at ``offset`` was replayed now, or left pending.

        Offsets are marked in increasing order above ``end``; a record between ``end`` and
        ``offset`` does not exist (the records are read in order), so such gaps join the range
        before when it is pending. Returns ``False``, changing nothing, when the marker would grow
        beyond :data:`MAX_MARKER_CHARS`.
        """
        before = ([list(r) for r in self.pending], self.end)
        grew = False
        if offset >= self.end:
            if not replayed:
                if self.pending and self.pending[-1][1] == self.end - 1:
                    self.pending[-1][1] = offset
                else:
                    self.pending.append([offset, offset])
                    grew = True
            self.end = offset + 1
        elif replayed:
            i = self._find(offset)
            first, last = self.pending[i]
            if first == last:
                del self.pending[i]
            elif offset == first:
                self.pending[i][0] = offset + 1
            elif offset == last:
                self.pending[i][1] = offset - 1
            else:
                self.pending[i : i + 1] = [[first, offset - 1], [offset + 1, last]]
                grew = True
        if grew and len(self.encode()) > MAX_MARKER_CHARS:
            self.pending, self.end = before
            return False
        return True


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
    try:
        when = dt.datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith(("Z", "z")) else text)
    except ValueError:
        raise CliError(
            f"--since {text!r}: expected an ISO 8601 time (2026-11-30T12:00:00Z) or epoch milliseconds", 2
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return int(when.timestamp() * 1000)


def _header(record: kafka.Record, name: str) -> str | None:
    for k, v in reversed(record.headers):
        if k == name and v is not None:
            return v.decode("utf-8", "replace")
    return None


def _int_header(record: kafka.Record, name: str) -> int | None:
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
        self.partition_counts: dict[str, int | None] = {}
        self.rows: list[dict[str, Any]] = []
        self.counts = {"sent": 0, "already_replayed": 0, "not_matching": 0, "no_target": 0}
        self.full: set[int] = set()

    def target(self, record: kafka.Record) -> tuple[str | None, int | None, str | None]:
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
                self.partition_counts[topic] = kafka.topic_partitions(self.conf, [topic], self.timeout_s)[
                    topic
                ]
            except KafkaClientError as exc:
                if exc.code != "UNKNOWN_TOPIC_OR_PART":
                    raise
                self.partition_counts[topic] = None
        return self.partition_counts[topic]

    def matches(self, record: kafka.Record) -> bool:
        if self.keys and record.key not in self.keys:
            return False
        if self.since_ms is not None:
            when = _int_header(record, self.h_failed_at)
            when = when if when is not None else record.timestamp_ms
            if when is None or when < self.since_ms:
                return False
        return True

    def row(self, record: kafka.Record, topic: str, partition: int | None) -> dict[str, Any]:
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

    def headers(self, record: kafka.Record) -> list[tuple[str, bytes | None]]:
        return [(k, v) for k, v in record.headers if not k.startswith(self.prefix)]


@dead_letter_app.command("replay")
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
    timeout_s: Annotated[
        float, typer.Option("--timeout", metavar="SECONDS", help="Seconds to wait for each broker answer.")
    ] = 30.0,
    log_level: Annotated[_Level, typer.Option(help="Log level (stderr).")] = _Level.WARNING,
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
    group = marker_group or f"keyedconsumer-replay.{from_topic}"
    job = _Replay(conf, from_topic, to, {k.encode() for k in key or []}, since_ms, timeout_s)
    if to is not None and job.partitions_of(to) is None:
        raise CliError(f"target topic {to!r} does not exist", 2)
    reader = kafka.TopicReader(conf, from_topic, group, timeout_s)
    publisher = None
    error: str | None = None
    try:
        if not dry_run:  # first: it fences off an older replay, and aborts what a crashed one left open
            publisher = kafka.TransactionalPublisher(conf, group, timeout_s)
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
    _replay_report(job, group, dry_run, as_json, error)
    if error is not None:
        raise CliError(error, 1)
    if job.full or job.counts["no_target"]:
        raise CliError("some records were left behind (see above)", 1)


def _replay_records(
    job: _Replay,
    reader: kafka.TopicReader,
    publisher: kafka.TransactionalPublisher | None,
    markers: dict[int, ReplayMarker],
    start: dict[int, int],
    batch_size: int,
) -> None:
    batch: list[tuple[kafka.Record, dict[str, Any]]] = []
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


# -- entry point ----------------------------------------------------------------------------------------


def main() -> None:
    """The ``keyedconsumer`` console script (``python -m keyedconsumer`` too)."""
    app(prog_name="keyedconsumer")
