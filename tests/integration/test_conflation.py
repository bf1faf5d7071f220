"""Conflation on the real broker: while a key's head runs, only the newest waiting message of the
key runs; the replaced ones count done (their offsets are committed), are reported, and are not
run again after a rebalance; every key's latest value runs."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable

import pytest

from keyedconsumer import KeyedConsumer, Message

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
        c = KeyedConsumer(name=group, handler=handle, brokers=[kafka_bootstrap], topics=[topic], concurrency=KEYS,
                          conflate=True, on_conflated=on_conflated,
                          config={"session.timeout.ms": 6000, "heartbeat.interval.ms": 500})
        consumers.append(c)
        return c

    def produce_phase(first: int) -> None:
        produce(kafka_bootstrap, topic, [(f"k{k}".encode(), f"{k}:{first + i}".encode(), None)
                                         for i in range(20) for k in range(KEYS)])

    # phase 1: 20 messages per key; each key's first runs until 18 per key were conflated
    a = consumer()
    gate["phase0"] = lambda: a.conflated >= 18 * KEYS
    produce_phase(0)
    threads = [threading.Thread(target=a.run, daemon=True)]
    threads[0].start()
    try:
        assert wait_until(lambda: committed(kafka_bootstrap, group, topic, 2) == end_offsets(kafka_bootstrap, topic, 2), 90)
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
        assert wait_until(lambda: committed(kafka_bootstrap, group, topic, 2) == end_offsets(kafka_bootstrap, topic, 2), 120)
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
