"""Idle clients keep valid OAUTHBEARER tokens (issue 25, item 18), on a broker of this module's own
that closes idle connections after 5 s (``connections.max.idle.ms``): an idle client's next request
opens a new connection, which authenticates with the client's current token, and a token that
expired is refused (``invalid_token``).

librdkafka calls ``oauth_cb`` when a token reaches 80% of its lifetime; confluent-kafka before 2.13
served that call only from the client's ``poll()`` / ``flush()``, so a producer that had nothing to
write (a dead-letter producer, an audit producer) never refreshed its token; from 2.13 on, librdkafka's
background thread serves it (confluent-kafka-python #2130). Tokens live 12 s here (librdkafka
refreshes at 80%: 2.4 s before expiry, room for a retry of the callback); the clients idle for 30 s,
then write, and no client ever presents an expired token. (Not KIP-368's
``connections.max.reauth.ms``: with it, librdkafka's re-authentication on each token refresh is
refused by the broker, "Request not valid in current SASL state", for busy clients too.)

The broker: one KRaft node (the shared Kafka's jars, ``scripts/install-deps --print-libs``) with a
PLAINTEXT listener (the test's own admin and reads) and a SASL_PLAINTEXT listener with OAUTHBEARER
checked by Kafka's unsecured-JWT validator, on free ports below the ephemeral range; stopped after.
"""

from __future__ import annotations

import base64
import logging
import secrets
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka.admin import AdminClient, NewTopic
from keyedconsumer.middleware import Audit, DeadLetter

from keyedconsumer import KeyedConsumer, Message
from keyedconsumer.kafka import admin

from ..faults.services import port_free, stable_free_port
from .kafkautil import produce, read_all, wait_until
from .test_oauth import oauth_config, unsecured_jwt

pytestmark = pytest.mark.kafka

ROOT = Path(__file__).resolve().parents[2]
#: Seconds a token lives; milliseconds after which the broker closes an idle connection.
TOKEN_LIFETIME_S = 12.0
IDLE_CLOSE_MS = 5000  # not the consumer's heartbeat interval (3 s): its coordinator connection stays


class ReauthBroker:
    def __init__(self) -> None:
        ports: list[int] = []
        while len(ports) < 3:
            p = stable_free_port()
            if p not in ports:
                ports.append(p)
        self.plain_port, self.controller_port, self.sasl_port = ports
        self.dir = Path(tempfile.mkdtemp(prefix="kc-oauth-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def plaintext(self) -> str:
        return f"127.0.0.1:{self.plain_port}"

    @property
    def sasl(self) -> str:
        return f"127.0.0.1:{self.sasl_port}"

    def start(self) -> None:
        libs = subprocess.run(
            [str(ROOT / "scripts" / "install-deps"), "--print-libs"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        props = self.dir / "server.properties"
        validator = "org.apache.kafka.common.security.oauthbearer.internals.unsecured.OAuthBearerUnsecuredValidatorCallbackHandler"
        login = "org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule"
        props.write_text(
            f"""process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:{self.controller_port}
listeners=PLAINTEXT://127.0.0.1:{self.plain_port},CONTROLLER://127.0.0.1:{self.controller_port},SASL_PLAINTEXT://127.0.0.1:{self.sasl_port}
advertised.listeners=PLAINTEXT://127.0.0.1:{self.plain_port},SASL_PLAINTEXT://127.0.0.1:{self.sasl_port}
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT
log.dirs={self.dir / "data"}
sasl.enabled.mechanisms=OAUTHBEARER
listener.name.sasl_plaintext.sasl.enabled.mechanisms=OAUTHBEARER
listener.name.sasl_plaintext.oauthbearer.sasl.jaas.config={login} required unsecuredLoginStringClaim_sub="broker";
listener.name.sasl_plaintext.oauthbearer.sasl.server.callback.handler.class={validator}
connections.max.idle.ms={IDLE_CLOSE_MS}
num.network.threads=2
num.io.threads=2
num.partitions=1
offsets.topic.replication.factor=1
offsets.topic.num.partitions=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
group.initial.rebalance.delay.ms=0
auto.create.topics.enable=true
"""
        )
        log4j = self.dir / "log4j2.properties"
        log4j.write_text(
            "status = warn\nappender.f.type = File\nappender.f.name = F\n"
            f"appender.f.fileName = {self.dir / 'server.log'}\nappender.f.layout.type = PatternLayout\n"
            "appender.f.layout.pattern = [%d] %p %m (%c)%n\nrootLogger.level = INFO\nrootLogger.appenderRef.f.ref = F\n"
        )
        java = ["java", f"-Dlog4j2.configurationFile={log4j}", "-cp", f"{libs}/*"]
        cluster = base64.urlsafe_b64encode(secrets.token_bytes(16)).decode().rstrip("=")
        subprocess.run(
            [*java, "kafka.tools.StorageTool", "format", "-t", cluster, "-c", str(props)],
            check=True,
            capture_output=True,
            timeout=120,
        )
        out = open(self.dir / "kafka.out", "wb")
        self.proc = subprocess.Popen(
            [*java[:1], "-Xms128m", "-Xmx384m", *java[1:], "kafka.Kafka", str(props)],
            stdout=out,
            stderr=out,
            stdin=subprocess.DEVNULL,
        )
        probe = AdminClient({"bootstrap.servers": self.plaintext, "log_level": 0})

        def answers() -> bool:
            assert self.proc is not None and self.proc.poll() is None, (self.dir / "kafka.out").read_text()[
                -2000:
            ]
            try:
                probe.list_topics(timeout=2)
            except Exception:
                return False
            return not port_free(self.sasl_port)

        assert wait_until(answers, 120, 0.5), "the broker did not start"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        subprocess.run(["rm", "-rf", str(self.dir)], check=False)


@pytest.fixture(scope="module")
def reauth_broker() -> Iterator[ReauthBroker]:
    broker = ReauthBroker()
    try:
        broker.start()
        yield broker
    finally:
        broker.stop()


class Captured(logging.Handler):
    """librdkafka's log lines (``config["logger"]``), kept."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class Poison(Exception):
    pass


@pytest.mark.timeout(180)
def test_idle_dead_letter_and_audit_producers_and_admin_clients_keep_valid_tokens(
    reauth_broker: ReauthBroker,
) -> None:
    # given a token source whose tokens live 12 s, and whose identity provider fails every other
    # call of each thread that asks (each client's refreshes come from a thread of its own; each
    # fetch is retried)
    calls: list[float] = []
    per_thread: dict[int, int] = {}
    lock = threading.Lock()

    def oauth_cb(_config: str) -> tuple[str, float]:
        with lock:
            calls.append(time.monotonic())
            n = per_thread[threading.get_ident()] = per_thread.get(threading.get_ident(), 0) + 1
        if n % 2 == 0:
            raise ConnectionError("identity provider: connection reset")
        return unsecured_jwt(TOKEN_LIFETIME_S)

    librdkafka_log = logging.getLogger(f"test.oauth.{uuid.uuid4().hex[:6]}")
    captured = Captured()
    librdkafka_log.addHandler(captured)
    errors: list[Any] = []
    config = {**oauth_config(oauth_cb), "logger": librdkafka_log}
    topic = f"oauth-{uuid.uuid4().hex[:8]}"
    creator = AdminClient({"bootstrap.servers": reauth_broker.plaintext})
    creator.create_topics([NewTopic(topic, 1, 1)])[topic].result(60)
    seen: list[bytes] = []

    def handle(msg: Message) -> None:
        seen.append(msg.value or b"")
        if msg.value == b"poison":
            raise Poison("bad record")

    # and a consumer on the SASL listener with a dead-letter producer and an audit producer
    dead_letter = DeadLetter(topic="{topic}.dlq", timeout_s=20.0)
    audit = Audit(topic=f"{topic}.audit", brokers=[reauth_broker.sasl], producer_config=config)
    consumer = KeyedConsumer(
        name=f"g-{uuid.uuid4().hex[:8]}",
        handler=handle,
        brokers=[reauth_broker.sasl],
        topics=[topic],
        middlewares=[audit, dead_letter],
        config={**config, "error_cb": errors.append},
        startup_timeout_s=30,
    )
    thread = threading.Thread(target=consumer.run, daemon=True)
    thread.start()
    try:
        # when it handles a first record, then idles for more than three token lifetimes
        produce(reauth_broker.plaintext, topic, [(b"k", b"ok", 0)])
        assert wait_until(lambda: seen == [b"ok"] and audit.written >= 1, 60), (seen, audit.written, errors)
        idle_from = time.monotonic()
        admin_conf = {"bootstrap.servers": reauth_broker.sasl, **config}
        while time.monotonic() - idle_from < 30:
            # the admin helpers of inspect and web make short-lived clients meanwhile
            assert topic in admin.all_topics(admin_conf, 10.0)
            time.sleep(4)
        # and then a record fails
        produce(reauth_broker.plaintext, topic, [(b"k", b"poison", 0)])
        # then the idle dead-letter and audit producers write it at once
        assert wait_until(lambda: dead_letter.published == 1 and audit.written >= 2, 15), (
            dead_letter.published,
            audit.written,
            errors,
            captured.lines[-10:],
        )
    finally:
        consumer.stop()
        thread.join(30)
        audit.close(10)
    assert [m.value() for m in read_all(reauth_broker.plaintext, f"{topic}.dlq", 1)] == [b"poison"]
    # and no client ever presented an expired token: no authentication failed
    bad = [
        line
        for line in captured.lines
        if "invalid_token" in line or "SASL authentication error" in line or "Authentication failure" in line
    ]
    assert bad == [] and not [e for e in errors if "AUTHENTICATION" in e.name()], (bad[:5], errors)
    # and tokens were refreshed while idle (every client, not only the polling consumer)
    idle_calls = [t for t in calls if idle_from <= t <= idle_from + 30]
    assert len(idle_calls) >= 3 * 2 * 2, len(idle_calls)  # >= 2 refreshes x 3 producers, x 2 calls
