"""An in-memory Kafka for unit tests: partitions, offsets, commits, rebalances and a fake clock.

A handler with its middleware runs through the real engine, in milliseconds, with no Kafka::

    from keyedconsumer.testing import InMemoryBroker

    broker = InMemoryBroker()
    broker.create_topic("payments", partitions=3)
    for i in range(3):
        broker.produce("payments", f"{i}", key=f"acct-{i}")
    consumer = broker.consumer(name="billing", handler=handle, topics=["payments"])
    with broker.run(consumer) as run:
        run.until_idle(timeout_s=5)          # every record of "payments" committed by "billing"
    assert broker.lag("billing", "payments") == {("payments", 0): 0, ("payments", 1): 0, ("payments", 2): 0}

What is modelled, the way librdkafka and the Kafka group coordinator behave:

- **Topics and partitions**, offsets from 0 with no gaps. Keyed records go to ``crc32(key) % n``
  (librdkafka's default ``consistent_random`` partitioner); null keys go round-robin.
- **Store vs commit.** ``store()`` keeps an offset in the client; with ``enable.auto.commit`` the
  stored offsets are committed on each auto-commit tick of the *fake* clock
  (``auto.commit.interval.ms``, 5 s by default), after each revoke and on ``close()``; ``commit()``
  commits at once. Storing for a partition not assigned fails (``_STATE``), as in librdkafka.
  Deliberately stricter than a real broker: a commit for a partition the member does not own is
  refused (``CommitError``, code ``ILLEGAL_GENERATION``), so an engine that commits for a revoked
  partition is caught.
- **Consumer groups and incremental rebalances.** A member that subscribes or closes moves only the
  partitions needed for balance (cooperative-sticky). A partition is assigned to its new owner only
  after the old owner's ``on_revoke`` returned (and its offsets were committed). Callbacks run inside
  ``poll_batch``, in the poll thread, as librdkafka runs them. :meth:`InMemoryBroker.rebalance`
  revokes every partition of a group and deals them out again (each to another member when there
  are several); with ``lost=True`` they are lost instead (``on_lost``, stored offsets dropped).
- **A fake clock.** ``poll_batch(n, timeout_s)`` with nothing to deliver waits a fraction of a
  millisecond of real time (so worker threads run) and then advances :class:`FakeClock` by
  ``timeout_s`` instead of sleeping. Pass the clock to the consumer (``clock=broker.clock``;
  :meth:`InMemoryBroker.consumer` does) and ``RetryLater`` back-off of minutes takes milliseconds.
  Fake time passes only while a consumer polls idle; a handler's own run time is not fake time.

- **Produced records.** What handlers give to ``msg.produce`` lands in the broker's topics (read
  them with :meth:`InMemoryBroker.records`) before the message counts done. With
  ``transactional=True`` a :class:`FakeTransactionalProducer` applies each transaction whole (the
  offsets committed and the records appended) or not at all; a transaction for partitions the
  member no longer owns is aborted, and a newer producer of the same ``transactional_id`` fences
  off the older one.

- **Hermetic.** The broker's ``client_factory`` is a :class:`~keyedconsumer.kafka.Connector`: the
  consumers built with it get their clients from it, and their middleware their producers
  (``DeadLetter()``, ``DeadLetter(brokers=...)``, ``Audit()``), so dead letters, the audit trail and
  what handlers produce all land in the broker's topics. While a run (:meth:`InMemoryBroker.run`,
  :meth:`InMemoryBroker.run_app`) or a test with the ``kc_broker`` fixture is on, a real Kafka or
  Redis client that anything tries to start is refused: the run or the test fails with
  :class:`NetworkRefusedError`, naming what tried to connect (:mod:`keyedconsumer.hermetic`).

Not modelled: replication, transactions left open by a crash and ``read_uncommitted`` readers,
compaction, retention, record size limits, quotas, and a
member being slower than ``max.poll.interval.ms``.

Layout: :mod:`~keyedconsumer.testing.broker` (the broker, its records, the member protocol),
:mod:`~keyedconsumer.testing.group` (the group coordinator's state and its commits),
:mod:`~keyedconsumer.testing.run` (:class:`Run`: consumers in threads),
:mod:`~keyedconsumer.testing.client` (:class:`FakeClient`, :class:`FakePublisher`: the fakes of the
Kafka seams, which use only the broker's public methods) and :mod:`~keyedconsumer.testing.clock`.
"""

from ..hermetic import NetworkRefusedError
from .broker import BrokerConnector, GroupEvent, InMemoryBroker, Record
from .client import FakeClient, FakePublisher, FakeTransactionalProducer
from .clock import FakeClock
from .group import Commit
from .run import AppRun, Run

__all__ = [
    "InMemoryBroker",
    "BrokerConnector",
    "NetworkRefusedError",
    "FakeClock",
    "FakeClient",
    "FakePublisher",
    "FakeTransactionalProducer",
    "Record",
    "Commit",
    "Run",
    "AppRun",
    "GroupEvent",
]
