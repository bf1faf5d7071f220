"""Parking and scheduled messages with the Redis sequencer, on the real broker and real Redis.

Produces order events for 200 accounts. The first event of one account hits a flaky downstream:
it fails 3 times before it works. With ``Retry(park=True)`` that account is *parked* in Redis: its
failing event and every later event of the account wait there, in order, while all other accounts
flow on and the partition's committed offset moves past the failing event. The Redis scheduler
retries it after its back-off and then drains the account's list. Meanwhile a few reminders are
scheduled with ``consumer.schedule(...)``; they reach the handler when due (partition -1).

    python examples/redis_parking.py [--brokers 127.0.0.1:9092] [--redis-url redis://127.0.0.1:6379/0]

Redis must persist every write (``appendonly yes``, ``appendfsync always``): ``scripts/services up``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import uuid
from collections import defaultdict

from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from keyedconsumer.middleware import DeadLetter, Retry

from keyedconsumer import KeyedConsumer, Message, RedisSequencer
from keyedconsumer.sequencing import inspect_redis

ACCOUNTS, FLAKY, FAILURES, PARTITIONS, REMINDERS = 200, "acct-42", 3, 4, 3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--brokers", default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092"))
    ap.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--events", type=int, default=5000)
    args = ap.parse_args(argv)
    if args.events < ACCOUNTS:
        ap.error(f"--events must be at least {ACCOUNTS} (one per account)")

    # 1. A fresh topic (and its dead-letter topic), filled with numbered events per account.
    topic = f"orders-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": args.brokers})
    admin.create_topics([NewTopic(topic, PARTITIONS, 1), NewTopic(f"{topic}.dlq", 1, 1)])[topic].result(30)
    producer = Producer({"bootstrap.servers": args.brokers, "acks": "all", "enable.idempotence": True})
    sent: dict[str, int] = defaultdict(int)  # account -> events produced
    flaky_at: list[tuple[int, int]] = []  # (partition, offset) of the flaky account's first event
    for i in range(args.events):
        account = f"acct-{i % ACCOUNTS}"
        body = {"account": account, "seq": sent[account], "cents": i}
        note = (lambda err, m: flaky_at.append((m.partition(), m.offset()))) if body["seq"] == 0 else None
        producer.produce(
            topic,
            key=account.encode(),
            value=json.dumps(body).encode(),
            on_delivery=note if account == FLAKY else None,
        )
        sent[account] += 1
    producer.flush(30)

    # 2. The handler: records what it handled; the flaky account's first event fails FAILURES times.
    lock = threading.Lock()
    seen: dict[str, list[int]] = defaultdict(list)  # account -> seq numbers in the order handled
    reminders: list[tuple[str, float]] = []  # (account, seconds late)
    flaky_ok = threading.Event()

    def handle(msg: Message) -> None:
        body = json.loads(msg.value or b"{}")
        if msg.partition == -1:  # a scheduled message: it never was in Kafka
            with lock:
                reminders.append((body["account"], time.time() - body["due"]))
            return
        if (body["account"], body["seq"]) == (FLAKY, 0) and msg.attempt <= FAILURES:
            raise ConnectionError(f"downstream unavailable (attempt {msg.attempt})")
        with lock:
            seen[body["account"]].append(body["seq"])
        if body["account"] == FLAKY and body["seq"] == 0:
            flaky_ok.set()

    # 3. The consumer: leases, parking and the scheduler live in Redis under `namespace`.
    namespace = topic  # one namespace per consumer group (or tenant)
    seq = RedisSequencer(args.redis_url, namespace, lease_ttl_s=5.0)
    dead_letter = DeadLetter(brokers=[args.brokers])  # after the last attempt: publish to {topic}.dlq
    consumer = KeyedConsumer(
        name=f"{topic}-processor",
        handler=handle,
        brokers=[args.brokers],
        topics=[topic],
        concurrency=16,
        sequencer=seq,
        config={"auto.commit.interval.ms": 200},  # commit often, so we can watch the offset move
        middlewares=[  # outermost first: a final failure is dead-lettered; a failure before it parks the key
            dead_letter,
            Retry(max_attempts=5, initial_delay_s=1.0, multiplier=1.0, jitter=0, park=True),
        ],
    )

    # 4. Beside the consumer: schedule reminders once it runs, watch the committed offsets, stop at the end.
    probe = Consumer(
        {"bootstrap.servers": args.brokers, "group.id": f"{topic}-processor", "enable.auto.commit": False}
    )  # reads the group's commits only, never joins it
    tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
    ends = [probe.get_watermark_offsets(tp, timeout=10)[1] for tp in tps]
    passed_while_parked = threading.Event()

    def operator() -> None:
        deadline = time.monotonic() + 60
        try:
            while not seq.is_scheduler and time.monotonic() < deadline:  # wait until the consumer runs
                time.sleep(0.05)
            for n in range(REMINDERS):  # one reminder each for acct-0, acct-1, acct-2, due in 1, 2, 3 s
                delay = 1.0 + n
                body = {"account": f"acct-{n}", "due": time.time() + delay}
                consumer.schedule(f"acct-{n}".encode(), json.dumps(body).encode(), delay_s=delay)
            while time.monotonic() < deadline:
                committed = [tp.offset for tp in probe.committed(tps, timeout=10)]
                part, off = flaky_at[0]
                if committed[part] > off and not flaky_ok.is_set():
                    passed_while_parked.set()  # the offset moved past the event still waiting in Redis
                with lock:
                    handled = sum(len(v) for v in seen.values())
                if (
                    handled >= args.events
                    and len(reminders) == REMINDERS
                    and committed == ends
                    and not seq.parker.draining
                ):
                    break
                time.sleep(0.1)
        finally:
            consumer.stop()

    threading.Thread(target=operator, daemon=True).start()
    t0 = time.monotonic()
    consumer.run()  # returns after consumer.stop()
    probe.close()

    # 5. What happened, and what Redis holds now (it should hold nothing of this namespace).
    in_order = all(seen[a] == list(range(n)) for a, n in sent.items())
    state = inspect_redis(args.redis_url, namespace)
    clean = not (state["leases"] or state["parked"] or state["scheduled"] or state["quarantined"])
    handled = sum(len(v) for v in seen.values())
    print(f"handled             {handled} of {args.events} events in {time.monotonic() - t0:.1f} s")
    print(f"in order, once      {in_order}")
    print(
        f"parked / drained    {seq.parker.parked} / {seq.parker.drained} ({FLAKY}: {sent[FLAKY]} events; "
        f"drained counts the reminders too)"
    )
    part, off = flaky_at[0]
    print(
        f"offset passed park  {passed_while_parked.is_set()} (partition {part}'s committed offset passed "
        f"{off} while {FLAKY} was parked)"
    )
    print(f"dead-lettered       {dead_letter.published}")
    for account, late in sorted(reminders):
        print(f"reminder            {account} delivered {late * 1000:.0f} ms after its due time")
    print(f"redis at the end    {state}")
    print(f"redis clean         {clean}")
    on_time = len(reminders) == REMINDERS and all(late >= 0 for _, late in reminders)  # never early
    ok = in_order and passed_while_parked.is_set() and on_time and clean and dead_letter.published == 0
    print("RESULT              " + ("OK" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
