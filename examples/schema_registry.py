"""Avro orders through the Confluent Schema Registry, into a handler typed ``Message[Order]``.

Produces ``--orders`` Avro records (confluent-kafka's AvroSerializer registers the schema) keyed by
customer, plus one record that is not in the Confluent wire format; consumes them with
``Typed(Avro(registry, model=Order), key=Text())`` behind ``DeadLetter``: every order reaches the
handler as an ``Order``, each customer's in order, and the bad record lands in ``<topic>.dlq``.

    scripts/services up && scripts/registry up
    .venv/bin/python examples/schema_registry.py --brokers 127.0.0.1:9092 --registry http://127.0.0.1:8081

Needs the extra ``keyedconsumer[schema-registry]``.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import uuid
from typing import Any

from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic  # (confluent_kafka.admin's stubs do not re-export it)
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from keyedconsumer.middleware import DeadLetter, Retry, Text, Typed
from keyedconsumer.middleware.schema_registry import Avro, registry_client
from pydantic import BaseModel

from keyedconsumer import KeyedConsumer, Message

ORDER_AVSC = json.dumps(
    {
        "type": "record",
        "name": "Order",
        "namespace": "example",
        "fields": [
            {"name": "id", "type": "string"},
            {"name": "seq", "type": "int"},
            {"name": "cents", "type": "long"},
        ],
    }
)


class Order(BaseModel):
    id: str
    seq: int
    cents: int


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--brokers", default="127.0.0.1:9092")
    ap.add_argument("--registry", default="http://127.0.0.1:8081")
    ap.add_argument("--orders", type=int, default=1000)
    ap.add_argument("--customers", type=int, default=50)
    args = ap.parse_args()

    topic = f"orders-avro-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": args.brokers})
    admin.create_topics([NewTopic(topic, num_partitions=4, replication_factor=1)])[topic].result(30)
    registry = registry_client(args.registry)

    # produce: Avro values through the registry, customer ids as UTF-8 keys, and one bad record
    serialize = AvroSerializer(registry, ORDER_AVSC)
    ctx = SerializationContext(topic, MessageField.VALUE)
    producer = Producer({"bootstrap.servers": args.brokers, "acks": "all", "enable.idempotence": True})
    seqs: dict[str, int] = {}
    for i in range(args.orders):
        customer = f"c{i % args.customers}"
        seqs[customer] = seqs.get(customer, -1) + 1
        producer.produce(
            topic,
            key=customer.encode(),
            value=serialize({"id": f"o{i}", "seq": seqs[customer], "cents": 100 + i}, ctx),
        )
        producer.poll(0)
    producer.produce(topic, key=b"c0", value=b'{"id": "plain json", "seq": 0, "cents": 1}')
    producer.flush(30)

    # consume: the handler sees Orders; the plain-JSON record is dead-lettered, not retried
    lock = threading.Lock()
    last_seq: dict[str, int] = {}
    violations = 0
    handled = 0

    def handle(msg: Message[Order]) -> None:
        nonlocal violations, handled
        order: Order = msg.payload
        customer: str = msg.key_payload
        with lock:
            if order.seq != last_seq.get(customer, -1) + 1:
                violations += 1
            last_seq[customer] = order.seq
            handled += 1

    consumer = KeyedConsumer(
        name=f"orders-avro-{uuid.uuid4().hex[:6]}",
        handler=handle,
        brokers=[args.brokers],
        topics=[topic],
        concurrency=16,
        middlewares=[
            DeadLetter(brokers=[args.brokers]),
            Retry(max_attempts=3, initial_delay_s=0.05),
            Typed(Avro(registry, model=Order), key=Text()),
        ],
    )

    def stop_when_done() -> None:
        deadline = time.monotonic() + 120
        while handled < args.orders and time.monotonic() < deadline:
            time.sleep(0.05)
        consumer.stop()

    threading.Thread(target=stop_when_done, daemon=True).start()
    consumer.run()

    reader = Consumer(
        {
            "bootstrap.servers": args.brokers,
            "group.id": f"dlq-{uuid.uuid4().hex}",
            "auto.offset.reset": "earliest",
        }
    )
    reader.subscribe([f"{topic}.dlq"])
    dead: list[Any] = []
    deadline = time.monotonic() + 30
    while not dead and time.monotonic() < deadline:
        dead = [m for m in reader.consume(10, 0.5) if m.error() is None]
    reader.close()

    print(f"topic               {topic}")
    print(f"orders handled      {handled} / {args.orders}")
    print(f"order violations    {violations}")
    print(f"dead-lettered       {len(dead)}")
    for name, value in (dead[0].headers() or []) if dead else []:
        if name in ("kafka_dlt-exception-fqcn", "kafka_dlt-exception-message", "kafka_dlt-validation-errors"):
            text = value.decode() if isinstance(value, bytes) else str(value)
            print(f"  {name}: {text[:160]}")
    ok = handled == args.orders and violations == 0 and len(dead) == 1
    print(f"RESULT              {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
