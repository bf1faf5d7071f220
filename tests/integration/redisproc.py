"""A test's own redis-server (AOF, fsync always), which the test may SIGKILL and restart, or stall
with SIGSTOP/SIGCONT (a Redis that stops answering without closing its connections); and
:class:`FreezingProxy`, a TCP proxy that holds one client's traffic to Redis (its connection cut
off while the others' are not)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
from contextlib import suppress
from pathlib import Path

import redis

from keyedconsumer.sequencing.store import connect
from tests.faults.services import stable_free_port

from .kafkautil import wait_until


class PrivateRedis:
    """A private redis-server on a port below the ephemeral range (a port from ``bind(0)`` can be
    taken by an outgoing connection before the server restarts on it)."""

    def __init__(self, tmp: Path) -> None:
        self.port, self.dir = stable_free_port(), tmp / "redis"
        self.dir.mkdir()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        exe = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.proc = subprocess.Popen(
            [
                exe,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.dir),
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--save",
                "",
                "--logfile",
                str(self.dir / "log"),
            ],
        )
        r = connect(self.url, 5.0)
        assert wait_until(lambda: self._ping(r), 20)

    @staticmethod
    def _ping(r: redis.Redis) -> bool:
        try:
            return bool(r.ping()) and r.info("persistence").get("loading") == 0
        except redis.RedisError:
            return False

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        assert self.proc is not None
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)


class FreezingProxy:
    """Listens on ``127.0.0.1:<free port>`` and forwards to ``127.0.0.1:upstream_port``;
    :meth:`freeze` holds all traffic in both directions (nothing is dropped or closed: the client
    sees a server that stopped answering) until :meth:`release`."""

    def __init__(self, upstream_port: int) -> None:
        self._upstream = upstream_port
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._open = threading.Event()
        self._open.set()
        self._closed = False
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, name="redis-proxy", daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def freeze(self) -> None:
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def close(self) -> None:
        self._closed = True
        self._open.set()
        for s in [self._server, *self._sockets]:
            with suppress(OSError):
                s.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self._upstream))
            self._sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            if not data:
                for s in (src, dst):
                    with suppress(OSError):
                        s.shutdown(socket.SHUT_RDWR)
                return
            self._open.wait()  # frozen: held until released
            try:
                dst.sendall(data)
            except OSError:
                return
