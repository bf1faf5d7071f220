"""Parking survives its failures: an instance SIGKILLed while it drains a parked key (another
finishes the key, in order, nothing lost), and a Redis restart mid-run with parked and scheduled
messages (nothing lost). Real broker, real Redis, several processes."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path

import pytest
from keyedconsumer.middleware import Retry

from keyedconsumer import KeyedConsumer, Message, RedisSequencer
from keyedconsumer.sequencing import inspect_redis
from keyedconsumer.sequencing.store import connect

from .kafkautil import committed, end_offsets, log_lines, produce, wait_until
from .redisnodes import RedisNode, free_ports

pytestmark = [pytest.mark.kafka, pytest.mark.redis]
ROOT = Path(__file__).resolve().parents[2]


def _events(log: Path) -> list[list[str]]:
    return [ln.split() for ln in log_lines(log)]


def _spawn(
    bootstrap: str, topic: str, group: str, log: Path, redis_url: str, ns: str, *extra: str
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.integration.procs.park_consumer",
            bootstrap,
            topic,
            group,
            str(log),
            redis_url,
            ns,
            *extra,
        ],
        cwd=ROOT,
    )


def _stop(*procs: subprocess.Popen[bytes]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


@pytest.mark.timeout(180)
def test_sigkill_while_draining_a_parked_key_another_instance_finishes_it_in_order(
    kafka_bootstrap,
    redis_url,
    new_topic,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    # given two instances, and key "bad" whose first message fails twice, so the key is parked with
    # its 12 messages, each taking 0.3 s; plus 2,000 messages of other keys
    topic = new_topic(2)
    recs: list[tuple[bytes | None, bytes | None, int | None]] = [
        (b"bad", f"bad:{i}".encode(), 0) for i in range(12)
    ]
    recs += [(f"k{i % 100}".encode(), f"k{i % 100}:{i}".encode(), None) for i in range(2000)]
    produce(kafka_bootstrap, topic, recs)
    ns, log = f"kill-{uuid.uuid4().hex[:8]}", tmp_path / "events.log"
    group = f"g-{ns}"
    args = ("--fail-value", "bad:0", "--fail-times", "2", "--slow-key", "bad", "--slow-s", "0.3")
    a = _spawn(kafka_bootstrap, topic, group, log, redis_url, ns, *args)
    b = _spawn(kafka_bootstrap, topic, group, log, redis_url, ns, *args)
    procs = {a.pid: a, b.pid: b}
    try:
        # when the scheduler instance has finished some of the parked key, it is SIGKILLed mid-drain
        def draining_pid() -> int | None:
            done = [e for e in _events(log) if e[0] == "E" and e[4] == "bad"]
            if len(done) < 3:
                return None
            owner = inspect_redis(redis_url, ns)["scheduler"]
            return int(owner.split("-")[0]) if owner else None

        assert wait_until(lambda: draining_pid() is not None, 90), _events(log)[-5:]
        victim = procs[draining_pid()]  # type: ignore[index]
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        killed_at = time.monotonic_ns()
        survivor = b if victim is a else a
        # then the survivor finishes the key: every message ends, in order, nothing lost
        ends = end_offsets(kafka_bootstrap, topic, 2)

        def finished() -> bool:
            ok = {e[5] for e in _events(log) if e[0] == "E"}
            return (
                all(v.decode() in ok for _, v, _ in recs)
                and committed(kafka_bootstrap, group, topic, 2) == ends
            )

        assert wait_until(finished, 90), len({e[5] for e in _events(log) if e[0] == "E"})
        assert wait_until(lambda: inspect_redis(redis_url, ns)["parked"] == [], 30)
        # and the dead instance is dropped from the check-ins once silent for its timeout
        assert wait_until(
            lambda: (
                [int(i["id"].split("-")[0]) for i in inspect_redis(redis_url, ns)["instances"]]
                == [survivor.pid]
            ),
            30,
        )
        _stop(survivor)
        assert survivor.returncode == 0
    finally:
        _stop(a, b)
    ev = _events(log)
    first_end: dict[str, int] = {}
    for e in ev:
        if e[0] == "E" and e[4] == "bad":
            first_end.setdefault(e[5], len(first_end))
    assert sorted(first_end, key=first_end.get) == [f"bad:{i}" for i in range(12)]  # type: ignore[arg-type]
    # the survivor ran some of the key after the kill; no two runs of the key overlapped
    assert any(
        e[0] == "S" and e[4] == "bad" and int(e[1]) == survivor.pid and int(e[-1]) > killed_at for e in ev
    )
    runs: dict[tuple[str, str], int] = {}
    spans: list[tuple[int, int]] = []
    for e in ev:
        if e[4] != "bad":
            continue
        k = (e[1], e[5] + e[6])
        if e[0] == "S":
            runs[k] = int(e[-1])
        elif k in runs:
            spans.append((runs.pop(k), int(e[-1])))
    spans += [
        (s, killed_at) for (pid, _), s in runs.items() if int(pid) == victim.pid
    ]  # cut short by the kill
    spans.sort()
    assert all(x[1] <= y[0] for x, y in zip(spans, spans[1:], strict=False)), spans
    st = inspect_redis(redis_url, ns)
    assert st["parked"] == [] and st["scheduled"] == 0 and st["leases"] == []


@pytest.mark.timeout(150)
def test_redis_restart_mid_run_loses_no_parked_or_scheduled_message(
    kafka_bootstrap, new_topic, start, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    # given a private Redis, a consumer parking key "bad" (its first message fails 3 times, 1 s
    # apart) behind which 5 more wait, 3,000 other messages, and 5 scheduled messages due in 2-4 s
    rs = RedisNode(free_ports(1)[0], tmp_path)
    rs.start()
    try:
        _redis_restart_scenario(rs, kafka_bootstrap, new_topic, start)
    finally:
        rs.stop()


def _redis_restart_scenario(rs: RedisNode, kafka_bootstrap: str, new_topic, start) -> None:  # type: ignore[no-untyped-def]
    topic = new_topic(2)
    recs: list[tuple[bytes | None, bytes | None, int | None]] = [
        (b"bad", f"bad:{i}".encode(), 0) for i in range(6)
    ]
    recs += [(f"k{i % 50}".encode(), f"k:{i}".encode(), None) for i in range(3000)]
    produce(kafka_bootstrap, topic, recs)
    ends_seen: dict[str, int] = defaultdict(int)
    order: list[str] = []
    lock = threading.Lock()

    def handle(msg: Message) -> None:
        v = (msg.value or b"").decode()
        if v == "bad:0" and msg.attempt <= 3:
            raise ConnectionError("fails")
        with lock:
            ends_seen[v] += 1
            if v.startswith(("bad", "s")):
                order.append(v)

    ns = f"rr-{uuid.uuid4().hex[:8]}"
    group = f"g-{ns}"
    seq = RedisSequencer(rs.url, ns, lease_ttl_s=3.0, socket_timeout_s=0.5)
    consumer = KeyedConsumer(
        name=group,
        handler=handle,
        brokers=[kafka_bootstrap],
        topics=[topic],
        concurrency=8,
        sequencer=seq,
        middlewares=[Retry(max_attempts=None, initial_delay_s=1.0, multiplier=1.0, jitter=0, park=True)],
    )
    r = start(consumer)
    assert wait_until(lambda: seq.parker is not None and seq.parker.parked >= 6, 30)
    # (scheduled once the key is parked, however long the join and the parks took: still pending
    # when Redis is killed)
    for i in range(5):
        consumer.schedule(b"s", f"s{i}".encode(), delay_s=2.0 + i * 0.5)
    # when Redis is SIGKILLed with the key parked and the schedules pending, and restarted 2 s later
    assert inspect_redis(rs.url, ns)["scheduled"] >= 1
    rs.kill()
    time.sleep(2.0)
    rs.start()
    # then every message and every scheduled one is handled, in order per key, and Redis ends clean
    ends = end_offsets(kafka_bootstrap, topic, 2)
    want = {v.decode() for _, v, _ in recs} | {f"s{i}" for i in range(5)}
    assert wait_until(
        lambda: (
            want <= set(ends_seen)
            and committed(kafka_bootstrap, group, topic, 2) == ends
            and not seq.parker.draining
        ),
        90,
    ), sorted(want - set(ends_seen))[:10]
    assert r.stop(30) and r.error is None
    assert [v for v in order if v.startswith("bad")] == [f"bad:{i}" for i in range(6)]
    assert [v for v in order if v.startswith("s")] == [f"s{i}" for i in range(5)]
    st = inspect_redis(rs.url, ns)
    assert st["parked"] == [] and st["scheduled"] == 0 and st["leases"] == []


@pytest.mark.timeout(180)
def test_a_consumer_killed_while_its_key_is_parked_runs_each_message_once_in_order(
    kafka_bootstrap: str, redis_url: str, new_topic, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """Issue 25 §12: ``seen_retention_s=1`` and a parked retry longer than that, with the consumer
    killed before it committed: Kafka delivers the key's parked messages again to the next consumer,
    long after 1 s. They must be recognised as parked already (markers live while the key is
    parked), not parked a second time (before: 40 duplicate runs and an order violation)."""
    from keyedconsumer.sequencing import keys, unpark_now

    # given 40 messages of key "p", the first of which fails once and parks the key with a retry
    # due in 10 minutes, on a consumer keeping "already parked" markers for 1 s and committing
    # only every 60 s
    topic, ns, group = new_topic(1), f"k{uuid.uuid4().hex[:8]}", f"pk-{uuid.uuid4().hex[:8]}"
    log, once = tmp_path / "events.log", tmp_path / "failed-once"
    acked = produce(kafka_bootstrap, topic, [(b"p", f"v{i}".encode(), None) for i in range(40)])
    opts = ("--fail-value", "v0", "--fail-times", "1", "--fail-once-file", str(once), "--retry-delay", "600")
    opts += ("--seen-retention", "1", "--session-ms", "6000")
    a = _spawn(kafka_bootstrap, topic, group, log, redis_url, ns, *opts, "--commit-ms", "60000")
    r = connect(redis_url, 5.0)
    lid = keys.lease_id(b"p", topic, 0)
    b = None
    try:
        assert wait_until(lambda: r.llen(keys.park(ns, lid)) == 40, 60), r.llen(keys.park(ns, lid))
        # when it is killed, and another consumer of the group starts 1.5 s later (the markers'
        # asked-for retention is over) and gets the partition from its beginning
        a.kill()
        a.wait(10)
        time.sleep(1.5)
        b = _spawn(kafka_bootstrap, topic, group, log, redis_url, ns, *opts, "--commit-ms", "500")
        assert wait_until(lambda: committed(kafka_bootstrap, group, topic, 1) == {0: 40}, 90)
        # then the key's list still holds each message once
        assert r.llen(keys.park(ns, lid)) == 40
        # and once the parked retry is made due, each message runs once more to success, in order
        assert unpark_now(redis_url, ns, lid)
        assert wait_until(lambda: not r.exists(keys.park(ns, lid)), 60)
    finally:
        _stop(*(p for p in (a, b) if p is not None))
        r.close()
    ends = [int(e[3]) for e in _events(log) if e[0] == "E"]
    assert sorted(ends) == sorted(o for _p, o in acked), ends
    assert ends == sorted(ends)
