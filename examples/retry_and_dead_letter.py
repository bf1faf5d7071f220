"""Retry with back-off and a dead-letter topic, on the real broker.

Produces payment events for 50 accounts; one account's events are poison (its handler always fails)
and one event is not even JSON. The handler runs behind, outermost first:

    Logging -> DeadLetter -> Retry(3 attempts, 0.05 s, x2) -> Typed(Payment)

so the poison events are retried three times and then published to ``payments-....dlq`` with
failure headers, the undecodable event goes straight to the dead-letter topic (never retried), and
every other account's events flow on, in order, while the poison ones wait.

    python examples/retry_and_dead_letter.py [--brokers 127.0.0.1:9092]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
import uuid

from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient, NewTopic
from keyedconsumer.middleware import DeadLetter, Logging, Retry, Typed
from pydantic import BaseModel

from keyedconsumer import KeyedConsumer, Message


class Payment(BaseModel):
    account: str
    seq: int
    cents: int


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--brokers", default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092"))
    ap.add_argument("--events", type=int, default=2000)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")

    topic = f"payments-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": args.brokers})
    admin.create_topics([NewTopic(topic, 4, 1), NewTopic(f"{topic}.dlq", 1, 1)])[topic].result(30)
    producer = Producer({"bootstrap.servers": args.brokers, "acks": "all", "enable.idempotence": True})
    seq: dict[str, int] = {}
    for i in range(args.events):
        account = f"acct-{i % 50}"
        seq[account] = seq.get(account, -1) + 1
        producer.produce(
            topic,
            key=account.encode(),
            value=json.dumps({"account": account, "seq": seq[account], "cents": i}).encode(),
        )
    producer.produce(topic, key=b"acct-7", value=b"\x00 this is not json")
    producer.flush(30)
    total = args.events + 1

    lock = threading.Lock()
    last_seq: dict[str, int] = {}
    violations = 0
    handled = 0

    def handle(msg: Message) -> None:
        nonlocal violations, handled
        p: Payment = msg.payload
        if p.account == "acct-13":
            raise ConnectionError("the ledger refuses acct-13")  # poison: always fails
        time.sleep(0.001)  # the remote call
        with lock:
            if p.seq <= last_seq.get(p.account, -1):
                violations += 1
            last_seq[p.account] = p.seq
            handled += 1

    dead_letter = DeadLetter(brokers=[args.brokers])
    consumer = KeyedConsumer(
        name=f"{topic}-processor",
        handler=handle,
        brokers=[args.brokers],
        topics=[topic],
        concurrency=16,
        middlewares=[
            Logging(),
            dead_letter,
            Retry(max_attempts=3, initial_delay_s=0.05, multiplier=2.0),
            Typed(Payment),
        ],
    )
    poison = sum(1 for i in range(args.events) if i % 50 == 13)

    def watch() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and handled + dead_letter.published < total:
            time.sleep(0.1)
        consumer.stop()

    threading.Thread(target=watch, daemon=True).start()
    t0 = time.monotonic()
    consumer.run()
    elapsed = time.monotonic() - t0

    reader = Consumer(
        {"bootstrap.servers": args.brokers, "group.id": uuid.uuid4().hex, "auto.offset.reset": "earliest"}
    )
    reader.subscribe([f"{topic}.dlq"])
    dead = []
    end = time.monotonic() + 15
    while len(dead) < poison + 1 and time.monotonic() < end:
        dead.extend(m for m in reader.consume(100, 0.5) if m.error() is None)
    reader.close()

    print(f"handled             {handled} of {args.events - poison} good events in {elapsed:.1f} s")
    print(f"order violations    {violations}")
    print(f"dead-lettered       {len(dead)} (poison: {poison}, undecodable: 1)")
    if dead:
        print("first dead letter headers:")
        for k, v in dead[0].headers() or []:
            text = (v or b"").decode("utf-8", "replace").splitlines()[0][:100] if v else ""
            print(f"  {k}: {text}")
    ok = handled == args.events - poison and violations == 0 and len(dead) == poison + 1
    print("RESULT              " + ("OK" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
