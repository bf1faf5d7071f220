"""Settings of the commands: the typer options they share, ``-X`` librdkafka properties, the
settings of ``run`` validated (layered by :mod:`.layers`: flags > environment > TOML file >
defaults), and the secret values seen on the way, which nothing we print may show."""

from __future__ import annotations

import json
from collections.abc import Iterable
from enum import Enum
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qs, urlsplit

import pydantic
import typer

from ..config import ENV_PREFIX, SECRET_WORDS, ConsumerConfig
from ..sequencing.config import RedisSequencerConfig
from .errors import CliError
from .help import KAFKA
from .layers import Layered, RunOptions, layered

DEFAULT_BROKERS = "127.0.0.1:9092"


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
                    v
                    for k, vs in query.items()
                    if any(w in k.lower() for w in ("pass", "pwd", "secret", "token"))
                    for v in vs
                ]
            except ValueError:
                return
            self.values.update(p for p in passwords if p)

    def scrub(self, text: str) -> str:
        for value in sorted(self.values, key=len, reverse=True):
            text = text.replace(value, "***")
        return text


_secrets = _Secrets()


def _parse_properties(props: Iterable[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for prop in props:
        key, sep, value = prop.partition("=")
        if not sep or not key.strip():
            raise CliError(f"-X expects KEY=VALUE (a librdkafka property), got {key.strip() or prop!r}", 2)
        out[key.strip()] = value
    return out


def _brokers(value: Any) -> str:
    """``bootstrap.servers`` from what a layer gave: a TOML list, ``a:9092,b:9092`` or a JSON list."""
    if value is None:
        return DEFAULT_BROKERS
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
) -> tuple[dict[str, Any], Layered]:
    """librdkafka properties of the inspect / replay / audit / web clients (flags > environment >
    TOML file, :func:`~keyedconsumer.cli.layers.layered`), and the layered settings."""
    settings = layered({"brokers": brokers, "config": _parse_properties(props)}, config_file)
    conf: dict[str, Any] = dict(settings.values.get("config") or {})
    _secrets.add_config(conf)
    conf["bootstrap.servers"] = _brokers(settings.values.get("brokers"))
    return conf, settings


def _env_or_toml(field: str, settings: Layered) -> Any:
    """A setting the environment or the TOML file gave (``group``: the group id they name)."""
    return settings.values.get("group_id" if field == "group" else field)


_BROKERS_HELP = f"Bootstrap servers, comma-separated (env {ENV_PREFIX}BROKERS; default {DEFAULT_BROKERS})."
_X_HELP = "A librdkafka property, passed through (repeatable); secret values are never printed."
_CONFIG_HELP = (
    "TOML settings file (top-level keys: setting names; [config]: librdkafka properties; [sequencer]: "
    "Redis sequencer options). Flags beat the environment, which beats the file."
)

BrokersOpt = Annotated[
    str | None,
    typer.Option(
        "--brokers",
        "-b",
        metavar="HOST:PORT,...",
        help=_BROKERS_HELP,
        show_default=False,
        rich_help_panel=KAFKA,
    ),
]
PropsOpt = Annotated[
    list[str] | None,
    typer.Option("-X", "--property", metavar="KEY=VALUE", help=_X_HELP, rich_help_panel=KAFKA),
]


class _Level(str, Enum):
    DEBUG = "DEBUG"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"


TimeoutOpt = Annotated[
    float, typer.Option("--timeout", metavar="SECONDS", help="Seconds to wait for each broker answer.")
]
ToolLogLevelOpt = Annotated[_Level, typer.Option(help="Log level (stderr).")]
ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config",
        metavar="FILE",
        envvar=f"{ENV_PREFIX}CONFIG_FILE",
        help=_CONFIG_HELP,
        dir_okay=False,
        show_default=False,
        rich_help_panel=KAFKA,
    ),
]


def _resolve_run(settings: Layered) -> tuple[ConsumerConfig, RunOptions, dict[str, Any]]:
    """The consumer's settings, the command's own, and the sequencer's options, validated.

    Raises
    ------
    CliError
        (exit code 2) No group, no topic, sequencer options without ``redis``, or a bad value
        (naming the field and its layer).
    """
    options = settings.run_options()
    _secrets.add_config(settings.values.get("config") or {})
    _secrets.add_url(options.redis)
    if settings.values.get("name") is None:
        raise CliError(
            f"no consumer group: pass --group, set {ENV_PREFIX}GROUP, or 'group' in the TOML file", 2
        )
    if settings.values.get("topics") is None:
        raise CliError(f"no topic: pass --topic, set {ENV_PREFIX}TOPICS, or 'topics' in the TOML file", 2)
    config = settings.consumer_config()
    sequencer = settings.sequencer_options()
    if sequencer and not options.redis:
        named = ", ".join(settings.where(("sequencer", k)) for k in sequencer)
        raise CliError(f"Redis sequencer options need --redis ({named})", 2)
    if options.redis:
        try:
            RedisSequencerConfig.model_validate(
                {"url": options.redis, "namespace": options.namespace or config.group, **sequencer}
            )
        except pydantic.ValidationError as exc:
            raise settings.explain(exc, ("sequencer",)) from None
    return config, options, sequencer
