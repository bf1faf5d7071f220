"""Tracing middleware with the OpenTelemetry SDK's in-memory exporter (no Kafka)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from keyedconsumer.middleware import DeadLetter, Retry, Tracing
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from keyedconsumer import Message, RetryLater, SkipMessage

pytestmark = [pytest.mark.timeout(30)]

TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
PARENT_ID = 0x00F067AA0BA902B7
TRACEPARENT = f"00-{TRACE_ID:032x}-{PARENT_ID:016x}-01".encode()


@pytest.fixture
def otel() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def msg(
    headers: list[tuple[str, bytes | None]] | None = None,
    key: bytes | None = b"acct-1",
    value: bytes | None = b"{}",
) -> Message:
    return Message("orders", 3, 42, key, value, headers, 1_700_000_000_000)


def drive(handler: Callable[[Message], Any], m: Message, max_attempts: int = 10) -> None:
    """Run ``m`` like the engine does: again after each RetryLater, with the attempt increased."""
    for _ in range(max_attempts):
        try:
            handler(m)
            return
        except RetryLater:
            m.attempt += 1
    raise AssertionError("still retrying")


class FakePublisher:
    def __init__(self) -> None:
        self.records: list[tuple[str, list[tuple[str, bytes | None]]]] = []

    def publish(self, topic, key, value, headers=None, timeout_s=30.0):  # type: ignore[no-untyped-def]
        self.records.append((topic, list(headers or [])))
        return 0, len(self.records) - 1


def traceparent_of(span: ReadableSpan) -> bytes:
    ctx = span.get_span_context()
    assert ctx is not None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-01".encode()


def test_a_record_with_traceparent_gets_a_consumer_child_span(otel) -> None:  # type: ignore[no-untyped-def]
    provider, exporter = otel
    seen: list[Any] = []
    # given a record whose producer put a W3C trace context in its headers
    m = msg([("traceparent", TRACEPARENT), ("tracestate", b"vendor=1"), ("other", b"x")])
    # when the traced handler runs
    Tracing(tracer_provider=provider)(lambda m: seen.append(trace.get_current_span()))(m)
    # then one CONSUMER span, child of the producer's span, with the messaging attributes
    (span,) = exporter.get_finished_spans()
    assert span.name == "process orders" and span.kind is SpanKind.CONSUMER
    assert span.parent is not None and span.parent.span_id == PARENT_ID and span.parent.is_remote
    assert span.context is not None and span.context.trace_id == TRACE_ID
    assert span.context.trace_state.get("vendor") == "1"
    attrs = dict(span.attributes or {})
    assert attrs == {
        "messaging.system": "kafka",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": "orders",
        "messaging.destination.partition.id": "3",
        "messaging.kafka.offset": 42,
        "messaging.consumer.group.name": "",
        "messaging.kafka.message.key": "acct-1",
        "messaging.message.body.size": 2,
        "keyedconsumer.message.attempt": 1,
        "keyedconsumer.outcome": "SUCCESS",
    }
    assert span.status.status_code is StatusCode.UNSET
    # and the span was current inside the handler, not after it
    assert seen[0].get_span_context().span_id == span.context.span_id
    assert not trace.get_current_span().get_span_context().is_valid


def test_without_trace_context_the_span_is_a_root(otel) -> None:  # type: ignore[no-untyped-def]
    provider, exporter = otel
    Tracing(tracer_provider=provider)(lambda m: None)(msg())
    (span,) = exporter.get_finished_spans()
    assert span.parent is None


def test_handler_spans_are_children_of_the_consumer_span(otel) -> None:  # type: ignore[no-untyped-def]
    provider, exporter = otel
    tracer = provider.get_tracer("app")

    def handle(m: Message) -> None:
        with tracer.start_as_current_span("write ledger"):
            pass

    Tracing(tracer_provider=provider)(handle)(msg([("traceparent", TRACEPARENT)]))
    inner, outer = exporter.get_finished_spans()
    assert inner.name == "write ledger" and outer.name == "process orders"
    assert (
        inner.parent is not None
        and outer.context is not None
        and inner.parent.span_id == outer.context.span_id
    )


def test_a_failure_is_recorded_with_error_status_and_reraised(otel) -> None:  # type: ignore[no-untyped-def]
    provider, exporter = otel

    def handle(m: Message) -> None:
        raise ValueError("bad amount")

    with pytest.raises(ValueError):
        Tracing(tracer_provider=provider)(handle)(msg())
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR and "bad amount" in (span.status.description or "")
    attrs = dict(span.attributes or {})
    assert attrs["error.type"] == "builtins.ValueError" and attrs["keyedconsumer.outcome"] == "FAIL"
    (event,) = span.events
    assert event.name == "exception" and dict(event.attributes or {})["exception.type"].endswith("ValueError")


def test_ack_fail_is_an_error_and_skip_is_not(otel) -> None:  # type: ignore[no-untyped-def]
    provider, exporter = otel
    tracing = Tracing(tracer_provider=provider)
    tracing(lambda m: m.ack_fail(KeyError("gone")))(msg())

    def skip(m: Message) -> None:
        raise SkipMessage()

    with pytest.raises(SkipMessage):
        tracing(skip)(msg())
    failed, skipped = exporter.get_finished_spans()
    assert (
        failed.status.status_code is StatusCode.ERROR
        and dict(failed.attributes or {})["error.type"] == "builtins.KeyError"
    )
    assert (
        skipped.status.status_code is StatusCode.UNSET
        and dict(skipped.attributes or {})["keyedconsumer.outcome"] == "SKIP"
    )


def test_retries_are_spans_per_attempt_linked_and_the_dead_letter_carries_the_last(otel) -> None:  # type: ignore[no-untyped-def]
    provider, exporter = otel
    pub = FakePublisher()

    def handle(m: Message) -> None:
        raise RuntimeError("poison")

    # given Tracing outside DeadLetter outside Retry(3 attempts)
    stack = Tracing(tracer_provider=provider)(
        DeadLetter(publisher=pub)(Retry(max_attempts=3, jitter=0.0, initial_delay_s=0.5)(handle))  # type: ignore[arg-type]
    )
    # when a record with trace context fails every attempt
    m = msg([("traceparent", TRACEPARENT), ("keep", b"me")])
    drive(stack, m)
    # then there is one span per attempt, each a child of the producer's span, numbered
    spans = exporter.get_finished_spans()
    assert [dict(s.attributes or {})["keyedconsumer.message.attempt"] for s in spans] == [1, 2, 3]
    assert all(s.parent is not None and s.parent.span_id == PARENT_ID for s in spans)
    assert [dict(s.attributes or {})["keyedconsumer.outcome"] for s in spans] == [
        "RETRY",
        "RETRY",
        "DEAD_LETTERED",
    ]
    assert all(s.status.status_code is StatusCode.ERROR for s in spans)
    assert dict(spans[0].attributes or {})["keyedconsumer.retry.delay_s"] == 0.5
    assert dict(spans[2].attributes or {})["error.type"] == "builtins.RuntimeError"
    assert dict(spans[2].attributes or {})["keyedconsumer.dead_letter.topic"] == "orders.dlq"
    assert [e.name for e in spans[2].events] == ["dead_lettered", "exception"]
    # and attempt n links to attempt n - 1
    assert not spans[0].links
    for prev, cur in zip(spans, spans[1:], strict=False):
        (link,) = cur.links
        assert prev.context is not None and link.context.span_id == prev.context.span_id
    # and the dead-letter record's trace parent is the last attempt, in place of the producer's
    ((topic, headers),) = pub.records
    assert topic == "orders.dlq"
    assert [v for k, v in headers if k == "traceparent"] == [traceparent_of(spans[2])]
    assert ("keep", b"me") in headers and ("kafka_dlt-attempts", b"3") in headers


def test_without_trace_context_all_attempts_share_the_first_attempts_trace(otel) -> None:  # type: ignore[no-untyped-def]
    provider, exporter = otel
    calls = []

    def handle(m: Message) -> None:
        calls.append(m.attempt)
        if m.attempt < 3:
            raise RuntimeError("flaky")

    drive(Tracing(tracer_provider=provider)(Retry(max_attempts=3, jitter=0.0)(handle)), msg())
    first, second, third = exporter.get_finished_spans()
    assert calls == [1, 2, 3] and first.parent is None
    assert first.context is not None and second.parent is not None and third.parent is not None
    assert second.parent.span_id == first.context.span_id and third.parent.span_id == first.context.span_id
    assert {s.context.trace_id for s in (first, second, third) if s.context} == {first.context.trace_id}
    assert third.status.status_code is StatusCode.UNSET


def test_tracing_inside_dead_letter_still_gives_the_record_the_attempts_context(otel) -> None:  # type: ignore[no-untyped-def]
    provider, exporter = otel
    pub = FakePublisher()

    def handle(m: Message) -> None:
        raise RuntimeError("poison")

    DeadLetter(publisher=pub)(Tracing(tracer_provider=provider)(handle))(msg([("traceparent", TRACEPARENT)]))  # type: ignore[arg-type]
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR
    assert [v for k, v in pub.records[0][1] if k == "traceparent"] == [traceparent_of(span)]


def test_async_handlers_see_their_span(otel) -> None:  # type: ignore[no-untyped-def]
    provider, exporter = otel
    seen: list[int] = []

    async def handle(m: Message) -> None:
        await asyncio.sleep(0)
        seen.append(trace.get_current_span().get_span_context().span_id)

    wrapped = Tracing(tracer_provider=provider)(handle)
    assert asyncio.iscoroutinefunction(wrapped)

    async def main() -> None:
        await asyncio.gather(wrapped(msg([("traceparent", TRACEPARENT)])), wrapped(msg()))

    asyncio.run(main())
    spans = exporter.get_finished_spans()
    assert sorted(seen) == sorted(s.context.span_id for s in spans if s.context)


@pytest.mark.parametrize(
    "key,value,expect",
    [
        (b"\xff\xfe", b"x", {"messaging.message.body.size": 1}),  # no text form: no key attribute
        (None, None, {"messaging.kafka.message.tombstone": True}),
        (b"", b"", {"messaging.kafka.message.key": "", "messaging.message.body.size": 0}),
    ],
)
def test_keys_and_tombstones(otel, key: bytes | None, value: bytes | None, expect: dict[str, Any]) -> None:  # type: ignore[no-untyped-def]
    provider, exporter = otel
    Tracing(tracer_provider=provider)(lambda m: None)(msg(key=key, value=value))
    attrs = dict(exporter.get_finished_spans()[0].attributes or {})
    extra = {
        k: v
        for k, v in attrs.items()
        if k
        in ("messaging.kafka.message.key", "messaging.kafka.message.tombstone", "messaging.message.body.size")
    }
    assert extra == expect


def test_record_key_false_keeps_keys_out(otel) -> None:  # type: ignore[no-untyped-def]
    provider, exporter = otel
    Tracing(tracer_provider=provider, record_key=False)(lambda m: None)(msg(key=b"alice@example.com"))
    assert "messaging.kafka.message.key" not in dict(exporter.get_finished_spans()[0].attributes or {})


def test_the_package_works_without_the_tracing_extra() -> None:
    code = (
        "import sys; sys.modules['opentelemetry'] = None\n"
        "import keyedconsumer.middleware as mw\n"
        "try:\n    mw.Tracing()\nexcept ImportError as e:\n    print('ERR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "ERR" in out.stdout and "keyedconsumer[tracing]" in out.stdout


def test_importing_middleware_does_not_import_opentelemetry() -> None:
    code = (
        "import sys, keyedconsumer.middleware; print(any(m.startswith('opentelemetry') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr
