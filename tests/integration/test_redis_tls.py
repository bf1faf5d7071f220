"""The Redis sequencer over TLS with a password (``rediss://:PW@host:port/0?ssl_ca_certs=...``).

A private Debian ``redis-server`` serves TLS only (``--port 0 --tls-port N``), with a password and
durable AOF; its CA and server certificate are made here with the ``openssl`` command line. A short
consumer on the real broker takes leases over it, and the password shows in no repr and no log.

redis-py reads TLS options from the URL's query string: names it has no parser for (``ssl_ca_certs``,
``ssl_cert_reqs``, ``ssl_certfile``...) are passed to ``SSLConnection`` as the decoded strings
(``parse_qs``: a path must be percent-encoded, and a ``+`` in it would become a space).
``ssl_cert_reqs`` defaults to ``required`` and ``ssl_check_hostname`` to true, so the certificate
must name the host of the URL (here ``IP:127.0.0.1`` in its subjectAltName).
"""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import threading
import uuid
from pathlib import Path
from urllib.parse import quote

import pytest
import redis

from keyedconsumer import KeyedConsumer, Message, RedisSequencer
from keyedconsumer.sequencing import inspect_redis, keys

from .kafkautil import committed, end_offsets, produce, wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.redis]


def _openssl(*args: str, cwd: Path) -> None:
    out = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, f"openssl {' '.join(args)}: {out.stderr}"


def _make_certs(d: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 signed by it: ``(ca.crt, server.crt, server.key)``."""
    assert shutil.which("openssl"), "the openssl command line is needed to make the test certificates"
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(
        "req",
        "-x509",
        *ec,
        *"-keyout ca.key -out ca.crt -days 2".split(),
        "-subj",
        "/CN=test CA",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
        cwd=d,
    )
    _openssl("req", "-new", *ec, *"-keyout server.key -out server.csr -subj /CN=127.0.0.1".split(), cwd=d)
    (d / "server.ext").write_text(
        "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n"
        "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n"
    )
    sign = "x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out server.crt -days 2"
    _openssl(*sign.split(), "-extfile", "server.ext", cwd=d)
    return d / "ca.crt", d / "server.crt", d / "server.key"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers(r: redis.Redis) -> bool:
    try:
        return bool(r.ping()) and r.info("persistence").get("loading") == 0
    except redis.RedisError:
        return False


class _TlsRedis:
    """A private TLS-only redis-server with a password and durable AOF (``--port 0 --tls-port N``)."""

    def __init__(self, tmp: Path, password: str) -> None:
        self.ca, self.cert, self.key = _make_certs(tmp)
        self.dir, self.port, self.password = tmp / "redis", _free_port(), password
        self.dir.mkdir()
        self.proc: subprocess.Popen[bytes] | None = None
        ca_query = quote(str(self.ca), safe="/")  # parse_qs decodes it; a raw "+" would become a space
        self.url = f"rediss://:{password}@127.0.0.1:{self.port}/0?ssl_ca_certs={ca_query}"

    def start(self) -> None:
        exe = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.proc = subprocess.Popen(
            [
                exe,
                "--port",
                "0",
                "--tls-port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--tls-cert-file",
                str(self.cert),
                "--tls-key-file",
                str(self.key),
                "--tls-ca-cert-file",
                str(self.ca),
                "--tls-auth-clients",
                "no",
                "--requirepass",
                self.password,
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--save",
                "",
                "--dir",
                str(self.dir),
                "--logfile",
                str(self.dir / "log"),
            ],
        )
        r = redis.Redis.from_url(self.url, socket_timeout=2, socket_connect_timeout=2)
        up = wait_until(lambda: _answers(r) or self.proc.poll() is not None, 20)  # type: ignore[union-attr]
        r.close()
        log = (self.dir / "log").read_text() if (self.dir / "log").exists() else ""
        assert up and self.proc.poll() is None, f"TLS redis-server did not start: {log[-2000:]}"

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.mark.timeout(60)
def test_sequencer_over_rediss_with_a_password(  # type: ignore[no-untyped-def]
    kafka_bootstrap, new_topic, start, tmp_path: Path, caplog
) -> None:
    # given a TLS-only redis-server with a password and durable AOF, and its CA file
    caplog.set_level(logging.DEBUG)
    pw = f"tls-secret-{uuid.uuid4().hex}"
    rs = _TlsRedis(tmp_path, pw)
    url, port = rs.url, rs.port
    try:
        rs.start()
        # the server really checks TLS and the password: no CA, or no password, is refused
        with pytest.raises(redis.ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
            redis.Redis.from_url(f"rediss://:{pw}@127.0.0.1:{port}/0", socket_timeout=2).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(url.replace(f":{pw}@", ""), socket_timeout=2).ping()

        # when a consumer with the Redis sequencer on this URL handles 150 messages of 30 keys,
        topic = new_topic(2)
        batch1: list[tuple[bytes | None, bytes | None, int | None]] = [
            (f"k{i % 30}".encode(), f"k{i % 30}:{i}".encode(), None) for i in range(150)
        ]
        produce(kafka_bootstrap, topic, batch1)
        got: dict[bytes, list[tuple[int, int]]] = {}
        lock = threading.Lock()

        def handle(msg: Message) -> None:
            assert msg.key is not None and msg.value is not None
            with lock:
                got.setdefault(msg.key, []).append((int(msg.value.split(b":")[1]), msg.fencing_token or 0))

        def handled() -> int:
            with lock:
                return sum(map(len, got.values()))

        ns = f"tls-{uuid.uuid4().hex[:8]}"
        group = f"g-{ns}"
        seq = RedisSequencer(url, ns, lease_ttl_s=2.0, socket_timeout_s=0.5)
        consumer = KeyedConsumer(
            name=group,
            handler=handle,
            brokers=[kafka_bootstrap],
            topics=[topic],
            concurrency=8,
            sequencer=seq,
        )
        r = start(consumer)
        assert wait_until(lambda: handled() >= 150, 30), (handled(), r.error)
        state_running = inspect_redis(url, ns)
        # loses its TLS Redis for a moment (redis-py's errors reach the log), and handles 150 more
        rs.kill()

        def redis_warnings() -> list[str]:
            return [
                x.getMessage()
                for x in caplog.records
                if x.name == "keyedconsumer.redis" and x.levelno >= logging.WARNING
            ]

        assert wait_until(lambda: any("Error" in w for w in redis_warnings()), 10), caplog.text[-2000:]
        rs.start()
        batch2 = [(f"k{i % 30}".encode(), f"k{i % 30}:{i}".encode(), None) for i in range(150, 300)]
        produce(kafka_bootstrap, topic, batch2)  # type: ignore[arg-type]
        ends = end_offsets(kafka_bootstrap, topic, 2)
        done = lambda: handled() >= 300 and committed(kafka_bootstrap, group, topic, 2) == ends  # noqa: E731
        assert wait_until(done, 30), (handled(), r.error)
        assert r.stop(30) and r.error is None

        # then every message ran once, in order per key, each under a lease with a fencing token > 0
        assert handled() == 300 and {n for runs in got.values() for n, _ in runs} == set(range(300))
        for k, runs in got.items():
            assert [n for n, _ in runs] == sorted(n for n, _ in runs), k
            assert all(tok > 0 for _, tok in runs), (k, runs)
        assert seq.acquire_calls > 0
        assert state_running["scheduler"] is not None and state_running["instances"]
        state = inspect_redis(url, ns)
        assert state["leases"] == [] and state["parked"] == [] and state["scheduled"] == 0
        r_tls = redis.Redis.from_url(url, socket_timeout=2)  # the fencing counters are in this TLS Redis
        fence_now = {
            k: int(r_tls.hget(keys.slot_fence(ns, keys.lease_id(k, topic, 0)), "n") or 0) for k in got
        }
        assert all(fence_now[k] >= max(t for _, t in runs) for k, runs in got.items()), fence_now
        r_tls.close()

        # and the password is in no repr and no log record (DEBUG included; Redis errors included)
        shown = [repr(seq), str(seq), repr(seq.config), str(seq.config), repr(consumer)]
        assert all(pw not in s for s in shown), [s for s in shown if pw in s]
        assert "***" in repr(seq) and f"127.0.0.1:{port}" in repr(seq)
        leaked = [x.getMessage() for x in caplog.records if pw in x.getMessage() or pw in str(x.args)]
        assert leaked == [] and pw not in caplog.text
    finally:
        rs.kill()
