"""A dead-letter record's failure headers (the ``DeadLetter`` middleware's, Spring's ``kafka_dlt-*``
names), read from a :class:`~keyedconsumer.kafka.admin.Record`.

Every header is attacker-controlled: anyone who may write to a dead-letter topic may write any
header. A header given more than once counts by its last value (as Kafka's ``Headers.lastHeader``);
text is decoded as UTF-8 with each invalid byte replaced, numbers that do not parse are ``None``.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections import Counter
from typing import Any

from ..kafka import admin

__all__ = ["H", "Failure", "header", "int_header", "replay_headers"]

#: The ``DeadLetter`` middleware's module: its header names (``H.H_TOPIC``, ``H.PREFIX``, ...).
H: Any = importlib.import_module("keyedconsumer.middleware.dead_letter")


def header(record: admin.Record, name: str) -> str | None:
    """The last value of header ``name`` as text (invalid UTF-8 replaced), ``None`` if absent or null."""
    for k, v in reversed(record.headers):
        if k == name and v is not None:
            return v.decode("utf-8", "replace")
    return None


def int_header(record: admin.Record, name: str) -> int | None:
    """The last value of header ``name`` as an int, ``None`` if absent or not an integer."""
    value = header(record, name)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def replay_headers(record: admin.Record) -> list[tuple[str, bytes | None]]:
    """The record's headers a replay sends: all but the failure headers (``kafka_dlt-*``), in order."""
    return [(k, v) for k, v in record.headers if not k.startswith(H.PREFIX)]


@dataclasses.dataclass(frozen=True)
class Failure:
    """What a dead-letter record's headers say of its failure (each ``None`` where absent or unreadable).

    ``failed_at_ms`` is ``kafka_dlt-failed-at``, else the record's timestamp (ms since the epoch);
    ``repeated``: the failure headers given more than once (the last value counts).
    """

    original_topic: str | None
    original_partition: int | None
    original_offset: int | None
    failed_at_ms: int | None
    exception: str | None
    cause: str | None
    error: str | None
    attempts: int | None
    stacktrace: str | None
    repeated: tuple[str, ...] = ()

    @classmethod
    def of(cls, record: admin.Record) -> Failure:
        counts = Counter(k for k, _ in record.headers if k.startswith(H.PREFIX))
        failed_at = int_header(record, H.H_FAILED_AT)
        return cls(
            original_topic=header(record, H.H_TOPIC),
            original_partition=int_header(record, H.H_PARTITION),
            original_offset=int_header(record, H.H_OFFSET),
            failed_at_ms=failed_at if failed_at is not None else record.timestamp_ms,
            exception=header(record, H.H_FQCN),
            cause=header(record, H.H_CAUSE_FQCN),
            error=header(record, H.H_MESSAGE),
            attempts=int_header(record, H.H_ATTEMPTS),
            stacktrace=header(record, H.H_STACKTRACE),
            repeated=tuple(sorted(k for k, n in counts.items() if n > 1)),
        )
