"""Mistakes that mypy --strict must report, each on the line marked with "E:" and part of the message.

Not run: tests/unit/test_typing.py type-checks it and compares the errors with the marks.
"""

from __future__ import annotations

from keyedconsumer.middleware import Typed
from keyedconsumer.middleware.schema_registry import Avro
from pydantic import BaseModel

from keyedconsumer import Message


class Order(BaseModel):
    id: str
    cents: int


def wrong_field(msg: Message[Order]) -> None:
    print(msg.payload.total)  # E: "Order" has no attribute "total"


def wrong_type(msg: Message[Order]) -> str:
    name: str = msg.payload.cents  # E: Incompatible types in assignment
    return name


def tombstone_unchecked(msg: Message[Order | None]) -> None:
    print(msg.payload.cents)  # E: Item "None" of "Order | None" has no attribute "cents"


not_a_model = Typed(42)  # E: No overload variant of "Typed" matches argument type "int"
dicts_are_not_orders: Typed[Order] = Typed(Avro("http://127.0.0.1:8081"))  # E: expected "Decoder[Order]"
