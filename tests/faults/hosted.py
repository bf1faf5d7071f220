"""The services and hosts of the harness's cluster run (``python -m tests.faults.run --cluster``).

- **Hosts** (:mod:`tests.faults.hosts`): one network namespace per consumer slot (``c1``-``c3`` on
  hosts 1-3, the joiner ``j4`` on host 4), on a bridge of the run's own. A consumer restarted in a
  slot comes back on the same host. A host can be cut off the network and healed.
- **Services**, plain processes in the root namespace, listening on the bridge's address: a 3-broker
  Kafka (KRaft, replication factor 3, ``min.insync.replicas=2``) and a Redis Cluster (3 masters,
  3 replicas, AOF ``fsync always``) through ``scripts/services cluster-*`` (:mod:`tests.faults.cluster`),
  and one plain Redis (AOF) that stands for the handler's own database: its fenced writes go there,
  not to the Redis Cluster under test, so a failover of the leases' Redis cannot rewrite the
  checker's record of what the handlers did.

It offers what the orchestrator uses of :class:`tests.faults.services.Services` (``bootstrap``,
``redis_url``, ``up``, ``down``, ``kafka_kill`` / ``kafka_start``, ``redis_kill`` / ``redis_start``),
where a kill picks its victim: the broker that leads the most partitions, the Redis master that
holds the most keys. ``redis_start`` first waits for the killed master's replica to take its slots
over (the failover), then restarts the killed node, which rejoins as a replica.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from confluent_kafka.admin import AdminClient

from . import hosts
from .cluster import Cluster, pick_bases
from .services import pick_ports, run_services, services_env

#: Consumer slots and their hosts.
SLOT_HOSTS = {"c1": 1, "c2": 2, "c3": 3, "j4": 4}
#: How long ``redis_start`` waits for the killed master's failover before it restarts the node anyway.
FAILOVER_WAIT_S = 30.0


def _redis_cli(host: str, port: int, *args: str) -> str:
    r = subprocess.run(
        ["redis-cli", "-h", host, "-p", str(port), *args], capture_output=True, text=True, timeout=5
    )
    return r.stdout


class ClusterServices:
    """The cluster run's services on the bridge of its hosts.

    Parameters
    ----------
    run_dir:
        The services' run dir (the cluster's nodes under ``cluster/``, the handler's Redis under ``db/``).
    owner_pid:
        The orchestrator (its hosts are stale once it is gone).
    log:
        ``log(kind, pid, detail)``: the orchestrator's fault log (victims chosen, failovers).
    """

    def __init__(self, run_dir: Path, owner_pid: int, log: Callable[[str, int | str, str], None]) -> None:
        self.run_dir = run_dir
        self.log = log
        self.hosts = hosts.Hosts(len(SLOT_HOSTS), owner_pid)
        try:
            self.cluster = Cluster(run_dir, pick_bases((38100, 48100)), host=self.hosts.address)
            self.db_port = pick_ports((28180, 28181, 28182), avoid=self.cluster.ports)[2]
        except BaseException:
            self.hosts.close()
            raise
        self.db_env = services_env(
            run_dir / "db", REDIS_PORT=self.db_port, KC_SERVICES_HOST=self.hosts.address
        )
        self.kafka_victim = 0
        self.redis_victim = 0

    # -- what the orchestrator and run.json use --------------------------------------------------
    @property
    def bootstrap(self) -> str:
        return self.cluster.bootstrap

    @property
    def redis_url(self) -> str:
        return self.cluster.redis_url

    @property
    def db_url(self) -> str:
        """The handler's own database (a plain Redis, never killed)."""
        return f"redis://{self.hosts.address}:{self.db_port}/0"

    def describe(self) -> dict[str, Any]:
        """What the watchdog needs to clean up (:func:`cleanup`), and where things run."""
        return {
            "cluster": True,
            "hosts_tag": self.hosts.tag,
            "services_host": self.hosts.address,
            "bases": [self.cluster.kafka_base, self.cluster.redis_base],
            "db_port": self.db_port,
            "db_url": self.db_url,
            "slot_hosts": SLOT_HOSTS,
        }

    def exec_prefix(self, slot: str) -> list[str]:
        """The command prefix that runs a process of ``slot`` on its host."""
        return self.hosts.exec_prefix(SLOT_HOSTS[slot])

    # -- lifecycle -------------------------------------------------------------------------------
    def up(self) -> None:
        run_services(self.db_env, self.run_dir / "services.out", "redis-start", timeout_s=60)
        self.cluster.up()

    def down(self) -> None:
        """SIGKILL every node (the run's data is thrown away: a graceful stop would only cost time),
        then remove the hosts."""
        try:
            self.cluster.kill_all()
            run_services(self.db_env, self.run_dir / "services.out", "redis-kill", timeout_s=60)
        finally:
            self.hosts.close()

    # -- faults ----------------------------------------------------------------------------------
    def kafka_kill(self) -> None:
        """SIGKILL the broker that leads the most partitions (the test topic's and the group's)."""
        admin = AdminClient({"bootstrap.servers": self.bootstrap, "log_level": 0})
        led: dict[int, int] = {}
        for t in admin.list_topics(timeout=10).topics.values():
            for p in t.partitions.values():
                if p.leader >= 0:
                    led[p.leader] = led.get(p.leader, 0) + 1
        node = max(sorted(led), key=lambda n: led[n]) if led else 1
        self.kafka_victim = node
        self.log("kafka_victim", "-", f"broker{node}:leads:{led.get(node, 0)}")
        self.cluster.kafka_kill(node)

    def kafka_start(self) -> None:
        self.cluster.kafka_start(self.kafka_victim)

    def _masters(self) -> dict[int, str]:
        """``{node: id}`` of the Redis Cluster's masters that are up, as a live node sees them."""
        for i in range(1, 7):
            out = _redis_cli(self.cluster.host, self.cluster.redis_port(i), "cluster", "nodes")
            if not out.strip():
                continue
            masters = {}
            for line in out.splitlines():
                x = line.split()
                if len(x) > 2 and "master" in x[2] and "fail" not in x[2]:
                    port = int(x[1].split("@")[0].rsplit(":", 1)[1])
                    masters[port - self.cluster.redis_base + 1] = x[0]
            return masters
        return {}

    def redis_kill(self) -> None:
        """SIGKILL the Redis master that holds the most keys."""
        sizes = {}
        for node in self._masters():
            with contextlib.suppress(ValueError):
                sizes[node] = int(
                    _redis_cli(self.cluster.host, self.cluster.redis_port(node), "dbsize").strip()
                )
        node = max(sorted(sizes), key=lambda n: sizes[n]) if sizes else 1
        self.redis_victim = node
        self.log("redis_victim", "-", f"node{node}:keys:{sizes.get(node, 0)}")
        self.cluster.redis_kill(node)

    def redis_start(self) -> None:
        """Wait until a replica took the killed master's place, then restart it (it rejoins as a replica)."""
        node, t0 = self.redis_victim, time.monotonic()
        while time.monotonic() - t0 < FAILOVER_WAIT_S:
            masters = self._masters()
            if len(masters) == 3 and node not in masters:
                self.log(
                    "redis_failover",
                    "-",
                    f"node{node}:{time.monotonic() - t0:.1f}s:masters:" + ",".join(map(str, sorted(masters))),
                )
                break
            time.sleep(0.2)
        else:
            self.log("redis_failover", "-", f"node{node}:none")
        self.cluster.redis_start(node)

    # -- hosts -----------------------------------------------------------------------------------
    def cut(self, slot: str) -> None:
        self.hosts.cut(SLOT_HOSTS[slot])

    def heal(self, slot: str) -> None:
        self.hosts.heal(SLOT_HOSTS[slot])


def used_memory(r: Any) -> int:
    """``used_memory`` of a Redis, or the sum over a Redis Cluster's nodes (redis-py answers a
    cluster's INFO with one dict per node)."""
    info = r.info("memory")
    if "used_memory" in info:
        return int(info["used_memory"])
    return sum(int(v.get("used_memory", 0)) for v in info.values() if isinstance(v, dict))


def cleanup(cfg: dict[str, Any]) -> None:
    """Stop what a cluster run described in ``cfg`` (its ``run.json``) left running: the watchdog's
    part after an orchestrator died."""
    svc_dir = Path(cfg["services_dir"])
    try:
        if svc_dir.exists():
            Cluster(svc_dir, tuple(cfg["bases"]), host=cfg["services_host"]).kill_all()
            env = services_env(
                svc_dir / "db", REDIS_PORT=cfg["db_port"], KC_SERVICES_HOST=cfg["services_host"]
            )
            run_services(env, svc_dir / "services.out", "redis-kill", timeout_s=60)
    finally:
        hosts.destroy(cfg["hosts_tag"])
        shutil.rmtree(svc_dir, ignore_errors=True)
