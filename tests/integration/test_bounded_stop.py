"""A stop is bounded whatever the broker does (confluent-kafka-python #1667, librdkafka #1002;
parallel-consumer #597, #809): SIGTERM makes ``run()`` return within
``max(shutdown_timeout_s, BLOCKING_CALL_S) + SHUTDOWN_MARGIN_S`` seconds while the broker is stopped
(SIGSTOP) or gone, and during joins and leaves of the group; what could not be committed is logged,
and no commit is ever past an unfinished message.

The broker tests run their own Kafka (free ports, own run dir), which they stop and kill; the shared
broker is never touched.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from keyedconsumer.consumer import BLOCKING_CALL_S, SHUTDOWN_MARGIN_S

from .kafkautil import committed, log_lines, produce, wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
SHUTDOWN_S = 3.0
#: The documented bound of a stop, in seconds (see KeyedConsumer.stop).
BOUND_S = max(SHUTDOWN_S, BLOCKING_CALL_S) + SHUTDOWN_MARGIN_S


@pytest.fixture
def own_kafka() -> Iterator[object]:
    """A broker (and Redis) of one test only, on free ports: these tests stop and kill it.

    One per test: a broker that a test SIGSTOPped and resumed answered, but in one CI run did not
    serve the next test's CreateTopics within 60 s ("Failed while waiting for controller"); what a
    test does to its broker must not decide whether the next one can start.
    """
    from tests.faults.services import Services, pick_ports

    run_dir = Path(tempfile.mkdtemp(prefix="kc-stop-"))
    svc = Services(run_dir, pick_ports((29192, 29193, 29379)))
    svc.up()
    try:
        yield svc
    finally:
        pid = _kafka_pid(svc)
        if pid:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        svc.down()


def _kafka_pid(svc: object) -> int | None:
    try:
        return int((svc.run_dir / "kafka" / "kafka.pid").read_text().split()[0])  # type: ignore[attr-defined]
    except (OSError, ValueError, IndexError):
        return None


def _topic(bootstrap: str, partitions: int) -> str:
    name = f"stop-{uuid.uuid4().hex[:10]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(name, partitions, 1)])[name].result(60)
    return name


def _start(bootstrap: str, topic: str, group: str, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    err = open(log.with_suffix(f".{time.monotonic_ns()}.err"), "wb")
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.integration.procs.stop_consumer",
            bootstrap,
            topic,
            group,
            str(log),
            "--shutdown-s",
            str(SHUTDOWN_S),
            *extra,
        ],
        cwd=ROOT,
        stdout=err,
        stderr=err,
    )


def _ends(log: Path) -> set[tuple[int, int]]:
    lines = log_lines(log)
    return {(int(x[2]), int(x[3])) for x in (ln.split() for ln in lines) if x and x[0] == "E" and len(x) == 4}


def _started(bootstrap: str, topic: str, group: str, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    """:func:`_start`, then wait until the process is about to call ``run()`` (its ``R`` line): a
    SIGTERM before ``run()`` registered its handler kills a process at once (the default action),
    and the interpreter's start-up takes longer than the shortest wait below on a loaded machine."""
    proc = _start(bootstrap, topic, group, log, *extra)
    marker = f"R {proc.pid}"  # a whole line: "R 123" is not the line "R 1234" of another process
    assert wait_until(lambda: marker in log_lines(log), 60), _stderr(log)
    return proc


def _term_and_time(proc: subprocess.Popen[bytes]) -> float:
    """SIGTERM ``proc``; the seconds until it exited (it is killed past the bound + 30 s)."""
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(BOUND_S + 30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        return float("inf")
    return time.monotonic() - t0


def _stderr(log: Path) -> str:
    return "".join(
        p.read_text(errors="replace") for p in sorted(log.parent.glob(log.name.split(".")[0] + ".*.err"))
    )


def _assert_commits_cover_only_finished(
    bootstrap: str, group: str, topic: str, partitions: int, ends: set[tuple[int, int]]
) -> None:
    for p, off in committed(bootstrap, group, topic, partitions).items():
        if off is not None:
            missing = [o for o in range(off) if (p, o) not in ends]
            assert not missing, f"partition {p} committed at {off} past unfinished offsets {missing[:10]}"


@pytest.mark.timeout(180)
def test_sigterm_returns_within_the_bound_while_the_broker_is_stopped(own_kafka, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # given a consumer working through a backlog on a broker that is then stopped (SIGSTOP)
    bootstrap = own_kafka.bootstrap
    topic, group, log = _topic(bootstrap, 2), f"g-{uuid.uuid4().hex[:8]}", tmp_path / "stopped.log"
    produce(bootstrap, topic, [(f"k{i % 50}".encode(), b"x", i % 2) for i in range(3000)])
    proc = _start(bootstrap, topic, group, log)
    assert wait_until(lambda: len(_ends(log)) >= 300, 60), _stderr(log)
    pid = _kafka_pid(own_kafka)
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(1.0)
        # when it is SIGTERMed
        elapsed = _term_and_time(proc)
    finally:
        os.kill(pid, signal.SIGCONT)
    # then it exited cleanly within the bound, and said what it could not commit
    assert proc.returncode == 0 and elapsed <= BOUND_S, (elapsed, proc.returncode, _stderr(log)[-3000:])
    err = _stderr(log)
    assert "final commit failed" in err or "did not close within" in err, err[-3000:]
    # and once the broker is back, no commit is past an unfinished message
    _assert_commits_cover_only_finished(bootstrap, group, topic, 2, _ends(log))


@pytest.mark.timeout(180)
def test_sigterm_returns_within_the_bound_when_the_broker_is_gone(own_kafka, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # given a consumer working through a backlog on a broker that is then killed
    bootstrap = own_kafka.bootstrap
    topic, group, log = _topic(bootstrap, 2), f"g-{uuid.uuid4().hex[:8]}", tmp_path / "gone.log"
    produce(bootstrap, topic, [(f"k{i % 50}".encode(), b"x", i % 2) for i in range(3000)])
    proc = _start(bootstrap, topic, group, log)
    assert wait_until(lambda: len(_ends(log)) >= 300, 60), _stderr(log)
    own_kafka.kafka_kill()
    try:
        # when it is SIGTERMed
        elapsed = _term_and_time(proc)
    finally:
        own_kafka.kafka_start()
    # then it exited cleanly within the bound, and no commit is past an unfinished message
    assert proc.returncode == 0 and elapsed <= BOUND_S, (elapsed, proc.returncode, _stderr(log)[-3000:])
    _assert_commits_cover_only_finished(bootstrap, group, topic, 2, _ends(log))


@pytest.mark.redis
@pytest.mark.timeout(420)
def test_sigterm_during_joins_and_leaves_returns_within_the_bound_every_time(
    kafka_bootstrap, redis_url, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    # given two members with the Redis sequencer on a 4-partition topic with a steady backlog
    rng = random.Random(7)
    topic = _topic(kafka_bootstrap, 4)
    group, ns = f"g-{uuid.uuid4().hex[:8]}", f"stop{uuid.uuid4().hex[:8]}"
    produce(kafka_bootstrap, topic, [(f"k{i % 200}".encode(), b"x", None) for i in range(20_000)])
    extra = ("--redis", redis_url, "--namespace", ns)
    log = tmp_path / "members.log"
    a = _start(kafka_bootstrap, topic, group, log, *extra)
    assert wait_until(lambda: len(_ends(log)) >= 200, 60), _stderr(log)
    times: list[float] = []
    # when, again and again, a member joins (or one restarts right after a SIGKILL) and is SIGTERMed
    # at once or during its join, or the old member is SIGTERMed while the new one joins
    for round_ in range(6):
        b = _started(kafka_bootstrap, topic, group, log, *extra)
        if round_ == 2:  # SIGKILL the joiner once it has partitions, restart it, SIGTERM it at once
            time.sleep(6.0)
            b.kill()
            b.wait(10)
            b = _started(kafka_bootstrap, topic, group, log, *extra)
            time.sleep(1.5)
        else:
            time.sleep(rng.uniform(0.5, 4.0))
        victim = a if round_ in (3, 5) else b
        times.append(_term_and_time(victim))
        assert victim.returncode == 0, (round_, victim.returncode, _stderr(log)[-3000:])
        if victim is a:
            a = b
        else:
            time.sleep(rng.uniform(0.0, 2.0))  # the leave's rebalance may still be under way
    times.append(_term_and_time(a))
    # then every stop returned within the bound
    assert all(t <= BOUND_S for t in times), (times, _stderr(log)[-4000:])


@pytest.mark.timeout(420)
def test_finished_work_never_runs_again_under_kip848_membership_churn(kafka_bootstrap, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # given members of a group.protocol=consumer group (KIP-848) working through a backlog
    rng = random.Random(11)
    topic = _topic(kafka_bootstrap, 6)
    group, log = f"g-{uuid.uuid4().hex[:8]}", tmp_path / "churn.log"
    n = 30_000
    produce(kafka_bootstrap, topic, [(f"k{i % 300}".encode(), b"x", None) for i in range(n)])
    extra = ("--protocol", "consumer", "--sleep", "0.002")
    a = _start(kafka_bootstrap, topic, group, log, *extra)
    assert wait_until(lambda: len(_ends(log)) >= 500, 60), _stderr(log)
    # when members join and leave (SIGTERM: graceful) again and again while it runs
    for _ in range(5):
        b = _started(kafka_bootstrap, topic, group, log, *extra)
        time.sleep(rng.uniform(2.0, 5.0))
        c = _started(kafka_bootstrap, topic, group, log, *extra)
        time.sleep(rng.uniform(1.0, 4.0))
        for proc in (b, c):
            assert _term_and_time(proc) <= BOUND_S and proc.returncode == 0, _stderr(log)[-3000:]
    assert wait_until(lambda: len(_ends(log)) >= n, 180), (len(_ends(log)), _stderr(log)[-3000:])
    assert _term_and_time(a) <= BOUND_S and a.returncode == 0
    # then every message ran, and none ran twice: each revoke's commit (with the metadata of what
    # finished above it) was accepted, even when the group had moved to a new member epoch meanwhile
    runs = [(int(x[2]), int(x[3])) for x in (ln.split() for ln in log_lines(log)) if x and x[0] == "E"]
    twice = len(runs) - len(set(runs))
    assert len(set(runs)) == n and twice == 0, (twice, len(set(runs)), _stderr(log)[-3000:])


@pytest.mark.timeout(240)
def test_sigterm_during_a_revoke_whose_commit_meets_a_stopped_broker_returns_within_the_bound(
    own_kafka, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    # given a member running all four messages of a 2-partition topic at once: each partition's
    # second message runs long (a revoke waits revoke_timeout_s for it, then commits) and its first
    # one ends just after the revoke started (so the revoke has a new offset to commit)
    bootstrap = own_kafka.bootstrap
    topic, group, log = _topic(bootstrap, 2), f"g-{uuid.uuid4().hex[:8]}", tmp_path / "revoke.log"
    produce(bootstrap, topic, [(f"k{i}".encode(), b"x", i // 2) for i in range(4)])
    err = open(tmp_path / "revoke.err", "wb")
    member = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.integration.procs.revoke_consumer",
            bootstrap,
            topic,
            group,
            str(log),
            "--shutdown-s",
            str(SHUTDOWN_S),
        ],
        cwd=ROOT,
        stdout=err,
        stderr=err,
    )

    def lines(kind: str) -> list[str]:
        return [ln for ln in log_lines(log) if ln.startswith(kind)]

    pid = _kafka_pid(own_kafka)
    assert pid is not None
    joiner = None
    try:
        assert wait_until(lambda: len(lines("S ")) == 4, 60), (tmp_path / "revoke.err").read_text()[-3000:]
        # when a second member joins: the first member's revoke starts (and waits for its handler)
        joiner = _start(bootstrap, topic, group, tmp_path / "joiner.log")
        assert wait_until(lambda: lines("V "), 60), (tmp_path / "revoke.err").read_text()[-3000:]
        # and the broker is stopped (SIGSTOP) while it waits, and the member is SIGTERMed
        os.kill(pid, signal.SIGSTOP)
        elapsed = _term_and_time(member)
    finally:
        os.kill(pid, signal.SIGCONT)
        if joiner is not None:
            joiner.kill()
            joiner.wait(10)
        if member.poll() is None:
            member.kill()
            member.wait(10)
    # then it exited cleanly within the documented bound, though the revoke's commit got no answer
    assert member.returncode == 0 and elapsed <= BOUND_S, (
        elapsed,
        member.returncode,
        (tmp_path / "revoke.err").read_text()[-3000:],
    )
