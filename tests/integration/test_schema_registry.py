"""Schema Registry payloads against the real broker and a real registry process: Avro, Protobuf and
JSON Schema records written by confluent-kafka's serializers reach ``Message[Order]`` handlers
decoded (keys too), and undecodable records land in the dead-letter topic with their headers.

The registry is the one ``scripts/registry up`` starts (franz-go's srfake, an in-memory
implementation of the Confluent REST API, on 127.0.0.1:8081), named by ``SCHEMA_REGISTRY_URL``;
without it these tests fail under ``CI=true`` and are skipped otherwise.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.schema_registry.json_schema import JSONSerializer
from confluent_kafka.schema_registry.protobuf import ProtobufSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from keyedconsumer.middleware import DeadLetter, Retry, Text, Typed
from keyedconsumer.middleware.schema_registry import Avro, JsonSchema, Protobuf
from pydantic import BaseModel, Field

from keyedconsumer import KeyedConsumer, Message, MessageError

from .kafkautil import produce, read_all, wait_until

pytestmark = [pytest.mark.kafka]

HINT = "start it with `scripts/registry up` and export SCHEMA_REGISTRY_URL=http://127.0.0.1:8081"


@pytest.fixture(scope="session")
def schema_registry_url() -> Iterator[str]:
    """URL of a running Confluent-compatible Schema Registry (``SCHEMA_REGISTRY_URL``)."""
    url = os.environ.get("SCHEMA_REGISTRY_URL", "")
    problem = "SCHEMA_REGISTRY_URL is not set"
    if url:
        try:
            with urllib.request.urlopen(f"{url.rstrip('/')}/subjects", timeout=5) as resp:
                json.load(resp)
            yield url
            return
        except Exception as exc:  # noqa: BLE001 - any failure means: not usable
            problem = f"{url} does not answer ({exc})"
    msg = f"Schema Registry is not available: {problem}: {HINT}"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(msg, pytrace=False)
    pytest.skip(msg)


@pytest.fixture
def registry(schema_registry_url: str) -> SchemaRegistryClient:
    return SchemaRegistryClient({"url": schema_registry_url})


class Order(BaseModel):
    id: str
    seq: int
    cents: int = Field(ge=0)


class OrderKey(BaseModel):
    customer: str


ORDER_AVSC = json.dumps(
    {
        "type": "record",
        "name": "Order",
        "namespace": "kc.test",
        "fields": [
            {"name": "id", "type": "string"},
            {"name": "seq", "type": "int"},
            {"name": "cents", "type": "int"},
        ],
    }
)
KEY_AVSC = json.dumps(
    {
        "type": "record",
        "name": "OrderKey",
        "namespace": "kc.test",
        "fields": [{"name": "customer", "type": "string"}],
    }
)
ORDER_JSON_SCHEMA = json.dumps(
    {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "title": "Order",
        "type": "object",
        "properties": {"id": {"type": "string"}, "seq": {"type": "integer"}, "cents": {"type": "integer"}},
        "required": ["id", "seq", "cents"],
        "additionalProperties": False,
    }
)


def _order_proto() -> Any:
    """An ``Order`` Protobuf message class, built from its descriptor (what protoc would generate)."""
    fdp = descriptor_pb2.FileDescriptorProto(
        name=f"kc_order_{uuid.uuid4().hex[:8]}.proto", package="kctest", syntax="proto3"
    )
    m = fdp.message_type.add(name="Order")
    m.field.add(
        name="id",
        number=1,
        type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
        label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL,
    )
    m.field.add(
        name="seq",
        number=2,
        type=descriptor_pb2.FieldDescriptorProto.TYPE_INT64,
        label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL,
    )
    m.field.add(
        name="cents",
        number=3,
        type=descriptor_pb2.FieldDescriptorProto.TYPE_INT64,
        label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL,
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("kctest.Order"))


def _ctx(topic: str, field: str = "value") -> SerializationContext:
    return SerializationContext(topic, MessageField.KEY if field == "key" else MessageField.VALUE)


def _framed(schema_id: int, payload: bytes) -> bytes:
    return b"\x00" + struct.pack(">I", schema_id) + payload


def _orders(n: int, keys: int) -> list[tuple[str, dict[str, Any]]]:
    """``n`` orders over ``keys`` customers; ``seq`` counts each customer's orders from 0."""
    seqs: dict[str, int] = {}
    out = []
    for i in range(n):
        customer = f"c{i % keys}"
        seq = seqs[customer] = seqs.get(customer, -1) + 1
        out.append((customer, {"id": f"o{i}", "seq": seq, "cents": i}))
    return out


def _run(consumer: KeyedConsumer, done: Callable[[], bool], timeout_s: float) -> None:
    """Run ``consumer`` until ``done()`` (or ``timeout_s``), then stop it; errors of run() propagate."""

    def watch() -> None:
        wait_until(done, timeout_s)
        consumer.stop()

    threading.Thread(target=watch, daemon=True).start()
    consumer.run()


def _collect() -> tuple[list[Message[Any]], Callable[[Message[Any]], None]]:
    seen: list[Message[Any]] = []
    lock = threading.Lock()

    def handle(msg: Message[Any]) -> None:
        with lock:
            seen.append(msg)

    return seen, handle


def _per_key_in_order(seen: list[Message[Any]], key: Callable[[Message[Any]], str]) -> bool:
    last: dict[str, int] = {}
    for m in seen:
        k = key(m)
        if m.payload.seq != last.get(k, -1) + 1:
            return False
        last[k] = m.payload.seq
    return True


@pytest.mark.timeout(120)
def test_avro_values_and_keys_reach_the_handler_as_models(kafka_bootstrap: str, new_topic, registry) -> None:  # type: ignore[no-untyped-def]
    # given 300 Avro orders over 2 partitions, keyed by an Avro OrderKey, and a tombstone, all
    # written by confluent-kafka's AvroSerializer (which registers the schemas)
    topic = new_topic(2)
    value_ser, key_ser = AvroSerializer(registry, ORDER_AVSC), AvroSerializer(registry, KEY_AVSC)
    orders = _orders(300, keys=12)
    records: list[tuple[bytes | None, bytes | None, int | None]] = [
        (key_ser({"customer": c}, _ctx(topic, "key")), value_ser(o, _ctx(topic)), None) for c, o in orders
    ]
    records.append((key_ser({"customer": "gone"}, _ctx(topic, "key")), None, None))
    produce(kafka_bootstrap, topic, records)
    seen, handle = _collect()

    typed: list[Message[Order]] = seen
    # when a consumer decodes them with Typed(Avro(...)) for the value and the key
    consumer = KeyedConsumer(
        name=f"sr-avro-{uuid.uuid4().hex[:8]}",
        handler=handle,
        brokers=[kafka_bootstrap],
        topics=[topic],
        concurrency=8,
        middlewares=[
            DeadLetter(brokers=[kafka_bootstrap]),
            Retry(),
            Typed(Avro(registry, model=Order), key=Avro(registry, model=OrderKey)),
        ],
    )
    _run(consumer, lambda: len(seen) >= 301, 90)
    # then every order arrived as an Order with its OrderKey, each customer's in order
    assert len(typed) == 301
    decoded = {
        (m.key_payload.customer, m.payload.id, m.payload.seq, m.payload.cents) for m in typed if m.payload
    }
    assert decoded == {(c, o["id"], o["seq"], o["cents"]) for c, o in orders}
    assert _per_key_in_order([m for m in typed if m.payload], lambda m: m.key_payload.customer)
    tomb = [m for m in typed if m.payload is None]
    assert [(m.key_payload, m.value) for m in tomb] == [(OrderKey(customer="gone"), None)]


@pytest.mark.timeout(120)
def test_json_schema_records_are_validated_and_violations_dead_lettered(
    kafka_bootstrap: str, new_topic, registry
) -> None:  # type: ignore[no-untyped-def]
    # given 100 orders written by JSONSerializer (validated and registered), with plain-text keys,
    # and one record framed with the same schema id whose document violates the schema
    topic = new_topic(1)
    ser = JSONSerializer(ORDER_JSON_SCHEMA, registry)
    orders = _orders(100, keys=5)
    records: list[tuple[bytes | None, bytes | None, int | None]] = [
        (c.encode(), ser(o, _ctx(topic)), 0) for c, o in orders[:50]
    ]
    schema_id = registry.get_latest_version(f"{topic}-value").schema_id
    records.append((b"c0", _framed(schema_id, b'{"id": "bad", "seq": 0, "cents": "lots"}'), 0))
    records += [(c.encode(), ser(o, _ctx(topic)), 0) for c, o in orders[50:]]
    produce(kafka_bootstrap, topic, records)
    seen, handle = _collect()
    # when a consumer decodes them with Typed(JsonSchema(...), key=Text())
    consumer = KeyedConsumer(
        name=f"sr-json-{uuid.uuid4().hex[:8]}",
        handler=handle,
        brokers=[kafka_bootstrap],
        topics=[topic],
        concurrency=4,
        middlewares=[
            DeadLetter(brokers=[kafka_bootstrap]),
            Retry(),
            Typed(JsonSchema(registry, model=Order), key=Text()),
        ],
    )
    _run(consumer, lambda: len(seen) >= 100, 90)
    # then the 100 orders arrived as Orders keyed by str, each customer's in order
    assert sorted(m.payload.id for m in seen) == sorted(o["id"] for _, o in orders)
    assert all(
        isinstance(m.payload, Order) and m.key_payload == f"c{int(m.payload.id[1:]) % 5}" for m in seen
    )
    assert _per_key_in_order(seen, lambda m: m.key_payload)
    # and the violating record is in the dead-letter topic, unchanged, with the failure headers
    dead = read_all(kafka_bootstrap, f"{topic}.dlq", 1)
    assert len(dead) == 1 and dead[0].key() == b"c0" and dead[0].value() == records[50][1]
    h = dict(dead[0].headers())
    assert h["kafka_dlt-original-offset"] == b"50" and h["kafka_dlt-attempts"] == b"1"
    assert h["kafka_dlt-exception-fqcn"] == b"keyedconsumer.middleware.typed.DecodeError"
    errors = json.loads(h["kafka_dlt-validation-errors"])
    assert errors[0]["type"] == "schema_mismatch" and "'lots' is not of type 'integer'" in errors[0]["msg"]


@pytest.mark.timeout(120)
def test_protobuf_records_reach_the_handler_as_messages(kafka_bootstrap: str, new_topic, registry) -> None:  # type: ignore[no-untyped-def]
    # given 200 Protobuf orders written by ProtobufSerializer over 3 partitions
    topic = new_topic(3)
    order_pb = _order_proto()
    ser = ProtobufSerializer(order_pb, registry, {"use.deprecated.format": False})
    orders = _orders(200, keys=7)
    produce(kafka_bootstrap, topic, [(c.encode(), ser(order_pb(**o), _ctx(topic)), None) for c, o in orders])
    seen, handle = _collect()
    # when a consumer decodes them with Typed(Protobuf(Order, ...))
    consumer = KeyedConsumer(
        name=f"sr-proto-{uuid.uuid4().hex[:8]}",
        handler=handle,
        brokers=[kafka_bootstrap],
        topics=[topic],
        concurrency=8,
        middlewares=[
            DeadLetter(brokers=[kafka_bootstrap]),
            Retry(),
            Typed(Protobuf(order_pb, registry), key=Text()),
        ],
    )
    _run(consumer, lambda: len(seen) >= 200, 90)
    # then each is an instance of the message class with the fields written, in order per key
    assert all(isinstance(m.payload, order_pb) for m in seen)
    assert sorted((m.key_payload, m.payload.id, m.payload.seq, m.payload.cents) for m in seen) == sorted(
        (c, o["id"], o["seq"], o["cents"]) for c, o in orders
    )
    assert _per_key_in_order(seen, lambda m: m.key_payload)


@pytest.mark.timeout(120)
def test_undecodable_records_are_dead_lettered_with_their_headers_and_the_rest_flow(
    kafka_bootstrap: str, new_topic, registry
) -> None:  # type: ignore[no-untyped-def]
    # given, between good Avro orders, a record that is plain JSON (bad magic byte), one too short
    # for its frame, one naming a schema id the registry does not know, one whose bytes do not match
    # its writer schema, and one that decodes but breaks the model (cents >= 0)
    topic = new_topic(1)
    ser = AvroSerializer(registry, ORDER_AVSC)
    good = [ser({"id": f"g{i}", "seq": i, "cents": i}, _ctx(topic)) for i in range(3)]
    schema_id = registry.get_latest_version(f"{topic}-value").schema_id
    bad = {
        b"magic": (b'{"id": "x", "seq": 0, "cents": 1}', "wire_format", "magic byte 0x7b"),
        b"short": (b"\x00\x00\x01", "wire_format", "too short"),
        b"unknown": (_framed(987654, good[0][5:]), "unknown_schema_id", "schema id 987654 is unknown"),
        b"mismatch": (_framed(schema_id, b"\x02x"), "schema_mismatch", f"writer schema id {schema_id}"),
        b"model": (
            ser({"id": "neg", "seq": 0, "cents": -5}, _ctx(topic)),
            "greater_than_equal",
            "greater than or equal",
        ),
    }
    records: list[tuple[bytes | None, bytes | None, int | None]] = [(b"k", good[0], 0)]
    records += [(k, v, 0) for k, (v, _, _) in bad.items()]
    records += [(b"k", good[1], 0), (b"k", good[2], 0)]
    produce(kafka_bootstrap, topic, records)
    seen, handle = _collect()
    group = f"sr-bad-{uuid.uuid4().hex[:8]}"
    # when a consumer with DeadLetter outside Retry and Typed(Avro) reads them
    consumer = KeyedConsumer(
        name=group,
        handler=handle,
        brokers=[kafka_bootstrap],
        topics=[topic],
        middlewares=[
            DeadLetter(brokers=[kafka_bootstrap]),
            Retry(max_attempts=3, initial_delay_s=0.01),
            Typed(Avro(registry, model=Order)),
        ],
    )
    _run(consumer, lambda: len(seen) >= 3, 90)
    # then the good orders reached the handler in order
    assert [m.payload.id for m in seen] == ["g0", "g1", "g2"]
    # and each undecodable record is in the dead-letter topic once, unchanged, never retried, with
    # the failure headers naming where it came from and why
    dead = read_all(kafka_bootstrap, f"{topic}.dlq", len(bad))
    assert [m.key() for m in dead] == list(bad)
    for offset, m in enumerate(dead, start=1):
        value, kind, words = bad[m.key()]
        h = dict(m.headers())
        assert m.value() == value
        assert h["kafka_dlt-original-topic"] == topic.encode()
        assert (h["kafka_dlt-original-partition"], h["kafka_dlt-original-offset"]) == (
            b"0",
            str(offset).encode(),
        )
        assert h["kafka_dlt-original-consumer-group"] == group.encode() and h["kafka_dlt-attempts"] == b"1"
        assert h["kafka_dlt-exception-fqcn"] == b"keyedconsumer.middleware.typed.DecodeError"
        assert f"offset={offset}".encode() in h["kafka_dlt-exception-message"]
        assert words.encode() in h["kafka_dlt-exception-message"], h["kafka_dlt-exception-message"]
        errors = json.loads(h["kafka_dlt-validation-errors"])
        assert errors[0]["type"] == kind, errors


@pytest.mark.timeout(90)
def test_an_unknown_schema_id_without_dead_letter_stops_naming_the_record(
    kafka_bootstrap: str, new_topic, registry
) -> None:  # type: ignore[no-untyped-def]
    # given a record naming a schema id the registry does not know
    topic = new_topic(1)
    produce(kafka_bootstrap, topic, [(b"a", _framed(876543, b"\x02x\x00\x00"), 0)])
    # when a consumer without DeadLetter decodes it
    consumer = KeyedConsumer(
        name=f"sr-stop-{uuid.uuid4().hex[:8]}",
        handler=lambda m: None,
        brokers=[kafka_bootstrap],
        topics=[topic],
        middlewares=[Retry(max_attempts=3, initial_delay_s=0.01), Typed(Avro(registry))],
    )
    # then it stops with an error naming the topic, partition and offset (never retried)
    with pytest.raises(MessageError) as info:
        consumer.run()
    assert (info.value.topic, info.value.partition, info.value.offset) == (topic, 0, 0)
    assert "schema id 876543 is unknown to the registry" in str(info.value)


@pytest.mark.timeout(180)
def test_the_schema_registry_example(kafka_bootstrap: str, schema_registry_url: str) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "examples/schema_registry.py",
            "--brokers",
            kafka_bootstrap,
            "--registry",
            schema_registry_url,
            "--orders",
            "500",
        ],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "order violations    0" in out.stdout and "dead-lettered       1" in out.stdout
    assert "RESULT              OK" in out.stdout
