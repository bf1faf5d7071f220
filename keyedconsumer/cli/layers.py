"""The settings of the command line, layered by pydantic-settings' own sources: flags > environment
> TOML file > defaults.

:class:`RunSettings` is a ``BaseSettings`` whose ``settings_customise_sources`` returns, highest
precedence first, the init-kwargs source (the flags typer parsed: only those given), the
environment (``KEYEDCONSUMER_<SETTING>``; the sequencer's options as
``KEYEDCONSUMER_SEQUENCER__<OPTION>``) and the TOML file of ``--config`` (pydantic-settings'
``TomlConfigSettingsSource``). pydantic-settings merges them: a setting comes from the first layer
that sets it, and the tables (``config``: librdkafka properties, ``sequencer``) merge key by key
(its ``deep_update``). The one rule of ours is inside each layer: ``group`` stands for the consumer's
``name`` and ``group_id`` (:func:`_name_the_group`), so that ``--group`` beats
``KEYEDCONSUMER_GROUP_ID`` as a whole.

Every :class:`~keyedconsumer.ConsumerConfig` field is a setting here, kept as the layer gave it and
validated by ``ConsumerConfig`` itself (one definition of each rule); the command's own settings
(:class:`RunOptions`) and the Redis sequencer's options are validated here. A bad value is reported
naming the field and the layer it came from (:meth:`Layered.explain`).
"""

from __future__ import annotations

import contextvars
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pydantic
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from ..config import ENV_PREFIX, ConsumerConfig, _refuse_unknown_environment_variables
from ..sequencing.config import RedisSequencerConfig
from .errors import CliError, _validation_message

__all__ = ["RunOptions", "RunSettings", "SequencerOptions", "Layered", "layered", "CONSUMER_KEYS", "RUN_KEYS"]


class RunOptions(pydantic.BaseModel):
    """Settings of ``keyedconsumer run`` that are not :class:`~keyedconsumer.ConsumerConfig` fields.

    Their environment variables are listed in ``keyedconsumer.config.CLI_SETTINGS`` (so that
    ``ConsumerConfig`` does not refuse them as typos): a new field must be added there too.

    Parameters
    ----------
    handler:
        ``package.module:function`` (or ``module:object.attribute``, or ``module:app`` for a
        :class:`~keyedconsumer.KeyedApp`).
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
    processes:
        Run this many processes of the handler, 1 to 256, forked by a supervisor that restarts
        them and serves one health and one metrics endpoint for all (docs/processes.md); ``None``
        (the default): consume in this process, without a supervisor. The bound guards against a
        typo forking hundreds of consumers.
    """

    model_config = pydantic.ConfigDict(extra="forbid", hide_input_in_errors=True)

    handler: str | None = None
    group: str | None = pydantic.Field(default=None, min_length=1)
    redis: str | None = pydantic.Field(default=None, min_length=1, repr=False)
    namespace: str | None = pydantic.Field(default=None, min_length=1)
    dead_letter_topic: str | None = pydantic.Field(default=None, min_length=1)
    retry_attempts: int | None = pydantic.Field(default=None, ge=1, le=1000)
    park: bool = False
    processes: int | None = pydantic.Field(default=None, ge=1, le=256)


#: The Redis sequencer's options besides its URL and namespace (``--redis``, ``--namespace``).
SEQUENCER_KEYS = tuple(f for f in RedisSequencerConfig.model_fields if f not in ("url", "namespace"))

#: The sequencer's options as the layers give them: their types, to read a string of the environment
#: (``"5"``, ``"true"``), no bounds (``RedisSequencerConfig`` checks those, naming the option).
SequencerOptions: type[pydantic.BaseModel] = pydantic.create_model(  # type: ignore[call-overload]
    "SequencerOptions",
    __config__=pydantic.ConfigDict(extra="forbid", hide_input_in_errors=True),
    **{f: (Optional[RedisSequencerConfig.model_fields[f].annotation], None) for f in SEQUENCER_KEYS},  # noqa: UP045
)

CONSUMER_KEYS = frozenset(ConsumerConfig.model_fields)
RUN_KEYS = frozenset(RunOptions.model_fields)

#: The TOML file of this resolution (``--config``): ``settings_customise_sources`` reads it.
_toml_file: contextvars.ContextVar[Path | None] = contextvars.ContextVar(
    "keyedconsumer_toml_file", default=None
)


def _name_the_group(values: dict[str, Any]) -> dict[str, Any]:
    """One layer's values with the group resolved inside the layer: ``group`` sets ``name`` and
    ``group_id``; ``group_id`` beats it for the group id; ``name`` alone gives the group id too.

    A layer that names the group at all names it whole, so a higher layer's ``--group`` beats a
    lower layer's ``group_id`` and ``name`` (taken field by field, ``KEYEDCONSUMER_GROUP_ID`` would
    beat ``--group``).
    """
    if not any(values.get(k) is not None for k in ("group", "name", "group_id")):
        return values
    out = dict(values)
    group, name, group_id = values.get("group"), values.get("name"), values.get("group_id")
    out["name"] = group if group is not None else (name if name is not None else group_id)
    out["group_id"] = group_id if group_id is not None else (group if group is not None else name)
    return out


class _GroupNamed(PydanticBaseSettingsSource):
    """A layer (another source) with :func:`_name_the_group` applied to what it gives."""

    def __init__(self, inner: PydanticBaseSettingsSource) -> None:
        super().__init__(inner.settings_cls)
        self.inner = inner

    def get_field_value(
        self, field: Any, field_name: str
    ) -> tuple[Any, str, bool]:  # pragma: no cover - unused
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        return _name_the_group(self.inner())

    def __repr__(self) -> str:
        return f"_GroupNamed({self.inner!r})"


def _toml_source(settings_cls: type[BaseSettings], path: Path | None) -> PydanticBaseSettingsSource:
    """pydantic-settings' TOML source of ``path`` (none: an empty layer), its failures as exit 2."""
    if path is None:
        return TomlConfigSettingsSource(settings_cls, toml_file=[])
    if not path.is_file() or not os.access(path, os.R_OK):
        raise CliError(f"cannot read {path}: no such readable file", 2)
    try:
        return TomlConfigSettingsSource(settings_cls, toml_file=path)
    except ValueError as exc:  # tomllib.TOMLDecodeError
        raise CliError(f"{path} is not valid TOML: {exc}", 2) from None


class _RunSettingsBase(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        hide_input_in_errors=True,  # a value may be a secret (sasl.password, a Redis URL's password)
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # highest precedence first: flags (init kwargs) > environment > TOML file (> the defaults)
        toml = _toml_source(settings_cls, _toml_file.get())
        return _GroupNamed(init_settings), _GroupNamed(env_settings), _GroupNamed(toml)


def _consumer_field(name: str) -> tuple[Any, Any]:
    # kept as the layer gives it (a string of the environment, a TOML value, a flag), validated by
    # ConsumerConfig; ``config`` is a table, so that the layers merge it property by property
    return (dict[str, Any] | None, None) if name == "config" else (Any, None)


#: Every setting of the command line: the command's own (:class:`RunOptions`), every
#: :class:`~keyedconsumer.ConsumerConfig` field, ``sequencer`` (the Redis sequencer's options), and
#: ``web_allowed_hosts`` (``keyedconsumer web``'s ``--allowed-host``: a list, or a comma-separated
#: string, kept as the layer gave it and checked by the web command).
RunSettings: type[BaseSettings] = pydantic.create_model(  # type: ignore[call-overload]
    "RunSettings",
    __base__=_RunSettingsBase,
    __doc__=__doc__,
    **{name: (f.annotation, f) for name, f in RunOptions.model_fields.items()},
    **{
        name: _consumer_field(name)
        for name in ConsumerConfig.model_fields
        if name not in RunOptions.model_fields
    },
    sequencer=(SequencerOptions | None, None),
    web_allowed_hosts=(Any, None),
)


_LAYERS = ("flag", "environment", "file")


def _flag(key: str) -> str:
    return {"topics": "--topic", "config": "-X", "brokers": "--brokers"}.get(
        key, "--" + key.replace("_", "-")
    )


@dataclass
class Layered:
    """The settings every layer gave, merged by pydantic-settings (flags > environment > file).

    ``values``: each setting some layer set (``RunSettings`` field names; ``sequencer`` a dict of
    the options given), nothing else. ``origin``: the layer each one came from, ``"flag"``,
    ``"environment"`` or ``"file"``.
    """

    values: dict[str, Any]
    origin: dict[str, str]
    toml_file: Path | None = None

    def where(self, loc: tuple[str, ...]) -> str:
        """Where the setting at ``loc`` (``("concurrency",)``, ``("sequencer", "lease_ttl_s")``) came
        from, for an error: ``flag --concurrency``, ``environment KEYEDCONSUMER_CONCURRENCY``, ``file
        kc.toml``; ``default`` when no layer set it."""
        key = ".".join(loc[:2]) if loc[:1] == ("sequencer",) and len(loc) > 1 else (loc[0] if loc else "")
        if key == "config":  # a table the layers merged: each layer that gave properties
            layers = sorted({v for k, v in self.origin.items() if k.startswith("config.")}, key=_LAYERS.index)
            return ", ".join(self._name(layer, key) for layer in layers) or "default"
        return self._name(self.origin.get(key) or self.origin.get(loc[0] if loc else "", "default"), key)

    def _name(self, layer: str, key: str) -> str:
        if key in ("name", "group_id") and self.origin.get("group") == layer:
            key = "group"  # the layer named the group as a whole
        if layer == "flag":
            return "flag " + _flag(key.replace(".", "_"))
        if layer == "environment":
            return f"environment {ENV_PREFIX}{key.replace('.', '__').upper()}"
        if layer == "file":
            return f"file {self.toml_file}"
        return "default"

    def explain(self, exc: pydantic.ValidationError, prefix: tuple[str, ...] = ()) -> CliError:
        """A one-line exit-2 error naming each bad field and the layer that gave it (never its value:
        every model here hides its inputs)."""
        parts = []
        for e in exc.errors():
            loc = (*prefix, *(str(x) for x in e["loc"]))
            msg = "unknown setting" if e["type"] == "extra_forbidden" else e["msg"]
            parts.append(f"{'.'.join(loc) or exc.title} (from {self.where(loc)}): {msg}")
        return CliError("invalid setting " + "; ".join(parts), 2)

    def consumer_values(self, *, without: tuple[str, ...] = ()) -> dict[str, Any]:
        """The :class:`~keyedconsumer.ConsumerConfig` fields some layer set."""
        return {k: v for k, v in self.values.items() if k in CONSUMER_KEYS and k not in without}

    def consumer_config(self) -> ConsumerConfig:
        """The consumer's validated settings.

        Raises
        ------
        CliError
            (exit code 2) A bad value, naming the field and its layer.
        """
        try:
            return ConsumerConfig.model_validate(self.consumer_values())
        except pydantic.ValidationError as exc:
            raise self.explain(exc) from None

    def check_consumer_values(self) -> None:
        """Validate the consumer settings the layers gave before anything uses them: a bad value
        exits 2 naming its layer even where a ``KeyedApp`` route's own option would have replaced
        it, and before the handler's module is imported (whose routes would read the same
        ``KEYEDCONSUMER_*`` variables and fail as an import). ``name`` and ``topics``, when no layer
        gave them, take placeholders (a ``KeyedApp``'s routes carry their own).

        Raises
        ------
        CliError
            (exit code 2) A bad value, naming the field and its layer.
        """
        try:
            ConsumerConfig.model_validate({"name": "_", "topics": ["_"], **self.consumer_values()})
        except pydantic.ValidationError as exc:
            raise self.explain(exc) from None

    def run_options(self) -> RunOptions:
        return RunOptions.model_validate({k: v for k, v in self.values.items() if k in RUN_KEYS})

    def sequencer_options(self) -> dict[str, Any]:
        """The Redis sequencer's options some layer set (``RedisSequencer(url, namespace, **these)``)."""
        return dict(self.values.get("sequencer") or {})


def _per_layer(flags: dict[str, Any], path: Path | None) -> list[tuple[str, dict[str, Any]]]:
    """What each layer gives on its own (for :attr:`Layered.origin`), through the same sources."""
    env = EnvSettingsSource(RunSettings)()
    token = _toml_file.set(path)
    try:
        toml = _toml_source(RunSettings, path)()
    finally:
        _toml_file.reset(token)
    return [
        ("flag", _name_the_group(flags)),
        ("environment", _name_the_group(env)),
        ("file", _name_the_group(toml)),
    ]


def layered(flags: dict[str, Any], config_file: Path | None) -> Layered:
    """The command line's settings: ``flags`` (typer's values; ``None`` = not given) over the
    environment over the TOML file ``config_file``, merged by pydantic-settings.

    Raises
    ------
    CliError
        (exit code 2) An unreadable or invalid TOML file; a setting no layer may hold (an unknown
        TOML key, a ``KEYEDCONSUMER_*`` typo); a bad value of the command's own settings or of the
        sequencer's options, naming the field and its layer.
    """
    try:
        _refuse_unknown_environment_variables("environment")
    except pydantic.ValidationError as exc:
        raise CliError(_validation_message(exc), 2) from None
    given = {k: v for k, v in flags.items() if v is not None and v != {}}
    origin: dict[str, str] = {}
    for layer, values in reversed(_per_layer(given, config_file)):
        origin.update(dict.fromkeys(values, layer))
        for table in ("sequencer", "config"):
            if isinstance(values.get(table), dict):
                origin.update(dict.fromkeys((f"{table}.{k}" for k in values[table]), layer))
    result = Layered({}, origin, config_file)
    token = _toml_file.set(config_file)
    try:
        settings = RunSettings(**given)
    except pydantic.ValidationError as exc:
        raise result.explain(exc) from None
    finally:
        _toml_file.reset(token)
    result.values = settings.model_dump(exclude_unset=True)
    return result
