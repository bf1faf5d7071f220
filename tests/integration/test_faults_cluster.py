"""The fault harness's cluster run at CI size (issue 15, "many hosts").

``python -m tests.faults.run --cluster``: 3 Kafka brokers (replication factor 3) and a Redis Cluster
(3 masters, 3 replicas) on a bridge of the run's own; 3 consumers (+1 that joins and leaves), each on
a host of its own (a network namespace), with the Redis sequencer on the Redis Cluster; seeded
faults: consumer SIGKILL / SIGTERM / SIGSTOP, the broker leading the most partitions SIGKILLed and
restarted, the Redis master holding the most keys SIGKILLed (its replica takes over; it rejoins as a
replica), a consumer's host cut off the network for longer than the lease TTL and the session
timeout, then healed. Then the checker, which reads only the logs (tests/faults/README.md).

Building hosts needs root (``ip netns``): without it the test is skipped on a workstation and FAILS
in CI (``CI=true``), like every service test.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from .kafkautil import log_lines
from .test_faults import assert_all_pass, run_harness

pytestmark = [pytest.mark.slow]


def _need_hosts() -> None:
    from tests.faults import hosts

    why = hosts.available()
    if why is not None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(why, pytrace=False)
        pytest.skip(why)


def _faults(out: Path) -> list[tuple[str, str]]:
    """``(kind, detail)`` of every record of the run's ``faults.log``."""
    rows = []
    for line in log_lines(out / "faults.log"):
        _t, kind, _pid, detail = line.split(" ", 3)
        rows.append((kind, detail))
    return rows


@contextlib.contextmanager
def _kept_on_failure(out: Path) -> Iterator[None]:
    """On a failure, copy the run's logs where pytest's rotation of its temporary dirs (other
    sessions of the same user remove all but the last 3) leaves them, and say where."""
    try:
        yield
    except BaseException:
        if out.exists():
            keep = Path(tempfile.mkdtemp(prefix="kc-faults-cluster-failed-"))
            shutil.copytree(out, keep / "run", dirs_exist_ok=True)
            print(f"the run's logs: {keep / 'run'}")  # shown with the failure
        raise


@pytest.mark.timeout(600)
def test_cluster_ci_run_keeps_every_guarantee(tmp_path: Path) -> None:
    # given the cluster run at CI size: 15,000 messages on 12 partitions (3 replicas each), consumers
    # on 4 network-namespace hosts, a broker leader and a Redis master SIGKILLed, a host cut off
    _need_hosts()
    out = tmp_path / "run"
    with _kept_on_failure(out):
        _run_and_check(out)


def _run_and_check(out: Path) -> None:
    data = run_harness(out, "--cluster", "--size", "ci", "--seed", "1", timeout_s=560)
    # then every fault of the schedule was landed: the host cut and healed, the Redis master failed
    # over to its replica, the leading broker killed and back
    kinds = [k for k, _d in _faults(out)]
    for kind in ("cut", "heal", "redis_kill", "redis_up", "kafka_kill", "kafka_up", "join", "leave"):
        assert kind in kinds, f"no {kind} in faults.log"
    failovers = [d for k, d in _faults(out) if k == "redis_failover"]
    assert failovers and not failovers[0].endswith(":none"), f"no Redis failover: {failovers}"
    # and no consumer exited unexpectedly or lost a thread to an exception (a lease renewer, say)
    assert data["clean_run"], data["header"]
    # and every check passes
    assert_all_pass(data)
