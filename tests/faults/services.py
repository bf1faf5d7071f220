"""The harness's own Kafka and Redis: ``scripts/services`` with a private run dir and private ports.

The shared services (9092, 6379, ``<repo>/.run``) are never touched: every command runs with
``KC_RUN_DIR`` set to the harness's own directory and its own ports, and ``scripts/services`` only
stops processes whose pid file is in that directory. The ports must be free before the start (a
service that already answers there would be *reused* by ``scripts/services``, and then neither
ours to kill nor to trust).
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import time
from collections.abc import Collection
from pathlib import Path

from .common import REPO

SERVICES = REPO / "scripts" / "services"


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.3)
        if s.connect_ex(("127.0.0.1", port)) == 0:
            return False
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (``net.ipv4.ip_local_port_range``; 32768 if
    unreadable). Any outgoing connection may take a port at or above it as its local end, so a
    service listening there can find its port taken when it is restarted after a kill (seen in CI:
    the harness's broker, restarted, could not bind its port)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def stable_port(port: int) -> bool:
    """``port`` is free now and below the ephemeral range, so no outgoing connection takes it later."""
    return port < ephemeral_start() and port_free(port)


def pick_ports(preferred: tuple[int, int, int], avoid: Collection[int] = ()) -> tuple[int, int, int]:
    """Kafka, Kafka controller and Redis ports: the preferred ones if all are :func:`stable_port`,
    else free ones below the ephemeral range. None is in ``avoid``: the ports of services of the
    same run chosen before and not started yet (free now, but taken once they start; seen in CI:
    the cluster harness's own Redis got a port of its Kafka cluster)."""

    def usable(port: int) -> bool:
        return port not in avoid and stable_port(port)

    if all(usable(p) for p in preferred):
        return preferred
    rng = random.Random()
    top = ephemeral_start() - 100
    for _ in range(200):
        base = rng.randrange(20000, top - 50)
        cand = (base, base + 1, base + 50)
        if all(usable(p) for p in cand):
            return cand
    raise RuntimeError("no free ports below the ephemeral range for the harness's Kafka and Redis")


def stable_free_port() -> int:
    """One free port below the ephemeral range, for a test's own server that may be killed and
    restarted (a port from ``bind(0)`` is in that range: see :func:`ephemeral_start`)."""
    rng = random.Random()
    for _ in range(500):
        port = rng.randrange(20000, ephemeral_start() - 100)
        if stable_port(port):
            return port
    raise RuntimeError("no free port below the ephemeral range")


def services_env(run_dir: Path, **settings: object) -> dict[str, str]:
    """The environment of ``scripts/services`` for services of their own in ``run_dir``: the
    ``settings`` (ports), the shared Kafka jars read-only when they are resolved (no Maven run), and
    the project's venv python for the readiness checks."""
    env = dict(os.environ)
    # no SASL listener: the harness does not use one, and each listener is one more port to lose
    env.update({"KC_RUN_DIR": str(run_dir), "KC_KAFKA_STOP_TIMEOUT": "20", "KAFKA_SASL_PORT": "off"})
    env.update({k: str(v) for k, v in settings.items()})
    shared_libs = REPO / ".run" / "cache" / "kafka-libs"
    if "KC_LIBS_DIR" not in env and "KC_CACHE_DIR" not in env and (shared_libs / ".complete").exists():
        env["KC_LIBS_DIR"] = str(shared_libs)
    py = REPO / ".venv" / "bin" / "python"
    if "KC_PYTHON" not in env and py.exists():
        env["KC_PYTHON"] = str(py)
    return env


def run_services(env: dict[str, str], log_path: Path, *args: str, timeout_s: float) -> None:
    """Run ``scripts/services args`` with ``env``, its output appended to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        out.write(f"\n== scripts/services {' '.join(args)}\n".encode())
        out.flush()
        subprocess.run([str(SERVICES), *args], env=env, stdout=out, stderr=out, check=True, timeout=timeout_s)


class Services:
    """Start, kill and restart the harness's broker and Redis.

    Parameters
    ----------
    run_dir:
        ``KC_RUN_DIR`` of these services (their data, logs and pid files).
    ports:
        ``(kafka, kafka controller, redis)``.
    durable_redis:
        ``False`` runs Redis with ``--appendonly no`` (the third negative control): started here,
        with the pid file ``scripts/services`` knows, so ``redis-kill`` still works.
    """

    def __init__(self, run_dir: Path, ports: tuple[int, int, int], durable_redis: bool = True) -> None:
        self.run_dir = run_dir
        self.kafka_port, self.controller_port, self.redis_port = ports
        self.durable_redis = durable_redis
        self.env = services_env(
            run_dir,
            KAFKA_PORT=self.kafka_port,
            KAFKA_CONTROLLER_PORT=self.controller_port,
            REDIS_PORT=self.redis_port,
        )
        self.log_path = run_dir / "services.out"

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.kafka_port}"

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def _run(self, *args: str, timeout_s: float = 180.0) -> None:
        run_services(self.env, self.log_path, *args, timeout_s=timeout_s)

    def up(self) -> None:
        for port in (self.kafka_port, self.controller_port, self.redis_port):
            if not port_free(port):
                raise RuntimeError(f"port {port} is in use: the harness runs its own services only")
        self.redis_start()
        self.kafka_start()
        for name in ("kafka/kafka.pid", "redis/redis.pid"):
            if not (self.run_dir / name).exists():
                raise RuntimeError(f"{name} missing: the services were not started by the harness")

    def kafka_kill(self) -> None:
        self._run("kafka-kill")

    def kafka_start(self) -> None:
        self._run("kafka-start")

    def redis_kill(self) -> None:
        self._run("redis-kill")

    def redis_start(self) -> None:
        if self.durable_redis:
            self._run("redis-start")
            return
        rdir = self.run_dir / "redis"
        rdir.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                "redis-server",
                "--daemonize",
                "yes",
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.redis_port),
                "--dir",
                str(rdir),
                "--pidfile",
                str(rdir / "redis.pid"),
                "--logfile",
                str(rdir / "redis.log"),
                "--appendonly",
                "no",
                "--save",
                "",
            ],
            check=True,
            timeout=30,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            r = subprocess.run(
                ["redis-cli", "-p", str(self.redis_port), "ping"], capture_output=True, text=True
            )
            if r.stdout.strip() == "PONG":
                return
            time.sleep(0.1)
        raise RuntimeError("non-durable Redis did not answer PING")

    def down(self) -> None:
        try:
            self._run("down", timeout_s=120)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
            self._run("kafka-kill")
            self._run("redis-kill")
