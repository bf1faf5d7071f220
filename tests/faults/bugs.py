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
    """A :class:`~keyedconsumer.kafka.KafkaClient` that stores ``offset + 1`` of every record it
    returns from ``poll_batch``, before the engine has run it (librdkafka then commits it)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def poll_batch(self, max_messages: int, timeout_s: float) -> list[Message]:
        msgs: list[Message] = self._inner.poll_batch(max_messages, timeout_s)
        for m in msgs:
            try:
                self._inner.store(m.topic, m.partition, m.offset + 1)
            except KafkaClientError:  # not assigned any more: nothing to store
                pass
        return msgs

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
