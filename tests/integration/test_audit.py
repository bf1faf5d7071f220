"""The audit trail on the real broker: the Audit middleware writes one record per attempt to a
Kafka topic, and ``keyedconsumer audit`` finds them by key, by offset, by outcome and by time."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from keyedconsumer.middleware import Audit, DeadLetter, Retry

from keyedconsumer import KeyedConsumer, Message

from .kafkautil import committed, end_offsets, produce, wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]


def _audit_cli(bootstrap: str, *args: str) -> list[dict[str, object]]:
    out = subprocess.run(
        [sys.executable, "-m", "keyedconsumer", "audit", "--brokers", bootstrap, "--json", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def test_audit_records_every_attempt_and_the_cli_finds_them(
    kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    # given an input topic with 300 records of 30 keys, one of which ("bad") always fails
    topic, audit_topic, dlq = new_topic(3), new_topic(3, prefix="audit"), new_topic(1, prefix="dlq")
    records = [(f"k{i % 30}".encode(), str(i).encode(), None) for i in range(300)] + [
        (b"bad", b"poison", None)
    ]
    produce(kafka_bootstrap, topic, records)
    group = f"audit-{uuid.uuid4().hex[:8]}"
    started = int(time.time() * 1000)

    def handle(msg: Message) -> None:
        if msg.key == b"bad":
            raise ValueError("account closed")

    audit = Audit(topic=audit_topic, brokers=[kafka_bootstrap], flush_interval_s=0.05)
    consumer = KeyedConsumer(
        name=group,
        handler=handle,
        brokers=[kafka_bootstrap],
        topics=[topic],
        concurrency=8,
        middlewares=[
            audit,
            DeadLetter(brokers=[kafka_bootstrap], topic=dlq),
            Retry(max_attempts=2, initial_delay_s=0.1),
        ],
    )
    import threading

    t = threading.Thread(target=consumer.run, daemon=True)
    t.start()
    try:
        assert wait_until(
            lambda: committed(kafka_bootstrap, group, topic, 3) == end_offsets(kafka_bootstrap, topic, 3), 90
        )
    finally:
        consumer.stop()
        t.join(60)
    audit.close()
    # then every attempt was written: 300 successes, and the bad key's retry and dead letter
    assert audit.written == 302 and audit.failed == 0
    # and the CLI finds a key's records (reading only the key's partition of the audit topic)
    bad = _audit_cli(kafka_bootstrap, "--topic", audit_topic, "--key", "bad")
    assert [(r["outcome"], r["attempt"], r["error_type"], r["error"]) for r in bad] == [
        ("RETRY", 1, "builtins.ValueError", "account closed"),
        ("DEAD_LETTERED", 2, "builtins.ValueError", "account closed"),
    ]
    k7 = _audit_cli(kafka_bootstrap, "--topic", audit_topic, "--key", "k7")
    assert len(k7) == 10 and {r["outcome"] for r in k7} == {"SUCCESS"}
    assert [r["offset"] for r in k7] == sorted(
        r["offset"] for r in k7
    )  # one partition: a key's records in order
    # by offset of the input topic, by outcome, and by time
    one = _audit_cli(
        kafka_bootstrap,
        "--topic",
        audit_topic,
        "--source-topic",
        topic,
        "--partition",
        str(k7[3]["partition"]),
        "--offset",
        str(k7[3]["offset"]),
    )
    assert [(r["key"], r["outcome"]) for r in one] == [("k7", "SUCCESS")]
    dead = _audit_cli(kafka_bootstrap, "--topic", audit_topic, "--outcome", "dead_lettered")
    assert [r["key"] for r in dead] == ["bad"]
    assert len(_audit_cli(kafka_bootstrap, "--topic", audit_topic, "--since", str(started))) == 302
    assert (
        _audit_cli(kafka_bootstrap, "--topic", audit_topic, "--since", str(int(time.time() * 1000) + 60_000))
        == []
    )
