"""Times and bytes as the command line and the dashboard show and read them: a time given as ISO 8601
or epoch milliseconds, an age, a UTC time, a key.

Library code below both faces (:mod:`keyedconsumer.cli`, :mod:`keyedconsumer.web`), which each turn
a :class:`ValueError` of :func:`parse_time` into their own kind of error.
"""

from __future__ import annotations

import datetime as dt

import pydantic

__all__ = ["TIME_FORMS", "parse_time", "age", "utc_text", "show_key"]

#: What :func:`parse_time` accepts, for error messages.
TIME_FORMS = "an ISO 8601 time (2026-11-30T12:00:00Z) or epoch milliseconds"

_DATETIME = pydantic.TypeAdapter(dt.datetime)


def parse_time(text: str) -> int:
    """A time given as epoch milliseconds (digits only) or an ISO 8601 time (pydantic's parser: ``Z``,
    offsets, dates, fractions of a second; a time without an offset is UTC).

    Returns
    -------
    Milliseconds since the epoch.

    Raises
    ------
    ValueError
        Neither form (the message says which forms are accepted).
    """
    text = text.strip()
    if text.isdigit():
        return int(text)
    try:
        when = _DATETIME.validate_python(text)
    except pydantic.ValidationError:
        raise ValueError(f"{text!r}: expected {TIME_FORMS}") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return int(when.timestamp() * 1000)


def age(seconds: float | None) -> str:
    """A duration in seconds as ``12.5 s``, ``3.0 min``, ``2.5 h`` or ``1.5 d`` (``-`` for ``None``)."""
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def utc_text(epoch_ms: int | None) -> str:
    """Milliseconds since the epoch as ``2026-11-30 12:00:00Z`` (``-`` for ``None``; a time outside
    years 1-9999, as a header an attacker wrote may hold, as ``<n> ms``)."""
    if epoch_ms is None:
        return "-"
    try:
        return dt.datetime.fromtimestamp(epoch_ms / 1000, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")
    except (OverflowError, OSError, ValueError):
        return f"{epoch_ms} ms"


def show_key(key: bytes | None) -> str | None:
    """A record key as one line of text: UTF-8, with each byte that is not valid UTF-8 as ``\\xNN``."""
    return None if key is None else key.decode("utf-8", "backslashreplace")
