"""The deliberate bugs of the negative controls, planted by the harness's consumer process.

They live here, in the tests, and reach the engine only through seams a test may use: the
consumer's ``client_factory`` (a wrapping :class:`~keyedconsumer.kafka.KafkaClient`) and a patch of
the lease table's validity check in the consumer process itself. Nothing in the installed package
can switch a guarantee off. A checker that cannot catch these proves nothing.

==================  ===============================================================================
name                bug
==================  ===============================================================================
``commit_on_poll``  store each message's offset as soon as it is polled, before its handler ran
``skip_fencing``    count a run's result even when its key's lease was lost or taken over meanwhile
``no_aof``          (not an engine bug) Redis without AOF, ``require_durable=False``
==================  ===============================================================================
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from keyedconsumer.errors import KafkaClientError
from keyedconsumer.kafka.client import connect
from keyedconsumer.message import Message

__all__ = ["CommitOnPoll", "commit_on_poll_factory", "plant_skip_fencing"]


class CommitOnPoll:
    """A :class:`~keyedconsumer.kafka.KafkaClient` that commits what was polled, not what finished:
    every record ``poll_batch`` returns has ``offset + 1`` stored at once, and every store or commit
    of the engine is raised to the position polled (without its metadata), so the committed offset
    is always past every polled message, finished or not."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._polled: dict[tuple[str, int], int] = {}  # (topic, partition) -> last polled offset + 1

    def poll_batch(self, max_messages: int, timeout_s: float) -> list[Message]:
        msgs: list[Message] = self._inner.poll_batch(max_messages, timeout_s)
        for m in msgs:
            tp = (m.topic, m.partition)
            self._polled[tp] = max(self._polled.get(tp, 0), m.offset + 1)
            try:
                self._inner.store(m.topic, m.partition, m.offset + 1)
            except KafkaClientError:  # not assigned any more: nothing to store
                pass
        return msgs

    def _raise(self, offsets: Any) -> list[tuple[str, int, int]]:
        return [(t, p, max(o, self._polled.get((t, p), 0))) for t, p, o in offsets]

    def store(self, topic: str, partition: int, offset: int, metadata: str = "") -> None:
        self._inner.store(topic, partition, max(offset, self._polled.get((topic, partition), 0)))

    def commit(self, offsets: Any, metadata: Any = None, timeout_s: float | None = None) -> None:
        self._inner.commit(self._raise(offsets), None, timeout_s)

    def commit_async(self, offsets: Any, metadata: Any = None) -> None:
        self._inner.commit_async(self._raise(offsets), None)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def commit_on_poll_factory(conf: dict[str, Any], on_error: Callable[[KafkaClientError], None]) -> Any:
    """``client_factory`` of a consumer with the ``commit_on_poll`` bug."""
    return CommitOnPoll(connect(conf, on_error))


def plant_skip_fencing() -> None:
    """Make every run count, even one made under a lease this instance lost or that another
    instance took over (patches the lease table in this process only)."""
    from keyedconsumer.sequencing.leases import LeaseTable

    LeaseTable.still_valid = lambda self, msg, lid: True  # type: ignore[method-assign]
