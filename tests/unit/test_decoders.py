"""Typed's decoders: values and keys, the errors that make a record undecodable (never retried) and
the ones that do not (the registry could not be asked), without a broker or a registry.

Records that cross Kafka and a real Schema Registry are in tests/integration/test_schema_registry.py.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient, SchemaRegistryError
from confluent_kafka.serialization import SerializationError
from keyedconsumer.middleware import DecodeError, Json, Text, Typed, UndecodableError
from keyedconsumer.middleware.schema_registry import Avro, JsonSchema, Protobuf, registry_client
from keyedconsumer.middleware.schema_registry import _is_transient as is_transient
from keyedconsumer.middleware.unavailable import Unavailable
from pydantic import BaseModel

from keyedconsumer import Message, PermanentError

pytestmark = pytest.mark.timeout(60)

#: nothing listens here: a registry that cannot be asked (port 1 refuses at once)
NOWHERE = {"url": "http://127.0.0.1:1", "max.retries": 0}
#: the topic name strategy asks the registry nothing before the wire format is read
TOPIC_STRATEGY = {"subject.name.strategy.type": "TOPIC"}


class Order(BaseModel):
    id: str
    cents: int


class OrderKey(BaseModel):
    customer: str


def rec(value: bytes | None = b'{"id": "o1", "cents": 5}', key: bytes | None = b"k1") -> Message[Any]:
    return Message("orders", 3, 42, key=key, value=value)


def framed(schema_id: int, payload: bytes) -> bytes:
    return b"\x00" + struct.pack(">I", schema_id) + payload


# -- Message is generic in its payload --------------------------------------------------------------


def test_message_is_generic_at_run_time_too() -> None:
    # given the parameterised and the bare class
    m = Message[Order]("t", 0, 1)
    # then both make messages, and payload and key_payload start empty
    assert isinstance(m, Message) and m.payload is None and m.key_payload is None
    assert Message[Order] is not Message and Message("t", 0, 1).payload is None


# -- values and keys --------------------------------------------------------------------------------


def test_typed_with_a_model_decodes_json_as_before() -> None:
    seen: list[Message[Order]] = []
    Typed(Order)(seen.append)(rec())
    assert seen[0].payload == Order(id="o1", cents=5) and seen[0].key_payload is None


def test_keys_are_decoded_when_a_key_decoder_is_given() -> None:
    # given a UTF-8 key decoder and a JSON key model
    seen: list[Message[Order]] = []
    Typed(Json(Order), key=Text())(seen.append)(rec(key="clé".encode()))
    Typed(Order, key=OrderKey)(seen.append)(rec(key=b'{"customer": "c9"}'))
    # and a null key and a tombstone
    Typed(Order, key=Text())(seen.append)(rec(value=None, key=None))
    # then each reaches the handler decoded; null stays None
    assert [m.key_payload for m in seen] == ["clé", OrderKey(customer="c9"), None]
    assert [m.payload for m in seen] == [Order(id="o1", cents=5), Order(id="o1", cents=5), None]


def test_an_undecodable_key_is_a_decode_error_naming_the_key() -> None:
    seen: list[Message[Order]] = []
    with pytest.raises(DecodeError) as info:
        Typed(Order, key=Text())(seen.append)(rec(key=b"\xff\xfe"))
    assert info.value.field == "key" and not seen and isinstance(info.value, PermanentError)
    assert str(info.value).startswith("cannot decode the key of topic=orders partition=3 offset=42 as str:")
    assert info.value.validation_errors[0]["type"] == "unicode_decode"


def test_a_value_error_names_the_record_and_the_first_field() -> None:
    with pytest.raises(DecodeError) as info:
        Typed(Order).decode(rec(b'{"id": "o1", "cents": "lots"}'))
    assert str(info.value) == (
        "cannot decode topic=orders partition=3 offset=42 as Order: 1 error(s), first: "
        "cents: Input should be a valid integer, unable to parse string as an integer"
    )
    assert info.value.field == "value" and info.value.validation_errors[0]["loc"] == ["cents"]


class Upper:
    """A decoder of its own: ASCII letters only, upper-cased."""

    name = "upper"

    def decode(self, data: bytes, *, msg: Message, field: str) -> str:
        if not data.isalpha():
            raise UndecodableError(f"not letters: {data!r}")
        if data == b"BOOM":
            raise RuntimeError("decoder crashed")
        return data.decode().upper()


def test_any_object_with_decode_is_a_decoder() -> None:
    seen: list[Message[str]] = []
    typed = Typed(Upper(), key=Upper())
    typed(seen.append)(rec(b"abc", key=b"xy"))
    assert (seen[0].payload, seen[0].key_payload) == ("ABC", "XY")
    # an UndecodableError is the record's fault: a DecodeError with the reason as its one error
    with pytest.raises(DecodeError) as info:
        typed.decode(rec(b"a-b"))
    assert info.value.validation_errors == [{"loc": [], "msg": "not letters: b'a-b'", "type": "undecodable"}]
    # anything else is not: it goes the ordinary failure path (Retry retries it)
    with pytest.raises(RuntimeError, match="decoder crashed"):
        typed.decode(rec(b"BOOM"))


class Digits:
    """A decoder without a name: errors show its class name."""

    def decode(self, data: bytes, *, msg: Message, field: str) -> int:
        if not data.isdigit():
            raise UndecodableError("not digits")
        return int(data)


def test_a_decoder_needs_no_name() -> None:
    assert Typed(Digits()).decode(rec(b"42")) == 42
    with pytest.raises(DecodeError, match="offset=42 as Digits: 1 error"):
        Typed(Digits()).decode(rec(b"4x"))


def test_async_handlers_get_decoded_messages() -> None:
    seen: list[Message[Order]] = []

    async def handle(m: Message[Order]) -> None:
        seen.append(m)

    asyncio.run(Typed(Order, key=Text())(handle)(rec()))
    assert seen[0].payload == Order(id="o1", cents=5) and seen[0].key_payload == "k1"


@pytest.mark.parametrize(
    "value, key", [(42, None), ("Order", None), (Order, 5), (Upper, None), (Order(id="a", cents=1), None)]
)
def test_typed_refuses_what_is_neither_a_model_class_nor_a_decoder(value: Any, key: Any) -> None:
    with pytest.raises(TypeError, match="pydantic model class or a decoder"):
        Typed(value, key=key)


# -- Confluent wire format, without a registry ------------------------------------------------------


@pytest.mark.parametrize(
    "decoder",
    [
        lambda: Avro(NOWHERE, conf=TOPIC_STRATEGY),
        lambda: JsonSchema(NOWHERE, conf=TOPIC_STRATEGY),
    ],
    ids=["avro", "json-schema"],
)
@pytest.mark.parametrize(
    "value, reason",
    [
        (
            b'{"id": "o1", "cents": 5}',
            "not Confluent wire format: magic byte 0x7b (expected 0x00, a schema id, or 0x01, a schema GUID)",
        ),
        (b"", "not Confluent wire format: empty"),
        (b"\x00\x00", "not Confluent wire format: 2 bytes, too short for magic byte 0x00 and its schema id"),
        (
            b"\x01" + b"\x00" * 8,
            "not Confluent wire format: 9 bytes, too short for magic byte 0x01 and its schema GUID",
        ),
    ],
)
def test_records_not_in_wire_format_are_undecodable_without_asking_the_registry(
    decoder: Any, value: bytes, reason: str
) -> None:
    with pytest.raises(DecodeError) as info:
        Typed(decoder()).decode(rec(value))
    assert reason in str(info.value) and "offset=42" in str(info.value)
    assert info.value.validation_errors[0]["type"] == "wire_format"


def test_a_registry_that_does_not_answer_is_not_the_records_fault() -> None:
    # given a well-framed record and a registry nobody listens on
    typed = Typed(Avro(NOWHERE, model=Order))
    # when it is decoded, then the record waits (Unavailable, a RetryLater that is no failure):
    # never a DecodeError, so it is never dead-lettered; the transport error is its cause
    with pytest.raises(Unavailable) as info:
        typed.decode(rec(framed(7, b"\x04o1\x0a")))
    assert not isinstance(info.value, DecodeError) and is_transient(info.value.__cause__)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "error, transient",
    [
        (SchemaRegistryError(404, 40403, "Schema not found"), False),
        (SchemaRegistryError(500, 50001, "Error in the backend data store"), True),
        (SchemaRegistryError(401, 401, "Unauthorized"), True),
        (SchemaRegistryError(429, 429, "Too many requests"), True),
        (ConnectionRefusedError(111, "refused"), True),
        (TimeoutError(), True),
        (SerializationError("Invalid magic byte"), False),
        (EOFError("Expected 1 bytes, read 0"), False),
        (IndexError("string index out of range"), False),
    ],
)
def test_which_errors_are_the_registrys_and_which_the_records(error: Exception, transient: bool) -> None:
    assert is_transient(error) is transient


def test_undecodable_reasons_name_the_schema_id() -> None:
    avro = Avro(NOWHERE)
    unknown = avro._undecodable(SchemaRegistryError(404, 40403, "Schema not found"), framed(99999, b"x"), [])
    assert unknown.errors[0]["type"] == "unknown_schema_id" and "schema id 99999 is unknown" in unknown.reason
    mismatch = avro._undecodable(EOFError("Expected 1 bytes, read 0"), framed(3, b"\x02"), [])
    assert mismatch.errors[0]["type"] == "schema_mismatch"
    assert (
        mismatch.reason == "does not match its writer schema id 3 (avro): EOFError: Expected 1 bytes, read 0"
    )
    # with the schema id in a header, the payload has no frame to judge
    headed = avro._undecodable(EOFError("short"), b"\x02", [("__value_schema_id", b"\x00" * 5)])
    assert headed.errors[0]["type"] == "schema_mismatch" and "(id in a header)" in headed.reason


def test_registry_client_takes_a_url_a_configuration_or_a_client() -> None:
    client = SchemaRegistryClient({"url": "http://127.0.0.1:1"})
    assert registry_client(client) is client
    assert isinstance(registry_client("http://127.0.0.1:1"), SchemaRegistryClient)
    assert isinstance(registry_client({"url": "http://127.0.0.1:1"}), SchemaRegistryClient)
    with pytest.raises(TypeError, match="registry must be"):
        registry_client(8081)  # type: ignore[arg-type]
    # the decoders share a client given to them (its schema cache)
    assert Avro(client).client is client and JsonSchema(client).client is client
    assert Avro(client, model=Order).name == "Order" and Avro(client).name == "avro"


def test_protobuf_needs_a_generated_message_class() -> None:
    with pytest.raises(TypeError, match="generated message class"):
        Protobuf(Order, NOWHERE)
