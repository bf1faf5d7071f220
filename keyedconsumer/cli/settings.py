"""Settings: flags > environment > TOML file > defaults; ``-X`` librdkafka properties; the secret
values seen on the way, which nothing we print may show."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable
from enum import Enum
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qs, urlsplit

import pydantic
import typer
from pydantic_settings import BaseSettings, SettingsConfigDict

from ..config import ENV_PREFIX, SECRET_WORDS, ConsumerConfig
from .errors import CliError, _validation_message

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


class RunOptions(BaseSettings):
    """Settings of ``keyedconsumer run`` that are not :class:`~keyedconsumer.ConsumerConfig` fields.

    Their environment variables are listed in ``keyedconsumer.config.CLI_SETTINGS`` (so that
    ``ConsumerConfig`` does not refuse them as typos): a new field must be added there too.

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
    return _env_value(field) is not None


def _env_value(field: str) -> str | None:
    name = f"{ENV_PREFIX}{field}".upper()
    return next((v for k, v in os.environ.items() if k.upper() == name), None)


#: The settings that name the consumer group: ``group`` (``--group``) sets ``name`` and ``group_id``.
_GROUP_KEYS = ("group", "group_id", "name")


def _group(flags: dict[str, Any], toml: dict[str, Any]) -> tuple[Any, Any] | None:
    """``(name, group_id)`` from the first source that names the group at all: the ``--group`` flag,
    then the environment, then the TOML file; ``None`` when none does.

    The source is chosen as a whole, because ``--group`` (or ``group``) stands for two fields: taken
    field by field, ``KEYEDCONSUMER_GROUP_ID`` would beat ``--group`` (it sets ``name``), and a TOML
    ``group_id`` would beat ``KEYEDCONSUMER_GROUP``. Within one source ``group`` sets both fields,
    ``group_id`` beats it for the group id, and ``name`` alone lets the group id follow the name.
    """
    if flags.get("group") is not None:
        return flags["group"], flags["group"]
    env = {k: v for k in _GROUP_KEYS if (v := _env_value(k)) is not None}
    for source in (env, {k: toml[k] for k in _GROUP_KEYS if k in toml}):
        if source:
            group = source.get("group")
            name = group if group is not None else source.get("name", source.get("group_id"))
            return name, source.get("group_id", group)
    return None


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


_BROKERS_HELP = f"Bootstrap servers, comma-separated (env {ENV_PREFIX}BROKERS; default {DEFAULT_BROKERS})."
_X_HELP = "A librdkafka property, passed through (repeatable); secret values are never printed."
_CONFIG_HELP = "TOML settings file (top-level keys: setting names; [config]: librdkafka properties)."

BrokersOpt = Annotated[
    str | None,
    typer.Option("--brokers", "-b", metavar="HOST:PORT,...", help=_BROKERS_HELP, show_default=False),
]
PropsOpt = Annotated[list[str] | None, typer.Option("-X", "--property", metavar="KEY=VALUE", help=_X_HELP)]
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
    ),
]


def _resolve_run(
    flags: dict[str, Any], props: list[str], config_file: Path | None
) -> tuple[ConsumerConfig, RunOptions]:
    """The settings of ``run``: each from the first of flags > environment > TOML file > defaults
    that sets it (the group as a whole: :func:`_group`; librdkafka properties one by one)."""
    toml = _load_toml(config_file)
    options = RunOptions(**_layer(toml, flags, _RUN_KEYS))
    _secrets.add_url(options.redis)
    values = _layer(toml, flags, _CONSUMER_KEYS - {"config", "name", "group_id"})
    values["config"] = _librdkafka_config(toml, props)
    group = _group(flags, toml)
    if group is None:
        raise CliError(
            f"no consumer group: pass --group, set {ENV_PREFIX}GROUP, or 'group' in the TOML file", 2
        )
    values["name"], values["group_id"] = group
    if "topics" not in values and not _env_set("topics"):
        raise CliError(f"no topic: pass --topic, set {ENV_PREFIX}TOPICS, or 'topics' in the TOML file", 2)
    try:
        settings = ConsumerConfig(**values)
    except pydantic.ValidationError as exc:
        raise CliError(_validation_message(exc), 2) from None
    return settings, options
