"""A commit in the revoke callback that the group refuses because the rebalance moved on meanwhile
(``STALE_MEMBER_EPOCH`` under KIP-848: getsentry/arroyo PR #419, librdkafka PR #4672) is made again
within the revoke budget, so the next owner does not run again what the revoked member finished.

The broker is real (``group.protocol=consumer``); the refusal is planted by a wrapping client, the
one seam that makes the broker's answer certain: the first commit made inside ``on_revoke`` is
refused with ``STALE_MEMBER_EPOCH``, as the coordinator answers a member whose epoch it has moved.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from typing import Any

import pytest

from keyedconsumer import CommitError, KeyedConsumer, Message
from keyedconsumer.kafka.client import connect

from .kafkautil import committed, produce, wait_until

pytestmark = pytest.mark.kafka


class StaleOnce:
    """A real client whose first commit inside ``on_revoke`` is refused with STALE_MEMBER_EPOCH."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.in_revoke = False
        self.refused = 0

    def subscribe(self, topics: Any, listener: Any) -> None:
        outer = self

        class Listener:
            def on_assign(self, partitions: Any) -> None:
                listener.on_assign(partitions)

            def on_lost(self, partitions: Any) -> None:
                listener.on_lost(partitions)

            def on_revoke(self, partitions: Any) -> None:
                outer.in_revoke = True
                try:
                    listener.on_revoke(partitions)
                finally:
                    outer.in_revoke = False

        self._inner.subscribe(topics, Listener())

    def commit(self, offsets: Any, metadata: Any = None, *args: Any, **kwargs: Any) -> None:
        if self.in_revoke and not self.refused:
            self.refused += 1
            raise CommitError("commit failed: STALE_MEMBER_EPOCH: The member epoch is stale", code="STALE_MEMBER_EPOCH")
        self._inner.commit(offsets, metadata, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@pytest.mark.timeout(120)
def test_a_revoke_commit_refused_with_a_stale_member_epoch_is_made_again(kafka_bootstrap, new_topic, start) -> None:  # type: ignore[no-untyped-def]
    # given a member of a KIP-848 group with manual commits (no commit of librdkafka's own at the
    # unassign) whose two partitions each start with a 3 s message, the rest finished meanwhile
    topic = new_topic(2)
    produce(kafka_bootstrap, topic, [(b"slow0", b"slow", 0), (b"slow1", b"slow", 1)]
            + [(f"k{i % 40}".encode(), b"x", i % 2) for i in range(400)])
    group = f"g-{uuid.uuid4().hex[:8]}"
    runs: Counter[tuple[int, int]] = Counter()
    lock = threading.Lock()

    def handle(msg: Message) -> None:
        if msg.value == b"slow":
            time.sleep(3.0)
        with lock:
            runs[(msg.partition, msg.offset)] += 1

    clients: list[StaleOnce] = []

    def factory(conf: Any, on_error: Any) -> Any:
        clients.append(StaleOnce(connect(conf, on_error)))
        return clients[-1]

    options: dict[str, Any] = {"name": group, "handler": handle, "brokers": [kafka_bootstrap], "topics": [topic],
                               "concurrency": 4, "manual_commit": True, "config": {"group.protocol": "consumer"}}
    a = KeyedConsumer(client_factory=factory, **options)
    ra = start(a)
    assert wait_until(lambda: sum(runs.values()) >= 400, 60), len(runs)
    # when a second member joins while the slow messages run: the first member's revoke waits for
    # its slow message, and its commit is refused once with STALE_MEMBER_EPOCH
    rb = start(KeyedConsumer(**options))
    assert wait_until(lambda: sum(runs.values()) >= 402 and len(a.assignment) == 1, 60), (len(runs), a.assignment)
    time.sleep(2.0)  # the new owner has read its committed offset and fetched
    assert rb.stop(30) and ra.stop(30)
    assert ra.error is None and rb.error is None
    # then it was made again and accepted: the new owner ran nothing the first had finished
    assert clients[0].refused == 1
    assert len(runs) == 402 and max(runs.values()) == 1, sorted(k for k, n in runs.items() if n > 1)[:20]
    assert committed(kafka_bootstrap, group, topic, 2) == {0: 201, 1: 201}
