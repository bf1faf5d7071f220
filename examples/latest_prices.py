"""Latest value per key (conflation) with an audit trail, on the real broker.

A price feed: ``--ticks`` price updates for 20 instruments (each instrument's prices rise tick by
tick), handled by a slow downstream write (5 ms, a cache or a database). Only the latest price of
an instrument matters, so the consumer conflates: while an instrument has updates waiting, only the
newest waiting one runs; the replaced ones count done (their offsets advance) and are written to
the audit trail as ``CONFLATED``, next to one record per handled update.

    python examples/latest_prices.py [--brokers 127.0.0.1:9092] [--ticks 4000]

It prints what ran, what was conflated, and checks that every tick is either handled or conflated
(in the audit topic too), that each instrument's handled prices only rise, that the cache holds each
instrument's last price, and that the committed offsets reached the end of the topic.
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
from keyedconsumer.middleware import Audit

from keyedconsumer import KeyedConsumer, Message

INSTRUMENTS = [f"SYM{i:02d}" for i in range(20)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--brokers", default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092"))
    ap.add_argument("--ticks", type=int, default=4000)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")

    topic = f"prices-{uuid.uuid4().hex[:8]}"
    audit_topic = f"{topic}.audit"
    admin = AdminClient({"bootstrap.servers": args.brokers})
    for f in admin.create_topics([NewTopic(topic, 4, 1), NewTopic(audit_topic, 1, 1)]).values():
        f.result(30)
    producer = Producer({"bootstrap.servers": args.brokers, "acks": "all", "enable.idempotence": True})
    last_sent: dict[str, int] = {}
    for i in range(args.ticks):
        sym = INSTRUMENTS[i % len(INSTRUMENTS)]
        price = last_sent.get(sym, 10_000) + 1 + i % 7
        last_sent[sym] = price
        producer.produce(topic, key=sym.encode(), value=json.dumps({"sym": sym, "price": price}).encode())
    producer.flush(30)

    cache: dict[str, int] = {}
    handled: list[tuple[str, int]] = []
    lock = threading.Lock()

    def on_price(msg: Message) -> None:
        tick = json.loads(msg.value or b"{}")
        time.sleep(0.005)  # the slow downstream write
        with lock:
            cache[tick["sym"]] = tick["price"]
            handled.append((tick["sym"], tick["price"]))

    audit = Audit(topic=audit_topic, brokers=[args.brokers], flush_interval_s=0.1)
    group = f"prices-{uuid.uuid4().hex[:6]}"
    consumer = KeyedConsumer(
        name=group,
        brokers=[args.brokers],
        topics=[topic],
        handler=on_price,
        middlewares=[audit],
        concurrency=8,
        conflate=True,
        on_conflated=audit.conflated,
    )
    runner = threading.Thread(target=consumer.run, daemon=True)
    started = time.monotonic()
    runner.start()
    while time.monotonic() - started < 120 and len(handled) + consumer.conflated < args.ticks:
        time.sleep(0.05)
    consumer.stop()
    runner.join(60)
    audit.close()

    # the audit topic, read back
    reader = Consumer(
        {"bootstrap.servers": args.brokers, "group.id": f"{group}-audit-reader", "enable.auto.commit": False}
    )
    reader.assign([TopicPartition(audit_topic, 0, 0)])
    outcomes: Counter[str] = Counter()
    audited: set[tuple[int, int]] = set()
    idle_since = time.monotonic()
    while time.monotonic() - idle_since < 3 and len(audited) < args.ticks:
        for m in reader.consume(500, 0.2):
            if m.error() is None:
                rec = json.loads(m.value())
                outcomes[rec["outcome"]] += 1
                audited.add((rec["partition"], rec["offset"]))
                idle_since = time.monotonic()
    reader.close()

    check = Consumer({"bootstrap.servers": args.brokers, "group.id": group, "enable.auto.commit": False})
    parts = [TopicPartition(topic, p) for p in range(4)]
    committed = sum(tp.offset for tp in check.committed(parts, timeout=10))
    check.close()

    rising = all(
        [p for s, p in handled if s == sym] == sorted(p for s, p in handled if s == sym)
        for sym in INSTRUMENTS
    )
    latest = cache == last_sent
    every_tick = len(handled) + consumer.conflated == args.ticks
    audit_whole = outcomes["SUCCESS"] == len(handled) and outcomes["CONFLATED"] == consumer.conflated
    print(f"ticks               {args.ticks}")
    print(f"handled             {len(handled)}")
    print(f"conflated           {consumer.conflated}")
    print(f"audit outcomes      {dict(sorted(outcomes.items()))}")
    print(f"prices only rise    {rising}")
    print(f"cache = last prices {latest}")
    print(f"every tick counted  {every_tick}")
    print(f"audit has each tick {audit_whole and len(audited) == args.ticks}")
    print(f"committed offsets   {committed} of {args.ticks}")
    ok = (
        rising
        and latest
        and every_tick
        and audit_whole
        and len(audited) == args.ticks
        and committed == args.ticks
    )
    print(f"RESULT              {'OK' if ok else 'FAILED'}")
    for f in admin.delete_topics([topic, audit_topic]).values():
        try:
            f.result(30)
        except Exception:  # cleanup only
            pass
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
