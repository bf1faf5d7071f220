"""Parking (ordered non-blocking retries in Redis) and scheduled messages, on the real broker and
real Redis: a failing key waits in Redis while other keys and the partition's offset move on, its
later messages follow it in order, and Redis is clean at the end."""

from __future__ import annotations

import threading
import time
import uuid
from collections import defaultdict

import pytest
from keyedconsumer.middleware import DeadLetter, Retry

from keyedconsumer import KeyedConsumer, Message, RedisSequencer
from keyedconsumer.sequencing import inspect_redis

from .kafkautil import committed, end_offsets, produce, read_all, wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.redis]


def _clean(redis_url: str, ns: str) -> dict:  # type: ignore[type-arg]
    state = inspect_redis(redis_url, ns)
    return {k: state[k] for k in ("leases", "parked", "scheduled", "quarantined")}


@pytest.mark.timeout(180)
def test_a_failing_key_is_parked_while_20000_other_messages_flow(
    kafka_bootstrap, redis_url, new_topic, start
) -> None:  # type: ignore[no-untyped-def]
    # given 20,000 messages of 1,000 keys on 2 partitions, and 10 messages of key "bad" whose
    # first fails 5 times before it succeeds
    topic = new_topic(2)
    records: list[tuple[bytes | None, bytes | None, int | None]] = []
    bad_seq = 0
    for i in range(20_000):
        if i % 2000 == 100:
            records.append((b"bad", f"bad:{bad_seq}".encode(), None))
            bad_seq += 1
        k = f"k{i % 1000}".encode()
        records.append((k, f"{k.decode()}:{i}".encode(), None))
    acks = produce(kafka_bootstrap, topic, records)
    bad_at = next(acks[i] for i, r in enumerate(records) if r[0] == b"bad")  # (partition, offset)

    seen: dict[bytes, list[str]] = defaultdict(list)
    running: set[bytes] = set()
    overlap: list[bytes] = []
    lock = threading.Lock()
    first_ok = threading.Event()
    passed_while_parked = threading.Event()

    def handle(msg: Message) -> None:
        assert msg.key is not None and msg.value is not None
        with lock:
            if msg.key in running:
                overlap.append(msg.key)
            running.add(msg.key)
        try:
            if msg.value == b"bad:0" and msg.attempt <= 5:
                raise ConnectionError(f"attempt {msg.attempt} fails")
            with lock:
                seen[msg.key].append(msg.value.decode())
            if msg.value == b"bad:0":
                first_ok.set()
        finally:
            with lock:
                running.discard(msg.key)

    ns = f"park-{uuid.uuid4().hex[:8]}"
    group = f"g-{ns}"
    seq = RedisSequencer(redis_url, ns, lease_ttl_s=2.0)
    consumer = KeyedConsumer(
        name=group,
        handler=handle,
        brokers=[kafka_bootstrap],
        topics=[topic],
        concurrency=16,
        middlewares=[
            Retry(
                max_attempts=None, initial_delay_s=1.0, multiplier=1.5, max_delay_s=3.0, jitter=0, park=True
            )
        ],
        sequencer=seq,
    )
    r = start(consumer)

    # when it runs, the partition's committed offset passes the failing message while it is parked
    def passed() -> bool:
        c = committed(kafka_bootstrap, group, topic, 2).get(bad_at[0])
        if c is not None and c > bad_at[1] and not first_ok.is_set():
            passed_while_parked.set()
        return passed_while_parked.is_set() or first_ok.is_set()

    wait_until(passed, 60, 0.1)
    ends = end_offsets(kafka_bootstrap, topic, 2)
    assert wait_until(
        lambda: (
            committed(kafka_bootstrap, group, topic, 2) == ends
            and first_ok.is_set()
            and len(seen[b"bad"]) == 10
            and not seq.parker.draining
        ),
        120,
    ), (committed(kafka_bootstrap, group, topic, 2), ends, seen[b"bad"])
    assert r.stop(30) and r.error is None

    # then the offset moved on while the key was parked, and the key's messages kept their order
    assert passed_while_parked.is_set(), (
        "the committed offset never passed the parked message before it succeeded"
    )
    assert seen[b"bad"] == [f"bad:{i}" for i in range(10)]
    assert seq.parker.parked >= 10 and seq.parker.drained >= 10
    for k, vals in seen.items():
        if k != b"bad":
            nums = [int(v.split(":")[1]) for v in vals]
            assert nums == sorted(nums), k
    assert sum(len(set(v)) for v in seen.values()) == len(records)
    assert overlap == []
    # and Redis holds nothing of the namespace but fencing counters and markers
    assert _clean(redis_url, ns) == {"leases": [], "parked": [], "scheduled": 0, "quarantined": []}


@pytest.mark.timeout(120)
def test_parked_message_dead_lettered_after_max_attempts_then_key_goes_on(
    kafka_bootstrap, redis_url, new_topic, start
) -> None:  # type: ignore[no-untyped-def]
    # given key "p" whose first message always fails, then two good messages of the same key
    topic = new_topic(1)
    produce(
        kafka_bootstrap,
        topic,
        [(b"p", b"poison", None), (b"p", b"p1", None), (b"p", b"p2", None), (b"q", b"q1", None)],
    )
    seen: list[tuple[str, int]] = []

    def handle(msg: Message) -> None:
        if msg.value == b"poison":
            raise ValueError("never works")
        seen.append((msg.value.decode(), msg.attempt))  # type: ignore[union-attr]

    ns = f"dlq-{uuid.uuid4().hex[:8]}"
    seq = RedisSequencer(redis_url, ns, lease_ttl_s=2.0)
    consumer = KeyedConsumer(
        name=f"g-{ns}",
        handler=handle,
        brokers=[kafka_bootstrap],
        topics=[topic],
        concurrency=4,
        sequencer=seq,
        middlewares=[
            DeadLetter(brokers=[kafka_bootstrap]),
            Retry(max_attempts=3, initial_delay_s=0.2, jitter=0, park=True),
        ],
    )
    r = start(consumer)
    assert wait_until(lambda: len(seen) == 3 and not seq.parker.draining, 60), seen
    assert r.stop(30) and r.error is None
    # then the poison message was dead-lettered once, after 3 attempts, and "p" went on in order
    dlq = read_all(kafka_bootstrap, f"{topic}.dlq", 1)
    assert [m.value() for m in dlq] == [b"poison"]
    assert dict(dlq[0].headers())["kafka_dlt-attempts"] == b"3"
    assert [v for v, _ in seen if v.startswith("p")] == ["p1", "p2"]
    assert committed(kafka_bootstrap, f"g-{ns}", topic, 1) == end_offsets(kafka_bootstrap, topic, 1)
    assert _clean(redis_url, ns) == {"leases": [], "parked": [], "scheduled": 0, "quarantined": []}


@pytest.mark.timeout(90)
def test_scheduled_messages_fire_no_earlier_than_due_in_key_order(
    kafka_bootstrap, redis_url, new_topic, start
) -> None:  # type: ignore[no-untyped-def]
    # given a running consumer with the Redis sequencer
    topic = new_topic(1)
    got: list[tuple[bytes, float, int, int]] = []

    def handle(msg: Message) -> None:
        got.append((msg.value or b"", time.time(), msg.partition, msg.offset))

    ns = f"sched-{uuid.uuid4().hex[:8]}"
    seq = RedisSequencer(redis_url, ns, lease_ttl_s=2.0)
    consumer = KeyedConsumer(
        name=f"g-{ns}",
        handler=handle,
        brokers=[kafka_bootstrap],
        topics=[topic],
        concurrency=4,
        sequencer=seq,
    )
    r = start(consumer)
    assert wait_until(lambda: seq.is_scheduler, 20)
    # when messages are scheduled 0.5-2 s ahead (two of one key, out of due order when scheduled)
    due: dict[bytes, float] = {}
    now = time.time()
    for i, (key, delay) in enumerate([(b"a", 1.5), (b"a", 0.5), (b"b", 1.0), (b"c", 2.0)]):
        v = f"{key.decode()}{i}".encode()
        consumer.schedule(key, v, [("h", b"1")], delay_s=delay)
        due[v] = now + delay
    assert wait_until(lambda: len(got) == 4, 30), got
    assert r.stop(30) and r.error is None
    # then each fired no earlier than its due time, not much later, in due order per key
    late = {v: t - due[v] for v, t, _, _ in got}
    assert all(x >= -0.01 for x in late.values()), late
    assert max(late.values()) < 1.5, late
    assert [v for v, *_ in got if v.startswith(b"a")] == [b"a1", b"a0"]
    assert all(p == -1 and o == -1 for _, _, p, o in got)
    assert _clean(redis_url, ns) == {"leases": [], "parked": [], "scheduled": 0, "quarantined": []}


@pytest.mark.timeout(90)
def test_a_misfire_is_delivered_at_start_up_and_counted(kafka_bootstrap, redis_url, new_topic, start) -> None:  # type: ignore[no-untyped-def]
    # given a message scheduled while no consumer runs, due 1.5 s ago by the time one starts
    topic = new_topic(1)
    ns = f"misfire-{uuid.uuid4().hex[:8]}"
    seq = RedisSequencer(redis_url, ns, lease_ttl_s=2.0)
    seq.schedule(topic, b"m", b"late", delay_s=0.0)
    time.sleep(1.5)
    got: list[bytes] = []
    consumer = KeyedConsumer(
        name=f"g-{ns}",
        handler=lambda m: got.append(m.value),
        brokers=[kafka_bootstrap],
        topics=[topic],
        concurrency=2,
        sequencer=seq,
    )
    r = start(consumer)
    # when it starts, then the message is delivered and counted as a misfire
    assert wait_until(lambda: got == [b"late"], 30)
    assert seq.parker.misfires == 1
    assert r.stop(30) and r.error is None


@pytest.mark.timeout(60)
def test_namespaces_never_see_each_others_keys(kafka_bootstrap, redis_url, new_topic, start) -> None:  # type: ignore[no-untyped-def]
    # given a message scheduled in namespace A, and a consumer of namespace B running
    topic = new_topic(1)
    ns_a, ns_b = f"nsa-{uuid.uuid4().hex[:8]}", f"nsb-{uuid.uuid4().hex[:8]}"
    RedisSequencer(redis_url, ns_a).schedule(topic, b"x", b"for-a", delay_s=0.0)
    got: list[bytes | None] = []
    seq_b = RedisSequencer(redis_url, ns_b, lease_ttl_s=2.0)
    r = start(
        KeyedConsumer(
            name=f"g-{ns_b}",
            handler=lambda m: got.append(m.value),
            brokers=[kafka_bootstrap],
            topics=[topic],
            concurrency=2,
            sequencer=seq_b,
        )
    )
    assert wait_until(lambda: seq_b.is_scheduler, 20)
    time.sleep(1.0)
    # then B never delivers A's message, and A still holds it
    assert got == []
    assert inspect_redis(redis_url, ns_a)["scheduled"] == 1
    assert r.stop(30) and r.error is None
    # when A's consumer runs, then it is delivered there
    seq_a = RedisSequencer(redis_url, ns_a, lease_ttl_s=2.0)
    got_a: list[bytes | None] = []
    r = start(
        KeyedConsumer(
            name=f"g-{ns_a}",
            handler=lambda m: got_a.append(m.value),
            brokers=[kafka_bootstrap],
            topics=[topic],
            concurrency=2,
            sequencer=seq_a,
        )
    )
    assert wait_until(lambda: got_a == [b"for-a"], 20)
    assert r.stop(30) and r.error is None


@pytest.mark.timeout(60)
def test_the_parking_scripts_store_the_last_error_and_conflate_under_the_lease(redis_url) -> None:  # type: ignore[no-untyped-def]
    # given a key's lease and a park that carries the failure that parked the key
    from keyedconsumer.sequencing.store import LastError, LeaseStore

    ns = f"lasterr-{uuid.uuid4().hex[:8]}"
    store = LeaseStore(redis_url, ns)
    lid = "k.6b"
    assert store.acquire([(lid, "me")], 5000)[0][0] > 0
    field = "74.0"
    before_ms = store.time_ms()
    failure = LastError("builtins.ValueError", "<b>boom</b>", "t[0]@5", 1)
    assert store.park([(lid, "me", [(field, 5, b"e5")], failure)], 60_000, 100, 1 << 20, conflate=True) == [
        (1, 0, 1, 2, [])
    ]
    # then the error is stored with the key, on the Redis server's clock
    [pk] = inspect_redis(redis_url, ns)["parked"]
    err = pk["last_error"]
    assert {k: err[k] for k in ("type", "message", "at", "attempt")} == {
        "type": "builtins.ValueError",
        "message": "<b>boom</b>",
        "at": "t[0]@5",
        "attempt": 1,
    }
    assert before_ms / 1000 - 0.001 <= err["time_s"] <= store.time_ms() / 1000 + 0.001
    # when newer messages of the key are parked behind it with conflate, the list keeps its head
    # and the newest only: each append returns what it replaced (a park without an error keeps the error)
    assert store.park([(lid, "me", [(field, 6, b"e6")], None)], 60_000, 100, 1 << 20, conflate=True) == [
        (1, 1, 1, 2, [])
    ]
    assert store.park(
        [(lid, "me", [(field, 7, b"e7"), (field, 8, b"e8")], None)], 60_000, 100, 1 << 20, conflate=True
    ) == [(1, 2, 2, 0, [b"e6", b"e7"])]  # 0 bytes added: each replaced an entry of its size
    assert store.fetch(lid, "me", 10) == (True, [b"e5", b"e8"], 2, [])
    from keyedconsumer.sequencing import keys

    assert int(store._r.get(keys.pbytes(ns, lid))) == 4
    assert inspect_redis(redis_url, ns)["parked"][0]["last_error"]["message"] == "<b>boom</b>"
    # and a list written without conflation is cut at the drain's fetch, under the lease only
    store.park([(lid, "me", [(field, o, f"e{o}".encode()) for o in (9, 10, 11)], None)], 60_000, 100, 1 << 20)
    assert store.fetch(lid, "other", 10, conflate=True) == (False, [], 0, [])
    assert store.fetch(lid, "me", 10, conflate=True) == (True, [b"e5", b"e11"], 2, [b"e8", b"e9", b"e10"])
    # and a failure of the head run again replaces the error, in the script that rewrites the head
    again = LastError("builtins.KeyError", "'x'", "t[0]@5", 2)
    assert store.replace_head(lid, "me", b"e5", b"e5'", again)
    assert inspect_redis(redis_url, ns)["parked"][0]["last_error"]["attempt"] == 2
    # and the error goes with the list once it is empty
    assert store.pop_many(lid, "me", [b"e5'", b"e11"]) == 2
    assert inspect_redis(redis_url, ns)["parked"] == []
    assert not store._r.exists(keys.error(ns, lid), keys.pbytes(ns, lid))
    store.release([(lid, "me")])
    store.close()


@pytest.mark.timeout(60)
def test_a_redelivered_failure_of_a_key_drained_meanwhile_leaves_no_error_behind(redis_url) -> None:  # type: ignore[no-untyped-def]
    # given a key parked with its failure, then drained (the list and its error are gone)
    from keyedconsumer.sequencing import keys
    from keyedconsumer.sequencing.store import LastError, LeaseStore

    ns = f"redeliv-{uuid.uuid4().hex[:8]}"
    store = LeaseStore(redis_url, ns)
    lid = "k.6c"
    try:
        assert store.acquire([(lid, "me")], 5000)[0][0] > 0
        failure = LastError("builtins.ValueError", "boom", "t[0]@5", 1)
        assert store.park([(lid, "me", [("74.0", 5, b"e5")], failure)], 60_000, 100, 1 << 20)[0][:3] == (
            1,
            0,
            1,
        )
        assert store.pop_many(lid, "me", [b"e5"]) == 1
        assert not store._r.exists(keys.error(ns, lid))
        # when Kafka delivers the same message again (a crash before its commit) and it fails again
        again = store.park([(lid, "me", [("74.0", 5, b"e5")], failure)], 60_000, 100, 1 << 20)
        # then it is recognised as parked already, nothing is appended, and no error key is left
        assert again[0] == (1, 0, 1, 0, [])
        assert not store._r.exists(keys.error(ns, lid), keys.park(ns, lid), keys.pbytes(ns, lid))
    finally:
        store.release([(lid, "me")])
        store.close()


@pytest.mark.timeout(60)
def test_parking_is_idempotent_per_topic_partition_offset(redis_url) -> None:  # type: ignore[no-untyped-def]
    # given a key's lease and three parked entries (offsets 5, 6, 7 of partition 0)
    from keyedconsumer.sequencing.store import LeaseStore

    store = LeaseStore(redis_url, f"idem-{uuid.uuid4().hex[:8]}")
    lid = "k.6b"
    [(token, depth)] = store.acquire([(lid, "me")], 5000)
    assert token > 0 and depth == 0
    field = "74.0"
    batch = [(field, o, f"e{o}".encode()) for o in (5, 6, 7)]
    assert store.park([(lid, "me", batch, None)], 60_000, 100, 1 << 20) == [(1, 0, 3, 6, [])]
    # when the same offsets come again (a re-delivery after a crash), plus offset 8
    again = store.park([(lid, "me", [*batch, (field, 8, b"e8")], None)], 60_000, 100, 1 << 20)
    # then all four are taken but only offset 8 is appended; another owner may not append at all
    assert again == [(1, 3, 4, 2, [])]
    assert store.park([(lid, "other", [(field, 9, b"e9")], None)], 60_000, 100, 1 << 20)[0][0] == 0
    ok, head, n, _ = store.fetch(lid, "me")
    assert ok and head == [b"e5"] and n == 4
    # and at the cap (5 messages) only what fits is taken, in order
    assert store.park(
        [(lid, "me", [(field, 10, b"e10"), (field, 11, b"e11")], None)], 60_000, 5, 1 << 20
    ) == [(1, 4, 1, 3, [])]
    assert store.fetch(lid, "me")[2] == 5
    assert store.pop_many(lid, "me", [b"e5", b"e6", b"x", b"e7"]) == 2  # stops at the first mismatch
    assert store.pop_many(lid, "other", [b"e7"]) == -1
    assert store.pop_many(lid, "me", [b"e7", b"e8", b"e10"]) == 3
    store.release([(lid, "me")])
    store.close()


@pytest.mark.timeout(120)
def test_at_the_per_key_cap_nothing_is_dropped_and_the_offset_waits(
    kafka_bootstrap, redis_url, new_topic, start
) -> None:  # type: ignore[no-untyped-def]
    # given key "bad" whose first message fails 4 times, a cap of 3 parked messages per key, and 8
    # more messages of the key produced while it is parked
    topic = new_topic(1)
    produce(kafka_bootstrap, topic, [(b"bad", b"bad:0", None)])
    seen: list[str] = []

    def handle(msg: Message) -> None:
        if msg.value == b"bad:0" and msg.attempt <= 4:
            raise ConnectionError("fails")
        seen.append((msg.value or b"").decode())

    ns = f"cap-{uuid.uuid4().hex[:8]}"
    group = f"g-{ns}"
    seq = RedisSequencer(redis_url, ns, lease_ttl_s=2.0, max_parked_per_key=3)
    r = start(
        KeyedConsumer(
            name=group,
            handler=handle,
            brokers=[kafka_bootstrap],
            topics=[topic],
            concurrency=4,
            sequencer=seq,
            middlewares=[Retry(max_attempts=None, initial_delay_s=1.0, multiplier=1.0, jitter=0, park=True)],
            config={"auto.commit.interval.ms": 100},
        )
    )
    assert wait_until(lambda: seq.parker is not None and seq.parker.parked >= 1, 30)
    acks = produce(kafka_bootstrap, topic, [(b"bad", f"bad:{i}".encode(), None) for i in range(1, 9)])
    # when the list is full, then the rest wait in memory and the committed offset stays before them
    depths: list[int] = []

    def full() -> bool:
        parked = inspect_redis(redis_url, ns)["parked"]
        depths.append(parked[0]["depth"] if parked else 0)
        c = committed(kafka_bootstrap, group, topic, 1)[0]
        return depths[-1] == 3 and c is not None and c <= acks[2][1] + 1

    assert wait_until(full, 30, 0.1), depths[-5:]
    assert max(depths) <= 3
    assert (
        committed(kafka_bootstrap, group, topic, 1)[0] <= acks[2][1] + 1
    )  # not past the first one held in memory
    # and once the key drains, every message runs, in order, and Redis ends clean
    assert wait_until(lambda: len(seen) == 9 and not seq.parker.draining, 60), seen
    assert seen == [f"bad:{i}" for i in range(9)]
    assert wait_until(
        lambda: committed(kafka_bootstrap, group, topic, 1) == end_offsets(kafka_bootstrap, topic, 1), 20
    )
    assert r.stop(30) and r.error is None
    assert _clean(redis_url, ns) == {"leases": [], "parked": [], "scheduled": 0, "quarantined": []}


@pytest.mark.timeout(120)
def test_quarantine_on_dead_letter_holds_the_key_until_released(
    kafka_bootstrap, redis_url, new_topic, start
) -> None:  # type: ignore[no-untyped-def]
    # given quarantine_on_dead_letter, key "p" whose first message always fails, two more of "p"
    topic = new_topic(1)
    produce(
        kafka_bootstrap,
        topic,
        [(b"p", b"poison", None), (b"p", b"p1", None), (b"p", b"p2", None), (b"q", b"q1", None)],
    )
    seen: list[str] = []

    def handle(msg: Message) -> None:
        if msg.value == b"poison":
            raise ValueError("never works")
        seen.append((msg.value or b"").decode())

    ns = f"quar-{uuid.uuid4().hex[:8]}"
    seq = RedisSequencer(redis_url, ns, lease_ttl_s=2.0, quarantine_on_dead_letter=True)
    r = start(
        KeyedConsumer(
            name=f"g-{ns}",
            handler=handle,
            brokers=[kafka_bootstrap],
            topics=[topic],
            concurrency=4,
            sequencer=seq,
            middlewares=[
                DeadLetter(brokers=[kafka_bootstrap]),
                Retry(max_attempts=2, initial_delay_s=0.2, jitter=0, park=True),
            ],
        )
    )
    # when the poison message is dead-lettered, then the key is quarantined and p1, p2 wait in Redis
    assert wait_until(lambda: inspect_redis(redis_url, ns)["quarantined"] == ["p"], 60)
    time.sleep(1.0)
    assert seen == ["q1"]
    assert [x["depth"] for x in inspect_redis(redis_url, ns)["parked"]] == [3]
    # when it is released, then the dead-lettered head is dropped and p1, p2 run in order
    assert seq.release_quarantine(b"p") is True
    assert wait_until(lambda: seen == ["q1", "p1", "p2"] and not seq.parker.draining, 30), seen
    assert r.stop(30) and r.error is None
    assert len(read_all(kafka_bootstrap, f"{topic}.dlq", 1)) == 1
    assert _clean(redis_url, ns) == {"leases": [], "parked": [], "scheduled": 0, "quarantined": []}
