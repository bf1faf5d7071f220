"""A flag for every setting: ``keyedconsumer run`` gets one typer option per
:class:`~keyedconsumer.ConsumerConfig` field and per Redis sequencer option that it does not spell
out itself, made from the models (their types and the ``Parameters`` of their docstrings), so a new
field is a new flag without a line here.

``--batch-size N``, ``--conflate/--no-conflate``, ``--event-loop [auto|asyncio|uvloop]``; the Redis
sequencer's options as ``--sequencer-<option>`` (``--sequencer-lease-ttl-s 5``). Typer parses and
type-checks them; their bounds are the models' (a bad value names the field and ``flag``).
"""

from __future__ import annotations

import functools
import inspect
import re
import types
import typing
from collections.abc import Callable
from enum import Enum
from typing import Annotated, Any

import typer

from ..config import ConsumerConfig
from ..sequencing import RedisSequencer
from ..sequencing.config import RedisSequencerConfig
from .help import EOS, HANDLER, KAFKA, PROCESSING, REDIS
from .layers import SEQUENCER_KEYS

__all__ = ["with_every_setting", "generated_flags"]

#: The parameter of the wrapped command that receives the generated flags given:
#: ``{field: value}``, the sequencer's under ``"sequencer"``.
MORE = "more_settings"


#: The end of a sentence: a full stop, then a capital letter, a backquote or a quote (not "e.g. x",
#: "1.5", "i.e. y"). A semicolon does not end one.
_SENTENCE_END = re.compile(r"(?<=\.)\s+(?=[A-Z`'\"(])")


def _descriptions(cls: type) -> dict[str, str]:
    """``{name: first sentence}`` of the ``Parameters`` section of ``cls``'s docstring, whole."""
    text = inspect.getdoc(cls) or ""
    section = text.split("Parameters\n----------\n", 1)[-1].split("\n\n\n", 1)[0]
    out: dict[str, str] = {}
    for names, body in re.findall(r"^([a-z_][\w, ]*):\n((?:    .*\n?)+)", section, re.M):
        sentence = _SENTENCE_END.split(" ".join(body.split()), maxsplit=1)[0]
        sentence = re.sub(r":\w+:`~?([^`]+)`", lambda m: m.group(1).split(".")[-1], sentence).replace(
            "``", ""
        )
        for name in names.split(","):
            out.setdefault(name.strip(), sentence)
    return out


#: The help panel of each generated flag of a ConsumerConfig field (:mod:`.help`); another field's is
#: ``PROCESSING``, a sequencer option's ``REDIS``.
_PANEL = {
    "name": HANDLER,
    "group_id": HANDLER,
    "require_topics": HANDLER,
    "startup_timeout_s": KAFKA,
    "batch_size": KAFKA,
    "poll_timeout_s": KAFKA,
    "commit_metadata_max_bytes": KAFKA,
    "transactional": EOS,
    "transactional_id": EOS,
    "transaction_interval_s": EOS,
    "transaction_timeout_s": EOS,
    "produce_timeout_s": EOS,
}


def _option(name: str, flag: str, annotation: Any, help_text: str, panel: str) -> tuple[Any, Any]:
    """``(annotation, default)`` of the typer parameter of one setting (``None``: not given)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    base = args[0] if origin in (typing.Union, types.UnionType) and len(args) == 1 else annotation
    help_text = help_text or f"See docs/configuration.md ({name})."
    if base is bool:
        return Annotated[
            bool | None,
            typer.Option(
                f"{flag}/--no-{flag[2:]}", help=help_text, show_default=False, rich_help_panel=panel
            ),
        ], None
    if typing.get_origin(base) is typing.Literal:
        choices = Enum(name, {str(v): str(v) for v in typing.get_args(base)}, type=str)  # type: ignore[misc]
        return Annotated[
            choices | None, typer.Option(flag, help=help_text, show_default=False, rich_help_panel=panel)
        ], None
    if base in (int, float):
        metavar = (
            "SECONDS"
            if name.endswith("_s")
            else "BYTES"
            if name.endswith("_bytes")
            else "N"
            if base is int
            else "X"
        )
        return Annotated[
            base | None,
            typer.Option(flag, metavar=metavar, help=help_text, show_default=False, rich_help_panel=panel),
        ], None
    return Annotated[
        str | None,
        typer.Option(flag, metavar="TEXT", help=help_text, show_default=False, rich_help_panel=panel),
    ], None


def generated_flags(spelled_out: set[str]) -> dict[str, tuple[str, tuple[str, ...], Any, Any]]:
    """``{parameter: (flag, settings path, annotation, default)}`` for every ConsumerConfig field
    not in ``spelled_out`` and every sequencer option."""
    out: dict[str, tuple[str, tuple[str, ...], Any, Any]] = {}
    consumer_help = _descriptions(ConsumerConfig)
    for name, f in ConsumerConfig.model_fields.items():
        if name not in spelled_out:
            flag = "--" + name.replace("_", "-")
            text = consumer_help.get(name, "")
            out[name] = (
                flag,
                (name,),
                *_option(name, flag, f.annotation, text, _PANEL.get(name, PROCESSING)),
            )
    sequencer_help = {**_descriptions(RedisSequencer), **_descriptions(RedisSequencerConfig)}
    for name in SEQUENCER_KEYS:
        flag = "--sequencer-" + name.replace("_", "-")
        text = sequencer_help.get(name) or f"RedisSequencer({name}=...): see docs/configuration.md."
        annotation = RedisSequencerConfig.model_fields[name].annotation
        out["sequencer_" + name] = (flag, ("sequencer", name), *_option(name, flag, annotation, text, REDIS))
    return out


def with_every_setting(spelled_out: set[str]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a typer command that takes ``more_settings`` (a dict): the command gets a flag for
    every setting not in ``spelled_out`` (:func:`generated_flags`), and ``more_settings`` holds
    those given, as settings (``{"batch_size": 100, "sequencer": {"lease_ttl_s": 5.0}}``)."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        flags = generated_flags(spelled_out)
        own = [p for p in inspect.signature(fn, eval_str=True).parameters.values() if p.name != MORE]
        extra = [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
            for name, (_flag, _path, annotation, default) in flags.items()
        ]

        @functools.wraps(fn)
        def command(**kwargs: Any) -> Any:
            more: dict[str, Any] = {}
            for name, (_flag, path, _annotation, _default) in flags.items():
                value = kwargs.pop(name, None)
                if isinstance(value, Enum):
                    value = value.value
                if value is not None:
                    if len(path) == 1:
                        more[path[0]] = value
                    else:
                        more.setdefault(path[0], {})[path[1]] = value
            return fn(**kwargs, **{MORE: more})

        del command.__wrapped__  # typer reads the signature below, not fn's
        command.__signature__ = inspect.Signature(own + extra)  # type: ignore[attr-defined]
        command.__annotations__ = {}
        return command

    return decorate
