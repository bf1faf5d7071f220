"""A route of a :class:`~keyedconsumer.KeyedApp` and how its settings are layered.

A route's settings come from, highest precedence first, its own options (``@app.handler(...,
concurrency=16)``), the settings put over the app (:meth:`KeyedApp.apply_settings`: the command
line's flags, environment and TOML file), the app's own options (``KeyedApp(brokers=...)``), and
the defaults; ``config`` (librdkafka properties) merges property by property (:func:`layered`). A
bad value is a ``pydantic.ValidationError`` titled with the route (:func:`route_settings`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

from .config import ConsumerConfig
from .engine.handler import ErrorHandler, Handler, Middleware
from .sequencing.base import Sequencer

__all__ = ["Route", "layered", "differing", "route_settings"]


@dataclass(frozen=True)
class Route:
    """One handler of a :class:`~keyedconsumer.KeyedApp`: what ``@app.handler(...)`` registered.

    ``settings`` is validated when the route is registered; ``sequencer`` is a factory, called once
    per run (a :class:`~keyedconsumer.RedisSequencer` belongs to one consumer). ``options`` are the
    :class:`~keyedconsumer.ConsumerConfig` fields the app and the route gave (the route's winning),
    ``topics`` and ``name`` included: what :meth:`~keyedconsumer.KeyedApp.apply_defaults` keeps; ``own`` those the
    route gave itself (with ``topics`` and ``name``), which :meth:`~keyedconsumer.KeyedApp.apply_settings` keeps.
    """

    handler: Handler
    settings: ConsumerConfig
    middlewares: Sequence[Middleware] = ()
    error_handler: ErrorHandler | None = None
    sequencer: Callable[[], Sequencer] | None = None
    consumer_options: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    #: ``handler`` is a batch handler (:meth:`~keyedconsumer.KeyedApp.batch_handler`): it takes a list of messages.
    batch: bool = False
    own: dict[str, Any] = field(default_factory=dict)
    #: The topics the handler produces to (``msg.produce``), each with its payload model or
    #: ``None``: declared with ``produces=`` for the AsyncAPI document, not checked at run time.
    produces: Mapping[str, Any] = field(default_factory=dict)


def layered(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """The options of ``layers``, a later one winning; ``config`` (librdkafka properties) merged
    property by property."""
    out: dict[str, Any] = {}
    config: dict[str, Any] = {}
    for layer in layers:
        out.update(layer)
        if isinstance(layer.get("config"), Mapping):
            config.update(layer["config"])
    if config:
        out["config"] = config
    return out


def differing(values: Mapping[str, Any], beaten_by: Mapping[str, Any]) -> list[str]:
    """The options of ``values`` that ``beaten_by`` gives another value; librdkafka properties
    one by one, as ``config.<property>``."""
    out = [k for k, v in values.items() if k != "config" and k in beaten_by and beaten_by[k] != v]
    mine, theirs = values.get("config") or {}, beaten_by.get("config") or {}
    return out + [f"config.{k}" for k, v in mine.items() if k in theirs and theirs[k] != v]


def route_settings(route: str, data: dict[str, Any], *, environment: bool = False) -> ConsumerConfig:
    """``data`` validated as the settings of ``route`` (``environment``: with the ``KEYEDCONSUMER_*``
    variables under it, as ``ConsumerConfig(**data)``); a ``pydantic.ValidationError`` is raised
    again titled with the route, its errors (naming the fields) unchanged."""
    try:
        return ConsumerConfig(**data) if environment else ConsumerConfig.model_validate(data)
    except ValidationError as exc:
        errors: list[InitErrorDetails] = [
            {"type": PydanticCustomError(e["type"], e["msg"]), "loc": e["loc"], "input": None}
            for e in exc.errors()
        ]
        raise ValidationError.from_exception_data(
            f"route {route!r} (ConsumerConfig)", errors, hide_input=True
        ) from None
