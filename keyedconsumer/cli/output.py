"""Output: logging and consoles that never show a secret, errors as one line, JSON."""

from __future__ import annotations

import functools
import json
import logging
import sys
from collections.abc import Callable
from enum import Enum
from typing import Any, TypeVar

import pydantic
import typer
from pythonjsonlogger.json import JsonFormatter
from rich.console import Console

from ..errors import KafkaClientError, PublishError
from .errors import CliError, _validation_message
from .settings import _secrets


class _ScrubFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if _secrets.values:
            text = record.getMessage()
            record.msg, record.args = _secrets.scrub(text), None
            if record.exc_info and record.exc_info[1] is not None:
                record.exc_text = _secrets.scrub(logging.Formatter().formatException(record.exc_info))
        return True


class _Format(str, Enum):
    TEXT = "text"
    JSON = "json"


#: The command's error line: logged as a JSON object (``--log-format json``), else printed.
_error_log: list[logging.Logger] = []


def _setup_logging(level: str, fmt: str = "text") -> None:
    """Log to stderr at ``level``: text lines, or (``fmt="json"``) one JSON object per line with
    ``asctime``, ``levelname``, ``name``, ``message`` and any ``extra`` fields (python-json-logger),
    e.g. the ``keyedconsumer`` dict of the Logging middleware; the command's error line too. Secrets
    are scrubbed in both. librdkafka's own lines come through Python logging too
    (:mod:`keyedconsumer.kafka.logs`)."""
    handler = logging.StreamHandler(sys.stderr)
    _error_log.clear()
    if fmt == "json":
        _error_log.append(logging.getLogger("keyedconsumer.cli"))
        handler.setFormatter(JsonFormatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    else:
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
        if _error_log:
            _error_log[0].error("error: %s", _secrets.scrub(message))
        else:
            _err_console().print(f"error: {_secrets.scrub(message)}", style="red", markup=False)
        raise typer.Exit(code)

    return wrapper  # type: ignore[return-value]


def _print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False) + "\n")
    sys.stdout.flush()
