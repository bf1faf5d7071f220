"""Tracing with OpenTelemetry (the optional extra ``keyedconsumer[tracing]``).

One ``CONSUMER`` span, ``process {topic}``, per attempt of a message. Its parent is the trace
context the producer put in the record's headers (W3C ``traceparent`` / ``tracestate``, read with
the globally configured propagator, or the one passed in), so a produced record's trace goes on in
the consumer. The span is current while the handlers inside run: their own spans and log records
are its children.

Attributes follow the OpenTelemetry messaging semantic conventions (the current names; the older
``messaging.kafka.destination.partition``, ``messaging.kafka.message.offset`` and
``messaging.kafka.consumer.group`` were replaced by the ones below):

=========================================  ===========================================================
attribute                                  value
=========================================  ===========================================================
``messaging.system``                       ``kafka``
``messaging.operation.type``               ``process`` (``messaging.operation.name`` too)
``messaging.destination.name``             the topic
``messaging.destination.partition.id``     the partition, as a string
``messaging.kafka.offset``                 the record's offset
``messaging.kafka.message.key``            the key, when it is valid UTF-8 (``record_key=False``: never)
``messaging.kafka.message.tombstone``      ``True`` for a null value (absent otherwise)
``messaging.message.body.size``            bytes of the value
``messaging.consumer.group.name``          the consumer group
``keyedconsumer.message.attempt``          ``Message.attempt``: 1, 2, ... (one span per attempt)
``keyedconsumer.outcome``                  ``SUCCESS``, ``SKIP``, ``FAIL``, ``RETRY``, ``DEAD_LETTERED`` or ``CANCELLED``
``keyedconsumer.retry.delay_s``            the back-off asked for by a retried attempt
``keyedconsumer.dead_letter.topic``        where a dead-lettered message went
``error.type``                             the failure's class, ``module.QualName`` (failures only)
=========================================  ===========================================================

**Failures.** An attempt that raised, failed with ``ack_fail``, asked to be retried
(``RetryLater``: the cause is recorded) or was dead-lettered has its exception recorded as a span
event and the status ``ERROR``.

**Retries.** Every attempt is its own span with its attempt number. Attempt ``n > 1`` links to
attempt ``n - 1``'s span. All attempts of a message are in one trace: the producer's trace, or,
for a record without trace context, the trace of its first attempt (later attempts are its
children). Links and that first-attempt trace live in ``msg.state``, so they hold for retries in
one process; a parked message drained from Redis keeps only its headers' (the producer's) context.

**Dead letters.** Tracing puts the attempt span's context (``traceparent``, ``tracestate``,
whatever the propagator injects) in ``msg.state`` under
:data:`keyedconsumer.middleware.dead_letter.STATE_HEADERS`; :class:`~keyedconsumer.middleware.DeadLetter`
writes those headers on the dead-letter record in place of the original record's, so the
dead-letter record's trace parent is the attempt that failed (whose own parent is the producer).
This works with Tracing on either side of DeadLetter; outside it (the usual place), the span also
records the dead-lettered failure and the dead-letter topic.

Place it near the outside, after :class:`~keyedconsumer.middleware.Recover`::

    [Recover(), Tracing(), Logging(), Metrics(), DeadLetter(...), Retry(), Typed(Order)]

opentelemetry is imported only when a ``Tracing`` is built, so ``keyedconsumer.middleware`` works
without the extra.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import Token
from typing import TYPE_CHECKING, Any

from keyedconsumer import Message, RetryLater, SkipMessage, Status

from ._kind import around
from .dead_letter import STATE_ERROR, STATE_HEADERS
from .logging import outcome_of

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.propagators.textmap import TextMapPropagator
    from opentelemetry.trace import Link, Span, SpanContext, SpanKind, Tracer, TracerProvider
    from opentelemetry.trace.status import Status as SpanStatus
    from opentelemetry.trace.status import StatusCode

__all__ = ["Tracing", "ATTEMPT", "OUTCOME"]

#: The span attribute holding ``Message.attempt``.
ATTEMPT = "keyedconsumer.message.attempt"
#: The span attribute holding the outcome (as :class:`~keyedconsumer.middleware.Logging` names it).
OUTCOME = "keyedconsumer.outcome"
_RETRY_DELAY = "keyedconsumer.retry.delay_s"
_DLQ_TOPIC = "keyedconsumer.dead_letter.topic"
#: ``msg.state`` keys of this middleware: the previous and the first attempt's span contexts.
_PREV = "tracing.span_context"
_FIRST = "tracing.first_span_context"
_MAX_STATUS_CHARS = 500


def _fqcn(exc: BaseException) -> str:
    cls = type(exc)
    return f"{cls.__module__}.{cls.__qualname__}"


class Tracing:
    """Open one OpenTelemetry ``CONSUMER`` span per attempt of each message.

    Parameters
    ----------
    tracer_provider:
        Where spans go (default: the global provider, ``opentelemetry.trace.set_tracer_provider``).
    propagator:
        Reads the trace context from the record's headers and writes it for the dead-letter record
        (default: the global one, W3C trace context and baggage unless ``OTEL_PROPAGATORS`` says
        otherwise).
    record_key:
        Put the message key (when valid UTF-8) in ``messaging.kafka.message.key``. Turn it off when
        keys are personal data.

    Raises
    ------
    ImportError
        opentelemetry-api is not installed (``pip install 'keyedconsumer[tracing]'``).
    """

    def __init__(
        self,
        *,
        tracer_provider: TracerProvider | None = None,
        propagator: TextMapPropagator | None = None,
        record_key: bool = True,
    ) -> None:
        try:
            from opentelemetry import context as otel_context
            from opentelemetry import propagate, trace

            # the attribute names, from the semantic conventions' own package (the messaging ones
            # are still "incubating" there, hence the module path)
            from opentelemetry.semconv._incubating.attributes import messaging_attributes as sc
            from opentelemetry.semconv.attributes.error_attributes import ERROR_TYPE
            from opentelemetry.trace.status import Status as SpanStatus
            from opentelemetry.trace.status import StatusCode
        except ImportError as exc:
            raise ImportError(
                "Tracing needs opentelemetry-api and opentelemetry-semantic-conventions: "
                "pip install 'keyedconsumer[tracing]'"
            ) from exc
        self._sc = sc
        self._error_type = ERROR_TYPE
        self.record_key = bool(record_key)
        self.tracer: Tracer = trace.get_tracer(
            "keyedconsumer.middleware.tracing", tracer_provider=tracer_provider
        )
        self.propagator: TextMapPropagator = (
            propagator if propagator is not None else propagate.get_global_textmap()
        )
        self._fields = frozenset(f.lower() for f in self.propagator.fields)
        self._empty: Callable[[], Context] = otel_context.Context
        self._attach: Callable[[Context], Token[Context]] = otel_context.attach
        self._detach: Callable[[Token[Context]], None] = otel_context.detach
        self._in_context: Callable[[Span, Context | None], Context] = trace.set_span_in_context
        self._span_of: Callable[[Context | None], Span] = trace.get_current_span
        self._non_recording: Callable[[SpanContext], Span] = trace.NonRecordingSpan
        self._link: type[Link] = trace.Link
        self._consumer_kind: SpanKind = trace.SpanKind.CONSUMER
        self._status: type[SpanStatus] = SpanStatus
        self._error: StatusCode = StatusCode.ERROR

    def __call__(self, handler: Any) -> Any:
        return around(handler, self._before, self._after)

    # -- the span of one attempt -------------------------------------------------------------------

    def _carrier(self, msg: Message) -> dict[str, str]:
        fields = self._fields
        return {
            k.lower(): v.decode("utf-8", "replace")
            for k, v in msg.headers
            if v is not None and (not fields or k.lower() in fields)
        }

    def _parent(self, msg: Message) -> Context:
        """The producer's context from the headers; without one, the first attempt's span (if any)."""
        parent = self.propagator.extract(self._carrier(msg), context=self._empty())
        if not self._span_of(parent).get_span_context().is_valid and msg.attempt > 1:
            first = msg.state.get(_FIRST)
            if first is not None:
                parent = self._in_context(self._non_recording(first), parent)
        return parent

    def _attributes(self, msg: Message) -> dict[str, Any]:
        sc = self._sc
        attrs: dict[str, Any] = {
            sc.MESSAGING_SYSTEM: sc.MessagingSystemValues.KAFKA.value,
            sc.MESSAGING_OPERATION_TYPE: sc.MessagingOperationTypeValues.PROCESS.value,
            sc.MESSAGING_OPERATION_NAME: "process",
            sc.MESSAGING_DESTINATION_NAME: msg.topic,
            sc.MESSAGING_DESTINATION_PARTITION_ID: str(msg.partition),
            sc.MESSAGING_KAFKA_OFFSET: msg.offset,
            sc.MESSAGING_CONSUMER_GROUP_NAME: msg.group_id,
            ATTEMPT: msg.attempt,
        }
        if msg.value is None:
            attrs[sc.MESSAGING_KAFKA_MESSAGE_TOMBSTONE] = True
        else:
            attrs[sc.MESSAGING_MESSAGE_BODY_SIZE] = len(msg.value)
        if self.record_key and msg.key is not None:
            try:
                attrs[sc.MESSAGING_KAFKA_MESSAGE_KEY] = msg.key.decode("utf-8")
            except UnicodeDecodeError:
                pass  # no canonical text form: not recorded (semantic conventions)
        return attrs

    def _before(self, msg: Message) -> tuple[Span, Token[Context]]:
        parent = self._parent(msg)
        prev = msg.state.get(_PREV)
        links = [self._link(prev, {"keyedconsumer.link": "previous attempt"})] if prev is not None else None
        span = self.tracer.start_span(
            f"process {msg.topic}",
            context=parent,
            kind=self._consumer_kind,
            attributes=self._attributes(msg),
            links=links,
        )
        ctx = self._in_context(span, parent)
        span_context = span.get_span_context()
        msg.state[_PREV] = span_context
        msg.state.setdefault(_FIRST, span_context)
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=ctx)
        msg.state[STATE_HEADERS] = [(k, v.encode("utf-8")) for k, v in carrier.items()]
        return span, self._attach(ctx)

    def _after(self, msg: Message, exc: BaseException | None, state: tuple[Span, Token[Context]]) -> None:
        span, token = state
        try:
            self._finish(span, msg, exc)
        finally:
            span.end()
            self._detach(token)
        if exc is not None:
            raise exc

    def _finish(self, span: Span, msg: Message, exc: BaseException | None) -> None:
        span.set_attribute(OUTCOME, outcome_of(msg, exc))
        if isinstance(exc, RetryLater):
            span.set_attribute(_RETRY_DELAY, exc.delay_s)
            cause = exc.__cause__ if exc.__cause__ is not None else exc
            self._failed(span, cause, f"retry in {exc.delay_s:g} s after {type(cause).__name__}: {cause}")
        elif isinstance(exc, SkipMessage):
            return
        elif exc is not None:
            self._failed(span, exc)
        elif msg.state.get("dead_lettered"):
            topic = str(msg.state["dead_lettered"])
            span.set_attribute(_DLQ_TOPIC, topic)
            span.add_event("dead_lettered", {"messaging.destination.name": topic})
            error = msg.state.get(STATE_ERROR)
            if isinstance(error, BaseException):
                self._failed(span, error, f"dead-lettered to {topic}: {type(error).__name__}: {error}")
            else:
                span.set_status(self._status(self._error, f"dead-lettered to {topic}"))
        elif msg.status is Status.FAIL and msg.error is not None:
            self._failed(span, msg.error)

    def _failed(self, span: Span, error: BaseException, description: str | None = None) -> None:
        span.record_exception(error)
        span.set_attribute(self._error_type, _fqcn(error))
        text = description if description is not None else f"{type(error).__name__}: {error}"
        span.set_status(self._status(self._error, text[:_MAX_STATUS_CHARS]))

    def __repr__(self) -> str:
        return f"Tracing(record_key={self.record_key})"
