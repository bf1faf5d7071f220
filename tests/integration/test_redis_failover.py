"""A failover behind one ``redis://`` address (issue 25 §10): a replica promoted with
``REPLICAOF NO ONE`` while a TCP proxy (a DNS name, a Sentinel-style switch) keeps the address.

The consumer's open connections still reach the old master, now a replica: they answer
``READONLY``. The new master's script cache is empty: it answers ``NOSCRIPT``. The consumer must
recover without a restart, be not ready meanwhile, and keep every key in order with fencing tokens
that never go down (the promoted master's counters jump past the old master's).
"""

from __future__ import annotations

import tempfile
import threading
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from keyedconsumer import KeyedConsumer, Message, RedisSequencer
from keyedconsumer.health import Health

from .kafkautil import committed, end_offsets, produce, wait_until
from .redisnodes import RedisNode, TcpProxy, free_ports

pytestmark = [pytest.mark.kafka, pytest.mark.redis]


@pytest.fixture
def pair() -> Iterator[tuple[RedisNode, RedisNode]]:
    """A master and its replica, private."""
    workdir = Path(tempfile.mkdtemp(prefix="kc-failover-"))
    m_port, r_port = free_ports(2)
    master, replica = RedisNode(m_port, workdir), RedisNode(r_port, workdir)
    master.start()
    replica.start()
    try:
        c = replica.client()
        c.execute_command("REPLICAOF", "127.0.0.1", str(m_port))
        assert wait_until(lambda: c.info("replication").get("master_link_status") == "up", 20)
        c.close()
        yield master, replica
    finally:
        master.stop()
        replica.stop()


class _Runs:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_key: dict[bytes, list[tuple[int, int]]] = defaultdict(list)  # key -> [(value, token)]

    def handle(self, msg: Message) -> None:
        with self.lock:
            self.by_key[msg.key or b""].append((int(msg.value or b"-1"), int(msg.fencing_token or 0)))

    def values(self) -> set[int]:
        with self.lock:
            return {v for runs in self.by_key.values() for v, _ in runs}


def _records(lo: int, hi: int, keys: range = range(20)) -> list[tuple[bytes, bytes, None]]:
    return [(f"k{keys[i % len(keys)]}".encode(), str(i).encode(), None) for i in range(lo, hi)]


@pytest.mark.timeout(180)
def test_a_replica_promoted_behind_one_address_is_used_without_a_restart(
    kafka_bootstrap: str, new_topic: Callable[[int], str], pair: tuple[RedisNode, RedisNode], start: Any
) -> None:
    master, replica = pair
    proxy = TcpProxy(master.port)
    topic, ns = new_topic(2), f"fo{uuid.uuid4().hex[:6]}"
    runs = _Runs()
    seq = RedisSequencer(f"redis://127.0.0.1:{proxy.port}/0", ns, lease_ttl_s=2.0, socket_timeout_s=1.0)
    consumer = KeyedConsumer(
        name=f"g-{ns}",
        handler=runs.handle,
        brokers=[kafka_bootstrap],
        topics=[topic],
        concurrency=8,
        sequencer=seq,
        config={"auto.commit.interval.ms": 500},
    )
    health = Health(consumer, live_within_s=30)
    run = start(consumer)
    m, r = master.client(), replica.client()
    try:
        # given a consumer reaching its Redis through one address, with 300 messages handled
        produce(kafka_bootstrap, topic, _records(0, 300))
        assert wait_until(lambda: runs.values() >= set(range(300)), 60)
        assert wait_until(lambda: health.check().ready, 20)
        # when the replica is promoted behind the address: new connections wait at the proxy, the
        # replica has every write (WAIT), it is promoted, and the old master follows it (its open
        # connections now answer READONLY)
        proxy.hold()
        assert m.execute_command("WAIT", 1, 5000) == 1
        r.execute_command("REPLICAOF", "NO", "ONE")
        m.execute_command("REPLICAOF", "127.0.0.1", str(replica.port))
        # and 300 more messages come, of those keys and of 20 keys never leased before
        produce(kafka_bootstrap, topic, _records(300, 600, range(40)))
        # then the consumer is not ready while its Redis does not answer
        assert wait_until(lambda: not health.check().ready, 30), health.check()
        assert not health.check().to_dict()["store_available"]
        # and once the address leads to the new master, it goes on without a restart: everything
        # runs, and it is ready again
        proxy.switch(replica.port)
        proxy.release()
        assert wait_until(lambda: runs.values() >= set(range(600)), 90), sorted(
            set(range(600)) - runs.values()
        )[:20]
        assert wait_until(lambda: health.check().ready, 30), health.check()
        assert wait_until(
            lambda: committed(kafka_bootstrap, f"g-{ns}", topic, 2) == end_offsets(kafka_bootstrap, topic, 2),
            30,
        )
    finally:
        assert run.stop(30)
        proxy.close()
    assert run.error is None
    # the new master answered NOSCRIPT (an empty script cache) and the scripts were loaded again
    assert int(r.info("errorstats").get("errorstat_NOSCRIPT", {}).get("count", 0)) >= 1
    # and each key's messages started in order, with fencing tokens that never went down: those
    # issued by the promoted master are above all of the old master's
    for key, rs in runs.by_key.items():
        firsts: list[int] = []
        for v, _t in rs:
            if v not in firsts:
                firsts.append(v)
        assert firsts == sorted(firsts), key
        tokens = [t for _v, t in rs]
        assert tokens == sorted(tokens) and tokens[0] > 0, (key, tokens)
    m.close()
    r.close()
