"""A ``KeyedApp`` for the shutdown-order tests: ``keyedconsumer run tests.integration.procs.shutdown_app:app``.

Two routes in one group ``KC_SD_GROUP`` on ``KC_SD_BROKERS``: ``KC_SD_TOPIC1`` (a plain handler)
and ``KC_SD_TOPIC2`` (``async def``), one message at a time per partition, each taking
``KC_SD_WORK_S`` seconds (a value ``hang`` takes 60 s). Every line goes to ``KC_SD_LOG`` (O_APPEND):

- ``import <t>`` when this module starts importing (it then sleeps ``KC_SD_IMPORT_S`` seconds, a
  slow import: the process runs, no consumer is registered yet);
- ``start <topic> <partition> <offset> <t>`` and ``end <topic> <partition> <offset> <t>`` around
  each handler run;
- ``shutdown <t> <committed>`` from the ``on_shutdown`` hook, ``<committed>`` the group's committed
  offsets read from the broker then, as JSON ``{"topic:partition": offset}``.

``<t>`` is ``time.monotonic()``.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

from confluent_kafka import Consumer, TopicPartition

from keyedconsumer import KeyedApp, Message


def log(line: str) -> None:
    fd = os.open(os.environ["KC_SD_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{line} {time.monotonic():.6f}\n".encode())
    finally:
        os.close(fd)


log("import")
time.sleep(float(os.environ.get("KC_SD_IMPORT_S", "0")))

BROKERS = os.environ["KC_SD_BROKERS"]
GROUP = os.environ["KC_SD_GROUP"]
TOPICS = [os.environ["KC_SD_TOPIC1"], os.environ["KC_SD_TOPIC2"]]
PARTITIONS = int(os.environ.get("KC_SD_PARTITIONS", "2"))


def work_s(msg: Message) -> float:
    return 60.0 if msg.value == b"hang" else float(os.environ.get("KC_SD_WORK_S", "0.05"))


def handle(msg: Message) -> None:
    log(f"start {msg.topic} {msg.partition} {msg.offset}")
    time.sleep(work_s(msg))
    log(f"end {msg.topic} {msg.partition} {msg.offset}")


async def handle_async(msg: Message) -> None:
    log(f"start {msg.topic} {msg.partition} {msg.offset}")
    await asyncio.sleep(work_s(msg))
    log(f"end {msg.topic} {msg.partition} {msg.offset}")


app = KeyedApp(brokers=[BROKERS], group_id=GROUP, ordering="partition", concurrency=4)
app.handler(TOPICS[0], name="plain")(handle)
app.handler(TOPICS[1], name="awaited")(handle_async)


@app.on_shutdown
def read_commits() -> None:
    c = Consumer({"bootstrap.servers": BROKERS, "group.id": GROUP})
    try:
        parts = [TopicPartition(t, p) for t in TOPICS for p in range(PARTITIONS)]
        got = {f"{tp.topic}:{tp.partition}": tp.offset for tp in c.committed(parts, timeout=10)}
    finally:
        c.close()
    log(f"shutdown {json.dumps(got, separators=(',', ':'))}")
