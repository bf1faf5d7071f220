"""Handlers typed with ``Message[Payload]``: mypy --strict must accept every line of this file.

Not run: tests/unit/test_typing.py type-checks it (and typed_handlers_errors.py, which must fail).
"""

from __future__ import annotations

from typing import Any

from keyedconsumer.middleware import DeadLetter, Json, Retry, Text, Typed
from keyedconsumer.middleware.schema_registry import Avro, JsonSchema, Protobuf, registry_client
from pydantic import BaseModel
from typing_extensions import assert_type

from keyedconsumer import KeyedApp, KeyedConsumer, Message


class Order(BaseModel):
    id: str
    cents: int


class OrderKey(BaseModel):
    customer: str


class OrderProto:
    """Stands for a generated Protobuf class (``order_pb2.Order``)."""

    id: str
    cents: int


def handle(msg: Message[Order]) -> None:
    assert_type(msg.payload, Order)
    cents: int = msg.payload.cents
    print(cents, msg.key_payload, msg.offset)


async def handle_async(msg: Message[Order]) -> None:
    assert_type(msg.payload.id, str)


def handle_untyped(msg: Message) -> None:  # the bare Message is Message[Any]: still fine under --strict
    assert_type(msg.payload, Any)


def handle_tombstones(msg: Message[Order | None]) -> None:
    if msg.payload is not None:
        assert_type(msg.payload.cents, int)


def handle_proto(msg: Message[OrderProto]) -> None:
    assert_type(msg.payload.cents, int)


registry = registry_client("http://127.0.0.1:8081")

# the decoders carry their payload type into Typed[...]
assert_type(Typed(Order), Typed[Order])
assert_type(Typed(Json(Order), key=Text()), Typed[Order])
assert_type(Typed(Order, key=OrderKey), Typed[Order])
assert_type(Typed(Avro(registry, model=Order)), Typed[Order])
assert_type(Typed(Avro(registry)), Typed[dict[str, Any]])
assert_type(Typed(JsonSchema(registry, model=Order), key=Avro(registry)), Typed[Order])
assert_type(Typed(Protobuf(OrderProto, registry)), Typed[OrderProto])
assert_type(Typed(Order).decode(Message("t", 0, 0)), Order | None)
assert_type(
    Avro("http://127.0.0.1:8081", model=Order).decode(b"", msg=Message("t", 0, 0), field="value"), Order
)

consumer = KeyedConsumer(
    name="orders",
    handler=handle,
    brokers=["127.0.0.1:9092"],
    topics=["orders"],
    middlewares=[
        DeadLetter(brokers=["127.0.0.1:9092"]),
        Retry(),
        Typed(Avro(registry, model=Order), key=Text()),
    ],
)
consumer_async = KeyedConsumer(
    name="orders",
    handler=handle_async,
    brokers=["127.0.0.1:9092"],
    topics=["orders"],
    middlewares=[Typed(Order)],
)
consumer_untyped = KeyedConsumer(
    name="orders", handler=handle_untyped, brokers=["127.0.0.1:9092"], topics=["orders"]
)

app = KeyedApp(brokers=["127.0.0.1:9092"], group_id="billing")


@app.handler("orders", middlewares=[Typed(JsonSchema(registry, model=Order))])
def handle_route(msg: Message[Order]) -> None:
    assert_type(msg.payload, Order)
