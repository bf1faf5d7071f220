"""The command's failures: one line on stderr and an exit code."""

from __future__ import annotations

import pydantic


class CliError(Exception):
    """A failure to report as one line on stderr, exiting with ``exit_code`` (1 run time, 2 input)."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _validation_message(exc: pydantic.ValidationError) -> str:
    # errors name fields only: every settings model hides its inputs (they may hold secrets)
    parts = []
    for e in exc.errors():
        where = ".".join(str(x) for x in e["loc"]) or exc.title
        parts.append(f"{where}: {e['msg']}")
    return "invalid setting " + "; ".join(parts)
