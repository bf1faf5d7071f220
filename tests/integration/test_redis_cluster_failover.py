"""Redis Cluster failovers with lagging replicas (issue 25 §9) and ``WAIT`` timeouts (issue 27 §2),
on a private cluster of 3 masters with 2 replicas each (ports of its own, stopped after).

- A forced takeover (``CLUSTER FAILOVER TAKEOVER``) by a replica that lagged: the new master never
  issues a fencing token already issued or lower (its counters jump past its config epoch's
  floor), and grants no lease before a lease the old master granted and lost has ended (its quiet
  time).
- A ``WAIT`` that times out (both replicas of a master stopped): an acquire does not count yet and
  gives the same token back when asked again; a renewal counts on its master's answer (a slow
  replica never makes a held lease lapse); a park does not count.
"""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from keyedconsumer.sequencing import keys as kk
from keyedconsumer.sequencing.store import LeaseStore, StoreUnavailable

from .kafkautil import wait_until
from .redisnodes import RedisClusterNodes, RedisNode

pytestmark = [pytest.mark.redis, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterNodes]:
    c = RedisClusterNodes(masters=3, replicas=2)
    try:
        c.up()
        yield c
    finally:
        c.down()


def _master_and_replicas(
    store: LeaseStore, cluster: RedisClusterNodes, lid: str
) -> tuple[RedisNode, list[RedisNode]]:
    """The node serving ``lid``'s slot and its replicas."""
    r: Any = store._r
    r.nodes_manager.initialize()
    master = r.get_node_from_key(kk.lease(store.namespace, lid))
    nodes = r.cluster_nodes()
    mid = nodes[master.name]["node_id"]
    replicas = [int(a.rsplit(":", 1)[1]) for a, d in nodes.items() if d.get("master_id") == mid]
    return cluster.node(master.port), [cluster.node(p) for p in replicas]


def _fill_past_kernel_buffers(m: Any, tag: str) -> None:
    """Write more than the kernel can buffer between a master and a stopped replica (``tcp_rmem`` +
    ``tcp_wmem`` maxima), so the writes that follow stay in the master's memory and die with it."""
    kernel = sum(
        int(Path(f"/proc/sys/net/ipv4/{f}").read_text().split()[2]) for f in ("tcp_rmem", "tcp_wmem")
    )
    chunk = 16 << 20
    for i in range(kernel // chunk + 2):
        m.set(f"{tag}:filler:{i}", b"x" * chunk)


def test_a_takeover_by_a_lagging_replica_issues_no_token_twice_and_grants_no_held_lease(
    cluster: RedisClusterNodes,
) -> None:
    # given a store on the cluster, a key whose master M has replicas R1 and R2, and a first token
    # that both replicas have
    ns, ttl_ms = f"tk{uuid.uuid4().hex[:6]}", 5000
    store = LeaseStore(cluster.url, ns, socket_timeout_s=2.0)
    store.check_durable()
    lid = kk.lease_id(b"account-1", "t", 0)
    master, (r1, r2) = _master_and_replicas(store, cluster, lid)
    t1 = store.acquire([(lid, "a")], ttl_ms)[0][0]
    assert t1 > 0 and store.release([(lid, "a")]) == [True]
    m = master.client()
    assert m.execute_command("WAIT", 2, 5000) == 2
    # when R2 stops, M writes more than the kernel buffers on the way to R2, and then grants the
    # key's lease to "b" (token t2, acknowledged by R1: it counts)
    r2.signal(signal.SIGSTOP)
    try:
        _fill_past_kernel_buffers(m, kk.lease(ns, lid))
        asked_s = time.monotonic()
        t2 = store.acquire([(lid, "b")], ttl_ms)[0][0]
        assert t2 > t1, (t1, t2)
        # and M dies, and R2, which never got t2, is forced to take over at once
        master.kill()
    finally:
        r2.signal(signal.SIGCONT)
    c2 = r2.client()
    c2.execute_command("CLUSTER", "FAILOVER", "TAKEOVER")
    assert wait_until(lambda: c2.execute_command("ROLE")[0] == b"master", 30)
    assert c2.get(kk.lease(ns, lid)) is None  # R2 lagged: b's lease is not there

    def served_by_r2() -> bool:
        try:
            return _master_and_replicas(store, cluster, lid)[0] is r2
        except Exception:  # the cluster is reconfiguring: ask again
            return False

    assert wait_until(served_by_r2, 30, 0.2)
    # then nobody gets the key before b's lease has ended (b counts it valid up to asked + TTL)...
    granted: list[tuple[int, float]] = []

    def acquired() -> bool:
        try:
            token = store.acquire([(lid, "c")], ttl_ms)[0][0]
        except StoreUnavailable:
            return False
        if token > 0:
            granted.append((token, time.monotonic()))
        return token > 0

    assert wait_until(acquired, 60, 0.05)
    (t3, at_s), *_ = granted
    assert at_s - asked_s >= ttl_ms / 1000, (at_s - asked_s, ttl_ms)
    # ... and its token is above every token issued before, the lost one included
    assert t3 > t2 > t1, (t1, t2, t3)
    store.close()
    m.close()
    c2.close()
    master.start()  # M rejoins, as a replica
    assert wait_until(cluster.settled, 60, 0.5)


def test_a_wait_that_times_out_delays_an_acquire_and_never_fails_a_renewal(
    cluster: RedisClusterNodes,
) -> None:
    # given a lease held on a master M, and another key of M not leased yet
    ns, ttl_ms = f"wt{uuid.uuid4().hex[:6]}", 5000
    store = LeaseStore(cluster.url, ns, socket_timeout_s=1.0)
    assert wait_until(cluster.settled, 60, 0.5)
    held = kk.lease_id(b"held", "t", 0)
    master, replicas = _master_and_replicas(store, cluster, held)
    r: Any = store._r
    other = next(
        lid
        for lid in (kk.lease_id(f"k{i}".encode(), "t", 0) for i in range(1000))
        if r.get_node_from_key(kk.lease(ns, lid)).port == master.port
    )
    token = store.acquire([(held, "h")], ttl_ms)[0][0]
    assert token > 0
    # when every replica of M stops answering
    for rep in replicas:
        rep.signal(signal.SIGSTOP)
    try:
        # then the held lease is still renewed (the master's answer counts)
        assert store.renew([(held, "h")], ttl_ms) == [True]
        # and a new lease is granted on M but does not count yet (0: ask again)
        assert store.acquire([(other, "o")], ttl_ms) == [(0, 0)]
        assert store.acquire([(other, "o")], ttl_ms) == [(0, 0)]
        # and a park does not count (its caller keeps the message and sends it again)
        with pytest.raises(StoreUnavailable) as err:
            store.park([(held, "h", [("74.0", 0, b"m0")], None)], 60_000, 10, 10_000)
        assert err.value.unacknowledged
        assert store.available  # Redis answered: slow replicas are not an outage
    finally:
        for rep in replicas:
            rep.signal(signal.SIGCONT)
    # and once a replica is back, the same owner asking again gets the same lease and one token
    got = store.acquire([(other, "o")], ttl_ms)[0][0]
    assert got > 0
    assert wait_until(lambda: store.acquire([(other, "o")], ttl_ms)[0][0] == got, 10)
    assert store.park([(held, "h", [("74.0", 0, b"m0")], None)], 60_000, 10, 10_000)[0][0] == 1
    ok, entries, _depth, _ = store.fetch(held, "h", 10)
    assert ok and entries == [b"m0"]
    store.close()
