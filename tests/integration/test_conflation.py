"""Conflation on the real broker: while a key's head runs, only the newest waiting message of the
key runs; the replaced ones count done (their offsets are committed), are reported, and are not
run again after a rebalance; every key's latest value runs. The same for a key parked in Redis:
its list keeps the parked head and the newest message."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable

import pytest
from keyedconsumer.middleware import Audit

from keyedconsumer import KeyedConsumer, Message, RedisSequencer, RetryLater
from keyedconsumer.cli.audit import find
from keyedconsumer.sequencing import inspect_redis, unpark_now

from .kafkautil import committed, end_offsets, produce, wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(240)]

KEYS = 10


def _wait(condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition did not come true"
        time.sleep(0.005)


class _Log:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ran: list[tuple[int, int]] = []  # (key, seq) in start order
        self.conflated: list[tuple[int, int]] = []


def _parse(msg: Message) -> tuple[int, int]:
    k, seq = (msg.value or b"0:0").decode().split(":")
    return int(k), int(seq)


def test_conflation_counts_offsets_done_and_keeps_the_latest_value_across_a_rebalance(
    kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(2)
    group = f"conflate-{uuid.uuid4().hex[:8]}"
    log = _Log()
    gate: dict[str, Callable[[], bool]] = {}
    consumers: list[KeyedConsumer] = []

    def handle(msg: Message) -> None:
        key, seq = _parse(msg)
        with log.lock:
            log.ran.append((key, seq))
        if seq in (0, 20):  # each key's first message of a phase runs until the phase's gate opens
            _wait(gate[f"phase{seq}"])

    def on_conflated(msg: Message) -> None:
        with log.lock:
            log.conflated.append(_parse(msg))

    def consumer() -> KeyedConsumer:
        c = KeyedConsumer(
            name=group,
            handler=handle,
            brokers=[kafka_bootstrap],
            topics=[topic],
            concurrency=KEYS,
            conflate=True,
            on_conflated=on_conflated,
            config={"session.timeout.ms": 6000, "heartbeat.interval.ms": 500},
        )
        consumers.append(c)
        return c

    def produce_phase(first: int) -> None:
        produce(
            kafka_bootstrap,
            topic,
            [(f"k{k}".encode(), f"{k}:{first + i}".encode(), None) for i in range(20) for k in range(KEYS)],
        )

    # phase 1: 20 messages per key; each key's first runs until 18 per key were conflated
    a = consumer()
    gate["phase0"] = lambda: a.conflated >= 18 * KEYS
    produce_phase(0)
    threads = [threading.Thread(target=a.run, daemon=True)]
    threads[0].start()
    try:
        assert wait_until(
            lambda: committed(kafka_bootstrap, group, topic, 2) == end_offsets(kafka_bootstrap, topic, 2), 90
        )
        # then each key ran its first and its newest message, the 18 between were conflated
        with log.lock:
            for k in range(KEYS):
                assert [s for kk, s in log.ran if kk == k] == [0, 19], k
            assert sorted(log.conflated) == sorted((k, s) for k in range(KEYS) for s in range(1, 19))
        assert a.conflated == 18 * KEYS
        # phase 2: 20 more per key, and a second member joins while each key's first of them runs
        b = consumer()
        gate["phase20"] = lambda: bool(b.assignment)
        produce_phase(20)
        _wait(lambda: sum(1 for _, s in log.ran if s == 20) >= 1)
        threads.append(threading.Thread(target=b.run, daemon=True))
        threads[1].start()
        assert wait_until(
            lambda: committed(kafka_bootstrap, group, topic, 2) == end_offsets(kafka_bootstrap, topic, 2), 120
        )
    finally:
        for c in consumers:
            c.stop()
        for t in threads:
            t.join(60)
    # then, across the rebalance: every message either ran or was conflated (none lost), each key's
    # messages started in order (a re-run after the rebalance never goes back before a newer value
    # that ran), every key's newest value ran, and a conflated message never ran afterwards
    with log.lock:
        ran, conflated = list(log.ran), set(log.conflated)
    for k in range(KEYS):
        seqs = [s for kk, s in ran if kk == k]
        assert 39 in seqs, (k, seqs)
        assert set(seqs) | {s for kk, s in conflated if kk == k} >= set(range(40)), (k, seqs)
        firsts = list(dict.fromkeys(seqs))
        assert firsts == sorted(firsts), (k, seqs)
        assert not ({s for kk, s in conflated if kk == k} & {s for s in seqs if s > 20}), (k, seqs)


@pytest.mark.redis
def test_a_parked_key_keeps_its_head_and_its_newest_message_the_others_are_conflated(
    kafka_bootstrap: str, redis_url: str, new_topic: Callable[..., str]
) -> None:
    # given key "p" whose first message (p:0) parks the key (due again in 60 s) while newer values of
    # the key arrive one by one, each after the previous one is in Redis; and 20 messages of other keys
    topic, audit_topic = new_topic(2), new_topic(1, prefix="audit")
    ns = f"cpark-{uuid.uuid4().hex[:8]}"
    group = f"g-{ns}"
    log = _Log()
    box: list[KeyedConsumer] = []

    def handle(msg: Message) -> None:
        key, seq = (msg.value or b"x:0").decode().split(":")
        with log.lock:
            log.ran.append((1 if key == "p" else 0, int(seq)))
        if key == "p" and seq == "0" and box[0].conflated < 8:
            raise RetryLater(60.0, park=True) from ValueError("not yet")  # no drain until un-parked below

    def on_conflated(msg: Message) -> None:
        with log.lock:
            log.conflated.append((msg.partition, msg.offset))
        audit.conflated(msg)

    audit = Audit(topic=audit_topic, brokers=[kafka_bootstrap], flush_interval_s=0.05)
    consumer = KeyedConsumer(
        name=group,
        handler=handle,
        brokers=[kafka_bootstrap],
        topics=[topic],
        concurrency=4,
        conflate=True,
        on_conflated=on_conflated,
        middlewares=[audit],
        sequencer=RedisSequencer(redis_url, ns, lease_ttl_s=2.0),
    )
    box.append(consumer)
    p_at = produce(kafka_bootstrap, topic, [(b"p", b"p:0", None)])
    t = threading.Thread(target=consumer.run, daemon=True)
    t.start()
    try:

        def depth() -> int:
            return sum(x["depth"] for x in inspect_redis(redis_url, ns)["parked"])

        _wait(lambda: depth() == 1)  # p:0 is parked
        produce(kafka_bootstrap, topic, [(f"k{i}".encode(), f"k:{i}".encode(), None) for i in range(20)])
        for i in range(1, 10):  # when p:1 .. p:9 arrive one by one while the key is parked
            p_at += produce(kafka_bootstrap, topic, [(b"p", f"p:{i}".encode(), None)])
            # each is parked behind the head; from p:2 on each replaces the one before it, in the
            # script that parks it (the head is due in 60 s: no drain meanwhile)
            _wait(lambda i=i: consumer.conflated == max(0, i - 1) and depth() == 2)  # type: ignore[misc]
        # and the key is made due now: p:0 runs again (and succeeds), then p:9
        [pk] = inspect_redis(redis_url, ns)["parked"]
        assert pk["depth"] == 2 and unpark_now(redis_url, ns, pk["lid"])
        assert wait_until(
            lambda: committed(kafka_bootstrap, group, topic, 2) == end_offsets(kafka_bootstrap, topic, 2), 90
        )
        _wait(lambda: (1, 9) in log.ran and depth() == 0)
    finally:
        consumer.stop()
        t.join(60)
    audit.close()
    # then p:0 ran (failing until p:1 .. p:8 were conflated), then only the newest value, p:9
    with log.lock:
        p_runs = [s for k, s in log.ran if k == 1]
        conflated = list(log.conflated)
        others = sorted(s for k, s in log.ran if k == 0)
    assert len(p_runs) >= 2 and set(p_runs[:-1]) == {0} and p_runs[-1] == 9, p_runs
    assert others == list(range(20))
    # and p:1 .. p:8 were conflated in order: counted, reported, their offsets committed (above)
    assert conflated == p_at[1:9] and consumer.conflated == 8
    # and the audit trail shows them as CONFLATED, of group and key p
    rows = list(
        find({"bootstrap.servers": kafka_bootstrap}, audit_topic, key="p", outcome="CONFLATED", timeout_s=30)
    )
    assert [(r["partition"], r["offset"], r["group"]) for r in rows] == [(p, o, group) for p, o in p_at[1:9]]
    # and Redis holds nothing of the key any more
    state = inspect_redis(redis_url, ns)
    assert state["parked"] == [] and state["quarantined"] == []


@pytest.mark.redis
def test_a_drain_conflates_the_messages_between_a_parked_head_and_the_newest(
    kafka_bootstrap: str, redis_url: str, new_topic: Callable[..., str]
) -> None:
    # given key "s" parked by its first message (due again in 60 s), and three scheduled messages of
    # the key due at once: the scheduler appends them to the key's list without conflating (it does
    # not hold the key's lease), and makes the key due
    topic = new_topic(1)
    ns = f"cdrain-{uuid.uuid4().hex[:8]}"
    ran: list[bytes] = []
    reported: list[tuple[bytes, int, int]] = []
    release = threading.Event()

    def handle(msg: Message) -> None:
        ran.append(msg.value or b"")
        if msg.value == b"s:0" and not release.is_set():
            raise RetryLater(60.0, park=True)

    consumer = KeyedConsumer(
        name=f"g-{ns}",
        handler=handle,
        brokers=[kafka_bootstrap],
        topics=[topic],
        conflate=True,
        on_conflated=lambda m: reported.append((m.value or b"", m.partition, m.offset)),
        sequencer=RedisSequencer(redis_url, ns, lease_ttl_s=2.0),
    )
    produce(kafka_bootstrap, topic, [(b"s", b"s:0", None)])
    t = threading.Thread(target=consumer.run, daemon=True)
    t.start()
    try:
        _wait(lambda: [x["depth"] for x in inspect_redis(redis_url, ns)["parked"]] == [1])
        for i in (1, 2, 3):  # due 10 ms apart: moved in that order (one due time has no order among its ids)
            consumer.schedule(b"s", f"s:{i}".encode(), delay_s=0.01 * i)
        # when the drain takes the list (the head is not due yet), it keeps the head and the newest
        _wait(lambda: consumer.conflated == 2)
        [pk] = inspect_redis(redis_url, ns)["parked"]
        assert pk["depth"] == 2 and inspect_redis(redis_url, ns)["scheduled"] == 0
        # then the scheduled messages between are conflated (reported, counted), the newest stays
        assert reported == [(b"s:1", -1, -1), (b"s:2", -1, -1)]
        # and once the key is due, its head runs again, then the newest
        release.set()
        assert unpark_now(redis_url, ns, pk["lid"])
        _wait(lambda: ran[-1:] == [b"s:3"] and inspect_redis(redis_url, ns)["parked"] == [])
    finally:
        consumer.stop()
        t.join(60)
    assert set(ran[:-1]) == {b"s:0"} and len(ran) >= 3 and consumer.conflated == 2
