"""Exactly-once results under the KIP-848 consumer protocol (``group.protocol=consumer``; issue 25,
items 3 and 4): the group coordinator's refusals of a transactional offset commit abort the
transaction (never fatal, never ignored), and members joining, leaving and being killed leave every
input's result exactly once, in key order, for a ``read_committed`` reader.

On ``TxnOffsetCommit`` a KIP-848 group answers a stale member epoch with ``ILLEGAL_GENERATION``
(Kafka's ``OffsetMetadataManager.validateTransactionalOffsetCommit`` maps ``STALE_MEMBER_EPOCH`` to
it: the API has no such code), a newer one with ``ILLEGAL_GENERATION`` too on Kafka 4.1 (or
``FENCED_MEMBER_EPOCH``), and a member that left with ``UNKNOWN_MEMBER_ID``.
"""

from __future__ import annotations

import random
import signal
import struct
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from keyedconsumer.errors import TransactionError
from keyedconsumer.kafka.transactional import KafkaTransactionalProducer

from .kafkautil import committed, end_offsets, once_in_key_order, produce, read_committed_all, wait_until
from .procs.eos_consumer import spawn

pytestmark = [pytest.mark.kafka]
ROOT = Path(__file__).resolve().parents[2]


def _topics(bootstrap: str, partitions: int) -> tuple[str, str]:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    names = (f"in-{uuid.uuid4().hex[:8]}", f"out-{uuid.uuid4().hex[:8]}")
    for fut in admin.create_topics([NewTopic(n, partitions, 1) for n in names]).values():
        fut.result(60)
    return names


def _member(bootstrap: str, group: str, topic: str) -> Consumer:
    c = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": group,
            "group.protocol": "consumer",
            "enable.auto.commit": False,
        }
    )
    c.subscribe([topic])
    return c


def _poll_until(members: list[Consumer], done, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "the group did not settle"
        for m in members:
            m.poll(0.05)


@pytest.mark.timeout(180)
def test_transactional_offset_commits_a_kip848_group_refuses_abort_and_are_never_fatal(
    kafka_bootstrap: str,
) -> None:
    # given a KIP-848 group whose member A held all 4 partitions, then gave two to a joining member B
    src, out = _topics(kafka_bootstrap, 4)
    group = f"kip848-{uuid.uuid4().hex[:8]}"
    a = _member(kafka_bootstrap, group, src)
    _poll_until([a], lambda: len(a.assignment()) == 4)
    before_join = a.consumer_group_metadata()  # A's member epoch before the join
    b = _member(kafka_bootstrap, group, src)
    _poll_until([a, b], lambda: len(a.assignment()) == 2 and len(b.assignment()) == 2)
    _poll_until([a, b], lambda: a.consumer_group_metadata() != before_join)  # A's epoch moved on
    mine = a.assignment()[0].partition
    current = a.consumer_group_metadata()
    # the member epoch is the int32 after librdkafka's "CGMDv2:" magic (rd_kafka_consumer_group_metadata_write)
    (epoch,) = struct.unpack("=i", current[7:11])
    ahead = current[:7] + struct.pack("=i", epoch + 100) + current[11:]
    left = b.consumer_group_metadata()
    b.close()  # B leaves: its member id is unknown from now on
    _poll_until([a], lambda: len(a.assignment()) == 4)  # and A holds every partition again

    def group_offsets(parts, timeout_s):  # type: ignore[no-untyped-def]
        return {
            (tp.topic, tp.partition): (tp.offset, tp.metadata or "")
            for tp in a.committed([TopicPartition(t, p) for t, p in parts], timeout_s)
        }

    metadata = [before_join]
    producer = KafkaTransactionalProducer(
        {"bootstrap.servers": kafka_bootstrap}, f"tx-{group}", lambda: metadata[0], group_offsets, 30, 10
    )
    try:
        # when transactions send A's offsets with a stale member epoch, a newer one, and a left member's
        refusals = {}
        for name, gm in (("stale epoch", before_join), ("newer epoch", ahead), ("left member", left)):
            metadata[0] = gm
            with pytest.raises(TransactionError) as info:
                producer.run([(out, b"k", name.encode(), None)], [(src, mine, 1)], {}, 30)
            refusals[name] = info.value
        # then each was refused with the group's code, aborted (retriable: the member rejoins), never fatal
        assert refusals["stale epoch"].code == "ILLEGAL_GENERATION"
        assert refusals["newer epoch"].code in ("ILLEGAL_GENERATION", "FENCED_MEMBER_EPOCH")
        assert refusals["left member"].code == "UNKNOWN_MEMBER_ID"
        assert all(e.abortable and e.retriable and not e.fatal and not e.in_doubt for e in refusals.values())
        # and the same producer then commits with A's current metadata
        metadata[0] = a.consumer_group_metadata()
        producer.run([(out, b"k", b"current", None)], [(src, mine, 1)], {}, 30)
    finally:
        producer.close()
    # and a read_committed reader sees only that transaction's record, and the group its offset
    assert read_committed_all(kafka_bootstrap, out, 4) == [(b"k", b"current")]
    assert committed(kafka_bootstrap, group, src, 4)[mine] == 1
    a.close()


def _spawn(
    bootstrap: str, group: str, src: str, out: str, name: str, folder: Path
) -> subprocess.Popen[bytes]:
    log = str(folder / f"{name}.log")
    options = ("--protocol", "consumer", "--sleep", "0.02", "--shutdown-s", "10", "--log-file", log)
    return spawn(bootstrap, group, src, out, "tx", f"{group}-{name}", "", str(folder), *options)


def _term(proc: subprocess.Popen[bytes], folder: Path) -> str:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
    path = folder / f"exit-{proc.pid}"
    return path.read_text() if path.exists() else f"no exit file (status {proc.returncode})"


def _kill(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)


@pytest.mark.timeout(420)
def test_exactly_once_under_kip848_members_joining_leaving_and_killed(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    # given 12,000 inputs over 40 keys and transactional consumer processes of a KIP-848 group
    rng = random.Random(25)
    src, out = _topics(kafka_bootstrap, 6)
    group = f"eos848-{uuid.uuid4().hex[:8]}"
    inputs = [f"k{k}:{s}".encode() for s in range(300) for k in range(40)]
    produce(kafka_bootstrap, src, [(v.split(b":")[0], v, None) for v in inputs])

    def done_so_far() -> int:
        return sum(o or 0 for o in committed(kafka_bootstrap, group, src, 6).values())

    procs: dict[str, subprocess.Popen[bytes]] = {}
    exits: list[tuple[str, str]] = []
    try:
        procs["A"] = _spawn(kafka_bootstrap, group, src, out, "A", tmp_path)
        assert wait_until(lambda: done_so_far() >= 300, 90)
        # when members join, one leaves (SIGTERM), one is killed (SIGKILL) and restarted, and the
        # first one is killed and restarted too, while the backlog is worked through
        procs["B"] = _spawn(kafka_bootstrap, group, src, out, "B", tmp_path)
        time.sleep(rng.uniform(2.0, 4.0))
        procs["C"] = _spawn(kafka_bootstrap, group, src, out, "C", tmp_path)
        time.sleep(rng.uniform(2.0, 4.0))
        exits.append(("B", _term(procs.pop("B"), tmp_path)))
        time.sleep(rng.uniform(0.5, 2.0))
        _kill(procs["C"])
        procs["C"] = _spawn(kafka_bootstrap, group, src, out, "C", tmp_path)
        time.sleep(rng.uniform(2.0, 4.0))
        procs["D"] = _spawn(kafka_bootstrap, group, src, out, "D", tmp_path)
        time.sleep(rng.uniform(1.0, 3.0))
        assert done_so_far() < len(inputs), "the churn came too late: the backlog was done"
        _kill(procs["A"])
        procs["A"] = _spawn(kafka_bootstrap, group, src, out, "A", tmp_path)
        ends = end_offsets(kafka_bootstrap, src, 6)
        assert wait_until(
            lambda: committed(kafka_bootstrap, group, src, 6) == {p: ends[p] or None for p in ends}, 240, 0.5
        ), (
            done_so_far(),
            len(inputs),
        )
    finally:
        for name, proc in procs.items():
            exits.append((name, _term(proc, tmp_path)))
    # then every graceful stop returned normally (no TransactionError: refusals were aborted and redone)
    logs = "".join(p.read_text() for p in sorted(tmp_path.glob("*.log")))
    assert all(detail == "ok" for _, detail in exits), (exits, logs[-4000:])
    # and a read_committed reader sees every input's result exactly once, each key's in input order
    assert once_in_key_order(read_committed_all(kafka_bootstrap, out, 6), inputs) == []
