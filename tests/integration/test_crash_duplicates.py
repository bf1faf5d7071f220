"""Fewer duplicates after a crash: while a slow message holds its partition's first unfinished
offset, the offsets finished above it are committed periodically (commit metadata on the
``auto.commit.interval.ms`` cadence, as Confluent Parallel Consumer commits its offset map), so a
SIGKILL re-runs only what finished since the last such commit, not everything above the slow
message. Before, that metadata was written only at a revoke, a stop and the ownership check, none
of which a SIGKILL reaches.

Real broker; the consumer is a separate process (``procs/stop_consumer.py``) so that it can be
SIGKILLed.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition

from keyedconsumer.offsets import FinishedOffsets

from .kafkautil import committed, log_lines, produce, wait_until

pytestmark = pytest.mark.kafka
ROOT = Path(__file__).resolve().parents[2]


def _start(bootstrap: str, topic: str, group: str, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    err = open(log.with_suffix(f".{time.monotonic_ns()}.err"), "wb")
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.integration.procs.stop_consumer",
            bootstrap,
            topic,
            group,
            str(log),
            "--sleep",
            "0",
            *extra,
        ],
        cwd=ROOT,
        stdout=err,
        stderr=err,
    )


def _ends(log: Path) -> list[tuple[int, int, int]]:
    """``(pid, partition, offset)`` of each handler end, in log order."""
    lines = log_lines(log)
    return [
        (int(x[1]), int(x[2]), int(x[3]))
        for x in (ln.split() for ln in lines)
        if x and x[0] == "E" and len(x) == 4
    ]


def _stderr(log: Path) -> str:
    return "".join(
        p.read_text(errors="replace") for p in sorted(log.parent.glob(log.name.split(".")[0] + ".*.err"))
    )


def _committed_finished(bootstrap: str, group: str, topic: str) -> tuple[int | None, FinishedOffsets | None]:
    """Partition 0's committed offset and the finished offsets its metadata names."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    try:
        (tp,) = c.committed([TopicPartition(topic, 0)], timeout=10)
    finally:
        c.close()
    if tp.offset < 0:
        return None, None
    return tp.offset, FinishedOffsets.decode(tp.offset, tp.metadata)


@pytest.mark.timeout(150)
def test_a_sigkill_while_a_slow_message_holds_the_offset_does_not_rerun_what_finished_above_it(
    kafka_bootstrap: str,
    new_topic,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    # given a partition whose first message (key "hot") never finishes, consumed by a process with
    # auto.commit.interval.ms = 500, which has finished the next one (key "early") and stored and
    # committed the hot message's offset (0): that offset will not move again
    topic, n = new_topic(1), 300
    produce(kafka_bootstrap, topic, [(b"hot", b"x", 0), (b"early", b"x", 0)])
    group, log = f"g-{uuid.uuid4().hex[:8]}", tmp_path / "runs.log"
    first = _start(kafka_bootstrap, topic, group, log, "--hold-key", "hot")
    try:
        assert wait_until(lambda: committed(kafka_bootstrap, group, topic, 1) == {0: 0}, 60), _stderr(log)[
            -3000:
        ]
        # when n messages of other keys arrive above it and finish (its offset does not move)
        produce(kafka_bootstrap, topic, [(f"k{i % 50}".encode(), b"x", 0) for i in range(n)])
        assert wait_until(lambda: len(_ends(log)) >= n + 1, 60), (len(_ends(log)), _stderr(log)[-3000:])

        # then, while the hot message still runs, the group's commit stays at it and its metadata
        # comes to name every offset above it finished, without a revoke or a stop
        def all_named() -> bool:
            offset, finished = _committed_finished(kafka_bootstrap, group, topic)
            return offset == 0 and finished is not None and all(finished.covers(o) for o in range(1, n + 2))

        assert wait_until(all_named, 30), (
            _committed_finished(kafka_bootstrap, group, topic),
            _stderr(log)[-3000:],
        )
    finally:
        # when the process is SIGKILLed (no revoke, no final commit)
        first.kill()
        first.wait(10)
    # and another member takes the partition over
    second = _start(kafka_bootstrap, topic, group, log)
    try:
        assert wait_until(lambda: committed(kafka_bootstrap, group, topic, 1) == {0: n + 2}, 90), (
            committed(kafka_bootstrap, group, topic, 1),
            _stderr(log)[-3000:],
        )
    finally:
        second.terminate()
        second.wait(30)
    # then the new owner ran the hot message only: nothing that had finished above it ran again
    assert [(p, o) for pid, p, o in _ends(log) if pid == second.pid] == [(0, 0)]
