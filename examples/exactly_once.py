"""Exactly-once results: each payment becomes two ledger entries, written in the Kafka transaction
that also commits the payment's offset (``transactional=True``; docs/exactly-once.md).

Produces payment events for 40 accounts. A consumer turns each into a debit entry (keyed by the
payer) and a credit entry (keyed by the payee) on a ledger topic with ``msg.produce``; halfway it is
stopped and a second consumer of the same group takes over. A ``read_committed`` reader of the
ledger then finds every payment's two entries exactly once, and each account's debits in the order
of its payments.

    python examples/exactly_once.py [--brokers 127.0.0.1:9092] [--events 2000]
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
from collections import Counter

from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from keyedconsumer import KeyedConsumer, Message


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--brokers", default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092"))
    ap.add_argument("--events", type=int, default=2000)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")

    payments, ledger = f"payments-{uuid.uuid4().hex[:8]}", f"ledger-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": args.brokers})
    for fut in admin.create_topics([NewTopic(payments, 4, 1), NewTopic(ledger, 4, 1)]).values():
        fut.result(30)
    producer = Producer({"bootstrap.servers": args.brokers, "acks": "all", "enable.idempotence": True})
    for i in range(args.events):
        payer, payee = f"acct-{i % 40}", f"acct-{(i * 7 + 3) % 40}"
        producer.produce(
            payments, key=payer.encode(), value=json.dumps({"id": i, "payee": payee, "cents": i}).encode()
        )
    producer.flush(30)

    handled = [0]
    lock = threading.Lock()

    def handle(msg: Message) -> None:  # a pure function of the input: nothing outside Kafka changes
        p = json.loads(msg.value or b"{}")
        entry = {"payment": p["id"], "cents": p["cents"]}
        msg.produce(ledger, msg.key, json.dumps({**entry, "side": "debit"}).encode())
        msg.produce(ledger, p["payee"].encode(), json.dumps({**entry, "side": "credit"}).encode())
        with lock:
            handled[0] += 1

    def consumer() -> KeyedConsumer:
        return KeyedConsumer(
            name=f"{payments}-ledger",
            handler=handle,
            brokers=[args.brokers],
            topics=[payments],
            concurrency=8,
            transactional=True,
            transaction_interval_s=0.1,
        )

    def stop_when(c: KeyedConsumer, count: int) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and handled[0] < count:
            time.sleep(0.01)
        c.stop()

    t0 = time.monotonic()
    first = consumer()  # stopped halfway: a second consumer of the group takes over
    threading.Thread(target=stop_when, args=(first, args.events // 2), daemon=True).start()
    first.run()
    second = consumer()
    threading.Thread(target=stop_when, args=(second, args.events), daemon=True).start()
    second.run()
    elapsed = time.monotonic() - t0

    reader = Consumer(
        {
            "bootstrap.servers": args.brokers,
            "group.id": uuid.uuid4().hex,
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
        }
    )
    reader.assign([TopicPartition(ledger, p, 0) for p in range(4)])
    entries = []
    end = time.monotonic() + 20
    while len(entries) < 2 * args.events and time.monotonic() < end:
        entries.extend(
            json.loads(m.value()) | {"key": m.key().decode()}
            for m in reader.consume(500, 0.5)
            if m.error() is None
        )
    reader.close()

    counts = Counter((e["payment"], e["side"]) for e in entries)
    once = len(counts) == 2 * args.events and set(counts.values()) == {1}
    debits: dict[str, list[int]] = {}
    for e in entries:
        if e["side"] == "debit":
            debits.setdefault(e["key"], []).append(e["payment"])
    in_order = all(ids == sorted(ids) for ids in debits.values())
    print(f"payments            {args.events} (handled {handled[0]} runs in {elapsed:.1f} s, two consumers)")
    print(f"ledger entries      {len(entries)} (read_committed)")
    print(f"each entry once     {once}")
    print(f"debits in order     {in_order}")
    ok = once and in_order
    print("RESULT              " + ("OK" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
