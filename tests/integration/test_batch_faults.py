"""Batch partial failures on the real broker (issue 25 §7): a poison message among batch-mates of
several partitions and keys ends in exactly one dead letter, no batch-mate is dead-lettered for it,
and every partition's commit reaches its end, when the handler names the failure (``BatchFailed``:
``test_batch_kafka.py``), when it raises without saying which message failed, and across a SIGKILL
in the middle of the poison's batch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import uuid
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from keyedconsumer.middleware import DeadLetter, Retry

from keyedconsumer import KeyedConsumer, Message

from .kafkautil import committed, end_offsets, produce, read_all, wait_until

pytestmark = [pytest.mark.kafka]

ROOT = Path(__file__).resolve().parents[2]


def _records(n: int, keys: int) -> list[tuple[bytes, bytes, None]]:
    seq: dict[int, int] = defaultdict(int)
    out = []
    for i in range(n):
        k = (i * 7) % keys
        out.append((f"k{k}".encode(), f"k{k}:{seq[k]}".encode(), None))
        seq[k] += 1
    return out


@pytest.mark.timeout(180)
def test_a_batch_that_raises_without_naming_the_failure_dead_letters_only_the_poison(
    kafka_bootstrap: str, new_topic, start
) -> None:  # type: ignore[no-untyped-def]
    # given 400 messages over 3 partitions and 40 keys, one poison message ("k5:0"), and a batch
    # handler that raises a plain exception whenever the poison is in its batch (it says nothing of
    # which message failed), under Retry(max_attempts=3) and DeadLetter
    topic = new_topic(3)
    records = _records(400, 40)
    produce(kafka_bootstrap, topic, records)
    poison = b"k5:0"
    lock = threading.Lock()
    done: Counter[bytes] = Counter()  # value -> successful runs
    order: dict[bytes, list[int]] = defaultdict(list)

    def handle(msgs: list[Message]) -> None:
        if any(m.value == poison for m in msgs):
            raise RuntimeError("something in this batch is wrong")
        with lock:
            for m in msgs:
                assert m.key is not None and m.value is not None
                done[m.value] += 1
                order[m.key].append(int(m.value.split(b":")[1]))

    group = f"bf-{uuid.uuid4().hex[:8]}"
    c = KeyedConsumer(
        name=group,
        batch_handler=handle,
        brokers=[kafka_bootstrap],
        topics=[topic],
        concurrency=2,
        handler_batch_size=25,
        middlewares=[
            DeadLetter(brokers=[kafka_bootstrap]),
            Retry(max_attempts=3, initial_delay_s=0.1, jitter=0.0),
        ],
    )
    r = start(c)
    ends = end_offsets(kafka_bootstrap, topic, 3)
    assert wait_until(lambda: committed(kafka_bootstrap, group, topic, 3, 10) == ends, 120, 0.5)
    assert r.stop(30) and r.error is None
    # then only the poison was dead-lettered, once; every other message ended done, each key in order
    dead = read_all(kafka_bootstrap, f"{topic}.dlq", 2, timeout_s=5.0)
    assert [d.value() for d in dead] == [poison]
    others = {v for _, v, _ in records if v != poison}
    assert set(done) == others
    per_key: dict[bytes, int] = defaultdict(int)
    for k, _, _ in records:
        per_key[k] += 1
    for k, n in per_key.items():
        assert order[k] == (list(range(1, n)) if k == b"k5" else list(range(n))), k


def _start(
    bootstrap: str, topic: str, group: str, log: Path, poison: str, *extra: str
) -> subprocess.Popen[bytes]:
    err = open(log.with_suffix(f".{uuid.uuid4().hex[:6]}.err"), "wb")
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.integration.procs.batch_consumer",
            bootstrap,
            topic,
            group,
            str(log),
            poison,
            *extra,
        ],
        cwd=ROOT,
        stdout=err,
        stderr=err,
    )


def _lines(log: Path, kind: str) -> list[list[str]]:
    text = log.read_text() if log.exists() else ""
    return [ln.split() for ln in text.splitlines() if ln.startswith(kind + " ")]


@pytest.mark.timeout(240)
def test_a_sigkill_in_the_middle_of_the_poisons_batch_still_dead_letters_it_once(
    kafka_bootstrap: str, new_topic, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    # given a batch consumer process over 3 partitions whose batch holding the poison's first attempt
    # stalls (batch-mates of other keys and partitions with it)
    topic = new_topic(3)
    records = _records(300, 30)
    produce(kafka_bootstrap, topic, records)
    poison = "k3:0"
    group, log = f"bk-{uuid.uuid4().hex[:8]}", tmp_path / "batch.log"
    first = _start(kafka_bootstrap, topic, group, log, poison, "--stall")
    try:
        assert wait_until(lambda: _lines(log, "S"), 60), log.read_text() if log.exists() else ""
        # when it is SIGKILLed in the middle of that batch, and a new process takes over
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
    finally:
        if first.poll() is None:
            first.kill()
    second = _start(kafka_bootstrap, topic, group, log, poison)
    try:
        ends = end_offsets(kafka_bootstrap, topic, 3)
        assert wait_until(lambda: committed(kafka_bootstrap, group, topic, 3, 10) == ends, 120, 0.5)
    finally:
        second.send_signal(signal.SIGTERM)
        second.wait(60)
    # then the poison was dead-lettered exactly once, no batch-mate was, every partition's commit
    # reached its end, and every other message ended done at least once
    dead = read_all(kafka_bootstrap, f"{topic}.dlq", 2, timeout_s=5.0)
    assert [d.value() for d in dead] == [poison.encode()]
    ok = {(int(x[2]), int(x[3])) for x in _lines(log, "E")}
    failed = {(int(x[2]), int(x[3])) for x in _lines(log, "F")}
    assert len(failed) == 1  # only the poison ever failed
    total = sum(ends.values())
    assert len(ok) == total - 1
