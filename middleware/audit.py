"""An audit trail: one record per attempt of each message, written to a Kafka topic in batches.

After an incident users ask "what happened to the message at offset X of key K?" (BigBen keeps a
record of everything that fired, with a retention). :class:`Audit` answers it from a Kafka topic,
which scales with partitions and retains by time (the topic's ``retention.ms``):
``keyedconsumer audit`` reads it back by key, by offset or by time range.

A record's Kafka key is the message's key, so a key's records are on one partition of the audit
topic, in the order they were written; its value is the JSON of :data:`FIELDS`.

Outcomes, as the middleware sees them (``outcome``): ``SUCCESS``, ``SKIP``, ``FAIL`` (an error
nothing inside handled: the engine's ``error_handler`` or a stop follows), ``RETRY`` (a retry
later, in memory), ``PARKED`` (a retry with ``park=True``: the key goes to Redis), and
``DEAD_LETTERED``; ``CONFLATED`` for messages replaced by a newer one of their key before they ran,
with ``KeyedConsumer(conflate=True, on_conflated=audit.conflated)``. Place :class:`Audit` outside ``DeadLetter`` and ``Retry`` to see those.

Cost: the handler's thread only appends to a bounded in-memory queue; one writer thread publishes
the queue every ``flush_interval_s`` (or every ``max_batch`` records) with one wait for the batch
(:meth:`~keyedconsumer.kafka.BatchPublisher.publish_many`). The queue holds at most ``max_queue``
records: when Kafka does not take them, handlers wait (memory stays bounded, nothing is dropped).
With ``wait=True`` a message counts done only once its record was acknowledged (at-least-once for
the trail too, at the price of up to ``flush_interval_s`` per message of a key); by default a crash
can lose the records of the last ``flush_interval_s``. Records that Kafka refused are counted
(``failed``) and logged, never dropped without a word.
"""

from __future__ import annotations

import atexit
import base64
import json
import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from keyedconsumer import BatchPublisher, ConsumerConfig, Message, PublisherFactory, PublishError, RetryLater

from ._kind import around
from ._publisher import PublisherSource
from .dead_letter import STATE_ERROR
from .logging import outcome_of

__all__ = ["Audit", "FIELDS", "DEFAULT_TOPIC"]

log = logging.getLogger("keyedconsumer.audit")

#: The audit topic when none is given.
DEFAULT_TOPIC = "keyedconsumer.audit"

#: The fields of a record's JSON value: ``v`` (format version, 1), ``time_ms`` (when the attempt
#: ended, ms since the epoch), ``group``, ``topic``, ``partition``, ``offset``, ``key`` (UTF-8
#: text, or ``null``), ``key_b64`` (base64 of a key that is not UTF-8), ``attempt``, ``outcome``,
#: ``duration_ms``, ``error_type`` and ``error`` (failures, dead letters too: the class,
#: ``module.QualName``, and the message, at most 1,000 characters), ``retry_in_s`` (``RETRY`` / ``PARKED``), ``fencing_token``
#: (with the Redis sequencer), ``instance`` (``host:pid``).
FIELDS = (
    "v",
    "time_ms",
    "group",
    "topic",
    "partition",
    "offset",
    "key",
    "key_b64",
    "attempt",
    "outcome",
    "duration_ms",
    "error_type",
    "error",
    "retry_in_s",
    "fencing_token",
    "instance",
)


class Audit:
    """Write one audit record per attempt of each message to a Kafka topic.

    Parameters
    ----------
    topic:
        The audit topic (create it with the retention you want; ``keyedconsumer audit`` reads it).
    brokers, producer_config:
        The cluster to write to (``acks=all``, idempotent producer) and extra producer properties.
        Default: the consumer's brokers and connection properties, with ``producer_config`` laid
        over them, as :class:`~keyedconsumer.middleware.DeadLetter` takes them (``bind_settings``).
        The producer is built when a consumer binds the middleware, by the consumer's publisher
        factory (``bind_publishers``: the in-memory broker's under :mod:`keyedconsumer.testing`).
    publisher:
        A :class:`~keyedconsumer.kafka.BatchPublisher` to use instead (``InMemoryBroker.publisher()``).
    flush_interval_s:
        Seconds between two publishes of the queue (> 0).
    max_batch:
        Records per publish, at most (>= 1).
    max_queue:
        Records waiting, at most (>= ``max_batch``); handlers wait beyond it.
    wait:
        ``True``: the message counts done only once its record was acknowledged; when it was not,
        the attempt fails with :class:`~keyedconsumer.PublishError` (retry and dead-letter
        middleware inside ``Audit`` do not see that; the engine's error handling does).

    Raises
    ------
    ValueError
        A bound above not met. Used without ``brokers``, ``publisher`` or a consumer that bound it
        (composed, or ``conflated`` called): the message says what to pass.
    """

    def __init__(
        self,
        *,
        topic: str = DEFAULT_TOPIC,
        brokers: Sequence[str] | None = None,
        producer_config: dict[str, Any] | None = None,
        publisher: BatchPublisher | None = None,
        flush_interval_s: float = 0.2,
        max_batch: int = 1000,
        max_queue: int = 100_000,
        wait: bool = False,
    ) -> None:
        if not flush_interval_s > 0 or max_batch < 1 or max_queue < max_batch:
            raise ValueError("Audit needs flush_interval_s > 0, max_batch >= 1 and max_queue >= max_batch")
        self.topic = topic
        self.flush_interval_s = float(flush_interval_s)
        self.max_batch = int(max_batch)
        self.max_queue = int(max_queue)
        self.wait = bool(wait)
        self._source: PublisherSource[BatchPublisher] = PublisherSource(
            "Audit",
            brokers=brokers,
            publisher=publisher,
            producer_config=producer_config,
            delivery_timeout_s=30.0,
        )
        self._instance = f"{socket.gethostname()}:{os.getpid()}"
        self._queue: deque[tuple[int, bytes | None, bytes]] = deque()  # (sequence number, key, value)
        self._seq = 0  # sequence number of the last record queued
        self._done_seq = 0  # every record up to this one was published (or refused)
        self._refused: set[int] = set()  # with wait=True: refused records not yet seen by their waiter
        self._cond = threading.Condition()
        self._closed = False
        #: Records acknowledged by Kafka so far.
        self.written = 0
        #: Records Kafka refused (each logged).
        self.failed = 0
        self._writer = threading.Thread(target=self._write_loop, name="keyedconsumer-audit", daemon=True)
        self._writer.start()
        atexit.register(self.close)

    # -- the middleware --------------------------------------------------------------------------

    def bind_publishers(self, factory: PublisherFactory | None) -> None:
        """The middleware hook ``KeyedConsumer`` calls first: the factory of its producers
        (``None``: :class:`~keyedconsumer.Publisher`)."""
        self._source.bind_publishers(factory)

    def bind_settings(self, settings: ConsumerConfig) -> None:
        """The middleware hook ``KeyedConsumer`` calls with its settings: build the producer (see
        ``brokers``). Raises ``ValueError`` when bound, with the same factory, to consumers of two
        clusters, and ``PublishError`` when the producer cannot be built."""
        self._source.bind_settings(settings)

    def __call__(self, handler: Any) -> Any:
        self._source.get()  # unbound and without brokers: fail when composed, not in the writer
        return around(handler, lambda _msg: time.perf_counter(), self._after, blocking_after=self.wait)

    def _after(self, msg: Message, exc: BaseException | None, t0: float) -> None:
        seq = self.append(msg, exc, time.perf_counter() - t0)
        if self.wait:
            with self._cond:
                while self._done_seq < seq:
                    self._cond.wait()
                refused = seq in self._refused
                self._refused.discard(seq)
            if refused and exc is None:
                raise PublishError(
                    f"the audit record of {msg.topic}[{msg.partition}]@{msg.offset} was not written"
                )
        if exc is not None:
            raise exc

    def conflated(self, msg: Message) -> None:
        """Record a message that was conflated (replaced by a newer one of its key before it ran):
        pass it as ``KeyedConsumer(conflate=True, on_conflated=audit.conflated)``."""
        self._source.get()
        self.append(msg, None, 0.0, outcome="CONFLATED")

    def record(
        self, msg: Message, exc: BaseException | None, duration_s: float, outcome: str | None = None
    ) -> dict[str, Any]:
        """The audit record of one attempt (the JSON value's fields, :data:`FIELDS`)."""
        outcome = outcome or outcome_of(msg, exc)
        if outcome == "RETRY" and isinstance(exc, RetryLater) and exc.park:
            outcome = "PARKED"
        rec: dict[str, Any] = {
            "v": 1,
            "time_ms": int(time.time() * 1000),
            "group": msg.group_id,
            "topic": msg.topic,
            "partition": msg.partition,
            "offset": msg.offset,
            "key": None,
            "attempt": msg.attempt,
            "outcome": outcome,
            "duration_ms": round(duration_s * 1000, 3),
            "instance": self._instance,
        }
        if msg.key is not None:
            try:
                rec["key"] = msg.key.decode("utf-8")
            except UnicodeDecodeError:
                rec["key_b64"] = base64.b64encode(msg.key).decode()
        failure = (
            exc if exc is not None else msg.state.get(STATE_ERROR) if outcome == "DEAD_LETTERED" else None
        )
        if isinstance(failure, BaseException) and outcome != "SKIP":
            cause = (
                failure.__cause__
                if isinstance(failure, RetryLater) and failure.__cause__ is not None
                else failure
            )
            rec["error_type"] = f"{type(cause).__module__}.{type(cause).__qualname__}"
            rec["error"] = str(cause)[:1000]
            if isinstance(failure, RetryLater):
                rec["retry_in_s"] = failure.delay_s
        if msg.fencing_token is not None:
            rec["fencing_token"] = msg.fencing_token
        return rec

    def append(
        self, msg: Message, exc: BaseException | None, duration_s: float, outcome: str | None = None
    ) -> int:
        """Queue the record of one attempt; waits while ``max_queue`` records wait. Returns its
        sequence number (records are published in that order)."""
        value = json.dumps(self.record(msg, exc, duration_s, outcome), separators=(",", ":")).encode()
        with self._cond:
            while len(self._queue) >= self.max_queue and not self._closed:
                self._cond.wait(1.0)
            self._seq += 1
            self._queue.append((self._seq, msg.key, value))
            if len(self._queue) >= self.max_batch:
                self._cond.notify_all()
            return self._seq

    # -- the writer ------------------------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                if not self._queue and not self._closed:
                    self._cond.wait(self.flush_interval_s)
                if not self._queue:
                    if self._closed:
                        return
                    continue
                n = min(len(self._queue), self.max_batch)
                taken = [self._queue.popleft() for _ in range(n)]
                self._cond.notify_all()
            self._publish(taken)
            if len(taken) < self.max_batch and not self._closed:
                time.sleep(self.flush_interval_s)  # let the next batch gather

    def _publish(self, taken: list[tuple[int, bytes | None, bytes]]) -> None:
        try:
            results: list[Any] = self._source.get().publish_many(
                [(self.topic, k, v, None) for _, k, v in taken]
            )
        except PublishError as exc:
            results = [exc] * len(taken)
        except Exception as exc:  # no producer (unbound), or none may be used (an in-memory run)
            results = [PublishError(f"cannot publish to {self.topic}: {exc}")] * len(taken)
        refused = [seq for (seq, _, _), r in zip(taken, results, strict=True) if isinstance(r, PublishError)]
        if refused:
            first = next(r for r in results if isinstance(r, PublishError))
            log.error("%d audit record(s) not written to %s: %s", len(refused), self.topic, first)
        with self._cond:
            self.written += len(taken) - len(refused)
            self.failed += len(refused)
            if self.wait:
                self._refused.update(refused)
            self._done_seq = taken[-1][0]
            self._cond.notify_all()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every record queued so far was published or refused (``True``), at most
        ``timeout_s`` seconds (``False`` then)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            target = self._seq
            self._cond.notify_all()
            while self._done_seq < target:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout_s: float = 30.0) -> None:
        """Publish what is queued, stop the writer, close the publisher (it runs at exit too)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._writer.join(timeout_s)
        publisher = self._source.current()
        try:
            if publisher is not None:
                publisher.close(timeout_s)
        except Exception as exc:  # closing is best effort: the records were acknowledged already
            log.debug("audit publisher close: %s", exc)
        atexit.unregister(self.close)

    def __repr__(self) -> str:
        return f"Audit(topic={self.topic!r}, written={self.written}, failed={self.failed})"
