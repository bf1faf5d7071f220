"""Dead-letter topic: publish a finally failed message, unchanged, with failure headers.

The original key, value and headers are published as bytes. The failure headers below are added,
and **replace** any headers of the same names already on the record, so a record dead-lettered
again and again does not grow until the broker refuses it as too large. Names follow Spring Kafka's ``DeadLetterPublishingRecoverer``
(``KafkaHeaders.DLT_*``); Spring writes partition/offset/timestamp as big-endian binary numbers,
keyedconsumer writes every value as UTF-8 text. The last three are keyedconsumer's own.

=====================================  =============================================================
header                                 value
=====================================  =============================================================
``kafka_dlt-original-topic``           topic the message was consumed from
``kafka_dlt-original-partition``       its partition (decimal)
``kafka_dlt-original-offset``          its offset (decimal)
``kafka_dlt-original-timestamp``       its timestamp, milliseconds since the epoch (absent if none)
``kafka_dlt-original-consumer-group``  the consumer group
``kafka_dlt-exception-fqcn``           the failure's class, ``module.QualName``
``kafka_dlt-exception-cause-fqcn``     the class of its root ``__cause__`` (absent if none)
``kafka_dlt-exception-message``        ``str(error)``, at most 4 KiB
``kafka_dlt-exception-stacktrace``     the formatted traceback, at most ``max_stacktrace_bytes``
``kafka_dlt-attempts``                 attempts made (``Message.attempt``)
``kafka_dlt-failed-at``                time of the failure, milliseconds since the epoch
``kafka_dlt-validation-errors``        JSON list of validation errors (decode failures only)
=====================================  =============================================================

**Headers from outer middleware.** A middleware outside this one may put a list of ``(name, bytes)``
headers in ``msg.state[STATE_HEADERS]``; they are written on the dead-letter record in place of the
original record's headers of the same names. :class:`~keyedconsumer.middleware.Tracing` puts the
failing attempt's trace context there (``traceparent``, ``tracestate``), so the dead-letter record
continues the trace of the attempt that failed. After a publish, ``msg.state["dead_lettered"]`` is
the dead-letter topic and ``msg.state[STATE_ERROR]`` the failure, for the middleware outside.

**Where the producer comes from** (:mod:`keyedconsumer.middleware._publisher`, shared with
``Audit``). Nothing is built when the middleware is made: a consumer that binds it gives the factory
of its producers (``bind_publishers``: the in-memory broker's when the consumer runs on
:class:`~keyedconsumer.testing.InMemoryBroker`, so a test's dead letters land there and nothing
reaches a network address; else :class:`~keyedconsumer.Publisher`), then its settings.

**Connection settings written once.** ``DeadLetter()`` with neither ``brokers`` nor ``publisher``
publishes to the cluster its consumer reads from: ``KeyedConsumer`` calls its ``bind_settings`` hook
with the consumer's :class:`~keyedconsumer.ConsumerConfig`, and the producer is built from the
consumer's ``brokers`` and its connection properties only
(:meth:`~keyedconsumer.ConsumerConfig.connection_properties`: ``security.protocol``, ``ssl.*``,
``sasl.*``, ``https.*``, ``oauth_cb``, ``logger`` ...; not ``session.timeout.ms``, ``fetch.*`` or the
other consumer properties), with ``producer_config`` laid over them. Given ``brokers``, nothing of
the consumer's is taken (another cluster gets no credentials of this one): pass its security
properties in ``producer_config``.

The message counts as done only after the broker acknowledged the dead-letter record (``acks=all``,
idempotent producer). If the publish fails, the middleware raises :class:`DeadLetterError`: nothing is
marked done, and the engine's error path (``error_handler`` or stop) takes over.

**One record per dead-lettered offset.** A failed publish is reported only once librdkafka has
given the record up (the producer's ``message.timeout.ms`` is the middleware's ``timeout_s``), so a
record reported failed is never delivered later behind a second attempt (spring-kafka #1749). And a
run that no longer owns its message (``Message.still_owned()``: its partition was revoked while it
ran past ``revoke_timeout_s``, or its key's Redis lease was lost) does not publish: the message's new
owner runs it again and dead-letters it itself (karafka PR #3220). Left: a run that loses ownership
*during* its publish (after the check) still writes its record; the check narrows that window to
the publish itself.
"""

from __future__ import annotations

import json
import logging
import time
import traceback
from collections.abc import Sequence
from typing import Any

from keyedconsumer import ConsumerConfig, Message, PublisherFactory, PublishError, RecordPublisher, RetryLater

from ._kind import around, failure_of
from ._publisher import PublisherSource

__all__ = ["DeadLetter", "DeadLetterError", "HEADERS", "STATE_HEADERS", "STATE_ERROR"]

PREFIX = "kafka_dlt-"
H_TOPIC = "kafka_dlt-original-topic"
H_PARTITION = "kafka_dlt-original-partition"
H_OFFSET = "kafka_dlt-original-offset"
H_TIMESTAMP = "kafka_dlt-original-timestamp"
H_GROUP = "kafka_dlt-original-consumer-group"
H_FQCN = "kafka_dlt-exception-fqcn"
H_CAUSE_FQCN = "kafka_dlt-exception-cause-fqcn"
H_MESSAGE = "kafka_dlt-exception-message"
H_STACKTRACE = "kafka_dlt-exception-stacktrace"
H_ATTEMPTS = "kafka_dlt-attempts"
H_FAILED_AT = "kafka_dlt-failed-at"
H_VALIDATION = "kafka_dlt-validation-errors"
#: Every header this middleware writes (and so removes from a record before writing).
HEADERS = (
    H_TOPIC,
    H_PARTITION,
    H_OFFSET,
    H_TIMESTAMP,
    H_GROUP,
    H_FQCN,
    H_CAUSE_FQCN,
    H_MESSAGE,
    H_STACKTRACE,
    H_ATTEMPTS,
    H_FAILED_AT,
    H_VALIDATION,
)
_MAX_MESSAGE_BYTES = 4096
#: ``msg.state`` key of headers an outer middleware adds to the dead-letter record (replacing the
#: original record's headers of the same names): a list of ``(name, bytes)``.
STATE_HEADERS = "dead_letter_headers"
#: ``msg.state`` key of the failure that was dead-lettered (set after a publish).
STATE_ERROR = "dead_letter_error"


log = logging.getLogger("keyedconsumer.middleware.dead_letter")


class DeadLetterError(Exception):
    """Publishing to the dead-letter topic failed; the message is not done."""


def _fqcn(exc: BaseException) -> str:
    cls = type(exc)
    return f"{cls.__module__}.{cls.__qualname__}"


def _root_cause(exc: BaseException) -> BaseException | None:
    seen = {id(exc)}
    cause = exc.__cause__
    root = None
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        root = cause
        cause = cause.__cause__
    return root


def _clip(text: str, max_bytes: int) -> bytes:
    data = text.encode("utf-8", "backslashreplace")
    if len(data) <= max_bytes:
        return data
    return data[: max(0, max_bytes - 16)].decode("utf-8", "ignore").encode() + b"...[truncated]"


class DeadLetter:
    """Publish a message whose handler finally failed to a dead-letter topic, then count it done.

    Place it outside :class:`~keyedconsumer.middleware.Retry` (``middlewares=[DeadLetter(...),
    Retry(...)]``): retries run first, and only the final failure is dead-lettered. A
    :class:`~keyedconsumer.PermanentError` (for example an undecodable payload from
    :class:`~keyedconsumer.middleware.Typed`) is not retried and is dead-lettered at once.

    Parameters
    ----------
    brokers:
        Bootstrap servers of the cluster holding the dead-letter topic. Default: the consumer's
        brokers and connection properties (given by ``KeyedConsumer`` through
        :meth:`bind_settings`). Either way the producer is built when a consumer binds the
        middleware, by the consumer's publisher factory (:meth:`bind_publishers`): under
        :mod:`keyedconsumer.testing` it writes into the in-memory broker.
    topic:
        Dead-letter topic; ``{topic}`` is replaced by the message's topic (default ``{topic}.dlq``).
    publisher:
        A :class:`~keyedconsumer.RecordPublisher` (e.g. a :class:`~keyedconsumer.Publisher`, or
        ``keyedconsumer.testing.FakePublisher``) to use instead of building one from ``brokers``.
    producer_config:
        Extra librdkafka producer properties for the built publisher; they win over the
        consumer's connection properties.
    timeout_s:
        Seconds librdkafka tries to deliver a dead-letter record (the built publisher's
        ``message.timeout.ms``) before the publish counts as failed; a given ``publisher`` uses its
        own ``delivery_timeout_s``.
    max_stacktrace_bytes:
        Bound of the stack trace header.

    Raises
    ------
    ValueError
        A bad bound. Used (composed or published with) without ``brokers``, ``publisher`` or a
        consumer that bound it: the message says what to pass.
    PublishError
        The producer cannot be built (an invalid property): when a consumer binds it, or, used
        without a consumer, when first composed or published with.
    """

    #: It acts on a message's end only, so it can wrap each message of a batch handler's batch.
    outcome_only = True

    def __init__(
        self,
        *,
        brokers: Sequence[str] | None = None,
        topic: str = "{topic}.dlq",
        publisher: RecordPublisher | None = None,
        producer_config: dict[str, Any] | None = None,
        timeout_s: float = 30.0,
        max_stacktrace_bytes: int = 8192,
    ) -> None:
        if not (timeout_s > 0) or max_stacktrace_bytes < 256:
            raise ValueError("DeadLetter timeout_s must be > 0 and max_stacktrace_bytes >= 256")
        self.topic = topic
        self.timeout_s = float(timeout_s)
        self.max_stacktrace_bytes = int(max_stacktrace_bytes)
        self._source: PublisherSource[RecordPublisher] = PublisherSource(
            "DeadLetter",
            brokers=brokers,
            publisher=publisher,
            producer_config=producer_config,
            delivery_timeout_s=self.timeout_s,
        )
        self.published = 0  # dead-letter records acknowledged so far

    def bind_publishers(self, factory: PublisherFactory | None) -> None:
        """The middleware hook ``KeyedConsumer`` calls first: the factory of the consumer's
        producers (``InMemoryBroker``'s under :mod:`keyedconsumer.testing`, else
        :class:`~keyedconsumer.Publisher` for ``None``), which builds this middleware's producer."""
        self._source.bind_publishers(factory)

    def bind_settings(self, settings: ConsumerConfig) -> None:
        """The middleware hook ``KeyedConsumer`` calls with its settings before composing: build the
        producer with the bound factory, for ``brokers`` when given, else for the consumer's
        ``brokers`` and :meth:`~keyedconsumer.ConsumerConfig.connection_properties`
        (``producer_config`` laid over them). With ``publisher`` given, nothing happens. Bound again
        (one instance in several consumers), it keeps its producer when the factory, brokers and
        connection properties are the same.

        Raises
        ------
        ValueError
            Already bound, with the same factory, to a consumer with other brokers or connection
            properties.
        PublishError
            The producer cannot be built (an invalid property).
        """
        self._source.bind_settings(settings)

    def _ready_publisher(self) -> RecordPublisher:
        return self._source.get()

    def topic_for(self, msg: Message) -> str:
        """The dead-letter topic of ``msg``."""
        return self.topic.replace("{topic}", msg.topic)

    def headers_for(self, msg: Message, error: BaseException) -> list[tuple[str, bytes | None]]:
        """The record's own headers without earlier failure headers, plus the headers outer middleware
        put in ``msg.state[STATE_HEADERS]`` (replacing same-named ones), plus this failure's."""
        extra: list[tuple[str, bytes | None]] = [
            (k, v) for k, v in msg.state.get(STATE_HEADERS) or () if k not in HEADERS
        ]
        replaced = {k for k, _ in extra}
        own = [(k, v) for k, v in msg.headers if k not in HEADERS and k not in replaced]
        add: list[tuple[str, bytes | None]] = [
            (H_TOPIC, msg.topic.encode()),
            (H_PARTITION, str(msg.partition).encode()),
            (H_OFFSET, str(msg.offset).encode()),
        ]
        if msg.timestamp_ms is not None:
            add.append((H_TIMESTAMP, str(msg.timestamp_ms).encode()))
        add.append((H_GROUP, msg.group_id.encode()))
        add.append((H_FQCN, _fqcn(error).encode()))
        root = _root_cause(error)
        if root is not None:
            add.append((H_CAUSE_FQCN, _fqcn(root).encode()))
        add.append((H_MESSAGE, _clip(str(error), _MAX_MESSAGE_BYTES)))
        trace = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        add.append((H_STACKTRACE, _clip(trace, self.max_stacktrace_bytes)))
        add.append((H_ATTEMPTS, str(msg.attempt).encode()))
        add.append((H_FAILED_AT, str(int(time.time() * 1000)).encode()))
        errors = getattr(error, "validation_errors", None)
        if errors is not None:
            add.append((H_VALIDATION, _clip(json.dumps(errors, default=str), 16384)))
        return own + extra + add

    def publish(self, msg: Message, error: BaseException) -> None:
        """Publish ``msg`` to its dead-letter topic and wait for the acknowledgement.

        Raises
        ------
        DeadLetterError
            The broker refused the record or did not acknowledge it in ``timeout_s``.
        ValueError
            No publisher: neither ``brokers`` nor ``publisher`` given, and no consumer bound it.
        """
        topic = self.topic_for(msg)
        try:
            self._ready_publisher().publish(
                topic, msg.key, msg.value, self.headers_for(msg, error), self.timeout_s
            )
        except PublishError as exc:
            raise DeadLetterError(
                f"dead-letter publish to {topic} failed for topic={msg.topic} partition={msg.partition} "
                f"offset={msg.offset}: {exc}"
            ) from error
        self.published += 1
        msg.state["dead_lettered"] = topic
        msg.state[STATE_ERROR] = error

    def _after(self, msg: Message, exc: BaseException | None, _state: Any) -> None:
        failure = failure_of(msg, exc)
        if failure is not None:
            if not msg.still_owned():
                # revoked (past revoke_timeout_s) or its key's lease lost: its new owner runs it
                # again and dead-letters it; this run's outcome does not count anyway
                log.warning(
                    "not dead-lettered: %r no longer belongs to this run (its new owner handles it)", msg
                )
                raise RetryLater(0.0, "no longer owned") from failure
            self.publish(msg, failure)
            msg.ack_dead_lettered()

    def __call__(self, handler: Any) -> Any:
        self._ready_publisher()  # unbound and without brokers: fail when composed, not at the first failure
        # publishing waits for the broker: for async handlers it runs in a worker thread
        return around(handler, None, self._after, blocking_after=True)
