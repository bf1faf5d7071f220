"""Handlers that tests/integration/test_processes.py runs with ``keyedconsumer run --processes N``.

Each handled message appends one line ``<pid> <partition> <offset> <key> <value>`` to the file named by
the environment variable ``KC_CLI_LOG`` (O_APPEND, one write: lines of concurrent handlers and of
the children never interleave), so a test sees which child handled what, in which order.
``KC_SLEEP_MS`` (default 2) is each handler's work.
"""

from __future__ import annotations

import os
import time

from keyedconsumer import Message

from .cli_handlers import _log as log_line

_SLEEP_S = float(os.environ.get("KC_SLEEP_MS", "2")) / 1000.0


def _log(msg: Message) -> None:
    log_line(str(os.getpid()), msg)  # "<pid> <partition> <offset> <key> <value>"


def handle(msg: Message) -> None:
    """A short piece of work, then log."""
    time.sleep(_SLEEP_S)
    _log(msg)


def poison(msg: Message) -> None:
    """Log, then fail every value that starts with ``poison`` (no dead-letter topic: the child stops
    and exits 1)."""
    _log(msg)
    if (msg.value or b"").startswith(b"poison"):
        raise ValueError(f"cannot handle {msg.value!r}")
