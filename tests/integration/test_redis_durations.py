"""Durations that reach Redis: the smallest accepted value of each option works against the real
Redis (``PEXPIRE key 0`` deletes the key, redis-py #4279; ``int(s * 1000)`` truncates 0.0009 s to
0), and a tiny delay never makes a due time earlier than the Redis server's time of the call.
The refusals just below each minimum are in ``tests/unit/test_bad_config.py``."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
import redis

from keyedconsumer import KeyedConsumer, Message, RedisSequencer, RetryLater
from keyedconsumer.engine.engine import Engine
from keyedconsumer.engine.workers import Mailbox
from keyedconsumer.sequencing import keys
from keyedconsumer.sequencing.store import connect

from .kafkautil import produce, wait_until

pytestmark = [pytest.mark.redis]


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = connect(redis_url, 5.0)
    yield client
    client.close()


def _redis_ms(r: redis.Redis) -> float:
    sec, usec = r.time()
    return sec * 1000 + usec / 1000


def _time_and_pttl(r: redis.Redis, key: str) -> tuple[float, int]:
    """The Redis server's time (ms) and the key's PTTL, read atomically on the node that holds the
    key (one script: on a Redis Cluster a MULTI of TIME and PTTL could not be routed)."""
    (sec, usec), pttl = r.eval("return {redis.call('TIME'), redis.call('PTTL', KEYS[1])}", 1, key)
    return int(sec) * 1000 + int(usec) / 1000, int(pttl)


_MAILBOXES: dict[int, Mailbox] = {}  # the owner's mailbox of each test's engine, by sequencer


def _attach(seq: RedisSequencer) -> Engine:
    mailbox = _MAILBOXES[id(seq)] = Mailbox()
    d = Engine("key", seq, mailbox.post)
    d.assign([("t", 0)])
    seq.attach(d.port, lambda e: None)
    return d


def _tick_until(seq: RedisSequencer, pred: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Serve the sequencer as the engine's owner thread does (what the renewer posted, then
    ``tick()``) until ``pred()``."""

    def ticked() -> bool:
        _MAILBOXES[id(seq)].drain()
        seq.tick()
        return pred()

    return wait_until(ticked, timeout_s, 0.005)


def _hold_lease(seq: RedisSequencer, d: Engine) -> str:
    """Admit a message of key "k0" and tick until its lease is held; returns the lease's Redis key."""
    d.admit([Message("t", 0, 0, b"k0", b"v")])
    assert _tick_until(seq, lambda: len(d.queue) == 1)
    return keys.lease(seq.config.namespace, keys.lease_id(b"k0", "t", 0))


@pytest.mark.timeout(30)
def test_lease_ttl_at_its_minimum_makes_leases_with_a_positive_ttl_in_redis(
    redis_url: str, r: redis.Redis
) -> None:
    # given a sequencer with the shortest lease TTL accepted (just above 0.05 s: 51 ms in Redis)
    seq = RedisSequencer(redis_url, f"dur-{uuid.uuid4().hex[:8]}", lease_ttl_s=0.0501)
    d = _attach(seq)
    try:
        # when it holds a key's lease and the scheduler lease
        lease_key = _hold_lease(seq, d)
        assert _tick_until(seq, lambda: seq.is_scheduler)
        # then both lease keys live in Redis with a positive TTL of at most 51 ms (renewed meanwhile)
        seen: dict[str, list[int]] = {lease_key: [], keys.scheduler(seq.config.namespace): []}

        def positive() -> bool:
            for k, ttls in seen.items():
                ttls.append(_time_and_pttl(r, k)[1])
            return all(any(t > 0 for t in ttls) for ttls in seen.values())

        # (read while the sequencer is served, as a live owner thread serves it: the scheduler
        # lease is renewed by the ticks, and 51 ms without one lets it lapse)
        assert _tick_until(seq, positive), seen
        assert all(t <= 51 for ttls in seen.values() for t in ttls), seen
    finally:
        seq.detach()
    # and released on detach
    assert r.exists(lease_key) == 0


@pytest.mark.timeout(30)
def test_renew_interval_at_its_minimum_keeps_a_lease_past_its_ttl(redis_url: str, r: redis.Redis) -> None:
    # given a sequencer renewing every 0.01 s (the minimum) a lease of 0.5 s
    seq = RedisSequencer(redis_url, f"dur-{uuid.uuid4().hex[:8]}", lease_ttl_s=0.5, renew_interval_s=0.01)
    d = _attach(seq)
    try:
        lease_key = _hold_lease(seq, d)
        owner = r.get(lease_key)
        token = int(r.get(keys.fence(seq.config.namespace, keys.lease_id(b"k0", "t", 0))) or 0)
        assert owner and token >= 1
        # when three TTLs pass while the key has work
        time.sleep(1.5)
        # then the lease is still this instance's, with the same fencing token, renewed all along
        assert r.get(lease_key) == owner
        assert 0 < r.pttl(lease_key) <= 500
        assert int(r.get(keys.fence(seq.config.namespace, keys.lease_id(b"k0", "t", 0))) or 0) == token
    finally:
        seq.detach()


@pytest.mark.timeout(60)
def test_instance_timeout_at_its_minimum_sees_a_silent_instance_gone_and_no_live_one(
    redis_url: str, r: redis.Redis
) -> None:
    # given two instances checking in every 0.5 s with the shortest instance timeout accepted
    # (just above three check-ins), and a silent instance last seen 5 s ago on the Redis clock
    ns = f"dur-{uuid.uuid4().hex[:8]}"
    opts = {"lease_ttl_s": 2.0, "renew_interval_s": 0.5, "instance_timeout_s": 1.5001}
    a, b = RedisSequencer(redis_url, ns, **opts), RedisSequencer(redis_url, ns, **opts)
    r.zadd(keys.instances(ns), {"ghost": _redis_ms(r) - 5000})
    _attach(a)
    _attach(b)
    try:
        # when both have checked in for longer than the timeout
        time.sleep(3.0)
        # then the silent one was seen gone (once), and neither live one
        assert sorted(a.gone_instances + b.gone_instances) == ["ghost"]
        live = r.zrange(keys.instances(ns), 0, -1)
        assert sorted(x.decode() for x in live) == sorted([a.instance_id, b.instance_id])
    finally:
        a.detach()
        b.detach()


@pytest.mark.kafka
@pytest.mark.timeout(150)
def test_seen_retention_at_its_minimum_keeps_the_marker_while_parked_and_the_derived_retention_after(
    kafka_bootstrap: str,
    redis_url: str,
    r: redis.Redis,
    new_topic,
    start,  # type: ignore[no-untyped-def]
) -> None:
    # given a consumer asked to keep "already parked" markers for 1 s (the smallest accepted value),
    # with a 6 s session timeout and a 0.5 s commit interval
    topic, ns = new_topic(1), f"dur-{uuid.uuid4().hex[:8]}"
    release = threading.Event()
    attempts: list[int] = []

    def handle(msg: Message) -> None:
        attempts.append(msg.attempt)
        if not release.is_set():
            raise RetryLater(0.3, park=True)

    seq = RedisSequencer(redis_url, ns, lease_ttl_s=2.0, seen_retention_s=1.0)
    run = start(
        KeyedConsumer(
            name=f"g-{ns}",
            handler=handle,
            brokers=[kafka_bootstrap],
            topics=[topic],
            concurrency=2,
            sequencer=seq,
            config={
                "session.timeout.ms": 6000,
                "heartbeat.interval.ms": 1000,
                "auto.commit.interval.ms": 500,
            },
        )
    )
    lid = keys.lease_id(b"p", topic, 0)
    seen, park = keys.seen(ns, lid), keys.park(ns, lid)
    # when a message of key "p" is parked, and retried from its list (failing again) for over 1 s
    produce(kafka_bootstrap, topic, [(b"p", b"v", None)])
    assert wait_until(lambda: seq.parker is not None and seq.parker.parked == 1, 60)
    assert wait_until(lambda: len(attempts) >= 5, 30), attempts
    # then its marker has no expiry while the key is parked
    assert r.exists(park) and r.pttl(seen) == -1
    # and once the key's list empties, the marker lives for the retention derived from the lease
    # TTL, the session timeout and the commit interval (2 + 6 + 0.5 s), not the 1 s asked for
    release.set()
    assert wait_until(lambda: not r.exists(park), 30)
    _now_ms, pttl = _time_and_pttl(r, seen)
    assert 1000 < pttl <= 8500, pttl
    assert seq.config.seen_retention_for(6.0, 0.5) == 8.5
    assert run.stop(30) and run.error is None


@pytest.mark.timeout(30)
@pytest.mark.parametrize("delay_s", [0.0, 1e-9, 0.0004, 0.0011])
def test_a_tiny_schedule_delay_is_never_due_before_the_redis_time_of_the_call(
    delay_s: float, redis_url: str, r: redis.Redis
) -> None:
    # given a namespace without a scheduler (nothing moves the message)
    ns = f"dur-{uuid.uuid4().hex[:8]}"
    seq = RedisSequencer(redis_url, ns)
    # when a message is scheduled with a delay below a millisecond (or none) and one at an absolute
    # time that far ahead
    t0 = _redis_ms(r)
    by_delay = seq.schedule("t", b"k", b"v", delay_s=delay_s)
    by_at = seq.schedule("t", b"k", b"v", at=(t0 + delay_s * 1000) / 1000)
    # then each is due no earlier than the Redis server's time before the call plus the delay (to
    # the microsecond, TIME's resolution), in whole milliseconds
    for sid in (by_delay, by_at):
        due = r.zscore(keys.sched_due(ns), sid)
        assert due is not None and due == int(due)
        assert due >= round(t0 + delay_s * 1000, 3), (due - t0, delay_s)
    r.delete(keys.sched_due(ns), keys.sched_entries(ns))
