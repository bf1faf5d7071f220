"""How the command shows its help and its usage errors.

- **Panels.** The options of a command are grouped by typer's ``rich_help_panel`` (:data:`PANELS`
  names those of ``run``, in their order). They are shown as plain sections by :class:`Command`:
  typer's rich rendering lays the options out as a table that, at 80 columns, cut help texts off
  with an ellipsis (measured on ``run --help``); click's plain layout wraps them whole.
- **A command of a nested group named at the top.** ``keyedconsumer replay`` answers "No such
  command 'replay'. Did you mean 'dead-letter replay'?": :class:`Group` extends typer's own
  suggestion (``difflib.get_close_matches`` over the group's commands) to the commands of its
  nested groups.
"""

from __future__ import annotations

import difflib
from typing import Any

from typer.core import TyperCommand, TyperGroup

__all__ = [
    "Command",
    "Group",
    "PANELS",
    "HANDLER",
    "KAFKA",
    "FAILURES",
    "PROCESSING",
    "EOS",
    "REDIS",
    "OUTPUT",
]

HANDLER = "Handler and topics"
KAFKA = "Kafka"
FAILURES = "Retry and dead letters"
PROCESSING = "Processing"
EOS = "Exactly-once results"
REDIS = "Redis sequencer"
OUTPUT = "Logs, health, metrics"
#: The panels of ``run --help``, in the order they are shown (then any other, then ``Options``).
PANELS = (HANDLER, KAFKA, FAILURES, PROCESSING, EOS, REDIS, OUTPUT)


class Command(TyperCommand):
    """A typer command whose options are shown in sections, one per ``rich_help_panel``."""

    def format_options(self, ctx: Any, formatter: Any) -> None:
        sections: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if param.param_type_name == "argument":
                name = "Arguments"
            else:
                name = getattr(param, "rich_help_panel", None) or "Options"
            sections.setdefault(name, []).append(record)
        order = ["Arguments", *PANELS]
        for name in sorted(
            sections, key=lambda n: (order.index(n) if n in order else len(order), n == "Options")
        ):
            with formatter.section(name):
                formatter.write_dl(sections[name])


class Group(TyperGroup):
    """A typer group whose "No such command" suggests a command of a nested group (see the module
    docstring)."""

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        try:
            return super().resolve_command(ctx, args)
        except Exception as exc:  # typer's click UsageError ("No such command ...")
            message = getattr(exc, "message", None)
            if isinstance(message, str) and args and "Did you mean" not in message:
                nested = {
                    sub: f"{name} {sub}"
                    for name, cmd in self.commands.items()
                    if isinstance(cmd, TyperGroup)
                    for sub in cmd.commands
                }
                close = difflib.get_close_matches(args[0], list(nested), n=1)
                if close:
                    exc.message = f"{message.rstrip('.')}. Did you mean {nested[close[0]]!r}?"  # type: ignore[attr-defined]
            raise
