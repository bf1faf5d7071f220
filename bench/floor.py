"""The CPU floor of a W1 message: what keyedconsumer's Python must do for each message at the least,
against raw's whole loop, measured in one process on one topic (issue 24's W1 goals).

    .venv/bin/python bench/floor.py [--brokers 127.0.0.1:9092] [--messages 500000] [--repeats 3]

W1's shape (8 partitions, 10,000 keys, 100 B values, the bench's recording handler,
``bench/common.py`` ``Recorder``, latency for one message in 16). Each repeat measures, in this
order:

- **raw**: the raw contender's loop (``bench/contender.py`` ``run_raw``): ``consume(500)``, the
  record's accessors, the handler and ``store_offsets`` a message. Its figure is wall time a message
  from the first record to the last (the denominator of every W1 goal) and the CPU of its Python
  thread (``time.thread_time``; librdkafka's own threads run on the other core).
- **poll**: keyedconsumer's poll path alone, the engine's own client (``kafka/client.py``
  ``poll_batch``): ``consume(500)`` and one :class:`~keyedconsumer.message.Message` a record,
  nothing else (the thread's CPU a message).
- **engine**: admit, take, run, settle, finish, one thread, no hand-over
  (``bench/engine_cpu.py``'s pass; it calls a no-op handler).
- **handler**: the bench's handler called on each ``Message`` (``msg.key``, ``msg.value``,
  ``msg.timestamp_ms`` into the recorder), as ``run_keyedconsumer`` wraps it.
- **lean**: ``bench/lean_engine.py``'s pass in the engine's place: the least bookkeeping that keeps
  a key's messages in order, one at a time, and each partition's offset behind its first unfinished
  message, with none of the engine's other features. poll + lean + handler is the floor of any
  engine in Python that builds a ``Message`` a record: the "lean" ratio.

The floor is poll + engine + handler: the Python CPU each message takes in keyedconsumer with no
thread hand-over, no garbage collection beyond what these passes set off, and perfect overlap with
librdkafka. Everything that holds the GIL shares one core's worth of it, so the best W1 ratio this
design can reach is about raw's wall time a message over the floor. Each pass has its own consumer
group on a topic this script creates and deletes. Prints one line a repeat and the medians, with
the machine's 1-minute load before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from common import FETCH_SETTINGS, Recorder, make_value  # noqa: E402
from confluent_kafka import Consumer, KafkaError, Producer  # noqa: E402
from confluent_kafka.admin import AdminClient, NewTopic  # noqa: E402
from engine_cpu import run as engine_pass  # noqa: E402
from lean_engine import run as lean_pass  # noqa: E402

from keyedconsumer.config import ConsumerConfig  # noqa: E402
from keyedconsumer.kafka.client import connect  # noqa: E402
from keyedconsumer.message import Message  # noqa: E402

PARTITIONS, KEYS, SIZE, BATCH = 8, 10_000, 100, 500


def produce(brokers: str, n: int) -> str:
    topic = f"bench-floor-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": brokers})
    admin.create_topics([NewTopic(topic, PARTITIONS, 1)])[topic].result(30)
    p = Producer({"bootstrap.servers": brokers, "enable.idempotence": True, "linger.ms": 20})
    seq: dict[int, int] = {}
    now = int(time.time() * 1000)
    for i in range(n):
        k = i % KEYS
        s = seq[k] = seq.get(k, 0) + 1
        while True:
            try:
                p.produce(topic, key=b"k%05d" % k, value=make_value(s, now, SIZE), timestamp=now)
                break
            except BufferError:
                p.poll(0.05)
    if p.flush(60):
        raise SystemExit("floor: the topic was not produced in 60 s")
    return topic


def _engine_conf(brokers: str, topic: str) -> dict[str, Any]:
    """The librdkafka properties keyedconsumer's own consumer gets for W1's options (a fresh group)."""
    return ConsumerConfig(
        name=f"floor-{uuid.uuid4().hex[:8]}",
        brokers=[brokers],
        topics=[topic],
        concurrency=1,
        max_in_flight=10_000,
    ).librdkafka()


def _raw_conf(brokers: str, topic: str) -> dict[str, Any]:
    """The raw contender's properties: its own, plus keyedconsumer's fetch bounds (bench/README.md,
    "Fetch settings")."""
    engine = _engine_conf(brokers, topic)
    return {
        "bootstrap.servers": brokers,
        "group.id": engine["group.id"],
        "enable.auto.offset.store": False,
        "enable.auto.commit": True,
        "auto.offset.reset": "earliest",
        **{k: engine[k] for k in FETCH_SETTINGS if k in engine},
    }


def _handler(n: int) -> Any:
    rec = Recorder(n, lat_every=16)
    begin, end = rec.begin, rec.end

    def sync_h(key: bytes, value: bytes, ts: int) -> None:
        begin(key, value, ts)
        end(key)

    return sync_h


def raw_pass(brokers: str, topic: str, n: int) -> tuple[float, float]:
    """(wall seconds a message from the first record to the last, the thread's CPU seconds a message)."""
    c = Consumer(_raw_conf(brokers, topic))
    c.subscribe([topic])
    h, store = _handler(n), c.store_offsets
    got, t0, c0 = 0, 0.0, 0.0
    try:
        while got < n:
            batch = c.consume(num_messages=BATCH, timeout=0.1)
            if batch and not got:
                t0, c0 = time.perf_counter(), time.thread_time()
            for m in batch:
                if m.error() is not None:
                    if m.error().code() != KafkaError._PARTITION_EOF:
                        raise SystemExit(f"floor: raw consume error {m.error()}")
                    continue
                h(m.key(), m.value(), m.timestamp()[1])
                store(message=m)
                got += 1
        return (time.perf_counter() - t0) / n, (time.thread_time() - c0) / n
    finally:
        c.close()


class _Listener:
    def on_assign(self, parts: list[Any]) -> None: ...
    def on_revoke(self, parts: list[Any]) -> None: ...
    def on_lost(self, parts: list[Any]) -> None: ...


def poll_pass(brokers: str, topic: str, n: int) -> tuple[float, list[Message]]:
    """(the thread's CPU seconds a message of ``poll_batch``, the last 20,000 messages for the
    handler pass)."""
    client = connect(_engine_conf(brokers, topic), on_error=lambda err: print("floor:", err, file=sys.stderr))
    client.subscribe([topic], _Listener())  # type: ignore[arg-type]
    got, c0, kept = 0, 0.0, []
    try:
        while got < n:
            msgs = client.poll_batch(BATCH, 0.1)
            if msgs and not got:
                c0 = time.thread_time()
            got += len(msgs)
            if got > n - 20_000:
                kept.extend(msgs)
        return (time.thread_time() - c0) / n, kept
    finally:
        client.close()


def handler_pass(msgs: list[Message], n: int) -> float:
    """The thread's CPU seconds a message of the bench's handler, as ``run_keyedconsumer`` calls it."""
    sync_h = _handler(n)

    def handler(msg: Message) -> None:
        sync_h(msg.key, msg.value, msg.timestamp_ms)

    c0, done = time.thread_time(), 0
    while done < n:
        for msg in msgs:
            handler(msg)
        done += len(msgs)
    return (time.thread_time() - c0) / done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--brokers", default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092"))
    ap.add_argument("--messages", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    n = args.messages
    load0 = os.getloadavg()[0]
    topic = produce(args.brokers, n)
    us = 1e6
    rows: list[tuple[float, float, float, float, float, float]] = []
    try:
        for i in range(args.repeats):
            raw_wall, raw_cpu = raw_pass(args.brokers, topic, n)
            poll, kept = poll_pass(args.brokers, topic, n)
            engine = engine_pass(min(n, 200_000))
            handler = handler_pass(kept, 200_000)
            lean = lean_pass(min(n, 200_000))
            rows.append((raw_wall, raw_cpu, poll, engine, handler, lean))
            floor = poll + engine + handler
            print(
                f"repeat {i + 1}: raw {raw_wall * us:.2f} us/msg wall ({1 / raw_wall:,.0f} msg/s), "
                f"{raw_cpu * us:.2f} us CPU; floor {floor * us:.2f} us = poll {poll * us:.2f} + "
                f"engine {engine * us:.2f} + handler {handler * us:.2f}; best ratio to raw "
                f"{raw_wall / floor:.2f}x (of raw's CPU: {raw_cpu / floor:.2f}x); lean {lean * us:.2f}: "
                f"{raw_wall / (poll + lean + handler):.2f}x",
                flush=True,
            )
    finally:
        AdminClient({"bootstrap.servers": args.brokers}).delete_topics([topic])
    med = [statistics.median(col) for col in zip(*rows, strict=True)]
    floor = med[2] + med[3] + med[4]
    print(
        f"median of {len(rows)}: raw {med[0] * us:.2f} us/msg wall, {med[1] * us:.2f} us CPU; floor "
        f"{floor * us:.2f} us (poll {med[2] * us:.2f}, engine {med[3] * us:.2f}, handler "
        f"{med[4] * us:.2f}); best W1 ratio to raw {med[0] / floor:.2f}x (of raw's CPU: "
        f"{med[1] / floor:.2f}x); with the lean pass ({med[5] * us:.2f} us) in the engine's place "
        f"{med[0] / (med[2] + med[5] + med[4]):.2f}x; "
        f"1-minute load {load0:.2f} before, {os.getloadavg()[0]:.2f} after"
    )


if __name__ == "__main__":
    main()
