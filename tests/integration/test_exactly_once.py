"""Producing results on a real broker: at-least-once (``msg.produce``) and exactly-once
(``transactional=True``), with SIGKILL and a rebalance mid-run, and the negative control."""

from __future__ import annotations

import signal
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource, NewTopic
from keyedconsumer.middleware import Retry

from keyedconsumer import KeyedConsumer, Message
from keyedconsumer.errors import TransactionError

from .conftest import Running
from .kafkautil import CommittedReader, committed, produce, wait_until
from .procs.eos_consumer import spawn

pytestmark = [pytest.mark.kafka]
ROOT = Path(__file__).resolve().parents[2]


def _spawn(
    bootstrap: str, group: str, src: str, out: str, mode: str, txn_id: str, marker: str, folder: Path
) -> subprocess.Popen[bytes]:
    return spawn(bootstrap, group, src, out, mode, txn_id, marker, str(folder))


def _kill_at_the_marker_and_finish(
    kafka_bootstrap: str, new_topic: Callable[..., str], tmp_path: Path, mode: str
) -> tuple[list[tuple[bytes, bytes]], list[bytes], bytes]:
    """Two consumer processes (the second joins mid-run: a rebalance); the one running the marker
    input is SIGKILLed right after the marker's handler returned (its record acknowledged, without
    ``transactional``) and before its offset could be committed, then restarted with the same
    ``transactional_id``. Returns what a ``read_committed`` reader saw of the output, the inputs,
    and the marker."""
    src, out = new_topic(4), new_topic(4)
    inputs = [f"k{k}:{s}".encode() for s in range(100) for k in range(20)]
    produce(kafka_bootstrap, src, [(v.split(b":")[0], v, None) for v in inputs])
    marker = b"k7:60"
    group = f"eos-{mode}-{uuid.uuid4().hex[:8]}"
    reader = CommittedReader(kafka_bootstrap, out, 4)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        procs["A"] = _spawn(kafka_bootstrap, group, src, out, mode, f"{group}-A", marker.decode(), tmp_path)
        # the second process joins once the first one is producing: a rebalance mid-run
        assert wait_until(lambda: len(reader.snapshot()) >= 50 or bool(list(tmp_path.glob("marker-*"))), 60)
        procs["B"] = _spawn(kafka_bootstrap, group, src, out, mode, f"{group}-B", marker.decode(), tmp_path)
        assert len({v for _, v in reader.snapshot()}) < len(inputs)  # k7 waits behind the marker: mid-run
        # when the process running the marker has returned from its handler, it is SIGKILLed
        assert wait_until(lambda: any(p.name != "marker-done" for p in tmp_path.glob("marker-*")), 90)
        pid = int(next(p for p in tmp_path.glob("marker-*") if p.name != "marker-done").name.split("-")[1])
        name = next(n for n, p in procs.items() if p.pid == pid)
        procs[name].send_signal(signal.SIGKILL)
        procs[name].wait(10)
        assert len({v for _, v in reader.snapshot()}) < len(inputs)  # the marker's result is not in yet
        # and restarted with the same transactional id
        procs[name] = _spawn(
            kafka_bootstrap, group, src, out, mode, f"{group}-{name}", marker.decode(), tmp_path
        )
        # and the other process is SIGKILLed too wherever it is (mid-transaction or not) once most
        # results are in, and restarted
        other = "B" if name == "A" else "A"
        wait_until(lambda: len(reader.snapshot()) >= 1500, 60, 0.01)
        procs[other].send_signal(signal.SIGKILL)
        procs[other].wait(10)
        procs[other] = _spawn(
            kafka_bootstrap, group, src, out, mode, f"{group}-{other}", marker.decode(), tmp_path
        )
        # then every input's result arrives (read_committed)
        assert wait_until(lambda: {v for _, v in reader.snapshot()} >= set(inputs), 150, 0.5), (
            f"{len({v for _, v in reader.snapshot()})} of {len(inputs)} results"
        )
        time.sleep(1.0)  # anything still to come (a duplicate) comes within a transaction interval or so
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(40)
            except subprocess.TimeoutExpired:
                p.kill()
    seen = reader.close()
    return seen, inputs, marker


@pytest.mark.timeout(300)
def test_exactly_once_under_sigkill_and_rebalance(kafka_bootstrap: str, new_topic, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # given 2,000 inputs over 20 keys, two transactional consumer processes, one SIGKILLed mid-run
    seen, inputs, marker = _kill_at_the_marker_and_finish(kafka_bootstrap, new_topic, tmp_path, "tx")
    # then a read_committed reader saw each input's result exactly once
    counts = Counter(v for _, v in seen)
    assert set(counts) == set(inputs)
    assert [v for v, n in counts.items() if n > 1] == []
    # and each key's results in the order of its inputs
    for k in range(20):
        seqs = [int(v.split(b":")[1]) for key, v in seen if key == f"k{k}".encode()]
        assert seqs == list(range(100)), f"k{k}"


@pytest.mark.timeout(300)
def test_without_transactional_the_same_run_duplicates_results(
    kafka_bootstrap: str, new_topic, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    # given the same run without transactional=True (the negative control)
    seen, inputs, marker = _kill_at_the_marker_and_finish(kafka_bootstrap, new_topic, tmp_path, "plain")
    # then every result arrived, and the marker's twice or more: its record was acknowledged before
    # the SIGKILL, its offset never committed, so it ran and produced again after the restart
    counts = Counter(v for _, v in seen)
    assert set(counts) == set(inputs)
    assert counts[marker] >= 2


@pytest.mark.timeout(120)
def test_a_message_counts_done_only_after_its_records_are_acknowledged(
    kafka_bootstrap: str,
    new_topic,
    start: Callable[[KeyedConsumer], Running],  # type: ignore[no-untyped-def]
) -> None:
    # given an output topic that refuses the handler's record (max.message.bytes below its size:
    # MSG_SIZE_TOO_LARGE), an input, and a handler retried without end
    src = new_topic(1)
    out = f"refusing-{uuid.uuid4().hex[:10]}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(out, 1, 1, config={"max.message.bytes": "100"})])[out].result(30)
    produce(kafka_bootstrap, src, [(b"k", b"v", None)])
    attempts: list[int] = []

    def handle(msg: Message) -> None:
        attempts.append(msg.attempt)
        msg.produce(out, msg.key, b"x" * 1000)

    group = f"ack-{uuid.uuid4().hex[:8]}"
    running = start(
        KeyedConsumer(
            name=group,
            handler=handle,
            brokers=[kafka_bootstrap],
            topics=[src],
            middlewares=[Retry(max_attempts=None, initial_delay_s=0.2, max_delay_s=0.5)],
            manual_commit=True,
            produce_timeout_s=10,
        )
    )
    # when the record has been refused on three attempts
    assert wait_until(lambda: len(attempts) >= 3, 60)
    # then the offset has not moved past the message
    assert committed(kafka_bootstrap, group, src, 1) == {0: None}
    assert running.error is None
    # and when the topic accepts the record, an attempt writes it and the offset moves on
    res = ConfigResource(
        ConfigResource.Type.TOPIC,
        out,
        incremental_configs=[
            ConfigEntry("max.message.bytes", "1048588", incremental_operation=AlterConfigOpType.SET)
        ],
    )
    admin.incremental_alter_configs([res])[res].result(30)
    assert wait_until(lambda: committed(kafka_bootstrap, group, src, 1) == {0: 1}, 60, 0.5)
    reader = CommittedReader(kafka_bootstrap, out, 1)
    try:
        assert wait_until(lambda: len(reader.snapshot()) == 1, 30)
        assert reader.snapshot() == [(b"k", b"x" * 1000)]
    finally:
        reader.close()


@pytest.mark.timeout(120)
def test_a_fenced_producer_stops_its_consumer_with_a_clear_error(
    kafka_bootstrap: str,
    new_topic,
    start: Callable[[KeyedConsumer], Running],  # type: ignore[no-untyped-def]
) -> None:
    # given a transactional consumer that has committed a transaction
    src, out = new_topic(1), new_topic(1)
    tid = f"fence-{uuid.uuid4().hex[:8]}"
    produce(kafka_bootstrap, src, [(b"k", b"1", None)])

    def handle(msg: Message) -> None:
        msg.produce(out, msg.key, msg.value)

    group = f"fence-{uuid.uuid4().hex[:8]}"
    first = start(
        KeyedConsumer(
            name=group,
            handler=handle,
            brokers=[kafka_bootstrap],
            topics=[src],
            transactional=True,
            transactional_id=tid,
        )
    )
    assert wait_until(lambda: committed(kafka_bootstrap, group, src, 1) == {0: 1}, 60, 0.2)
    # when another consumer starts with the same transactional id (a zombie's successor)
    other_src = new_topic(1)
    second = start(
        KeyedConsumer(
            name=f"{group}-2",
            handler=handle,
            brokers=[kafka_bootstrap],
            topics=[other_src],
            transactional=True,
            transactional_id=tid,
        )
    )
    assert wait_until(lambda: second.consumer.running and second.consumer.assignment != [], 60)
    # and the first one has something to commit
    produce(kafka_bootstrap, src, [(b"k", b"2", None)])
    # then the first one stops with a fatal TransactionError, and its record is not visible
    assert first.join(60)
    assert isinstance(first.error, TransactionError) and first.error.fatal, repr(first.error)
    assert committed(kafka_bootstrap, group, src, 1) == {0: 1}
    reader = CommittedReader(kafka_bootstrap, out, 1)
    try:
        time.sleep(2.0)
        assert reader.snapshot() == [(b"k", b"1")]
    finally:
        reader.close()
    assert second.error is None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transactional", [False, True])
def test_async_handlers_produce_on_the_real_broker(
    kafka_bootstrap: str,
    new_topic,
    start: Callable[[KeyedConsumer], Running],
    transactional: bool,  # type: ignore[no-untyped-def]
) -> None:
    # given 300 inputs over 10 keys and an async def handler producing one record each
    src, out = new_topic(2), new_topic(2)
    inputs = [f"k{i % 10}:{i // 10}".encode() for i in range(300)]
    produce(kafka_bootstrap, src, [(v.split(b":")[0], v, None) for v in inputs])

    async def handle(msg: Message) -> None:
        msg.produce(out, msg.key, msg.value)

    group = f"async-{uuid.uuid4().hex[:8]}"
    start(
        KeyedConsumer(
            name=group,
            handler=handle,
            brokers=[kafka_bootstrap],
            topics=[src],
            concurrency=8,
            transactional=transactional,
        )
    )
    # when every offset is committed
    assert wait_until(
        lambda: sum(o or 0 for o in committed(kafka_bootstrap, group, src, 2).values()) == 300, 60, 0.2
    )
    # then every result was written, each key's in input order
    reader = CommittedReader(kafka_bootstrap, out, 2)
    try:
        assert wait_until(lambda: len(reader.snapshot()) >= 300, 30)
        seen = reader.snapshot()
    finally:
        reader.close()
    assert sorted(v for _, v in seen) == sorted(inputs)
    for k in range(10):
        assert [int(v.split(b":")[1]) for key, v in seen if key == f"k{k}".encode()] == list(range(30))


@pytest.mark.timeout(120)
def test_a_record_the_topic_refuses_aborts_and_in_the_end_stops_the_transactional_consumer(
    kafka_bootstrap: str,
    new_topic,
    start: Callable[[KeyedConsumer], Running],  # type: ignore[no-untyped-def]
) -> None:
    # given an output topic that refuses the record (max.message.bytes below its size) and a
    # transactional consumer allowed 2 s of abortable failures
    src = new_topic(1)
    out = f"refusing-tx-{uuid.uuid4().hex[:10]}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(out, 1, 1, config={"max.message.bytes": "100"})])[out].result(30)
    produce(kafka_bootstrap, src, [(b"k", b"small", None), (b"k", b"big", None)])

    def handle(msg: Message) -> None:
        msg.produce(out, msg.key, msg.value if msg.value == b"small" else b"x" * 1000)

    group = f"refuse-tx-{uuid.uuid4().hex[:8]}"
    running = start(
        KeyedConsumer(
            name=group,
            handler=handle,
            brokers=[kafka_bootstrap],
            topics=[src],
            transactional=True,
            transaction_timeout_s=2,
        )
    )
    # when the transactions holding the big record keep being aborted
    assert running.join(60)
    # then the consumer stopped with an abortable TransactionError naming the refusal, and nothing of
    # the aborted transactions is visible: the offset never passed the big record's message, and the
    # output holds the small record exactly when its offset was committed (in a transaction of its own)
    assert isinstance(running.error, TransactionError) and running.error.abortable, repr(running.error)
    assert "MSG_SIZE_TOO_LARGE" in str(running.error)
    offset = committed(kafka_bootstrap, group, src, 1)[0]
    assert offset in (None, 1)
    reader = CommittedReader(kafka_bootstrap, out, 1)
    try:
        time.sleep(2.0)
        assert reader.snapshot() == ([] if offset is None else [(b"k", b"small")])
    finally:
        reader.close()
