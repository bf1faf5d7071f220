"""Regression tests for the failure cases other frameworks shipped (``shared/cases/README.md``).

Each test is named after its case (C2 and C4 need retry / dead-letter middleware and are not
here) and runs on the real broker: confluent_kafka is used directly only to produce, administer and
read committed offsets; the consumer under test is always :class:`keyedconsumer.KeyedConsumer` (C9
drives the engine's own client seam, :func:`keyedconsumer.kafka.client.connect`).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from confluent_kafka import ConsumerGroupTopicPartitions, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from keyedconsumer import ConsumerConfig, KafkaClientError, KeyedConsumer, Message, MessageError
from keyedconsumer.kafka.client import connect

from .kafkautil import committed, end_offsets, produce, wait_until

pytestmark = [pytest.mark.kafka]

#: Faster classic-protocol rebalances (the default heartbeat is 3 s).
FAST_CLASSIC = {"heartbeat.interval.ms": 500}


def new_group(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


class Intervals:
    """Start/end (time.monotonic) of every handler call, from any thread and any consumer."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple[str, int, int, bytes | None, float, float]] = []

    def record(self, who: str, msg: Message, t0: float) -> None:
        with self.lock:
            self.calls.append((who, msg.partition, msg.offset, msg.key, t0, time.monotonic()))

    def seen(self, who: str | None = None) -> set[tuple[int, int]]:
        with self.lock:
            return {(p, o) for w, p, o, _, _, _ in self.calls if who is None or w == who}

    def offsets(self, who: str, partition: int) -> set[int]:
        with self.lock:
            return {o for w, p, o, _, _, _ in self.calls if w == who and p == partition}

    def overlaps(self) -> list[tuple[Any, Any]]:
        """Pairs of calls of one key whose [start, end] intervals overlap."""
        by_key: dict[bytes | None, list[tuple[float, float, str, int, int]]] = defaultdict(list)
        with self.lock:
            for w, p, o, k, t0, t1 in self.calls:
                by_key[k].append((t0, t1, w, p, o))
        bad = []
        for calls in by_key.values():
            calls.sort()
            for prev, nxt in zip(calls, calls[1:], strict=False):
                if nxt[0] < prev[1]:
                    bad.append((prev, nxt))
        return bad


@contextmanager
def _released_at_exit(release: threading.Event) -> Iterator[None]:
    """Sets ``release`` on leaving the block, also when an assertion failed in it (the handlers
    waiting on it then end at once, and the consumers stop)."""
    try:
        yield
    finally:
        release.set()


def group_offsets(admin: AdminClient, group: str, topic: str, partitions: int) -> dict[int, int | None]:
    req = ConsumerGroupTopicPartitions(group, [TopicPartition(topic, p) for p in range(partitions)])
    res = admin.list_consumer_group_offsets([req], request_timeout=10)[group].result(timeout=10)
    return {tp.partition: (tp.offset if tp.offset >= 0 else None) for tp in res.topic_partitions}


class CommitSampler:
    """Reads the group's committed offsets (AdminClient) every ``interval_s`` in a thread."""

    def __init__(
        self, bootstrap: str, group: str, topic: str, partitions: int, interval_s: float = 0.05
    ) -> None:
        self.admin = AdminClient({"bootstrap.servers": bootstrap})
        self.args = (group, topic, partitions)
        self.interval_s = interval_s
        self.samples: list[dict[int, int | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(self.now())
            except Exception:  # a busy coordinator: try again
                pass
            self._stop.wait(self.interval_s)

    def now(self) -> dict[int, int | None]:
        return group_offsets(self.admin, *self.args)

    def __enter__(self) -> CommitSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(15)
        self.samples.append(self.now())

    def backwards(self) -> dict[int, list[tuple[int, int]]]:
        """Per partition, the (before, after) pairs where the committed offset decreased."""
        out = {}
        for p in range(self.args[2]):
            seq = [s[p] for s in self.samples if s.get(p) is not None]
            back = [(x, y) for x, y in zip(seq, seq[1:], strict=False) if y < x]
            if back:
                out[p] = back
        return out


# ------------------------------------------------------------------------------------------------
# C1: revoke after poll, before dispatch: commit follows finished offsets, never polled ones
# ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_c1_stop_mid_run_commits_first_unfinished_offset(kafka_bootstrap: str, new_topic, start) -> None:  # type: ignore[no-untyped-def]
    # given 300 messages on one partition (20 keys), a 50 ms handler at concurrency 4, and room to
    # poll everything ahead of the handlers
    n = 300
    topic = new_topic(1)
    produce(kafka_bootstrap, topic, [(f"k{i % 20}".encode(), str(i).encode(), 0) for i in range(n)])
    group = new_group("c1")
    lock = threading.Lock()
    finished1: set[int] = set()

    def slow(msg: Message) -> None:
        time.sleep(0.05)
        with lock:
            finished1.add(msg.offset)

    first = KeyedConsumer(
        name=group,
        handler=slow,
        brokers=[kafka_bootstrap],
        topics=[topic],
        concurrency=4,
        max_in_flight=10_000,
    )
    run1 = start(first)
    assert wait_until(lambda: len(finished1) >= 40 and first.in_flight > 100, 20)

    # when the consumer is stopped mid-run (its partition revoked on close) with messages polled
    # but never started
    polled_not_finished = first.in_flight
    assert run1.stop(), "the consumer did not stop"
    assert run1.error is None

    # then the committed offset is the first offset that did not finish, not the last polled one
    with lock:
        done1 = set(finished1)
    assert polled_not_finished > 100 and len(done1) < n
    first_unfinished = min(set(range(n)) - done1)
    assert committed(kafka_bootstrap, group, topic, 1) == {0: first_unfinished}

    # when a second consumer of the group runs
    seen2: list[int] = []
    all_done = threading.Event()

    def fast(msg: Message) -> None:
        with lock:
            seen2.append(msg.offset)
            if done1 | set(seen2) >= set(range(n)):
                all_done.set()

    second = KeyedConsumer(name=group, handler=fast, brokers=[kafka_bootstrap], topics=[topic], concurrency=4)
    run2 = start(second)
    assert all_done.wait(20), "the second run did not cover the rest"
    assert run2.stop(), "the consumer did not stop"
    assert run2.error is None

    # then it starts exactly at the first unfinished offset and, together, every message ran
    assert min(seen2) == first_unfinished
    assert set(seen2) == set(range(first_unfinished, n))
    assert done1 | set(seen2) == set(range(n))
    assert committed(kafka_bootstrap, group, topic, 1) == {0: n}


@pytest.mark.timeout(60)
def test_c1_stop_while_a_handler_still_runs_commits_first_unfinished_offset(
    kafka_bootstrap: str, new_topic, start
) -> None:  # type: ignore[no-untyped-def]
    # given 400 messages of distinct keys on one partition; the handler returns at once, except on
    # offset 300 where it takes 5 s; concurrency 4
    n, slow_at, slow_s = 400, 300, 5.0
    topic = new_topic(1)
    produce(kafka_bootstrap, topic, [(f"k{i}".encode(), str(i).encode(), 0) for i in range(n)])
    group = new_group("c1s")
    lock = threading.Lock()
    finished: set[int] = set()
    slow_started = threading.Event()

    def handle(msg: Message) -> None:
        if msg.offset == slow_at:
            slow_started.set()
            time.sleep(slow_s)
        with lock:
            finished.add(msg.offset)

    consumer = KeyedConsumer(
        name=group,
        handler=handle,
        brokers=[kafka_bootstrap],
        topics=[topic],
        concurrency=4,
        shutdown_timeout_s=1,
    )
    run = start(consumer)
    # when the slow handler has run for 2 s (the 3 other workers are free for everything else)
    assert slow_started.wait(20)
    others = set(range(n)) - {slow_at}
    all_others_ran = wait_until(lambda: finished >= others, 2.0)
    with lock:
        waited = sorted(others - finished)
    # and the consumer is stopped while the slow one still runs (longer than shutdown_timeout_s)
    assert run.stop(), "the consumer did not stop"
    assert run.error is None
    with lock:
        done = set(finished)
    assert slow_at not in done, "the slow handler ended before the stop: nothing was tested"
    got = committed(kafka_bootstrap, group, topic, 1)

    # then the commit is the first offset that did not finish (the slow one): an offset whose
    # handler returned is never delivered again
    problems = []
    first_unfinished = min(set(range(n)) - done)
    if got != {0: first_unfinished}:
        problems.append(f"committed {got[0]}, but every offset before {first_unfinished} had finished")
    # and no message of another key waited for the slow one while workers were free
    if not all_others_ran:
        problems.append(
            f"{len(waited)} message(s) of other keys did not run while the slow one ran: {waited[:5]}..."
        )
    assert problems == []
    assert first_unfinished == slow_at


def join_mid_run(kafka_bootstrap: str, topic: str, group: str, config: dict[str, Any], start) -> None:  # type: ignore[no-untyped-def]
    """Consumer A runs alone on a 2-partition topic; B joins mid-run and takes one partition.

    Two keys per partition and concurrency 4: every lane always has a message running, so the
    revoke always meets running handlers of the partition that moves. While B joins, A's handlers
    take 1 s. Asserts: nothing lost, no offset of the moved partition skipped, B starts exactly at
    A's first unfinished offset, the committed offsets never move backwards, no same-key overlap
    across the two consumers, and committed == end offsets at the end.
    """
    per_partition = 120
    produce(
        kafka_bootstrap,
        topic,
        [(f"p{p}-k{i % 2}".encode(), str(i).encode(), p) for p in (0, 1) for i in range(per_partition)],
    )
    everything = {(p, o) for p in (0, 1) for o in range(per_partition)}
    rec = Intervals()
    all_done = threading.Event()
    joining = threading.Event()

    def handler(who: str) -> Callable[[Message], None]:
        def handle(msg: Message) -> None:
            t0 = time.monotonic()
            time.sleep(1.0 if who == "A" and joining.is_set() else 0.05)
            rec.record(who, msg, t0)
            if rec.seen() >= everything:
                all_done.set()

        return handle

    a = KeyedConsumer(
        name=group,
        handler=handler("A"),
        brokers=[kafka_bootstrap],
        topics=[topic],
        concurrency=4,
        config=config,
    )
    b = KeyedConsumer(
        name=group,
        handler=handler("B"),
        brokers=[kafka_bootstrap],
        topics=[topic],
        concurrency=4,
        config=config,
    )
    with CommitSampler(kafka_bootstrap, group, topic, 2) as sampler:
        run_a = start(a)
        # given A owns both partitions and has processed some of each
        assert wait_until(lambda: len(rec.offsets("A", 0)) >= 10 and len(rec.offsets("A", 1)) >= 10, 20)
        assert sorted(a.assignment) == [(topic, 0), (topic, 1)]

        # when B joins the group mid-run, while A's handlers run
        joining.set()
        run_b = start(b)
        assert wait_until(lambda: len(b.assignment) == 1 and len(a.assignment) == 1, 20), (
            a.assignment,
            b.assignment,
        )
        joining.clear()
        moved = b.assignment[0][1]
        assert a.assignment == [(topic, 1 - moved)]
        assert all_done.wait(25), f"not everything ran: missing {sorted(everything - rec.seen())[:10]}"
        assert run_b.stop(), "the consumer did not stop"
        assert run_a.stop(), "the consumer did not stop"
        assert run_a.error is None and run_b.error is None

    # then nothing is lost
    assert rec.seen() == everything
    # and the partition really moved mid-run, and no offset of it was skipped: every offset before
    # B's first was finished by A
    by_b = rec.offsets("B", moved)
    by_a = rec.offsets("A", moved)
    assert by_a and by_b, "the partition did not move mid-run"
    b_start = min(by_b)
    assert set(range(b_start)) <= by_a, f"offsets skipped: {sorted(set(range(b_start)) - by_a)}"
    assert by_b == set(range(b_start, per_partition))
    # and the group's committed offsets never moved backwards
    assert sampler.backwards() == {}
    # and B started exactly at A's first unfinished offset: nothing A finished ran again
    assert b_start == min(set(range(per_partition)) - by_a), (
        f"B started at {b_start}, A had finished up to {max(by_a)}"
    )
    # and no key ever ran twice at once, across both consumers
    assert rec.overlaps() == []
    # and the group committed everything
    assert committed(kafka_bootstrap, group, topic, 2) == end_offsets(kafka_bootstrap, topic, 2)


@pytest.mark.timeout(60)
def test_c1_second_consumer_joins_mid_run_cooperative(kafka_bootstrap: str, new_topic, start) -> None:  # type: ignore[no-untyped-def]
    # given / when / then: see join_mid_run (classic protocol, cooperative-sticky assignor)
    join_mid_run(kafka_bootstrap, new_topic(2), new_group("c1j"), dict(FAST_CLASSIC), start)


# ------------------------------------------------------------------------------------------------
# C3: transactional input: offsets 0, 2, 4, 6 completing 0, 2, 6, 4 -> stored offset 7
# ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_c3_transactional_offsets_commit_past_last_data_offset(
    kafka_bootstrap: str, new_topic, start
) -> None:  # type: ignore[no-untyped-def]
    # given 4 data messages written in 4 transactions (a commit marker after each)
    topic = new_topic(1)
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "transactional.id": f"tx-{uuid.uuid4().hex}"})
    producer.init_transactions(30)
    for i in range(4):
        producer.begin_transaction()
        producer.produce(topic, key=f"k{i}".encode(), value=str(i).encode(), partition=0)
        producer.commit_transaction(30)
    group = new_group("c3")
    lock = threading.Lock()
    received: list[int] = []
    completed: list[int] = []
    all_done = threading.Event()

    def handle(msg: Message) -> None:
        with lock:
            received.append(msg.offset)
        time.sleep(1.0 if msg.value == b"2" else 0.05)  # the third data message finishes last
        with lock:
            completed.append(msg.offset)
            if len(completed) == 4:
                all_done.set()

    # when consumed read_committed (librdkafka's default), concurrency 4, no ordering
    consumer = KeyedConsumer(
        name=group,
        handler=handle,
        brokers=[kafka_bootstrap],
        topics=[topic],
        concurrency=4,
        ordering="none",
        config={},
    )
    run = start(consumer)
    assert all_done.wait(20)
    assert run.stop(), "the consumer did not stop"
    assert run.error is None

    # then the data offsets skip the markers, the third finished last, and the committed offset is
    # the one after the last data message
    data = sorted(received)
    assert data == [0, 2, 4, 6]
    assert completed[-1] == data[2] and sorted(completed[:3]) == [data[0], data[1], data[3]]
    assert committed(kafka_bootstrap, group, topic, 1) == {0: data[-1] + 1}


# ------------------------------------------------------------------------------------------------
# C5: a late store of a moved partition never moves the committed offset backwards
# ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "returns_first", [False, True], ids=["finishes-while-at-B", "returns-to-A-before-finish"]
)
def test_c5_slow_handler_after_revoke_never_moves_commit_backwards(
    kafka_bootstrap: str, new_topic, start, returns_first: bool
) -> None:  # type: ignore[no-untyped-def]
    # given 2 partitions of 20 messages; offset 2 of each is slow for consumer A (it runs until the
    # test releases it, 30 s at most), whose revoke waits only 1 s for running handlers; offsets
    # 2..19 share one key, so they wait behind the slow one (A's tracker of the partition holds
    # them unfinished when the partition moves)
    per_partition, slow_at = 20, 2
    topic = new_topic(2)
    produce(
        kafka_bootstrap,
        topic,
        [
            (f"p{p}-k{min(i, slow_at)}".encode(), (b"slow" if i == slow_at else str(i).encode()), p)
            for p in (0, 1)
            for i in range(per_partition)
        ],
    )
    everything = {(p, o) for p in (0, 1) for o in range(per_partition)}
    group = new_group("c5")
    rec = Intervals()
    lock = threading.Lock()
    slow_started: set[int] = set()
    release = threading.Event()

    def slow_a(msg: Message) -> None:
        t0 = time.monotonic()
        if msg.value == b"slow":
            with lock:
                slow_started.add(msg.partition)
            release.wait(30)
        rec.record("A", msg, t0)

    def fast_b(msg: Message) -> None:
        rec.record("B", msg, time.monotonic())

    # and a sampler of the group's committed offsets
    with CommitSampler(kafka_bootstrap, group, topic, 2) as sampler, _released_at_exit(release):
        a = KeyedConsumer(
            name=group,
            handler=slow_a,
            brokers=[kafka_bootstrap],
            topics=[topic],
            concurrency=4,
            revoke_timeout_s=1,
            config=dict(FAST_CLASSIC),
        )
        run_a = start(a)
        assert wait_until(lambda: slow_started == {0, 1}, 20)

        # when B (fast, committing every advance) joins and takes a partition while A's slow
        # message of it still runs, and B processes and commits that partition to its end
        b = KeyedConsumer(
            name=group,
            handler=fast_b,
            brokers=[kafka_bootstrap],
            topics=[topic],
            concurrency=4,
            manual_commit=True,
            config=dict(FAST_CLASSIC),
        )
        run_b = start(b)
        assert wait_until(lambda: len(b.assignment) == 1, 20)
        moved = b.assignment[0][1]
        assert wait_until(lambda: per_partition - 1 in rec.offsets("B", moved), 10)
        assert wait_until(lambda: sampler.now()[moved] == per_partition, 10)
        if returns_first:
            # and B leaves, the partition returns to A, and only then A's old slow message finishes
            assert run_b.stop(), "the consumer did not stop"
            assert wait_until(lambda: len(a.assignment) == 2, 20)
            assert slow_at not in rec.offsets("A", moved), "the slow message ended too early for this case"
            release.set()
            assert wait_until(lambda: slow_at in rec.offsets("A", moved) and rec.seen() >= everything, 15)
            time.sleep(1.0)  # room for a late store of A to be committed
        else:
            # and A's old slow message finishes while B owns the partition; then B leaves and the
            # partition returns to A
            release.set()
            assert wait_until(lambda: slow_at in rec.offsets("A", moved) and rec.seen() >= everything, 15)
            assert b.assignment == [(topic, moved)]
            time.sleep(0.5)  # room for a late store of A to show up
            assert run_b.stop(), "the consumer did not stop"
            assert wait_until(lambda: len(a.assignment) == 2, 20)
            time.sleep(0.5)
        assert run_a.stop(), "the consumer did not stop"
        assert run_a.error is None and run_b.error is None

    # then the slow message of the moved partition really finished after B had taken it over
    b_first = min(t0 for w, p, _, _, t0, _ in rec.calls if w == "B" and p == moved)
    a_slow_end = next(t1 for w, p, o, _, _, t1 in rec.calls if w == "A" and p == moved and o == slow_at)
    assert a_slow_end > b_first
    # and the group's committed offsets never moved backwards
    assert len(sampler.samples) > 20
    assert sampler.backwards() == {}
    # and every message ran at least once, and everything is committed
    assert rec.seen() == everything
    assert sampler.samples[-1] == {0: per_partition, 1: per_partition}


# ------------------------------------------------------------------------------------------------
# C6: a handler longer than max.poll.interval.ms does not get the member kicked out
# ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_c6_handler_longer_than_max_poll_interval_keeps_membership(
    kafka_bootstrap: str, new_topic, start, caplog
) -> None:  # type: ignore[no-untyped-def]
    # given a 6 s max.poll.interval.ms and a handler taking 8 s on the first message
    caplog.set_level(logging.INFO, logger="keyedconsumer")
    n = 10
    topic = new_topic(1)
    produce(kafka_bootstrap, topic, [(f"k{i}".encode(), str(i).encode(), 0) for i in range(n)])
    group = new_group("c6")
    lock = threading.Lock()
    calls: list[int] = []

    def handle(msg: Message) -> None:
        if msg.offset == 0:
            time.sleep(8)
        with lock:
            calls.append(msg.offset)

    consumer = KeyedConsumer(
        name=group,
        handler=handle,
        brokers=[kafka_bootstrap],
        topics=[topic],
        concurrency=2,
        config={"max.poll.interval.ms": 6000, "session.timeout.ms": 6000},
    )
    run = start(consumer)
    assert wait_until(lambda: consumer.assignment == [(topic, 0)], 20)

    # when the slow handler runs past max.poll.interval.ms
    assignments: list[list[Any]] = []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        assignments.append(consumer.assignment)
        with lock:
            if 0 in calls:
                break
        time.sleep(0.1)
    time.sleep(1.0)  # a late eviction would show here
    assignments.append(consumer.assignment)
    before_stop = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "keyedconsumer"]
    assert run.stop(), "the consumer did not stop"
    assert run.error is None

    # then the member kept its partition the whole time, nothing ran twice, and all is committed
    assert 0 in calls
    assert all(a == [(topic, 0)] for a in assignments), [a for a in assignments if a != [(topic, 0)]]
    assert sorted(calls) == list(range(n))
    assert sum(m.startswith("assigned") for _, m in before_stop) == 1, (
        before_stop
    )  # one assignment, no rejoin
    assert [m for lvl, m in before_stop if lvl >= logging.WARNING] == []  # nothing lost, no commit failed
    assert committed(kafka_bootstrap, group, topic, 1) == {0: n}


# ------------------------------------------------------------------------------------------------
# C7: a failed earlier message holds the offset even when a later one succeeded
# ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_c7_failed_message_holds_offset_and_is_redelivered(kafka_bootstrap: str, new_topic, start) -> None:  # type: ignore[no-untyped-def]
    # given m1 (key a) then m2 (key b) on one partition; m1 fails after 0.5 s, m2 succeeds at once
    topic = new_topic(1)
    acked = produce(kafka_bootstrap, topic, [(b"a", b"m1", 0), (b"b", b"m2", 0)])
    assert sorted(acked) == [(0, 0), (0, 1)]
    m1, m2 = 0, 1
    group = new_group("c7")
    lock = threading.Lock()
    events: list[tuple[str, int]] = []

    def handle(msg: Message) -> None:
        if msg.key == b"a":
            time.sleep(0.5)
            with lock:
                events.append(("fail", msg.offset))
            raise RuntimeError("m1 cannot be processed")
        with lock:
            events.append(("ok", msg.offset))

    # when consumed at concurrency 2 with no error handler
    consumer = KeyedConsumer(
        name=group, handler=handle, brokers=[kafka_bootstrap], topics=[topic], concurrency=2
    )
    run = start(consumer)
    run.thread.join(30)
    assert not run.thread.is_alive(), "run() did not stop on the unhandled failure"

    # then run() raised a MessageError naming m1, after m2 had succeeded
    assert isinstance(run.error, MessageError), run.error
    assert (run.error.topic, run.error.partition, run.error.offset) == (topic, 0, m1)
    assert "m1 cannot be processed" in str(run.error)
    assert events == [("ok", m2), ("fail", m1)]
    # and the committed offset stays at m1
    assert committed(kafka_bootstrap, group, topic, 1) == {0: m1}

    # when the consumer restarts (the failure fixed)
    seen: list[int] = []
    got_m1 = threading.Event()

    def fixed(msg: Message) -> None:
        with lock:
            seen.append(msg.offset)
        if msg.offset == m1:
            got_m1.set()

    again = KeyedConsumer(name=group, handler=fixed, brokers=[kafka_bootstrap], topics=[topic], concurrency=2)
    run2 = start(again)
    # then m1 is delivered again; m2, which succeeded (named finished in the commit's metadata), is
    # not run again, and the commit reaches the end
    assert got_m1.wait(20)
    assert wait_until(lambda: committed(kafka_bootstrap, group, topic, 1) == {0: 2}, 20)
    assert run2.stop(), "the consumer did not stop"
    assert run2.error is None
    assert seen == [m1]
    assert again.skipped_finished == 1


# ------------------------------------------------------------------------------------------------
# C8: committing nothing new, or an offset already committed, is benign
# ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_c8_manual_commit_with_nothing_new_is_benign(kafka_bootstrap: str, new_topic, start, caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.WARNING, logger="keyedconsumer")
    n = 5
    topic = new_topic(1)
    produce(kafka_bootstrap, topic, [(f"k{i}".encode(), str(i).encode(), 0) for i in range(n)])
    group = new_group("c8")
    lock = threading.Lock()
    seen: list[int] = []
    errors: list[tuple[BaseException, Any]] = []

    def handle(msg: Message) -> None:
        with lock:
            seen.append(msg.offset)

    def on_error(err: BaseException, msg: Any) -> None:
        errors.append((err, msg))

    def consumer() -> KeyedConsumer:
        return KeyedConsumer(
            name=group,
            handler=handle,
            error_handler=on_error,
            brokers=[kafka_bootstrap],
            topics=[topic],
            concurrency=2,
            manual_commit=True,
        )

    # given a manual-commit consumer that processed and committed everything; its stop commits the
    # same offsets again (final commit, then commit on revoke)
    first = consumer()
    run1 = start(first)
    assert wait_until(lambda: len(seen) == n and first.assignment, 20)
    assert wait_until(lambda: committed(kafka_bootstrap, group, topic, 1) == {0: n}, 10)
    assert run1.stop(), "the consumer did not stop"
    assert run1.error is None

    # when a manual-commit consumer of the group runs on the topic with nothing new, then stops
    second = consumer()
    run2 = start(second)
    assert wait_until(lambda: second.assignment == [(topic, 0)], 20)
    time.sleep(1.0)
    assert run2.stop(), "the consumer did not stop"

    # then nothing failed, nothing ran again, nothing was logged as a failure
    assert run2.error is None
    assert errors == []
    assert sorted(seen) == list(range(n))
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert committed(kafka_bootstrap, group, topic, 1) == {0: n}

    # when the engine's client commits nothing, then an offset already committed
    client_errors: list[KafkaClientError] = []
    conf = ConsumerConfig(
        name=group, brokers=[kafka_bootstrap], topics=[topic], manual_commit=True
    ).librdkafka()
    client = connect(conf, client_errors.append)
    try:
        client.check_brokers(10)
        client.commit([])  # librdkafka answers _NO_OFFSET
        client.commit([(topic, 0, n)])
    finally:
        client.close()
    # then neither is an error, and the committed offset is unchanged
    assert client_errors == []
    assert committed(kafka_bootstrap, group, topic, 1) == {0: n}


# ------------------------------------------------------------------------------------------------
# C9: one partition's store failure never silently drops another's
# ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_c9_store_of_unassigned_partition_fails_alone(kafka_bootstrap: str, new_topic) -> None:  # type: ignore[no-untyped-def]
    # given the engine's client subscribed to a 2-partition topic, owning both partitions
    topic, other = new_topic(2), new_topic(1)
    produce(kafka_bootstrap, topic, [(b"k", str(i).encode(), i % 2) for i in range(10)])
    produce(kafka_bootstrap, other, [(b"k", b"x", 0)])
    group = new_group("c9")
    conf = ConsumerConfig(
        name=group, brokers=[kafka_bootstrap], topics=[topic], config={"auto.commit.interval.ms": 200}
    ).librdkafka()
    client_errors: list[KafkaClientError] = []
    assigned: list[tuple[str, int]] = []

    class Listener:
        def on_assign(self, partitions: list[tuple[str, int]]) -> None:
            assigned.extend(partitions)

        def on_revoke(self, partitions: list[tuple[str, int]]) -> None:
            pass

        def on_lost(self, partitions: list[tuple[str, int]]) -> None:
            pass

    client = connect(conf, client_errors.append)
    try:
        client.subscribe([topic], Listener())
        deadline = time.monotonic() + 20
        while len(assigned) < 2 and time.monotonic() < deadline:
            client.poll_batch(100, 0.2)
        assert sorted(assigned) == [(topic, 0), (topic, 1)]

        # when offsets are stored for an assigned partition, an unassigned one, and another assigned one
        client.store(topic, 0, 3)
        with pytest.raises(KafkaClientError) as info:
            client.store(other, 0, 1)
        client.store(topic, 1, 4)

        # then only the unassigned store fails, naming its partition
        assert f"topic={other} partition=0" in str(info.value) and info.value.code

        # and both assigned partitions' offsets are committed (auto-commit of the stored offsets)
        def read_back() -> dict[int, int | None]:
            client.poll_batch(100, 0.1)
            return committed(kafka_bootstrap, group, topic, 2)

        assert wait_until(lambda: read_back() == {0: 3, 1: 4}, 10, 0.2), read_back()
    finally:
        client.close()
    assert committed(kafka_bootstrap, group, topic, 2) == {0: 3, 1: 4}
    assert committed(kafka_bootstrap, group, other, 1) == {0: None}
    assert client_errors == []


# ------------------------------------------------------------------------------------------------
# C10: KIP-848 (group.protocol=consumer): a member joining mid-run, no refused assign/unassign
# ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_c10_consumer_protocol_second_consumer_joins_mid_run(
    kafka_bootstrap: str, new_topic, start, caplog
) -> None:  # type: ignore[no-untyped-def]
    # given / when / then: see join_mid_run, under group.protocol=consumer
    caplog.set_level(logging.WARNING, logger="keyedconsumer")
    try:
        join_mid_run(kafka_bootstrap, new_topic(2), new_group("c10"), {"group.protocol": "consumer"}, start)
    finally:
        # and no assign()/unassign() was refused (it would be logged as a client error)
        logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        refused = [m for m in logged if "assign" in m.lower()]
        assert refused == [], refused
