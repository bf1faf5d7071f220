"""The Redis sequencer across processes: one key never runs on two instances at once, a paused
(zombie) instance loses its key and its late writes are refused, and leases are cleaned up."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import ConsumerGroupState, KafkaException
from confluent_kafka.admin import AdminClient
from pydantic import ValidationError

from keyedconsumer import KeyedConsumer, RedisSequencer
from keyedconsumer.sequencing import GroupTiming
from keyedconsumer.sequencing.store import connect

from .kafkautil import committed, end_offsets, log_lines, produce, wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.redis]
ROOT = Path(__file__).resolve().parents[2]


def start(
    bootstrap: str, topic: str, group: str, log: Path, redis_url: str, ns: str, *extra: str
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.integration.procs.redis_consumer",
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


def _stopped(pid: int) -> bool:
    """Every thread of process ``pid`` is stopped (SIGSTOP delivered to all of them)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # the thread ended meanwhile
            continue
        if state not in ("T", "t"):
            return False
    return True


def events(log: Path) -> list[list[str]]:
    return [line.split() for line in log_lines(log)]


def intervals(log: Path) -> dict[str, list[tuple[int, int, int, int, int]]]:
    """Per key: (start_ns, end_ns, pid, partition, offset) of every completed run."""
    starts: dict[tuple[str, str, str], int] = {}
    out: dict[str, list[tuple[int, int, int, int, int]]] = defaultdict(list)
    for e in events(log):
        kind, pid, part, off, key = e[0], e[1], e[2], e[3], e[4]
        if kind == "S":
            starts[(pid, part, off)] = int(e[-1])
        elif kind == "E":
            out[key].append((starts.pop((pid, part, off)), int(e[-1]), int(pid), int(part), int(off)))
    return out


def overlaps(runs: dict[str, list[tuple[int, int, int, int, int]]]) -> list[tuple[str, tuple, tuple]]:  # type: ignore[type-arg]
    bad = []
    for key, rs in runs.items():
        rs = sorted(rs)
        for a, b in zip(rs, rs[1:], strict=False):
            if b[0] < a[1]:
                bad.append((key, a, b))
    return bad


def stop_all(*procs: subprocess.Popen[bytes]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


def one_partition_each(bootstrap: str, group: str, members: int) -> bool:
    """The group is stable with ``members`` members, each assigned exactly one partition."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    try:
        desc = admin.describe_consumer_groups([group])[group].result(timeout=5)
    except KafkaException:
        return False
    return (
        desc.state == ConsumerGroupState.STABLE
        and len(desc.members) == members
        and all(m.assignment is not None and len(m.assignment.topic_partitions) == 1 for m in desc.members)
    )


def leftover_leases(redis_url: str, ns: str) -> list[bytes]:
    r = connect(redis_url, 5.0)
    return list(r.scan_iter(f"kc:{ns}:*:lease"))


@pytest.mark.timeout(150)
def test_two_instances_same_key_on_two_partitions_never_overlap(
    kafka_bootstrap: str, redis_url: str, new_topic, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    # given 20 keys whose messages are spread over both partitions of a topic
    topic = new_topic(2)
    n = 3000
    group, ns = f"rs-{uuid.uuid4().hex[:8]}", f"t{uuid.uuid4().hex[:8]}"
    log = tmp_path / "events.log"
    # when two instances of one group, once each has one partition, consume them with the Redis
    # sequencer (produced before both joined, the first could run them all alone)
    a = start(kafka_bootstrap, topic, group, log, redis_url, ns)
    b = start(kafka_bootstrap, topic, group, log, redis_url, ns)
    try:
        assert wait_until(lambda: one_partition_each(kafka_bootstrap, group, 2), 60), (
            "the group never settled"
        )
        acked = produce(
            kafka_bootstrap,
            topic,
            [(f"k{i % 20}".encode(), str(i).encode(), (i // 20) % 2) for i in range(n)],
        )
        done = lambda: {(int(e[2]), int(e[3])) for e in events(log) if e[0] == "E"} >= set(acked)  # noqa: E731
        assert wait_until(done, 100), "not everything was processed"
    finally:
        stop_all(a, b)
    runs = intervals(log)
    pids = {r[2] for rs in runs.values() for r in rs}
    # then both instances worked, and no key ever ran on both at the same time
    assert len(pids) == 2
    assert overlaps(runs) == []
    # and within a partition each key's messages were first run in offset order (a partition that
    # moved is re-run from its committed offset: at-least-once)
    for rs in runs.values():
        by_part: dict[int, list[int]] = defaultdict(list)
        seen: set[tuple[int, int]] = set()
        for _s, _e, _pid, part, off in sorted(rs):
            if (part, off) not in seen:
                seen.add((part, off))
                by_part[part].append(off)
        assert all(offs == sorted(offs) for offs in by_part.values())
    assert committed(kafka_bootstrap, group, topic, 2) == end_offsets(kafka_bootstrap, topic, 2)
    # and no lease is left behind
    assert wait_until(lambda: leftover_leases(redis_url, ns) == [], 10)


@pytest.mark.timeout(150)
def test_zombie_instance_loses_its_key_and_its_late_write_is_refused(
    kafka_bootstrap: str, redis_url: str, new_topic, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    # given key "hot" on both partitions; instance A (p0 or p1) runs a slow "hot" message
    topic = new_topic(2)
    ttl = 2.0
    # 100 "hot" messages of 0.3 s: 30 s of "hot" work, so the second instance's join (about 7 s
    # here, classic protocol) lands while "hot" still runs (40 of them, 12 s, were too few once in CI)
    recs = [(b"hot", f"h{i}".encode(), i % 2) for i in range(100)] + [
        (f"k{i}".encode(), b"x", i % 2) for i in range(200)
    ]
    produce(kafka_bootstrap, topic, recs)
    group, ns = f"zombie-{uuid.uuid4().hex[:8]}", f"z{uuid.uuid4().hex[:8]}"
    log = tmp_path / "events.log"
    common = ("--ttl", str(ttl), "--slow-key", "hot", "--slow-s", "0.3")
    a = start(kafka_bootstrap, topic, group, log, redis_url, ns, *common)
    b = start(kafka_bootstrap, topic, group, log, redis_url, ns, *common)
    procs = {a.pid: a, b.pid: b}
    try:
        # wait until both instances have run "hot" (so each owns one partition) and one has just
        # started it (its 0.3 s sleep, before its write, has at least 0.2 s to go)
        def running_hot() -> list[str] | None:
            evs = events(log)
            now_ns = time.monotonic_ns()
            pids = {int(e[1]) for e in evs if e[4] == "hot"}
            if len(pids) < 2:
                return None
            open_runs: dict[tuple[str, str, str], list[str]] = {}
            for e in evs:
                if e[4] != "hot":
                    continue
                if e[0] == "S":
                    open_runs[(e[1], e[2], e[3])] = e
                elif e[0] == "E":
                    open_runs.pop((e[1], e[2], e[3]), None)
            fresh = [e for e in open_runs.values() if now_ns - int(e[-1]) < 100_000_000]
            return fresh[0] if fresh else None

        chosen: list[list[str]] = []  # the run found, found once (a second look may find none)

        def choose() -> bool:
            found = running_hot()
            if found is not None:
                chosen[:] = [found]
            return found is not None

        assert wait_until(choose, 50, 0.01)
        run = chosen[0]
        zombie_pid, zombie_token, zombie_partition = int(run[1]), int(run[5]), int(run[2])
        zombie = procs[zombie_pid]
        other = a if zombie is b else b
        # when the instance holding "hot" is paused for longer than the lease TTL, while more "hot"
        # messages arrive on the other instance's partition
        zombie.send_signal(signal.SIGSTOP)
        assert wait_until(lambda: _stopped(zombie_pid), 10, 0.001), "the zombie did not stop"
        stopped_ns = time.monotonic_ns()
        # (the chosen run is still open: it was stopped within its 0.3 s sleep, before its write)
        assert stopped_ns < int(run[-1]) + 300_000_000, "the chosen run may have written before the stop"
        produce(
            kafka_bootstrap, topic, [(b"hot", f"late{i}".encode(), 1 - zombie_partition) for i in range(5)]
        )
        time.sleep(ttl * 2.5)
        # then the other instance took the key over, with a higher fencing token
        taken = [
            e
            for e in events(log)
            if e[0] == "S" and e[4] == "hot" and int(e[1]) == other.pid and int(e[-1]) > stopped_ns
        ]
        assert taken, "the other instance did not take the key over"
        assert min(int(e[5]) for e in taken) > zombie_token
        # when the zombie resumes
        resumed_ns = time.monotonic_ns()
        zombie.send_signal(signal.SIGCONT)
        time.sleep(ttl * 1.5)
    finally:
        stop_all(a, b)
    evs = events(log)
    # then its late write (with the old token) was refused
    late = [
        e
        for e in evs
        if e[0] == "W" and int(e[1]) == zombie_pid and e[4] == "hot" and int(e[5]) == zombie_token
    ]
    assert late and late[0][6] == "refused"
    # and it started no new "hot" work under its old lease after resuming
    after = [
        e
        for e in evs
        if e[0] == "S" and int(e[1]) == zombie_pid and e[4] == "hot" and int(e[-1]) > resumed_ns
    ]
    assert all(int(e[5]) > zombie_token for e in after)
    # and no two runs of "hot" overlapped except the zombie's stale one (which carries the lowest token)
    runs = intervals(log)
    bad = overlaps(runs)
    assert all(key == "hot" and zombie_pid in (x[2], y[2]) for key, x, y in bad)


@pytest.mark.timeout(30)
def test_sequencer_settings_are_validated() -> None:
    with pytest.raises(ValidationError) as info:
        RedisSequencer("redis://127.0.0.1:6379/0", "ns", lease_ttl_s=3.0, renew_interval_s=1.0)
    assert "lease_ttl_s" in str(info.value) or "renew_interval_s" in str(info.value)
    with pytest.raises(ValidationError):
        RedisSequencer("redis://127.0.0.1:6379/0", "bad{ns}")
    with pytest.raises(ValidationError):
        RedisSequencer("redis://127.0.0.1:6379/0", "ns", lease_ttl_s=float("nan"))
    s = RedisSequencer("redis://user:s3cret@127.0.0.1:6379/0", "ns")
    assert "s3cret" not in repr(s) and "s3cret" not in repr(s.config)
    with pytest.raises(ValueError):
        KeyedConsumer(name="n", topics=["t"], handler=lambda m: None, ordering="none", sequencer=s)


@pytest.mark.timeout(60)
def test_batched_renewals_and_releases_answer_for_each_lease_on_its_own(redis_url: str) -> None:
    # given 40 leases of this owner and 5 of another, spread over the hash slots (on a Redis
    # Cluster over its masters), and 3 that nobody holds; calls cut into batches of 7
    from keyedconsumer.sequencing import keys
    from keyedconsumer.sequencing.store import LeaseStore

    ns = f"many-{uuid.uuid4().hex[:8]}"
    store = LeaseStore(redis_url, ns)
    store.LEASE_BATCH = 7
    mine = [keys.lease_id(f"m{i}".encode(), "t", i % 3) for i in range(40)]
    theirs = [keys.lease_id(f"o{i}".encode(), "t", 0) for i in range(5)]
    nobody = [keys.lease_id(f"n{i}".encode(), "t", 0) for i in range(3)]
    try:
        assert all(tok > 0 for tok, _ in store.acquire([(lid, "me") for lid in mine], 5_000))
        assert all(tok > 0 for tok, _ in store.acquire([(lid, "them") for lid in theirs], 5_000))
        order = [*theirs[:2], *mine[:20], *nobody, *theirs[2:], *mine[20:]]
        expect = [lid in mine for lid in order]
        # when this owner renews them all for 60 s in one call
        assert store.renew([(lid, "me") for lid in order], 60_000) == expect
        # then each of its leases and their fencing tokens got the new TTL, the others did not
        r = store._r
        for lid in mine:
            assert r.pttl(keys.lease(ns, lid)) > 5_000 and r.pttl(keys.fence(ns, lid)) > 5_000
        for lid in theirs:
            assert 0 < r.pttl(keys.lease(ns, lid)) <= 5_000
        # and when it releases them all: its own go (lease and token), the other owner's stay
        assert store.release([(lid, "me") for lid in order]) == expect
        assert not any(r.exists(keys.lease(ns, lid), keys.fence(ns, lid)) for lid in mine)
        assert all(r.get(keys.lease(ns, lid)) == b"them" for lid in theirs)
        assert store.renew([], 60_000) == [] and store.release([]) == []
    finally:
        store.release([(lid, "them") for lid in theirs])
        store.close()


@pytest.mark.timeout(150)
def test_a_paused_instance_that_lost_its_partition_runs_nothing_after_it_resumes(
    kafka_bootstrap: str, redis_url: str, new_topic, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    # given instance A with a backlog of 600 messages of 60 keys queued in memory, slowly running them
    topic = new_topic(1)
    n = 600
    produce(kafka_bootstrap, topic, [(f"k{i % 60}".encode(), str(i).encode(), 0) for i in range(n)])
    group, ns = f"stall-{uuid.uuid4().hex[:8]}", f"s{uuid.uuid4().hex[:8]}"
    log = tmp_path / "events.log"
    common = ("--ttl", "2", "--session-ms", "6000")
    a_log = tmp_path / "a.log"
    a = start(
        kafka_bootstrap,
        topic,
        group,
        log,
        redis_url,
        ns,
        *common,
        "--sleep",
        "0.05",
        "--concurrency",
        "1",
        "--log",
        str(a_log),
    )
    b = None
    try:
        assert wait_until(lambda: sum(1 for e in events(log) if e[0] == "E") >= 20, 60)
        # when A is stopped (SIGSTOP) longer than the session timeout and the lease TTL, and B
        # takes the partition over and runs and commits everything
        a.send_signal(signal.SIGSTOP)
        b = start(kafka_bootstrap, topic, group, log, redis_url, ns, *common, "--sleep", "0.001")
        assert wait_until(lambda: committed(kafka_bootstrap, group, topic, 1) == {0: n}, 90)
        # and A resumes (SIGCONT) before librdkafka has told it of the loss
        resumed_ns = time.monotonic_ns()
        a.send_signal(signal.SIGCONT)
        time.sleep(4.0)
    finally:
        stop_all(a, *(p for p in (b,) if p is not None))
    # then A started nothing after it resumed: every message it had queued was run and committed by
    # B, and a fresh lease (a newer fencing token) would have let it run them again behind the commit
    late = [e for e in events(log) if e[0] == "S" and int(e[1]) == a.pid and int(e[-1]) > resumed_ns]
    assert late == []
    assert committed(kafka_bootstrap, group, topic, 1) == {0: n}
    # and its ownership check went to the broker a bounded number of times in the 4 s after it
    # resumed (none if librdkafka reported the loss first; once refused, it waits for the
    # rebalance; a coordinator that does not answer is asked again after 0.2, 0.4, 0.8, 1.6 s): not
    # every 0.2 s
    assert len(ownership_checks(a_log)) <= 5, ownership_checks(a_log)


def ownership_checks(log: Path) -> list[str]:
    """The ownership checks that went to the broker, from a consumer's ``--log`` file."""
    lines = log_lines(log)
    return [x for x in lines if "ownership check" in x and "not during a rebalance callback" not in x]


@pytest.mark.timeout(120)
def test_short_stalls_of_a_busy_process_ask_nothing_of_the_group_coordinator(
    kafka_bootstrap: str, redis_url: str, new_topic, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    # given an instance with a 10 s session timeout (1 s heartbeats: a stall past 4.5 s may have
    # cost the membership) and a 4 s lease TTL renewed every 0.5 s, running a backlog of 50 keys
    # (a lease was confirmed at most ~0.5 s before a stop, so it outlives a stop of 2.5 s by 1 s of
    # scheduling delays on a loaded machine; renewed every 1 s, the default, only by 0.5 s, and
    # a lease lost that way asks the coordinator)
    topic = new_topic(1)
    produce(kafka_bootstrap, topic, [(f"k{i % 50}".encode(), str(i).encode(), 0) for i in range(20000)])
    group, ns = f"short-{uuid.uuid4().hex[:8]}", f"s{uuid.uuid4().hex[:8]}"
    log, a_log = tmp_path / "events.log", tmp_path / "a.log"
    opts = ("--ttl", "4", "--renew-s", "0.5", "--session-ms", "10000", "--sleep", "0.002")
    opts += ("--log", str(a_log))
    a = start(kafka_bootstrap, topic, group, log, redis_url, ns, *opts)
    try:
        assert wait_until(lambda: sum(1 for e in events(log) if e[0] == "E") >= 100, 60)
        # when it is stopped 4 times for 2.5 s (a busy machine, a short pause: its leases and its
        # membership both outlive it)
        for _ in range(4):
            a.send_signal(signal.SIGSTOP)
            time.sleep(2.5)
            a.send_signal(signal.SIGCONT)
            time.sleep(1.5)
        ended = sum(1 for e in events(log) if e[0] == "E")
        assert wait_until(lambda: sum(1 for e in events(log) if e[0] == "E") > ended, 30)
    finally:
        stop_all(a)
    # then it asked the group coordinator nothing (before: a committed-offsets fetch and a commit
    # per stall, every 0.2 s while unanswered) and logged no stall
    lines = log_lines(a_log)
    assert ownership_checks(a_log) == []
    assert [x for x in lines if "no tick for" in x or "a stall" in x] == []


def _with_ownership_check(redis_url: str, **options: Any) -> tuple[RedisSequencer, Any, dict[str, Any]]:
    """A sequencer (lease TTL 1 s) attached to an engine with partition ("t", 0), whose ownership
    check answers ``owner["ok"]`` and counts its calls in ``owner["asked"]``. The test plays the
    engine's owner thread: ``owner["tick"]()`` runs what the renewer and the lease I/O thread posted,
    then ticks; ``owner["until"](pred)`` ticks until ``pred()`` holds (5 s at most): an acquire's
    answer comes back through the mailbox a tick or more after the tick that chose it."""
    from keyedconsumer.engine.engine import Engine
    from keyedconsumer.engine.workers import Mailbox

    seq = RedisSequencer(
        redis_url, f"stall{uuid.uuid4().hex[:8]}", lease_ttl_s=1.0, require_durable=False, **options
    )
    mailbox = Mailbox()
    d = Engine("key", seq, mailbox.post)
    d.assign([("t", 0)])
    owner: dict[str, Any] = {"ok": True, "asked": 0}

    def confirm() -> bool:
        owner["asked"] += 1
        return bool(owner["ok"])

    def tick() -> None:
        mailbox.drain()
        seq.tick()

    def until(pred: Any) -> bool:
        return wait_until(lambda: (tick(), pred())[1], 5)

    owner["tick"] = tick
    owner["until"] = until
    owner["drain"] = mailbox.drain
    seq.attach(d.port, lambda e: None, confirm=confirm, timing=GroupTiming(1.5, 0.5))  # stalls of 0.5 s
    return seq, d, owner


@pytest.mark.timeout(30)
def test_after_a_stall_or_a_lost_lease_no_lease_is_acquired_until_ownership_is_confirmed(
    redis_url: str,
) -> None:
    from keyedconsumer.message import Message

    # given a sequencer serving an engine with one partition, and an ownership check we control
    seq, d, owner = _with_ownership_check(redis_url)
    try:
        d.admit([Message("t", 0, 0, b"k0", b"v")])
        assert owner["until"](lambda: len(d.queue) == 1)
        assert owner["asked"] == 0  # no stall: leases come without a check
        # when the poll thread stalls for longer than half the lease TTL, and the group has moved on
        time.sleep(0.7)
        owner["ok"] = False
        d.admit([Message("t", 0, 1, b"k1", b"v")])
        for _ in range(3):
            owner["tick"]()
            time.sleep(0.25)
        # then the check is asked (again while it fails) and no lease is acquired meanwhile
        assert owner["asked"] >= 2
        assert len(d.queue) == 1 and seq._leases.want
        # when it passes, the lease is acquired
        owner["ok"] = True
        assert owner["until"](lambda: len(d.queue) == 2)
        assert owner["asked"] >= 3
        # when a held lease is lost (deleted in Redis: taken over) the check is asked again
        asked = owner["asked"]
        owner["ok"] = False
        # (a lease may have been lost already, in the stall above: k0's, granted after the renewer's
        # list was last published, is not renewed while nothing ticks, and may be lost and acquired
        # again; the loss waited for is the one the deletion causes. The owner ticks meanwhile, as
        # the poll loop does every turn: the renewer renews only the leases a tick published, so
        # without ticks a lease granted at the last tick is never renewed, and its loss never seen)
        lost = seq._leases.lost
        r = connect(redis_url, 5.0)
        for name in r.scan_iter(f"kc:{seq.config.namespace}:*:lease"):
            r.delete(name)
        assert owner["until"](lambda: seq._leases.lost > lost)
        d.admit([Message("t", 0, 2, b"k2", b"v")])
        owner["tick"]()
        owner["tick"]()
        assert owner["asked"] > asked and len(d.queue) == 2
    finally:
        seq.detach()


@pytest.mark.timeout(30)
def test_a_stall_within_a_tick_acquires_nothing_until_ownership_is_confirmed(redis_url: str) -> None:
    from keyedconsumer.engine.outcome import DONE
    from keyedconsumer.message import Message

    # given a sequencer whose idle lease of key k0 is released at the next tick (no linger)
    seq, d, owner = _with_ownership_check(redis_url, lease_linger_s=0.0)
    try:
        d.admit([Message("t", 0, 0, b"k0", b"v")])
        assert owner["until"](lambda: len(d.queue) == 1)
        ((k0,),) = d.take(1)
        d.finish([(k0, DONE)])  # k0's lane ran dry: its lease idles, to be released at the next tick
        # when the process is stopped after it chose the lease of k1 to ask for and before it asked
        # (here: the lease I/O thread is held up releasing k0's lease), and the group moved on
        release = seq._store.release

        def paused_release(requests):  # type: ignore[no-untyped-def]
            time.sleep(0.7)  # longer than half the lease TTL: a stall
            return release(requests)

        seq._store.release = paused_release
        owner["ok"] = False
        d.admit([Message("t", 0, 1, b"k1", b"v")])
        owner["tick"]()
        time.sleep(0.8)  # (stopped: the owner does not tick either)
        # then the ownership check is asked, and k1's lease was not acquired: no run of it is ready
        assert owner["until"](lambda: owner["asked"] >= 1)
        seq._store.release = release
        assert len(d.queue) == 0
        # and the check is asked again while it fails, with no lease meanwhile
        for _ in range(3):
            owner["tick"]()
            time.sleep(0.25)
        assert owner["asked"] >= 2 and len(d.queue) == 0
        # when it passes, the lease is acquired
        owner["ok"] = True

        def acquired() -> bool:
            owner["tick"]()
            return len(d.queue) == 1

        assert wait_until(acquired, 5)
    finally:
        seq.detach()


@pytest.mark.timeout(30)
def test_a_lease_granted_after_a_doubt_began_is_released_not_used(redis_url: str) -> None:
    from keyedconsumer.message import Message
    from keyedconsumer.sequencing import keys

    # given a sequencer whose acquire of k0's lease is on its way to Redis (held up in the lease
    # I/O thread) when the owner begins to doubt its partitions (a stall) and the group moved on
    seq, d, owner = _with_ownership_check(redis_url)
    try:
        acquire, sent, go = seq._store.acquire, threading.Event(), threading.Event()

        def held_up_acquire(requests, ttl_ms):  # type: ignore[no-untyped-def]
            sent.set()
            go.wait(10)
            return acquire(requests, ttl_ms)

        release, released = seq._store.release, []

        def recorded_release(requests):  # type: ignore[no-untyped-def]
            released.extend(requests)
            return release(requests)

        seq._store.acquire, seq._store.release = held_up_acquire, recorded_release
        d.admit([Message("t", 0, 0, b"k0", b"v")])
        owner["tick"]()
        assert sent.wait(5)  # checked for a stall and a doubt, and sent
        time.sleep(0.7)  # longer than the stall bound (0.5 s): the next tick doubts
        owner["ok"] = False
        owner["tick"]()
        assert owner["asked"] == 1
        # when Redis grants it, after the doubt began
        go.set()
        seq._store.acquire = acquire
        assert wait_until(lambda: owner["drain"]() >= 0 and seq.acquire_calls == 1, 5)
        # then no run of k0 is made ready while the check fails, and the grant is released
        for _ in range(4):
            owner["tick"]()
            time.sleep(0.25)
        assert len(d.queue) == 0 and owner["asked"] >= 2
        assert wait_until(lambda: len(released) == 1, 5), released
        # when the check passes, the lease is asked for again and the run made ready
        owner["ok"] = True
        assert owner["until"](lambda: len(d.queue) == 1)
        r = connect(redis_url, 5.0)  # (one key read: a SCAN of a big database outlasts the 1 s TTL)
        assert r.exists(keys.lease(seq.config.namespace, keys.lease_id(b"k0", "t", 0)))
    finally:
        seq.detach()


@pytest.mark.timeout(40)
def test_detach_releases_what_it_holds_before_it_returns_when_the_lease_io_thread_is_held_up(
    redis_url: str,
) -> None:
    from keyedconsumer.engine.engine import Engine
    from keyedconsumer.engine.workers import Mailbox
    from keyedconsumer.message import Message
    from keyedconsumer.sequencing import keys

    # given a sequencer (lease TTL 30 s) holding k0's lease, whose lease I/O thread is held up in
    # k1's acquire for longer than detach waits for it (5 s)
    ns = f"detach{uuid.uuid4().hex[:8]}"
    seq = RedisSequencer(redis_url, ns, lease_ttl_s=30.0, require_durable=False)
    mailbox = Mailbox()
    d = Engine("key", seq, mailbox.post)
    d.assign([("t", 0)])
    seq.attach(d.port, lambda e: None)
    go = threading.Event()
    try:
        d.admit([Message("t", 0, 0, b"k0", b"v")])
        assert wait_until(lambda: (mailbox.drain(), seq.tick(), len(d.queue) == 1)[2], 5)
        r = connect(redis_url, 5.0)
        k0_lease = keys.lease(ns, keys.lease_id(b"k0", "t", 0))
        assert r.exists(k0_lease)
        assert wait_until(lambda: r.zscore(keys.instances(ns), seq.instance_id) is not None, 5)
        acquire, sent = seq._store.acquire, threading.Event()

        def held_up_acquire(requests, ttl_ms):  # type: ignore[no-untyped-def]
            sent.set()
            go.wait(20)
            return acquire(requests, ttl_ms)

        seq._store.acquire = held_up_acquire
        d.admit([Message("t", 0, 1, b"k1", b"v")])
        assert wait_until(lambda: (mailbox.drain(), seq.tick(), sent.is_set())[2], 5)
        io = seq._lease_io_thread
        assert io is not None
        # when the consumer detaches
        seq.detach()
        # then k0's lease is released and the instance checked out before detach returned (not
        # left to the thread, which a process's exit would end first: k0 would wait 30 s)
        assert not r.exists(k0_lease) and not r.exists(keys.scheduler(ns))
        assert r.zscore(keys.instances(ns), seq.instance_id) is None
        # and the held-up thread ends once its call returns, sending nothing more
        go.set()
        io.join(5)
        assert not io.is_alive()
    finally:
        go.set()
        seq.detach()
