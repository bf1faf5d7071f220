"""A 3-broker Kafka and a Redis Cluster of the tests' own: ``scripts/services cluster-*`` with a
private run dir and free port ranges.

Like :class:`tests.faults.services.Services`, it never touches the shared services: every command
runs with ``KC_RUN_DIR`` set to its own directory, and the port ranges must be free before the
start (a service already answering there would be reused, neither ours to kill nor to trust).
"""

from __future__ import annotations

import random
import subprocess
from pathlib import Path

from .services import ephemeral_start, port_free, run_services, services_env, stable_port

KAFKA_NODES = 3
REDIS_NODES = 6


def _kafka_ports(base: int) -> list[int]:
    """Every port the Kafka nodes use: each broker's and its controller's."""
    return [base + 2 * i + j for i in range(KAFKA_NODES) for j in (0, 1)]


def _redis_ports(base: int) -> list[int]:
    """Every port the Redis nodes use: each node's and its cluster bus port (+10000)."""
    return [base + i + j for i in range(REDIS_NODES) for j in (0, 10000)]


def pick_bases(preferred: tuple[int, int] = (19092, 17000)) -> tuple[int, int]:
    """``(kafka base, redis base)``: the preferred ones if all their ports are free, else free ones."""

    def free(kafka: int, redis: int) -> bool:
        return all(stable_port(p) for p in _kafka_ports(kafka) + _redis_ports(redis))

    if free(*preferred):
        return preferred
    rng = random.Random()
    for _ in range(200):
        # below the ephemeral range (see services.ephemeral_start); a Redis node's bus port is +10000
        kafka, redis = (
            rng.randrange(22000, min(30000, ephemeral_start() - 100), 10),
            rng.randrange(10000, 11900, 10),
        )
        if free(kafka, redis):
            return kafka, redis
    raise RuntimeError("no free ports for the test cluster")


class Cluster:
    """Start, kill and restart the nodes of the test cluster.

    Parameters
    ----------
    run_dir:
        ``KC_RUN_DIR`` of the cluster (its nodes' data, logs and pid files under ``cluster/``).
    bases:
        ``(kafka base port, redis base port)`` (:func:`pick_bases`).
    host:
        The address every node binds and announces (``KC_SERVICES_HOST``): loopback, or the bridge
        of the test hosts (:mod:`tests.faults.hosts`).
    """

    def __init__(self, run_dir: Path, bases: tuple[int, int], host: str = "127.0.0.1") -> None:
        self.run_dir = run_dir
        self.kafka_base, self.redis_base = bases
        self.host = host
        self.env = services_env(
            run_dir,
            CLUSTER_KAFKA_BASE=self.kafka_base,
            CLUSTER_REDIS_BASE=self.redis_base,
            KC_SERVICES_HOST=host,
        )
        self.log_path = run_dir / "services.out"

    @property
    def bootstrap(self) -> str:
        """``host:port,...`` of the 3 brokers."""
        return ",".join(f"{self.host}:{self.kafka_port(i)}" for i in range(1, KAFKA_NODES + 1))

    @property
    def redis_nodes(self) -> list[tuple[str, int]]:
        """``(host, port)`` of the 6 Redis Cluster nodes (startup nodes for a cluster client)."""
        return [(self.host, self.redis_port(i)) for i in range(1, REDIS_NODES + 1)]

    @property
    def redis_url(self) -> str:
        """The Redis Cluster's URL (``redis+cluster://``, every node a startup node)."""
        return "redis+cluster://" + ",".join(f"{h}:{p}" for h, p in self.redis_nodes)

    @property
    def ports(self) -> list[int]:
        """Every port the cluster's nodes will listen on (brokers, controllers, Redis nodes, buses)."""
        return _kafka_ports(self.kafka_base) + _redis_ports(self.redis_base)

    def kafka_port(self, node: int) -> int:
        return self.kafka_base + 2 * (node - 1)

    def redis_port(self, node: int) -> int:
        return self.redis_base + node - 1

    def kafka_node_of_port(self, port: int) -> int:
        return (port - self.kafka_base) // 2 + 1

    def redis_node_of_port(self, port: int) -> int:
        return port - self.redis_base + 1

    def redis_pid(self, node: int) -> int:
        """The pid of Redis node ``node`` (1..6), from its pid file."""
        return int(
            (self.run_dir / "cluster" / f"redis-{node}" / "redis" / "redis.pid").read_text().split()[0]
        )

    def _run(self, *args: str, timeout_s: float = 300.0) -> None:
        run_services(self.env, self.log_path, *args, timeout_s=timeout_s)

    def up(self) -> None:
        for port in self.ports:
            if not port_free(port):
                raise RuntimeError(f"port {port} is in use: the tests run their own cluster only")
        self._run("cluster-up")

    def kafka_kill(self, node: int) -> None:
        """SIGKILL broker ``node`` (1..3)."""
        self._run("cluster-kafka-kill", str(node))

    def kafka_start(self, node: int) -> None:
        self._run("cluster-kafka-start", str(node))

    def redis_kill(self, node: int) -> None:
        """SIGKILL Redis node ``node`` (1..6)."""
        self._run("cluster-redis-kill", str(node))

    def redis_start(self, node: int) -> None:
        self._run("cluster-redis-start", str(node))

    def down(self) -> None:
        try:
            self._run("cluster-down", timeout_s=180)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
            self.kill_all()

    def kill_all(self) -> None:
        """SIGKILL every node (when their data does not matter any more)."""
        for i in range(1, KAFKA_NODES + 1):
            self._run("cluster-kafka-kill", str(i))
        for i in range(1, REDIS_NODES + 1):
            self._run("cluster-redis-kill", str(i))
