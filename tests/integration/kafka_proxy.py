"""A TCP proxy in front of a test's own broker that stalls the clients' traffic at an exact point.

The broker advertises the proxy's port (``advertised.listeners``), so every client connection goes
through it; the broker's own connections (client ids ``broker-*``) and the test's probes
(:data:`PROBE_CLIENT_ID`) are passed through untouched.
:meth:`KafkaProxy.freeze_at` arms a trigger on a request type (its Kafka API key, e.g. ``EndTxn``
= 26, the request of ``commit_transaction``): when a client sends one, all client traffic stops in
both directions (held, not dropped) until :meth:`KafkaProxy.release`, as if the broker stalled at
that very request, while the broker's clock and its own work (a transaction timing out) run on.
``forward=True`` lets the triggering request reach the broker first (its answer is held: the
broker did the work, the client does not know); ``forward=False`` holds the request itself.
"""

from __future__ import annotations

import socket
import struct
import threading
from contextlib import suppress

#: Kafka API keys (``org.apache.kafka.common.protocol.ApiKeys``).
END_TXN = 26
#: A client id the proxy never freezes (a test's probe of the broker), besides the broker's own.
PROBE_CLIENT_ID = "probe-of-the-test"


class KafkaProxy:
    """Listens on ``127.0.0.1:port`` (0: any free port) and forwards to ``127.0.0.1:upstream_port``."""

    def __init__(self, port: int, upstream_port: int) -> None:
        self._upstream = upstream_port
        self._server = socket.create_server(("127.0.0.1", port))
        self.port = self._server.getsockname()[1]
        self._cond = threading.Condition()
        self._frozen = False
        self._armed: tuple[int, bool] | None = None
        self._closed = False
        #: Set when an armed trigger fired (the clients' traffic is frozen from then on).
        self.triggered = threading.Event()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, name="kafka-proxy", daemon=True).start()

    def freeze_at(self, api_key: int, forward: bool) -> None:
        """Freeze all client traffic when a client next sends a request with ``api_key``."""
        with self._cond:
            self.triggered.clear()
            self._armed = (api_key, forward)

    def release(self) -> None:
        """Let the held traffic go, and all traffic from now on."""
        with self._cond:
            self._frozen = False
            self._armed = None
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._frozen = False
            self._cond.notify_all()
        for s in [self._server, *self._sockets]:
            with suppress(OSError):
                s.close()

    # -- the pumps ---------------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self._upstream), timeout=10)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            self._sockets += [client, upstream]
            threading.Thread(target=self._requests, args=(client, upstream), daemon=True).start()

    def _wait(self, exempt: bool) -> None:
        """Block while the client traffic is frozen (never for the broker's own connections)."""
        if exempt:
            return
        with self._cond:
            while self._frozen and not self._closed:
                self._cond.wait()

    def _requests(self, client: socket.socket, upstream: socket.socket) -> None:
        """Client to broker, one request (size-prefixed frame) at a time."""
        exempt: list[bool] = []
        try:
            while True:
                head = _read(client, 4)
                if head is None:
                    break
                body = _read(client, struct.unpack(">i", head)[0])
                if body is None:
                    break
                if not exempt:  # the first request names the client
                    exempt.append(_client_id(body).startswith(("broker-", PROBE_CLIENT_ID)))
                    threading.Thread(
                        target=self._responses, args=(upstream, client, exempt[0]), daemon=True
                    ).start()
                self._wait(exempt[0])
                with self._cond:
                    armed = self._armed
                    fires = (
                        not exempt[0] and armed is not None and struct.unpack(">h", body[:2])[0] == armed[0]
                    )
                    if fires:  # frozen before the answer can come back
                        self._armed, self._frozen = None, True
                        self.triggered.set()
                if fires and armed is not None and armed[1]:
                    upstream.sendall(head + body)  # this one request reaches the broker
                    continue
                self._wait(exempt[0])
                upstream.sendall(head + body)
        except OSError:
            pass
        finally:
            _shut(client, upstream)

    def _responses(self, upstream: socket.socket, client: socket.socket, exempt: bool) -> None:
        """Broker to client, as it comes."""
        try:
            while True:
                data = upstream.recv(65536)
                if not data:
                    break
                self._wait(exempt)
                client.sendall(data)
        except OSError:
            pass
        finally:
            _shut(client, upstream)


def _shut(*sockets: socket.socket) -> None:
    """End both directions of a proxied connection (the other pump then sees its end)."""
    for sock in sockets:
        with suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def _read(sock: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def _client_id(body: bytes) -> str:
    """The client id of a request (header v1+: api key, version, correlation id, client id)."""
    (length,) = struct.unpack(">h", body[8:10])
    return body[10 : 10 + length].decode(errors="replace") if length > 0 else ""
