"""The real :class:`~keyedconsumer.kafka.RecordPublisher`, on ``confluent_kafka.Producer``."""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from confluent_kafka import KafkaError, KafkaException, Producer

from .. import hermetic
from ..config import reveal
from ..errors import PublishError
from . import logs
from .oauth import TokenCallbackError, with_token_source

if TYPE_CHECKING:
    from . import BatchPublisher, RecordPublisher

__all__ = ["Publisher"]


class Publisher:
    """A producer that waits for the broker's acknowledgement of each record: the real
    :class:`~keyedconsumer.kafka.RecordPublisher`.

    Records are written with ``acks=all`` and ``enable.idempotence=true`` (librdkafka), so an
    acknowledged record is on every in-sync replica and a retried send is not duplicated. Safe to
    call from several threads at once. Used by the dead-letter middleware.

    **The fate of a record is known before** :meth:`publish` **returns.** librdkafka keeps retrying
    a record until its ``message.timeout.ms``; a caller that stopped waiting earlier would report a
    failure for a record that is then delivered after all, and a second attempt would write it
    twice (spring-kafka #1749, fixed by bounding the producer's delivery timeout by the wait, PR
    #1750). So ``message.timeout.ms`` is set to ``delivery_timeout_s``, and ``publish`` waits for the
    record's delivery report: success, or a failure after which librdkafka no longer sends it.

    Parameters
    ----------
    brokers:
        Bootstrap servers, ``host:port`` strings.
    config:
        Other librdkafka producer properties (``acks``, ``enable.idempotence`` and
        ``message.timeout.ms`` / ``delivery.timeout.ms`` are set after these). A
        ``pydantic.SecretStr`` value (as in ``ConsumerConfig.config``) is passed as its secret value.
    delivery_timeout_s:
        Seconds librdkafka tries to deliver a record (its ``message.timeout.ms``) before reporting
        it failed; :meth:`publish` returns within about that long.

    Raises
    ------
    PublishError
        The producer could not be created (an invalid property; an ``oauth_cb`` that gives no usable
        token, :mod:`keyedconsumer.kafka.oauth`).
    ValueError
        ``delivery_timeout_s`` not above 0.
    """

    #: Seconds past ``message.timeout.ms`` that :meth:`publish` waits for the delivery report:
    #: librdkafka checks for timed-out records about once a second.
    REPORT_GRACE_S = 5.0
    _who = "a Kafka producer (keyedconsumer.Publisher: DeadLetter's, Audit's or the application's own)"

    def __init__(
        self,
        brokers: Sequence[str],
        config: Mapping[str, Any] | None = None,
        *,
        delivery_timeout_s: float = 30.0,
    ) -> None:
        if not delivery_timeout_s > 0:
            raise ValueError(f"Publisher delivery_timeout_s must be > 0, got {delivery_timeout_s!r}")
        self.delivery_timeout_s = float(delivery_timeout_s)
        self._brokers = ",".join(brokers)
        hermetic.check(self._who, self._brokers)
        conf: dict[str, Any] = {
            "bootstrap.servers": self._brokers,
            "linger.ms": 5,
            "logger": logs.librdkafka_log,  # librdkafka's lines into Python logging, unless config gives one
        }
        conf.update(reveal(config or {}))
        conf.pop("delivery.timeout.ms", None)  # librdkafka's alias of message.timeout.ms
        conf.update(
            {
                "acks": "all",
                "enable.idempotence": True,
                "message.timeout.ms": max(1, int(self.delivery_timeout_s * 1000)),
            }
        )
        try:
            self._producer = Producer(with_token_source(conf))
        except TokenCallbackError as exc:
            raise PublishError(f"cannot create the producer: {exc}") from exc
        except KafkaException as exc:
            raise PublishError(f"cannot create the producer: {exc.args[0].str()}") from None
        # Delivery reports are served by one poller thread: a caller waits on its own event.
        # Callers polling themselves served each other's reports, and one whose report another
        # served slept on in its poll until the timeout (measured: ~100 ms per record with 16
        # threads publishing at once, bench/eos_cost.py). It starts now, not at the first record:
        # librdkafka's log lines and errors reach Python only through a poll (they would pile up
        # unseen in a producer that has nothing to send yet, e.g. DeadLetter's while the broker
        # is unreachable). It holds the publisher weakly, and ends when the publisher is closed
        # or collected.
        self._poller: threading.Thread | None = None
        self._poller_lock = threading.Lock()
        self._closing = threading.Event()
        self._fatal: KafkaError | None = None
        self._ensure_poller()

    def publish(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: list[tuple[str, bytes | None]] | None = None,
        timeout_s: float | None = None,
    ) -> tuple[int, int]:
        """Write one record and wait until the broker acknowledged it, or librdkafka gave it up.

        ``timeout_s`` is accepted for compatibility and not used: the wait ends with the record's
        delivery report, within ``delivery_timeout_s`` (plus :data:`REPORT_GRACE_S`).

        Returns
        -------
        ``(partition, offset)`` of the acknowledged record.

        Raises
        ------
        PublishError
            The broker refused the record (e.g. too large, not authorised), it could not be queued,
            or it was not delivered within ``delivery_timeout_s`` (e.g. the topic does not exist and
            is not created, the broker is unreachable); librdkafka then sends it no more. Or the
            producer hit a fatal error (librdkafka's idempotent producer, e.g.
            ``OUT_OF_ORDER_SEQUENCE_NUMBER``) and sends nothing more. Only if
            even the report does not come (it always does) does the error say the fate is unknown.
        """
        out = self.publish_many([(topic, key, value, headers)])[0]
        if isinstance(out, PublishError):
            raise out
        return out

    def publish_many(
        self, records: Sequence[tuple[str, bytes | None, bytes | None, list[tuple[str, bytes | None]] | None]]
    ) -> list[tuple[int, int] | PublishError]:
        """Write ``[(topic, key, value, headers)]`` and wait until each was acknowledged or given
        up: one wait for the whole batch (librdkafka batches them: ``linger.ms``), for writers that
        collect records (the audit trail).

        Returns
        -------
        Per record, in order: ``(partition, offset)``, or the :class:`PublishError` that says why it
        was not delivered (as :meth:`publish` would raise it).

        Raises
        ------
        PublishError
            The producer hit a fatal error (it sends nothing more), or, which never happens, no
            delivery report came in time (the fate of the records is unknown).
        """
        hermetic.check(self._who, self._brokers)  # one built before an in-memory run began
        results: list[tuple[int, int] | PublishError | None] = [None] * len(records)
        lock = threading.Lock()
        left = [len(records)]
        done = threading.Event()

        def reporter(i: int, topic: str) -> Any:
            def on_delivery(err: KafkaError | None, msg: Any) -> None:
                results[i] = (
                    PublishError(f"the record for {topic} was not delivered: {err.name()}: {err.str()}")
                    if err is not None
                    else (msg.partition(), msg.offset())
                )
                with lock:
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()

            return on_delivery

        for i, (topic, key, value, headers) in enumerate(records):
            try:
                wire: Any = list(headers) if headers else None
                self._producer.produce(
                    topic, value=value, key=key, headers=wire, on_delivery=reporter(i, topic)
                )
            except (KafkaException, BufferError) as exc:
                results[i] = PublishError(f"cannot publish to {topic}: {exc}")
                with lock:
                    left[0] -= 1
        if left[0] == 0:
            done.set()
        else:
            self._ensure_poller()
        deadline = time.monotonic() + self.delivery_timeout_s + self.REPORT_GRACE_S
        while not done.is_set():
            wait = deadline - time.monotonic()
            if wait <= 0:
                topics = ", ".join(sorted({r[0] for r in records}))
                raise PublishError(
                    f"no delivery report for {topics} within {self.delivery_timeout_s + self.REPORT_GRACE_S:g} s: "
                    "the record's fate is unknown (it may still be delivered)"
                )
            err = self._fatal
            if err is not None:  # a fatal producer error: the producer sends nothing more
                topics = ", ".join(sorted({r[0] for r in records}))
                raise PublishError(
                    f"cannot publish to {topics}: the producer failed: {err.name()}: {err.str()}"
                )
            done.wait(min(wait, 0.1))
        return [r for r in results if r is not None]

    def _ensure_poller(self) -> None:
        with self._poller_lock:
            if self._poller is None and not self._closing.is_set():
                self._poller = threading.Thread(
                    target=Publisher._serve_reports,
                    args=(weakref.ref(self),),
                    name="keyedconsumer-publisher",
                    daemon=True,
                )
                self._poller.start()

    @staticmethod
    def _serve_reports(ref: weakref.ref[Publisher]) -> None:
        """Serve delivery reports and log lines until :meth:`close` (or a fatal error, kept for
        the waiters), or until the publisher is collected."""
        while True:
            publisher = ref()
            if publisher is None or publisher._closing.is_set():
                return
            try:
                publisher._producer.poll(0.05)
            except KafkaException as exc:
                publisher._fatal = exc.args[0]
                return
            finally:
                del publisher

    def close(self, timeout_s: float = 10.0) -> None:
        """Wait up to ``timeout_s`` seconds for queued records; stop serving delivery reports."""
        if self._fatal is None:
            self._producer.flush(timeout_s)
        self._closing.set()
        poller = self._poller
        if poller is not None:
            poller.join(1.0)


if TYPE_CHECKING:  # mypy checks that the real publisher satisfies the seam

    def _is_a_record_publisher(publisher: Publisher) -> RecordPublisher:
        return publisher

    def _is_a_batch_publisher(publisher: Publisher) -> BatchPublisher:
        return publisher
