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
    consumer = KeyedConsumer(handler=handle, topics=[topic], brokers=bootstrap.split(","), name=group, concurrency=8)
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
        return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in cluster.redis_nodes], socket_timeout=5)

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
                    return c.cluster_info().get("cluster_state") == "ok" and c.get_node_from_key(keys[0]).port != master.port
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
