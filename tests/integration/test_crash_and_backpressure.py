"""A SIGKILLed consumer loses nothing; a SIGTERMed one leaves cleanly; back-pressure bounds memory."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from keyedconsumer import KeyedConsumer, Message

from .kafkautil import committed, end_offsets, log_lines, produce, wait_until

pytestmark = [pytest.mark.kafka]
ROOT = Path(__file__).resolve().parents[2]


def start_proc(bootstrap: str, topic: str, group: str, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.integration.procs.logging_consumer",
            bootstrap,
            topic,
            group,
            str(log),
            "8",
        ],
        cwd=ROOT,
    )


def read_log(log: Path) -> list[tuple[str, int, int, int, str, int]]:
    out = []
    for line in log_lines(log):
        kind, pid, p, o, key, ns = line.split()
        out.append((kind, int(pid), int(p), int(o), key, int(ns)))
    return out


@pytest.mark.timeout(180)
def test_sigkill_mid_run_then_restart_processes_everything(
    kafka_bootstrap: str, new_topic, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    # given 4,000 messages over 4 partitions
    topic = new_topic(4)
    n = 4000
    acked = produce(
        kafka_bootstrap, topic, [(f"k{i % 300}".encode(), str(i).encode(), None) for i in range(n)]
    )
    group = f"kill-{uuid.uuid4().hex[:8]}"
    log = tmp_path / "events.log"
    # when a consumer process is SIGKILLed mid-run
    proc = start_proc(kafka_bootstrap, topic, group, log)
    assert wait_until(lambda: log.exists() and sum(1 for r in read_log(log) if r[0] == "E") > 800, 60)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    ended_before = {(r[2], r[3]) for r in read_log(log) if r[0] == "E"}
    assert len(ended_before) < n  # it really died mid-run
    # and a new one is started in the same group
    proc = start_proc(kafka_bootstrap, topic, group, log)
    try:
        assert wait_until(lambda: {(r[2], r[3]) for r in read_log(log) if r[0] == "E"} >= set(acked), 90)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0  # SIGTERM drains and exits cleanly
    # then every acknowledged message ended at least once, and the group is at the end offsets
    ended = {(r[2], r[3]) for r in read_log(log) if r[0] == "E"}
    assert ended >= set(acked)
    assert committed(kafka_bootstrap, group, topic, 4) == end_offsets(kafka_bootstrap, topic, 4)
    # and per key the first runs came in offset order
    first_seen: dict[str, list[int]] = {}
    seen: set[tuple[int, int]] = set()
    for kind, _pid, p, o, key, _ns in read_log(log):
        if kind == "S" and (p, o) not in seen:
            seen.add((p, o))
            first_seen.setdefault(key, []).append(o)
    assert all(offs == sorted(offs) for offs in first_seen.values())


@pytest.mark.timeout(120)
def test_backpressure_bounds_in_flight_while_one_key_blocks(kafka_bootstrap: str, new_topic) -> None:  # type: ignore[no-untyped-def]
    # given a partition where one key in ten is "stuck" and its handler blocks
    topic = new_topic(1)
    n = 5000
    produce(
        kafka_bootstrap,
        topic,
        [((b"stuck" if i % 10 == 0 else f"k{i}".encode()), b"x" * 100, 0) for i in range(n)],
    )
    release = threading.Event()
    done: set[int] = set()
    lock = threading.Lock()

    def handle(msg: Message) -> None:
        if msg.key == b"stuck":
            release.wait(60)
        with lock:
            done.add(msg.offset)

    max_in_flight = 300
    consumer = KeyedConsumer(
        name=f"bp-{uuid.uuid4().hex[:8]}",
        handler=handle,
        brokers=[kafka_bootstrap],
        topics=[topic],
        concurrency=8,
        max_in_flight=max_in_flight,
        batch_size=100,
    )
    samples: list[int] = []
    filled: list[bool] = []

    def drive() -> None:
        # while the stuck key blocks, in-flight messages stay bounded and polling goes on
        # (fetching pauses at max_in_flight and resumes below half of it; the stuck key's queue
        # keeps it above half, so it stays paused)
        filled.append(wait_until(lambda: consumer.peak_in_flight >= max_in_flight, 30))
        t_end = time.monotonic() + 3
        while time.monotonic() < t_end:
            samples.append(consumer.in_flight)
            time.sleep(0.02)
        release.set()
        wait_until(lambda: len(done) == n, 60)
        consumer.stop()

    t = threading.Thread(target=drive)
    t.start()
    consumer.run()
    t.join()
    assert filled == [True]  # the buffer did fill up
    assert samples and max(samples) <= max_in_flight
    assert consumer.peak_in_flight <= max_in_flight
    assert len(done) == n  # after the release everything ran
