"""Handlers that the CLI tests run with ``keyedconsumer run tests.integration.procs.cli_handlers:<name>``.

Each handled message appends one line ``<kind> <partition> <offset> <key> <value>`` to the file named
by the environment variable ``KC_CLI_LOG`` (unbuffered, O_APPEND, so lines of concurrent handlers
never interleave).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

from keyedconsumer import Message


def _log(kind: str, msg: Message) -> None:
    fd = os.open(os.environ["KC_CLI_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        key = (msg.key or b"-").decode()
        value = (msg.value or b"-").decode()
        os.write(fd, f"{kind} {msg.partition} {msg.offset} {key} {value}\n".encode())
    finally:
        os.close(fd)


def handle(msg: Message) -> None:
    """Sync: a short piece of work, then log."""
    time.sleep(0.001)
    _log("ok", msg)


async def handle_async(msg: Message) -> None:
    """Async: a short await, then log."""
    await asyncio.sleep(0.001)
    _log("ok", msg)


def poison(msg: Message) -> None:
    """Fail every value that starts with ``poison``; log the others (and each failed attempt)."""
    if (msg.value or b"").startswith(b"poison"):
        _log("fail", msg)
        raise ValueError(f"cannot handle {msg.value!r}")
    _log("ok", msg)


_running = 0
_running_lock = threading.Lock()


def handle_counting(msg: Message) -> None:
    """Sync, 20 ms of work; logs the value as ``<value>|<handlers running now>`` (this one included)."""
    global _running
    with _running_lock:
        _running += 1
        now = _running
    try:
        time.sleep(0.02)
        key = (msg.key or b"-").decode()
        fd = os.open(os.environ["KC_CLI_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(
                fd, f"ok {msg.partition} {msg.offset} {key} {(msg.value or b'-').decode()}|{now}\n".encode()
            )
        finally:
            os.close(fd)
    finally:
        with _running_lock:
            _running -= 1


NOT_CALLABLE = 42
