"""Private Redis servers, Redis Clusters and a TCP proxy for the Redis fault tests.

Everything runs on ports of its own below the ephemeral range (never the shared 6379 or the shared
cluster's), in a temporary directory, and is stopped by the test that started it.

- :class:`RedisNode`: one ``redis-server`` (AOF, ``appendfsync always``), optionally a cluster node;
  SIGKILL, SIGSTOP / SIGCONT.
- :class:`RedisClusterNodes`: ``masters`` masters with ``replicas`` replicas each, created with
  ``redis-cli --cluster create``.
- :class:`TcpProxy`: one address in front of a Redis (as a DNS name or a proxy is in front of a
  failover): its target can be switched, new connections held (not accepted) for a while, and the
  reply to a chosen command dropped with its connection after Redis ran the command.
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from tests.faults.services import stable_free_port

from .kafkautil import wait_until

__all__ = ["RedisNode", "RedisClusterNodes", "TcpProxy", "free_ports"]


def free_ports(n: int, bus: bool = False) -> list[int]:
    """``n`` free ports below the ephemeral range (with ``bus``, each port + 10000 free too: a
    cluster node's bus port)."""
    out: list[int] = []
    while len(out) < n:
        port = stable_free_port()
        if port in out or (bus and (port + 10000 in out or not _free_below_ephemeral(port + 10000))):
            continue
        out.append(port)
    return out


def _free_below_ephemeral(port: int) -> bool:
    from tests.faults.services import stable_port

    return stable_port(port)


class RedisNode:
    """A private ``redis-server`` on ``127.0.0.1:port`` with a durable AOF (``cluster``: a cluster
    node with ``cluster-node-timeout`` 2 s)."""

    def __init__(self, port: int, workdir: Path, cluster: bool = False) -> None:
        self.port = port
        self.dir = workdir / f"redis-{port}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cluster = cluster
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        exe = shutil.which("redis-server") or "/usr/bin/redis-server"
        args = [
            exe,
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dir",
            str(self.dir),
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--save",
            "",
            "--logfile",
            str(self.dir / "redis.log"),
        ]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
            args += ["--cluster-node-timeout", "2000"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert wait_until(self.answers, 20, 0.05), f"redis-server on {self.port} did not start"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def answers(self) -> bool:
        """It answers, its AOF loaded."""
        try:
            c = self.client(0.5)
            try:
                return bool(c.ping()) and c.info("persistence").get("loading") == 0
            finally:
                c.close()
        except redis.RedisError:
            return False

    def client(self, timeout_s: float = 5.0) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=timeout_s)

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL, and wait for the process to be gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        self.kill()


class RedisClusterNodes:
    """A Redis Cluster of private nodes: ``masters`` masters, each with ``replicas`` replicas."""

    def __init__(self, masters: int = 3, replicas: int = 2) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kc-rc-"))
        self.replicas = replicas
        self.nodes = [
            RedisNode(p, self.dir, cluster=True) for p in free_ports(masters * (1 + replicas), bus=True)
        ]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def up(self) -> None:
        for n in self.nodes:
            n.start()
        exe = shutil.which("redis-cli") or "/usr/bin/redis-cli"
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run(
            [exe, "--cluster", "create", *addrs, "--cluster-replicas", str(self.replicas), "--cluster-yes"],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=60,
        )
        assert wait_until(self.settled, 60, 0.2), "the private Redis Cluster did not settle"

    def node(self, port: int) -> RedisNode:
        return next(n for n in self.nodes if n.port == port)

    def settled(self) -> bool:
        """Every node sees ``cluster_state:ok`` and every master its replicas connected."""
        try:
            for n in self.nodes:
                if n.proc is None or n.proc.poll() is not None:
                    continue
                c = n.client(1.0)
                try:
                    if c.cluster("info").get("cluster_state") != "ok":
                        return False
                    role = c.execute_command("ROLE")
                    if role[0] == b"master" and len(role[2]) < self.replicas:
                        return False
                finally:
                    c.close()
            return True
        except redis.RedisError:
            return False

    def down(self) -> None:
        for n in self.nodes:
            n.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class TcpProxy:
    """A TCP proxy on ``127.0.0.1:port`` in front of ``target`` (a port on 127.0.0.1).

    - :meth:`switch` makes new connections go to another target (existing ones stay where they are:
      as a DNS change or a proxy's reload leaves open connections alone).
    - :meth:`hold` stops accepting new connections until :meth:`release` (the new address not up yet).
    - :meth:`drop_reply_after` drops, ``times`` times, the connection that sent a chunk containing
      ``marker`` once Redis answers it: the command ran, its reply is lost.
    - :meth:`freeze` holds the traffic of every connection, both ways, until :meth:`thaw` (nothing
      dropped or closed: to its clients, a Redis that stopped answering; a cut-off connection).
    """

    def __init__(self, target: int) -> None:
        self.target = target
        self._listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listen.bind(("127.0.0.1", 0))
        self._listen.listen(64)
        self.port = int(self._listen.getsockname()[1])
        self._held = threading.Event()
        self._flowing = threading.Event()
        self._flowing.set()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._drops: list[list[Any]] = []  # [marker, times left]
        self.dropped: list[bytes] = []  # the chunks whose replies were dropped
        self._threads = [threading.Thread(target=self._accept, daemon=True, name="tcp-proxy")]
        self._threads[0].start()

    def switch(self, target: int) -> None:
        self.target = target

    def hold(self) -> None:
        self._held.set()

    def release(self) -> None:
        self._held.clear()

    def freeze(self) -> None:
        self._flowing.clear()

    def thaw(self) -> None:
        self._flowing.set()

    def drop_reply_after(self, marker: bytes, times: int = 1) -> None:
        with self._lock:
            self._drops.append([marker, times])

    def pending_drops(self) -> int:
        with self._lock:
            return sum(t for _m, t in self._drops)

    def close(self) -> None:
        self._stop.set()
        self._flowing.set()
        self._listen.close()

    def _take_drop(self, chunk: bytes) -> bool:
        with self._lock:
            for d in self._drops:
                if d[1] > 0 and d[0] in chunk:
                    d[1] -= 1
                    self.dropped.append(chunk)
                    return True
        return False

    def _accept(self) -> None:
        self._listen.settimeout(0.1)
        while not self._stop.is_set():
            if self._held.is_set():
                time.sleep(0.02)
                continue
            try:
                client, _ = self._listen.accept()
            except (TimeoutError, OSError):
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target), timeout=2)
            except OSError:
                client.close()
                continue
            threading.Thread(target=self._pipe, args=(client, upstream), daemon=True).start()

    def _pipe(self, client: socket.socket, upstream: socket.socket) -> None:
        sel = selectors.DefaultSelector()
        client.setblocking(False)
        upstream.setblocking(False)
        sel.register(client, selectors.EVENT_READ, upstream)
        sel.register(upstream, selectors.EVENT_READ, client)
        drop_next_reply = False
        try:
            while not self._stop.is_set():
                for key, _ in sel.select(0.2):
                    src: socket.socket = key.fileobj  # type: ignore[assignment]
                    dst: socket.socket = key.data
                    try:
                        data = src.recv(1 << 16)
                    except BlockingIOError:
                        continue
                    if not data:
                        return
                    if src is client:
                        drop_next_reply = drop_next_reply or self._take_drop(data)
                    elif drop_next_reply:  # Redis ran the command: lose its reply, and the connection
                        return
                    self._flowing.wait()  # frozen: held, both ways, until thawed
                    dst.setblocking(True)
                    dst.sendall(data)
                    dst.setblocking(False)
        except OSError:
            return
        finally:
            sel.close()
            client.close()
            upstream.close()


def redis_time_ms(r: Any) -> float:
    sec, usec = r.time()
    return int(sec) * 1000 + int(usec) / 1000


def until(cond: Callable[[], Any], timeout_s: float, step_s: float = 0.05) -> Any:
    """``cond()``'s first truthy value within ``timeout_s`` (``None`` if none)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(step_s)
    return None
