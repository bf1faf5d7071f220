"""Tracing on the real broker: produced trace context is continued, retries and dead letters are traced."""

from __future__ import annotations

import threading
import uuid

import pytest
from confluent_kafka import Producer
from keyedconsumer.middleware import DeadLetter, Retry, Tracing
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from keyedconsumer import KeyedConsumer, Message

from .kafkautil import committed, end_offsets, read_all, wait_until

pytestmark = [pytest.mark.kafka]

OK_TRACE, OK_PARENT = 0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331
BAD_TRACE, BAD_PARENT = 0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7


def traceparent(trace_id: int, span_id: int) -> bytes:
    return f"00-{trace_id:032x}-{span_id:016x}-01".encode()


def produce_with_headers(
    bootstrap: str, topic: str, records: list[tuple[bytes, bytes, list[tuple[str, bytes]]]]
) -> None:
    p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True})
    for key, value, headers in records:
        p.produce(topic, value=value, key=key, headers=headers, partition=0)
    assert p.flush(30) == 0


@pytest.mark.timeout(90)
def test_produced_context_is_continued_and_a_dead_lettered_message_is_traced_per_attempt(
    kafka_bootstrap: str,
    new_topic,
    start,  # type: ignore[no-untyped-def]
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    # given a record that succeeds and a poison record, each produced with a traceparent header
    topic = new_topic(1)
    produce_with_headers(
        kafka_bootstrap,
        topic,
        [
            (b"ok", b"1", [("traceparent", traceparent(OK_TRACE, OK_PARENT))]),
            (b"poison", b"2", [("traceparent", traceparent(BAD_TRACE, BAD_PARENT)), ("tenant", b"t1")]),
        ],
    )
    handled = threading.Event()

    def handle(msg: Message) -> None:
        if msg.key == b"poison":
            raise RuntimeError("poison pill")
        handled.set()

    group = f"tracing-{uuid.uuid4().hex[:8]}"
    dead_letter = DeadLetter(brokers=[kafka_bootstrap])
    consumer = KeyedConsumer(
        name=group,
        handler=handle,
        brokers=[kafka_bootstrap],
        topics=[topic],
        concurrency=2,
        middlewares=[
            Tracing(tracer_provider=provider),
            dead_letter,
            Retry(max_attempts=3, initial_delay_s=0.2, jitter=0.0),
        ],
    )
    # when the consumer runs until the poison record was dead-lettered
    running = start(consumer)
    assert wait_until(lambda: handled.is_set() and dead_letter.published == 1, 60)
    assert running.stop(30) and running.error is None
    provider.shutdown()
    spans = exporter.get_finished_spans()
    # then the good record has one CONSUMER span, a child of its producer's span
    (ok,) = [s for s in spans if s.context is not None and s.context.trace_id == OK_TRACE]
    assert ok.kind is SpanKind.CONSUMER and ok.parent is not None and ok.parent.span_id == OK_PARENT
    attrs = dict(ok.attributes or {})
    assert attrs["messaging.destination.name"] == topic and attrs["messaging.consumer.group.name"] == group
    assert attrs["messaging.kafka.offset"] == 0 and attrs["messaging.destination.partition.id"] == "0"
    assert attrs["messaging.kafka.message.key"] == "ok" and ok.status.status_code is StatusCode.UNSET
    # and the poison record has one span per attempt, all children of its producer's span
    bad = sorted(
        (s for s in spans if s.context is not None and s.context.trace_id == BAD_TRACE),
        key=lambda s: dict(s.attributes or {})["keyedconsumer.message.attempt"],
    )
    assert [dict(s.attributes or {})["keyedconsumer.message.attempt"] for s in bad] == [1, 2, 3]
    assert all(s.parent is not None and s.parent.span_id == BAD_PARENT for s in bad)
    assert all(s.status.status_code is StatusCode.ERROR for s in bad)
    assert [dict(s.attributes or {})["keyedconsumer.outcome"] for s in bad] == [
        "RETRY",
        "RETRY",
        "DEAD_LETTERED",
    ]
    for prev, cur in zip(bad, bad[1:], strict=False):
        assert prev.context is not None and [link.context.span_id for link in cur.links] == [
            prev.context.span_id
        ]
    assert any(e.name == "exception" for e in bad[2].events)
    # and the dead-letter record carries the last attempt's trace context (and the other headers)
    (dead,) = read_all(kafka_bootstrap, f"{topic}.dlq", 1)
    headers = dead.headers() or []
    last = bad[2].context
    assert last is not None
    assert [v for k, v in headers if k == "traceparent"] == [traceparent(BAD_TRACE, last.span_id)]
    assert ("tenant", b"t1") in headers and ("kafka_dlt-attempts", b"3") in headers
    # and everything is committed
    assert committed(kafka_bootstrap, group, topic, 1) == end_offsets(kafka_bootstrap, topic, 1)
