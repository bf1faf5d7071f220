"""One SIGTERM stops every consumer of the process (issue 12, section 8): one owner of the signal
handlers (``keyedconsumer.signals``), however the consumers run.

A subprocess (``tests/integration/procs/two_consumers.py``) runs two consumers of two topics and
groups: both with ``run()``, one in the main thread and one in another thread; or both with
``run_async()`` under one ``asyncio.gather``; or as two routes of one ``KeyedApp`` (whose shutdown
hook must run after both stopped, before ``run()`` returns). Once both consumed every message, one SIGTERM must
end the process (exit 0) with both groups' offsets committed at the end offsets: each consumer
stopped gracefully and made its final commit.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from .kafkautil import committed, end_offsets, produce

pytestmark = [pytest.mark.kafka]

ROOT = Path(__file__).resolve().parents[2]
N = 200  # messages per topic
PARTITIONS = 2


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["threads", "async", "app"])
def test_one_sigterm_stops_both_consumers_of_a_process_and_each_commits(
    kafka_bootstrap: str, new_topic: Callable[..., str], mode: str
) -> None:
    # given two topics with N messages each, and a process consuming both, one group per topic
    topics = [new_topic(PARTITIONS), new_topic(PARTITIONS)]
    groups = [f"sig-{mode}-{i}-{uuid.uuid4().hex[:8]}" for i in range(2)]
    for topic in topics:
        produce(kafka_bootstrap, topic, [(f"k{i % 10}".encode(), str(i).encode(), None) for i in range(N)])
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.integration.procs.two_consumers",
            mode,
            kafka_bootstrap,
            topics[0],
            groups[0],
            topics[1],
            groups[1],
            str(N),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout or []:
            lines.append(line.strip())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        # when both consumed everything
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and sum(line.startswith("consumed") for line in lines) < 2:
            assert proc.poll() is None, (
                f"the process ended early: {lines} {proc.stderr.read() if proc.stderr else ''}"
            )
            time.sleep(0.05)
        assert sorted(line.split()[1] for line in lines if line.startswith("consumed")) == sorted(groups), (
            lines
        )
        # and the process gets one SIGTERM
        proc.send_signal(signal.SIGTERM)
        # then it exits 0 within a bound: both consumers stopped
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            pytest.fail(f"one SIGTERM did not stop both consumers: the process still runs ({lines})")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(5)
    err = proc.stderr.read() if proc.stderr else ""
    assert proc.returncode == 0, f"rc={proc.returncode} {lines} {err[-3000:]}"
    assert any(line.startswith("returned") for line in lines), lines
    if mode == "app":
        assert lines[0] == "startup" and lines[-2:] == ["shutdown", "returned"], lines
    # and each group's committed offsets reached the end offsets: each made its final commit
    for topic, group in zip(topics, groups, strict=True):
        assert committed(kafka_bootstrap, group, topic, PARTITIONS) == end_offsets(
            kafka_bootstrap, topic, PARTITIONS
        )
