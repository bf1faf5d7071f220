"""keyedconsumer.testing: the in-memory broker, its fake client and clock, and engine behaviour
tested through them (no Kafka)."""

from __future__ import annotations

import asyncio
import threading
import time
import zlib
from collections import defaultdict

import pytest
from keyedconsumer.middleware import DeadLetter, Retry

from keyedconsumer import (
    CommitError,
    KafkaClientError,
    KeyedConsumer,
    Message,
    MessageError,
    SkipMessage,
    Status,
)
from keyedconsumer.testing import Commit, FakeClock, InMemoryBroker

pytestmark = [pytest.mark.timeout(30)]


def never_backwards(commits: list[Commit]) -> dict[tuple[str, int], list[int]]:
    """Committed offsets per partition, in commit order; fails if one moves back."""
    seen: dict[tuple[str, int], list[int]] = defaultdict(list)
    for c in commits:
        tp = (c.topic, c.partition)
        assert not seen[tp] or c.offset >= seen[tp][-1], (
            f"committed offset of {tp} moved back: {seen[tp]} then {c}"
        )
        seen[tp].append(c.offset)
    return seen


# -- the user story ---------------------------------------------------------------------------------


def test_three_messages_are_handled_and_their_offsets_committed() -> None:
    # given three messages on a two-partition topic
    broker = InMemoryBroker()
    broker.create_topic("orders", partitions=2)
    recs = [broker.produce("orders", f"v{i}", key=f"k{i}") for i in range(3)]
    handled: list[tuple[int, int, bytes | None]] = []
    # when a consumer built the long way (client_factory + clock) runs until idle
    consumer = KeyedConsumer(
        name="billing",
        handler=lambda m: handled.append((m.partition, m.offset, m.value)),
        topics=["orders"],
        client_factory=broker.client_factory,
        clock=broker.clock,
    )
    with broker.run(consumer) as run:
        run.until_idle(timeout_s=5)
    # then each message ran once and every partition is committed at its end offset
    assert sorted(handled) == sorted((r.partition, r.offset, r.value) for r in recs)
    ends: dict[tuple[str, int], int] = {}
    for r in recs:
        ends[(r.topic, r.partition)] = r.offset + 1
    assert broker.committed("billing") == ends
    assert set(broker.lag("billing", "orders").values()) == {0}
    assert broker.committed("another-group") == {}


@pytest.mark.timeout(30)
def test_retry_with_minutes_of_backoff_then_dead_letter_takes_milliseconds() -> None:
    # given a poison message between two good ones, behind Retry (60 s, then 120 s) and DeadLetter
    broker = InMemoryBroker()
    broker.create_topic("payments", partitions=1)
    for key, value in (("good", "1"), ("bad", "2"), ("good", "3")):
        broker.produce("payments", value, key=key, headers=[("trace", "t-1")])
    attempts: list[tuple[bytes | None, int, float]] = []

    def handle(msg: Message) -> None:
        attempts.append((msg.key, msg.attempt, broker.clock()))
        if msg.key == b"bad":
            raise ValueError("card declined")

    consumer = broker.consumer(
        name="payments-processor",
        handler=handle,
        topics=["payments"],
        middlewares=[
            DeadLetter(publisher=broker.publisher()),
            Retry(max_attempts=3, initial_delay_s=60, multiplier=2, max_delay_s=600, jitter=0),
        ],
    )
    # when it runs until idle
    started = time.monotonic()
    with broker.run(consumer) as run:
        run.until_idle(timeout_s=10)
    real_s = time.monotonic() - started
    # then the bad message ran three times, 60 and 120 fake seconds apart, in a few real seconds
    # (back-offs waited in real time would take 180 s; 8 s leaves a loaded machine room and stays
    # below until_idle's 10 s)
    bad = [(attempt, at) for key, attempt, at in attempts if key == b"bad"]
    assert [a for a, _ in bad] == [1, 2, 3]
    assert bad[1][1] - bad[0][1] >= 60 and bad[2][1] - bad[1][1] >= 120
    assert real_s < 8.0, real_s
    # and it was dead-lettered once, unchanged, with the failure headers; everything is committed
    (dead,) = broker.records("payments.dlq")
    assert (dead.key, dead.value, dead.header("trace")) == (b"bad", b"2", b"t-1")
    assert dead.header("kafka_dlt-original-offset") == b"1"
    assert dead.header("kafka_dlt-attempts") == b"3"
    assert dead.header("kafka_dlt-exception-fqcn") == b"builtins.ValueError"
    assert dead.header("kafka_dlt-original-consumer-group") == b"payments-processor"
    assert [k for k, _, _ in attempts].count(b"good") == 2
    assert broker.committed("payments-processor") == {("payments", 0): 3}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("manual_commit", [False, True])
def test_rebalance_mid_run_keeps_key_order_and_commits_nothing_past_an_unfinished_message(
    manual_commit: bool,
) -> None:
    broker = InMemoryBroker()
    broker.create_topic("events", partitions=4)
    keys = [f"key-{i}".encode() for i in range(12)]
    blocked_key, blocked_seq = keys[0], 3
    entered, release = threading.Event(), threading.Event()
    lock = threading.Lock()
    log: list[tuple[str, bytes, int]] = []
    running: set[bytes] = set()
    overlaps: list[bytes] = []

    def handler_of(member: str):  # type: ignore[no-untyped-def]
        def handle(msg: Message) -> None:
            assert msg.key is not None
            seq = int(msg.value or b"0")
            with lock:
                if msg.key in running:
                    overlaps.append(msg.key)
                running.add(msg.key)
            try:
                if (msg.key, seq) == (blocked_key, blocked_seq) and not entered.is_set():
                    entered.set()
                    assert release.wait(20)
                time.sleep(0.0005)
                with lock:
                    log.append((member, msg.key, seq))
            finally:
                with lock:
                    running.discard(msg.key)

        return handle

    c1, c2 = (
        broker.consumer(
            name=name,
            group_id="grp",
            handler=handler_of(name),
            topics=["events"],
            concurrency=4,
            manual_commit=manual_commit,
        )
        for name in ("c1", "c2")
    )
    with broker.run(c1, c2) as run:
        # given two members of one group holding two partitions each
        run.wait_for(
            lambda: sorted(map(len, broker.assignments("grp").values())) == [2, 2], what="a 2/2 assignment"
        )
        records = {}
        for seq in range(10):
            for key in keys:
                rec = broker.produce("events", str(seq), key=key)
                records[(key, seq)] = rec
        blocked = records[(blocked_key, blocked_seq)]
        blocked_tp = ("events", blocked.partition)

        def blocked_commits() -> list[int]:
            return [c.offset for c in broker.commits("grp") if (c.topic, c.partition) == blocked_tp]

        try:
            # when one message blocks, every other message has finished, and the auto-commit clock ticked
            assert entered.wait(10)
            others = sum(1 for (k, s) in records if k != blocked_key or s < blocked_seq)
            run.wait_for(lambda: len({(k, s) for _, k, s in log}) == others, what="all other messages")
            tick = broker.clock()
            run.wait_for(lambda: broker.clock() > tick + 60, what="fake time passing")
            # then the other partitions are committed to their ends (a handler logs before its
            # outcome reaches the owner, so the last commits may come a few idle polls later) ...
            ends = broker.end_offsets("events")
            run.wait_for(
                lambda: all(broker.committed("grp").get(tp) == ends[tp] for tp in ends if tp != blocked_tp),
                what="the other partitions committed to their ends",
            )
            # ... while its partition's commits stay at or before it
            assert all(offset <= blocked.offset for offset in blocked_commits()), blocked_commits()
            # when the group rebalances while it still runs
            owner_before = next(m for m, tps in broker.assignments("grp").items() if blocked_tp in tps)
            broker.rebalance("grp")
            run.wait_for(
                lambda: sorted(map(len, broker.assignments("grp").values())) == [0, 2],
                what="the member without the blocked message to revoke",
            )
            assert all(offset <= blocked.offset for offset in blocked_commits()), blocked_commits()
        finally:
            release.set()
        run.until_idle(timeout_s=20)
        assignments = broker.assignments("grp")
    # then every partition moved to the other member
    assert blocked_tp not in assignments[owner_before]
    # and nothing ran concurrently per key, no key skipped ahead, and every message ran
    assert overlaps == []
    by_key: dict[bytes, list[int]] = defaultdict(list)
    for _, key, seq in log:
        assert seq <= max(by_key[key], default=-1) + 1, f"{key!r} ran {seq} after {by_key[key]}"
        by_key[key].append(seq)
    assert {k: sorted(set(v)) for k, v in by_key.items()} == {k: list(range(10)) for k in keys}
    assert {m for m, _, _ in log} == {"c1", "c2"}
    # and the commits of each partition never moved back and ended at the end offsets
    final = never_backwards(broker.commits("grp"))
    assert {tp: offs[-1] for tp, offs in final.items()} == broker.end_offsets("events")


# -- the broker model -------------------------------------------------------------------------------


def test_partitioner_hashes_keys_like_librdkafka_and_spreads_null_keys() -> None:
    broker = InMemoryBroker()
    broker.create_topic("t", partitions=4)
    for key in (b"a", b"acct-1", b"\x00\xff", "text"):
        raw = key.encode() if isinstance(key, str) else key
        assert broker.produce("t", "x", key=key).partition == zlib.crc32(raw) % 4
        assert broker.produce("t", "y", key=key).partition == zlib.crc32(raw) % 4  # stable
    assert [broker.produce("t", "n").partition for _ in range(6)] == [0, 1, 2, 3, 0, 1]
    for p in range(4):
        assert [r.offset for r in broker.records("t", p)] == list(range(len(broker.records("t", p))))
    assert broker.produce("t", "v", partition=2).partition == 2
    with pytest.raises(ValueError, match="no partition 4"):
        broker.produce("t", "v", partition=4)
    with pytest.raises(ValueError, match="exists"):
        broker.create_topic("t", partitions=4)
    assert broker.produce("new-topic", "v").partition == 0  # auto-created with default_partitions
    strict = InMemoryBroker(auto_create_topics=False)
    with pytest.raises(ValueError, match="unknown topic"):
        strict.produce("nope", "v")


def test_fake_clock_moves_only_forward_when_told() -> None:
    clock = FakeClock(start_s=5.0)
    assert clock() == 5.0
    assert clock.advance(2.5) == 7.5 and clock() == 7.5
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            clock.advance(bad)
    assert clock() == 7.5


def test_auto_commit_waits_for_the_clock_tick_and_manual_commit_does_not() -> None:
    broker = InMemoryBroker()
    broker.create_topic("t", partitions=1)
    for i in range(3):
        broker.produce("t", str(i), key="k")
    hour_ms = 3_600_000
    auto = broker.consumer(
        name="auto",
        handler=lambda m: None,
        topics=["t"],
        poll_timeout_s=0.1,
        config={"auto.commit.interval.ms": hour_ms},
    )
    with broker.run(auto) as run:
        # given every message done: its offsets are stored, not committed, until the tick
        run.wait_for(lambda: broker.stored("auto") == {("t", 0): 3}, what="the offsets stored")
        assert broker.committed("auto") == {}
        # when the fake clock reaches the auto-commit interval, the stored offsets are committed
        broker.clock.advance(hour_ms / 1000)
        run.wait_for(lambda: broker.committed("auto") == {("t", 0): 3}, what="the auto commit")
    assert broker.commits("auto")[0].automatic
    # with manual_commit the engine commits synchronously, no tick needed
    manual = broker.consumer(
        name="manual",
        handler=lambda m: None,
        topics=["t"],
        poll_timeout_s=0.1,
        manual_commit=True,
        config={"auto.commit.interval.ms": hour_ms},
    )
    with broker.run(manual) as run:
        run.wait_for(lambda: broker.committed("manual") == {("t", 0): 3}, what="the manual commit")
    assert broker.commits("manual") and not any(c.automatic for c in broker.commits("manual"))


def test_lost_partitions_drop_stored_offsets_and_are_delivered_again_but_revoked_ones_are_committed() -> None:
    broker = InMemoryBroker()
    broker.create_topic("t", partitions=1)
    handled: list[int] = []
    consumer = broker.consumer(
        name="g",
        handler=lambda m: handled.append(m.offset),
        topics=["t"],
        poll_timeout_s=0.1,
        config={"auto.commit.interval.ms": 3_600_000},
    )
    with broker.run(consumer) as run:
        for i in range(3):
            broker.produce("t", str(i), key=f"k{i}")
        run.wait_for(lambda: broker.stored("g") == {("t", 0): 3}, what="three offsets stored")
        # a revoke commits what is done: nothing is delivered again
        broker.rebalance("g")
        run.wait_for(lambda: broker.committed("g") == {("t", 0): 3}, what="the commit on revoke")
        run.wait_for(
            lambda: list(broker.assignments("g").values()) == [[("t", 0)]], what="the partition assigned back"
        )
        for i in range(3, 6):
            broker.produce("t", str(i), key=f"k{i}")
        run.wait_for(lambda: broker.stored("g") == {("t", 0): 6}, what="six offsets stored")
        # a loss commits nothing: the stored offsets are dropped and the records come again
        broker.rebalance("g", lost=True)
        run.wait_for(lambda: len(handled) == 9, what="the re-delivery")
        assert broker.committed("g") == {("t", 0): 3}
    assert handled == [0, 1, 2, 3, 4, 5, 3, 4, 5]
    assert broker.committed("g") == {("t", 0): 6}  # committed on close


def test_members_joining_and_leaving_move_only_some_partitions() -> None:
    broker = InMemoryBroker()
    broker.create_topic("t", partitions=4)
    handled: list[tuple[str, int, int]] = []
    c1 = broker.consumer(
        name="a", group_id="g", topics=["t"], handler=lambda m: handled.append(("a", m.partition, m.offset))
    )
    c2 = broker.consumer(
        name="b", group_id="g", topics=["t"], handler=lambda m: handled.append(("b", m.partition, m.offset))
    )
    with broker.run(c1) as run:
        run.wait_for(lambda: [len(v) for v in broker.assignments("g").values()] == [4], what="all four to a")
        (first,) = broker.assignments("g")
        run.add(c2)
        run.wait_for(lambda: sorted(map(len, broker.assignments("g").values())) == [2, 2], what="a 2/2 split")
        kept = broker.assignments("g")[first]
        for i in range(40):
            broker.produce("t", str(i), key=f"k{i}")
        run.until_idle(timeout_s=10)
        run.stop(c2)
        run.wait_for(
            lambda: list(broker.assignments("g").values()) == [[("t", p) for p in range(4)]],
            what="all four back to a",
        )
        for i in range(40, 60):
            broker.produce("t", str(i), key=f"k{i}")
        run.until_idle(timeout_s=10)
    # incremental: the first member gave up two partitions (revoked before the second got them), kept two
    calls = broker.callbacks("g")
    (second,) = {m for m, _, _ in calls} - {first}
    t = [("t", p) for p in range(4)]
    moved = sorted(set(t) - set(kept))
    assert calls[:3] == [(first, "assign", t), (first, "revoke", moved), (second, "assign", moved)]
    # and when the second left, its partitions came back to the first, after its revoke; the first's
    # own close revoked all four
    assert calls[3:] == [(second, "revoke", moved), (first, "assign", moved), (first, "revoke", t)]
    assert len(kept) == 2
    assert {m for m, _, _ in handled} == {"a", "b"}
    assert sorted((p, o) for _, p, o in handled) == sorted(
        (r.partition, r.offset) for r in (r for p in range(4) for r in broker.records("t", p))
    )
    assert set(broker.lag("g", "t").values()) == {0}


class Recorder:
    """A rebalance listener that records its calls and the thread they ran in."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[tuple[str, int]]]] = []
        self.threads: set[int] = set()

    def _got(self, kind: str, tps: list[tuple[str, int]]) -> None:
        self.calls.append((kind, tps))
        self.threads.add(threading.get_ident())

    def on_assign(self, tps: list[tuple[str, int]]) -> None:
        self._got("assign", tps)

    def on_revoke(self, tps: list[tuple[str, int]]) -> None:
        self._got("revoke", tps)

    def on_lost(self, tps: list[tuple[str, int]]) -> None:
        self._got("lost", tps)


def test_the_fake_client_alone_models_store_commit_and_the_cooperative_hand_over() -> None:
    broker = InMemoryBroker()
    broker.create_topic("t", partitions=2)
    for p in (0, 1):
        for _ in range(3):
            broker.produce("t", "v", partition=p)
    conf = {"group.id": "g", "auto.offset.reset": "earliest"}
    errors: list[KafkaClientError] = []
    a, la = broker.client_factory(conf, errors.append), Recorder()
    a.subscribe(["t"], la)
    # the first poll runs on_assign, in the polling thread, then delivers from the start
    msgs = a.poll_batch(10, 0.1)
    assert la.calls == [("assign", [("t", 0), ("t", 1)])] and la.threads == {threading.get_ident()}
    assert sorted((m.partition, m.offset) for m in msgs) == [(p, o) for p in (0, 1) for o in range(3)]
    assert a.high_watermarks([("t", 0), ("nope", 0)]) == {("t", 0): 3, ("nope", 0): None}
    # a stored offset is not committed before the auto-commit tick; storing for another partition fails
    a.store("t", 1, 2)
    with pytest.raises(KafkaClientError) as info:
        a.store("t", 7, 1)
    assert info.value.code == "_STATE" and broker.committed("g") == {}
    # an idle poll advances the fake clock by its timeout
    before = broker.clock()
    assert a.poll_batch(10, 0.25) == [] and broker.clock() == before + 0.25
    # a second member joins: it gets its partition only after the first revoked it and committed
    b, lb = broker.client_factory(conf, errors.append), Recorder()
    b.subscribe(["t"], lb)
    assert b.poll_batch(10, 0.1) == [] and lb.calls == []
    a.poll_batch(10, 0.1)
    assert la.calls[-1] == ("revoke", [("t", 1)]) and broker.committed("g") == {("t", 1): 2}
    assert [(m.partition, m.offset) for m in b.poll_batch(10, 0.1)] == [(1, 2)]
    assert lb.calls == [("assign", [("t", 1)])]
    # commits: refused for a partition the member does not own, taken at once for one it owns
    with pytest.raises(CommitError) as refused:
        a.commit([("t", 1, 3)])
    assert refused.value.code == "ILLEGAL_GENERATION"
    a.commit([("t", 0, 1)])
    assert broker.committed("g")[("t", 0)] == 1
    # the auto-commit tick of the fake clock commits what was stored
    a.store("t", 0, 3)
    broker.clock.advance(5.0)
    a.poll_batch(10, 0.1)
    assert broker.committed("g")[("t", 0)] == 3 and broker.commits("g")[-1].automatic
    # close revokes (in the closing thread), commits what was stored, and hands the partition over
    b.store("t", 1, 3)
    b.close()
    assert lb.calls[-1] == ("revoke", [("t", 1)]) and broker.committed("g")[("t", 1)] == 3
    a.poll_batch(10, 0.1)
    assert la.calls[-1] == ("assign", [("t", 1)]) and broker.assignments("g") == {
        a.member_id: [("t", 0), ("t", 1)]
    }
    with pytest.raises(KafkaClientError):
        b.poll_batch(10, 0.1)
    assert errors == []


def test_until_idle_names_what_is_left_when_it_times_out() -> None:
    broker = InMemoryBroker()
    broker.create_topic("slow", partitions=1)
    broker.produce("slow", "1", key="k")
    broker.produce("slow", "2", key="k")
    release = threading.Event()
    consumer = broker.consumer(name="g", handler=lambda m: release.wait(10), topics=["slow"])
    with broker.run(consumer) as run:
        try:
            with pytest.raises(TimeoutError, match=r"slow\[0\] committed None of end 2 \(2 left\)"):
                run.until_idle(timeout_s=0.2)
        finally:
            release.set()
        run.until_idle(timeout_s=5)
    assert broker.committed("g") == {("slow", 0): 2}


def test_run_refuses_a_consumer_of_the_real_kafka_client() -> None:
    broker = InMemoryBroker()
    real = KeyedConsumer(name="g", handler=lambda m: None, topics=["t"])
    with pytest.raises(ValueError, match="real Kafka client"):
        broker.run(real)
    broker.run(broker.consumer(name="g", handler=lambda m: None, topics=["t"])).stop()


# -- the engine, tested through the harness -------------------------------------------------------


def test_an_unhandled_failure_stops_the_consumer_and_commits_up_to_the_failing_message() -> None:
    broker = InMemoryBroker()
    broker.create_topic("t", partitions=1)
    for i in range(5):
        broker.produce("t", str(i), key="same")
    handled: list[int] = []

    def handle(msg: Message) -> None:
        if msg.offset == 2:
            raise ValueError("boom")
        handled.append(msg.offset)

    consumer = broker.consumer(name="g", handler=handle, topics=["t"])
    with pytest.raises(MessageError) as info:
        with broker.run(consumer) as run:
            run.until_idle(timeout_s=5)
    assert (info.value.topic, info.value.partition, info.value.offset) == ("t", 0, 2)
    assert isinstance(info.value.cause, ValueError)
    assert handled == [0, 1]
    assert broker.committed("g") == {("t", 0): 2}


def test_skipped_messages_are_done() -> None:
    broker = InMemoryBroker()
    broker.create_topic("t", partitions=1)
    for i in range(4):
        broker.produce("t", str(i), key="k")
    seen: list[Message] = []

    def handle(msg: Message) -> None:
        seen.append(msg)
        if msg.offset == 1:
            raise SkipMessage()
        if msg.offset == 2:
            msg.ack_skip()

    consumer = broker.consumer(name="g", handler=handle, topics=["t"])
    with broker.run(consumer) as run:
        run.until_idle(timeout_s=5)
    assert [m.status for m in seen] == [Status.SUCCESS, Status.SKIP, Status.SKIP, Status.SUCCESS]
    assert broker.committed("g") == {("t", 0): 4}


@pytest.mark.parametrize("ordering", ["partition", "key"])
def test_partition_ordering_runs_one_message_per_partition_at_a_time(ordering: str) -> None:
    # the same data and handler; only the ordering differs (the "key" run shows the handler can overlap)
    broker = InMemoryBroker()
    broker.create_topic("t", partitions=1)
    for i in range(8):
        broker.produce("t", str(i), key=f"k{i}")
    lock = threading.Lock()
    now, peak, order = [0], [0], []

    def handle(msg: Message) -> None:
        with lock:
            now[0] += 1
            peak[0] = max(peak[0], now[0])
            order.append(msg.offset)
        time.sleep(0.01)
        with lock:
            now[0] -= 1

    consumer = broker.consumer(name="g", handler=handle, topics=["t"], concurrency=4, ordering=ordering)
    with broker.run(consumer) as run:
        run.until_idle(timeout_s=10)
    if ordering == "partition":
        assert peak[0] == 1 and order == list(range(8))
    else:
        assert peak[0] >= 2 and sorted(order) == list(range(8))


def test_back_pressure_stops_fetching_at_max_in_flight() -> None:
    broker = InMemoryBroker()
    broker.create_topic("t", partitions=1)
    for i in range(100):
        broker.produce("t", str(i), key="one-key")
    release = threading.Event()
    handled: list[int] = []

    def handle(msg: Message) -> None:
        release.wait(10)
        handled.append(msg.offset)

    consumer = broker.consumer(name="g", handler=handle, topics=["t"], max_in_flight=4, poll_timeout_s=1.0)
    with broker.run(consumer) as run:
        run.wait_for(lambda: broker.delivered("g") > 0, what="a delivery")
        start = broker.clock()
        run.wait_for(lambda: broker.clock() > start + 50, what="fifty idle polls")
        assert broker.delivered("g") <= 4
        release.set()
        run.until_idle(timeout_s=10)
    assert handled == list(range(100))


def test_async_handlers_run_through_the_harness_too() -> None:
    broker = InMemoryBroker()
    broker.create_topic("t", partitions=2)
    for i in range(20):
        broker.produce("t", str(i), key=f"k{i % 3}")
    handled: list[tuple[int, int]] = []

    async def handle(msg: Message) -> None:
        await asyncio.sleep(0)
        handled.append((msg.partition, msg.offset))

    consumer = broker.consumer(name="g", handler=handle, topics=["t"], concurrency=3)
    with broker.run(consumer) as run:
        run.until_idle(timeout_s=10)
    assert sorted(handled) == sorted(
        (r.partition, r.offset) for p in range(2) for r in broker.records("t", p)
    )
    assert set(broker.lag("g", "t").values()) == {0}


def test_client_errors_go_to_the_error_handler_and_a_fatal_one_stops_the_consumer() -> None:
    broker = InMemoryBroker()
    broker.create_topic("t", partitions=1)
    reported: list[tuple[BaseException, Message | None]] = []
    consumer = broker.consumer(
        name="g",
        handler=lambda m: None,
        topics=["t"],
        error_handler=lambda err, msg: reported.append((err, msg)),
    )
    with pytest.raises(KafkaClientError, match="broker gone"):
        with broker.run(consumer) as run:
            broker.inject_error(KafkaClientError("_TRANSPORT: flaky", code="_TRANSPORT"), group="g")
            run.wait_for(lambda: len(reported) == 1, what="the error reported")
            assert reported[0][1] is None and isinstance(reported[0][0], KafkaClientError)
            broker.inject_error(KafkaClientError("_FATAL: broker gone", code="_FATAL", fatal=True), group="g")
            run.wait_for(lambda: False, timeout_s=10, what="the consumer to stop")
    assert len(reported) == 1


@pytest.mark.timeout(60)
def test_a_stop_that_cannot_finish_a_message_commits_what_finished_above_it_and_the_next_owner_skips_it() -> (
    None
):
    # given key "a" blocked at offset 0 and 20 other keys finished above it (offsets 1..20)
    broker = InMemoryBroker()
    broker.create_topic("t", partitions=1)
    release = threading.Event()
    runs: list[tuple[str, int]] = []

    def handler_of(member: str):  # type: ignore[no-untyped-def]
        def handle(msg: Message) -> None:
            if msg.key == b"a" and member == "c1":
                release.wait(20)
            runs.append((member, msg.offset))

        return handle

    broker.produce("t", "blocked", key="a")
    for i in range(20):
        broker.produce("t", str(i), key=f"k{i}")
    c1 = broker.consumer(
        name="c1", group_id="g", topics=["t"], handler=handler_of("c1"), concurrency=4, shutdown_timeout_s=0.5
    )
    c2 = broker.consumer(name="c2", group_id="g", topics=["t"], handler=handler_of("c2"), concurrency=4)
    try:
        with broker.run(c1) as run:
            run.wait_for(lambda: len(runs) == 20, what="the 20 other keys")
            # when the first member stops while offset 0 still runs
            run.stop(c1)
            # then it committed offset 0 (never past it), with metadata naming offsets 1..20 finished
            (last,) = [c for c in broker.commits("g") if not c.automatic][-1:]
            assert last.offset == 0 and last.metadata.startswith("kc1:")
            # and the next owner runs offset 0 and new messages, not what already finished
            broker.produce("t", "new", key="k3")
            run.add(c2)
            run.wait_for(lambda: ("c2", 21) in runs, what="the new message on the second member")
            run.until_idle(timeout_s=10)
    finally:
        release.set()
    assert sorted(o for m, o in runs if m == "c2") == [0, 21]
    assert c2.skipped_finished == 20
    assert broker.committed("g") == {("t", 0): 22}


@pytest.mark.timeout(60)
def test_a_final_commit_refused_during_a_rebalance_is_made_again_once_the_rebalance_is_served() -> None:
    from keyedconsumer.testing import FakeClient

    # given a client whose first commit at stop is refused: the group is in the middle of a rebalance
    broker = InMemoryBroker()
    broker.create_topic("t", partitions=1)
    refusals: list[str] = []

    class Rebalancing(FakeClient):
        """Refuses commits from the stop on, until it has been polled (which serves the rebalance)."""

        def commit(self, offsets, metadata=None, timeout_s=None):  # type: ignore[no-untyped-def]
            if stopping.is_set() and not served.is_set():
                refusals.append("REBALANCE_IN_PROGRESS")
                raise CommitError("commit failed: REBALANCE_IN_PROGRESS", code="REBALANCE_IN_PROGRESS")
            return super().commit(offsets, metadata, timeout_s)

        def poll_batch(self, max_messages, timeout_s):  # type: ignore[no-untyped-def]
            if refusals:
                served.set()
            return super().poll_batch(max_messages, timeout_s)

    def factory(conf, on_error):  # type: ignore[no-untyped-def]
        real = broker.client_factory(conf, on_error)
        real.__class__ = Rebalancing
        return real

    stopping, served = threading.Event(), threading.Event()
    handled: list[int] = []
    c = KeyedConsumer(
        name="g",
        topics=["t"],
        handler=lambda m: handled.append(m.offset),
        client_factory=factory,
        clock=broker.clock,
        poll_timeout_s=0.05,
        config={"auto.commit.interval.ms": 3_600_000},
    )
    for i in range(5):
        broker.produce("t", str(i), key=f"k{i}")
    with broker.run(c) as run:
        run.wait_for(lambda: len(handled) == 5, what="five messages")
        # when it stops
        stopping.set()
        run.stop(c)
    # then the refused commit was made again (synchronously, not left to the close's auto commit):
    # the group's offset is at the end, nothing runs twice
    assert refusals == ["REBALANCE_IN_PROGRESS"]
    assert [(x.offset, x.automatic) for x in broker.commits("g")][0] == (5, False)
    assert broker.committed("g") == {("t", 0): 5}
    assert sorted(handled) == list(range(5))
