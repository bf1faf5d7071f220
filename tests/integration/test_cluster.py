"""The cluster services (``scripts/services cluster-up``): a 3-broker Kafka and a Redis Cluster,
each losing a node (SIGKILL) while in use.

- Kafka: replication factor 3, ``min.insync.replicas=2``. A consumer works through a keyed backlog
  while the leader of a partition is killed and more records are produced: every record is handled,
  each key's messages start in order (a re-run after the failover may repeat, never skip ahead),
  no two messages of one key run at once, and the committed offsets reach the end.
- Redis: 3 masters, 3 replicas. A master is killed: its replica takes over its slots and every
  write the killed master had replicated before it died (``WAIT``) is read back.
"""

from __future__ import annotations

import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from keyedconsumer import KeyedConsumer, Message

from .kafkautil import committed, end_offsets, produce, wait_until
from .test_ordering import Recorder, keyed_records

pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.timeout(420)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[object]:
    from tests.faults.cluster import Cluster, pick_bases

    c = Cluster(Path(tempfile.mkdtemp(prefix="kc-cluster-")), pick_bases())
    try:
        c.up()
        yield c
    finally:
        c.down()


def _leader(admin: AdminClient, topic: str, partition: int) -> tuple[int, list[int], list[int]]:
    """``(leader node id, replicas, in-sync replicas)`` of a partition (-1: no leader now, or the
    broker asked does not know the partition yet: metadata reaches each broker a moment apart)."""
    t = admin.list_topics(topic, timeout=10).topics.get(topic)
    p = t.partitions.get(partition) if t is not None and t.error is None else None
    if p is None:
        return -1, [], []
    return p.leader, list(p.replicas), list(p.isrs)


class _Starts:
    """Per key, the values of the messages as they started (a value may repeat after a re-run)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.values: dict[bytes | None, list[int]] = {}

    def add(self, msg: Message) -> None:
        with self.lock:
            self.values.setdefault(msg.key, []).append(int(msg.value or b"-1"))


def test_a_consumer_loses_nothing_while_a_partition_leader_is_killed(cluster) -> None:  # type: ignore[no-untyped-def]
    # given a topic with 3 replicas of each of its 3 partitions, and 3,000 of 6,000 keyed records
    bootstrap = cluster.bootstrap
    admin = AdminClient({"bootstrap.servers": bootstrap})
    topic = f"cl-{uuid.uuid4().hex[:10]}"
    admin.create_topics([NewTopic(topic, num_partitions=3)])[topic].result(60)  # broker default: 3 replicas
    assert wait_until(lambda: all(len(_leader(admin, topic, p)[2]) == 3 for p in range(3)), 60)
    records = keyed_records(6000, 300)
    produce(bootstrap, topic, records[:3000])
    rec, starts = Recorder(len(records)), _Starts()

    def handle(msg: Message) -> None:
        rec.start(msg)
        starts.add(msg)
        time.sleep(0.001)
        rec.end(msg)

    group = f"g-{uuid.uuid4().hex[:8]}"
    consumer = KeyedConsumer(
        handler=handle, topics=[topic], brokers=bootstrap.split(","), name=group, concurrency=8
    )
    runner = threading.Thread(target=consumer.run, daemon=True)
    runner.start()
    killed = None
    try:
        assert wait_until(lambda: len(rec.seen) >= 1000, 90), len(rec.seen)
        # when the leader of partition 0 is killed, and the other 3,000 records are produced
        leader, _, _ = _leader(admin, topic, 0)
        assert leader > 0
        killed = leader
        cluster.kafka_kill(leader)
        produce(bootstrap, topic, records[3000:])
        # then every record is handled
        assert rec.all_seen.wait(180), f"{len(rec.seen)} of {len(records)} handled"
    finally:
        consumer.stop()
        runner.join(60)
    assert not runner.is_alive()
    # each key's messages started in order: a message never before its predecessor had run
    for key, values in starts.values.items():
        highest = -1
        for v in values:
            assert v <= highest + 1, (key, values)
            highest = max(highest, v)
    assert rec.overlaps == 0
    # and with the killed broker back, the committed offsets reach the end of each partition
    cluster.kafka_start(killed)
    assert committed(bootstrap, group, topic, 3, timeout_s=60) == end_offsets(bootstrap, topic, 3)


def test_a_killed_redis_master_is_replaced_by_its_replica_with_the_writes_it_replicated(cluster) -> None:  # type: ignore[no-untyped-def]
    from redis.cluster import ClusterNode, RedisCluster

    def client() -> RedisCluster:
        return RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in cluster.redis_nodes], socket_timeout=5
        )

    # given a cluster of 3 masters and 3 replicas, and 1,000 keys written over every master
    r = client()
    roles = [r.get_node(h, p) for h, p in cluster.redis_nodes]
    assert sum(n is not None and n.server_type == "primary" for n in roles) == 3, r.cluster_nodes()
    keys = [f"kc-test:{i}" for i in range(1000)]
    for k in keys:
        r.set(k, k)
    # every master confirms that its replica has its writes (replication is asynchronous)
    for node in r.get_primaries():
        assert r.execute_command("WAIT", 1, 5000, target_nodes=node) >= 1
    # when the master of the first key is killed
    master = r.get_node_from_key(keys[0])
    node = next(i for i, (_, p) in enumerate(cluster.redis_nodes, start=1) if p == master.port)
    r.close()
    cluster.redis_kill(node)
    try:
        # then its replica takes its slots over, and every key reads back
        def served() -> bool:
            try:
                c = client()
                try:
                    return (
                        c.cluster_info().get("cluster_state") == "ok"
                        and c.get_node_from_key(keys[0]).port != master.port
                    )
                finally:
                    c.close()
            except Exception:  # the cluster is electing: ask again
                return False

        assert wait_until(served, 60, 0.5)
        r = client()
        try:
            assert [r.get(k) for k in keys] == [k.encode() for k in keys]
        finally:
            r.close()
    finally:
        cluster.redis_start(node)  # it rejoins as a replica
        _wait_settled(cluster)


def _wait_settled(cluster, timeout_s: float = 90.0) -> None:  # type: ignore[no-untyped-def]
    """Wait until every master serving slots has a connected replica again and no node is flagged
    failing: a restarted master rejoins as a replica some seconds after it answers, and the next
    test must find a settled cluster."""
    from redis.cluster import ClusterNode, RedisCluster

    def settled() -> bool:
        try:
            r = RedisCluster(
                startup_nodes=[ClusterNode(h, p) for h, p in cluster.redis_nodes], socket_timeout=5
            )
        except Exception:
            return False
        try:
            nodes = r.cluster_nodes()
            followed = {
                d.get("master_id")
                for d in nodes.values()
                if d.get("connected") and "fail" not in d.get("flags", "")
            }
            masters = [d for d in nodes.values() if "master" in d.get("flags", "") and d.get("slots")]
            return all("fail" not in d.get("flags", "") for d in nodes.values()) and all(
                d["node_id"] in followed for d in masters
            )
        except Exception:
            return False
        finally:
            r.close()

    assert wait_until(settled, timeout_s, 0.5), "the Redis Cluster did not settle after a node restart"


def test_every_redis_cluster_node_must_persist_each_write(cluster) -> None:  # type: ignore[no-untyped-def]
    import redis

    from keyedconsumer.sequencing.store import LeaseStore

    # given the cluster, every node with appendonly yes and appendfsync always
    url = "redis+cluster://" + ",".join(f"{h}:{p}" for h, p in cluster.redis_nodes)
    store = LeaseStore(url, f"ns{uuid.uuid4().hex[:6]}")
    store.check_durable()
    # when one replica stops persisting (a replica becomes its master's successor on a failover)
    host, port = cluster.redis_nodes[-1]
    node = redis.Redis(host=host, port=port, socket_timeout=5)
    node.config_set("appendfsync", "everysec")
    try:
        # then the store refuses the cluster, naming that node
        with pytest.raises(RuntimeError, match=f"appendfsync=everysec on {host}:{port}"):
            store.check_durable()
    finally:
        node.config_set("appendfsync", "always")
        node.close()


def test_a_redis_failover_never_issues_a_fencing_token_twice_nor_loses_a_parked_message(cluster) -> None:  # type: ignore[no-untyped-def]
    """The replica is made to lag for certain, not by chance: it is stopped (SIGSTOP) and its master
    then writes more than every kernel buffer between them can hold (``tcp_rmem`` + ``tcp_wmem``
    maxima), so the writes that follow stay in the master's memory and die with it."""
    import os
    import signal

    import redis

    from keyedconsumer.sequencing import keys as kk
    from keyedconsumer.sequencing.store import LeaseStore, StoreUnavailable

    # given a store on the cluster, and a key whose master M has one replica R
    url = "redis+cluster://" + ",".join(f"{h}:{p}" for h, p in cluster.redis_nodes)
    ns = f"ns{uuid.uuid4().hex[:6]}"
    store = LeaseStore(url, ns, socket_timeout_s=2.0)
    store.check_durable()
    lid = "k." + b"account-1".hex()
    r = store._r
    master = r.get_node_from_key(kk.lease(ns, lid))
    nodes = r.cluster_nodes()
    replica = next(addr for addr, d in nodes.items() if d.get("master_id") == nodes[master.name]["node_id"])
    m_node = cluster.redis_node_of_port(master.port)
    r_node = cluster.redis_node_of_port(int(replica.rsplit(":", 1)[1]))
    # and a lease (its first token) and a parked message that R acknowledged
    issued = [store.acquire([(lid, "owner-1")], 30_000)[0][0]]
    assert issued[0] > 0
    assert store.park([(lid, "owner-1", [("t/0", 0, b"parked-before")], None)], 60_000, 10, 10_000)[0][0] == 1
    assert store.release([(lid, "owner-1")]) == [True]
    # when R stops, and M writes more than the kernel can buffer on the way to R
    kernel = sum(
        int(Path(f"/proc/sys/net/ipv4/{f}").read_text().split()[2]) for f in ("tcp_rmem", "tcp_wmem")
    )
    chunk = 16 << 20
    pid = cluster.redis_pid(r_node)
    os.kill(pid, signal.SIGSTOP)
    try:
        for i in range(kernel // chunk + 2):
            r.set(f"{kk.lease(ns, lid)}:filler:{i}", b"x" * chunk)
        # then a new lease and a parking on M do not count: no replica has them (the acquire's 0:
        # held on M, not acknowledged, ask again)
        assert store.acquire([(lid, "owner-2")], 30_000) == [(0, 1)]
        with pytest.raises(StoreUnavailable, match="no replica"):
            store.park([(lid, "owner-2", [("t/0", 1, b"parked-during-the-lag")], None)], 60_000, 10, 10_000)
        # and M dies with them (SIGKILL), so R takes its slots over without them
        cluster.redis_kill(m_node)
    finally:
        os.kill(pid, signal.SIGCONT)

    def promoted() -> bool:
        try:
            store._r.nodes_manager.initialize()
            return store._r.get_node_from_key(kk.lease(ns, lid)).port == cluster.redis_port(r_node)
        except redis.RedisError:
            return False

    try:
        assert wait_until(promoted, 60, 0.5)
        # while the new master has no replica, no lease counts (a lease it granted could be lost):
        # it is in its quiet time after the failover, or grants without a replica's acknowledgement
        assert store.acquire([(lid, "owner-3")], 30_000)[0][0] <= 0
        # and a consumer starting now waits (try again), it is not refused as misconfigured: the
        # failover is under way (the old master is flagged failing)
        with pytest.raises(StoreUnavailable, match="failover is under way"):
            store.check_durable()
    finally:
        cluster.redis_start(m_node)  # M rejoins, as R's replica

    def acquired() -> bool:
        try:
            token = store.acquire([(lid, "owner-3")], 30_000)[0][0]
        except StoreUnavailable:
            return False
        if token > 0:  # not 0 (no replica yet) nor < 0 (the new master's quiet time: lease TTL + 2 s)
            issued.append(token)
        return token > 0

    assert wait_until(acquired, 120, 0.5)
    # and no fencing token was issued twice or lower: the promoted master's are above all of M's
    assert len(issued) == 2 and issued[1] > issued[0], issued
    # and the parked message that counted is there, the refused one is not
    ok, entries, depth, _ = store.fetch(lid, "owner-3", 10)
    assert ok and entries == [b"parked-before"] and depth == 1
    store.close()
