"""SASL on the real broker: SCRAM and OAUTHBEARER, with the connection settings written once.

The broker of ``scripts/services`` has a SASL_PLAINTEXT listener (``KAFKA_SASL_PORT``, default
9094) next to PLAINTEXT, with SCRAM-SHA-256, SCRAM-SHA-512 and OAUTHBEARER checked by Kafka's
unsecured-JWT validator. ``KAFKA_SASL_BOOTSTRAP_SERVERS`` names it (``scripts/test`` exports it).
The SCRAM users are made here through the PLAINTEXT listener
(``AdminClient.alter_user_scram_credentials``); topics are made and read there too. The consumers
and their ``DeadLetter()`` (no brokers given) talk only to the SASL listener.
"""

from __future__ import annotations

import base64
import json
import logging
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException
from confluent_kafka.admin import (
    AdminClient,
    ScramCredentialInfo,
    ScramMechanism,
    UserScramCredentialDeletion,
    UserScramCredentialUpsertion,
)
from keyedconsumer.middleware import DeadLetter, Metrics

from keyedconsumer import KafkaClientError, KeyedConsumer, Message

from .kafkautil import committed, end_offsets, produce, read_all, wait_until

pytestmark = pytest.mark.kafka


_MECHANISMS = {"SCRAM-SHA-256": ScramMechanism.SCRAM_SHA_256, "SCRAM-SHA-512": ScramMechanism.SCRAM_SHA_512}


@pytest.fixture
def scram_user(kafka_bootstrap: str, sasl_bootstrap: str) -> Iterator[Callable[[str], tuple[str, str]]]:
    """``scram_user(mechanism) -> (user, password)``: a new SCRAM user, usable on the SASL listener
    when returned; deleted at teardown."""
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    made: list[tuple[str, str]] = []

    def make(mechanism: str) -> tuple[str, str]:
        user, password = f"kc-{uuid.uuid4().hex[:8]}", secrets.token_urlsafe(16)
        upsert = UserScramCredentialUpsertion(
            user, ScramCredentialInfo(_MECHANISMS[mechanism], 4096), password.encode()
        )
        for fut in admin.alter_user_scram_credentials([upsert]).values():
            fut.result(timeout=30)
        made.append((user, mechanism))
        probe = Consumer(
            {
                "bootstrap.servers": sasl_bootstrap,
                "group.id": "probe",
                "log_level": 0,
                "security.protocol": "SASL_PLAINTEXT",
                "sasl.mechanism": mechanism,
                "sasl.username": user,
                "sasl.password": password,
            }
        )

        def authenticates() -> bool:
            try:
                probe.list_topics(timeout=2)
                return True
            except KafkaException:
                return False

        try:  # the credential reaches the broker through its metadata log: at once, or nearly
            assert wait_until(authenticates, 30, 0.2), f"the SCRAM user {user} cannot log in"
        finally:
            probe.close()
        return user, password

    yield make
    if made:
        dels = [UserScramCredentialDeletion(u, _MECHANISMS[m]) for u, m in made]
        for fut in admin.alter_user_scram_credentials(dels).values():
            fut.result(timeout=30)


def _dead_letters(bootstrap: str, topic: str, expect: int) -> list[tuple[bytes | None, str]]:
    out = []
    for m in read_all(bootstrap, topic, expect, timeout_s=30):
        headers = {k: (v or b"").decode() for k, v in (m.headers() or [])}
        out.append((m.value(), headers["kafka_dlt-original-offset"]))
    return sorted(out, key=lambda r: int(r[1]))


class Poison(Exception):
    pass


def _consume_and_dead_letter(
    kafka_bootstrap: str,
    sasl_bootstrap: str,
    new_topic: Callable[..., str],
    start: Any,
    config: dict[str, Any],
    *,
    until: Callable[[], bool] = lambda: True,
) -> tuple[str, str]:
    """Given 30 messages (two of them poison) on a 2-partition topic, a consumer on the SASL
    listener with ``config`` and ``DeadLetter()`` (no brokers): all are handled, the poison ones
    dead-lettered over the same SASL connection settings, the offsets committed. The consumer is
    stopped once ``until()`` holds too. Returns ``(topic, group)``."""
    topic = new_topic(2)
    records = [(f"k{i % 5}".encode(), b"poison" if i in (7, 21) else b"ok", i % 2) for i in range(30)]
    produce(kafka_bootstrap, topic, records)
    group = f"g-{uuid.uuid4().hex[:8]}"
    seen: list[bytes] = []
    lock = threading.Lock()

    def handle(msg: Message) -> None:
        with lock:
            seen.append(msg.value or b"")
        if msg.value == b"poison":
            raise Poison("bad record")

    dead_letter = DeadLetter(topic="{topic}.dlq", timeout_s=20.0)  # no brokers: the consumer's
    consumer = KeyedConsumer(
        name=group,
        handler=handle,
        brokers=[sasl_bootstrap],
        topics=[topic],
        middlewares=[dead_letter],
        concurrency=4,
        config=config,
        startup_timeout_s=30,
    )
    running = start(consumer)
    assert wait_until(lambda: dead_letter.published == 2 and len(seen) >= 30, 60), (
        len(seen),
        dead_letter.published,
    )
    assert wait_until(until, 30)
    assert running.stop(30) and running.error is None, running.error
    # then every message ran, the two poison ones are on the dead-letter topic...
    assert sorted(seen) == sorted(v for _, v, _ in records)
    dlq = _dead_letters(kafka_bootstrap, f"{topic}.dlq", 2)
    assert [v for v, _ in dlq] == [b"poison", b"poison"]
    # ...and the group committed every offset (read over PLAINTEXT)
    assert committed(kafka_bootstrap, group, topic, 2) == end_offsets(kafka_bootstrap, topic, 2)
    return topic, group


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_scram_consumer_commits_and_its_dead_letter_publishes_over_the_same_sasl_settings(
    kafka_bootstrap: str,
    sasl_bootstrap: str,
    new_topic: Callable[..., str],
    start: Any,
    scram_user: Callable[[str], tuple[str, str]],
    mechanism: str,
) -> None:
    # given a SCRAM user, and a consumer that names its credentials once, with its librdkafka
    # statistics fed to the metrics
    user, password = scram_user(mechanism)
    metrics = Metrics()
    config = {
        "security.protocol": "SASL_PLAINTEXT",
        "sasl.mechanism": mechanism,
        "sasl.username": user,
        "sasl.password": password,
        "stats_cb": metrics.stats_cb,
        "statistics.interval.ms": 1000,
    }

    def fetched() -> list[float]:
        return [
            s.value
            for m in metrics.registry.collect()
            if m.name == "keyedconsumer_librdkafka_rx_messages"
            for s in m.samples
            if s.name.endswith("_total")
        ]

    # when it consumes (DeadLetter() with no brokers), then all is handled, dead-lettered, committed;
    # and librdkafka's figures reach the metrics (a report a second): every message fetched counted
    _consume_and_dead_letter(
        kafka_bootstrap,
        sasl_bootstrap,
        new_topic,
        start,
        config,
        until=lambda: max(fetched(), default=0) >= 30,
    )


def _b64(data: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()


@pytest.mark.timeout(120)
def test_oauthbearer_consumer_gets_its_token_from_oauth_cb(
    kafka_bootstrap: str,
    sasl_bootstrap: str,
    new_topic: Callable[..., str],
    start: Any,
) -> None:
    # given an oauth_cb that makes an unsecured JWT (alg none; sub, iat, exp), as the broker's
    # development validator accepts, and records each call
    calls: list[tuple[str, str]] = []
    lock = threading.Lock()

    def oauth_cb(oauthbearer_config: str) -> tuple[str, float]:
        now = time.time()
        with lock:
            calls.append((threading.current_thread().name, oauthbearer_config))
        token = (
            _b64({"alg": "none"})
            + "."
            + _b64({"sub": "kc-oauth", "iat": int(now), "exp": int(now) + 3600})
            + "."
        )
        return token, now + 3600

    config = {
        "security.protocol": "SASL_PLAINTEXT",
        "sasl.mechanism": "OAUTHBEARER",
        "sasl.oauthbearer.config": "scope=test",
        "oauth_cb": oauth_cb,
    }
    # when a consumer with it consumes, its DeadLetter() publishing with the same oauth_cb
    _consume_and_dead_letter(kafka_bootstrap, sasl_bootstrap, new_topic, start, config)
    # then the callback was called, with the configured sasl.oauthbearer.config, for the consumer
    # and for the dead-letter producer (confluent-kafka calls it once for each client it builds)
    assert len(calls) >= 2, calls
    assert {c for _, c in calls} == {"scope=test"}


@pytest.mark.timeout(60)
def test_a_wrong_scram_password_fails_clearly_within_the_startup_timeout(
    sasl_bootstrap: str,
    new_topic: Callable[..., str],
    scram_user: Callable[[str], tuple[str, str]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # given a real SCRAM user and a consumer with the wrong password, its own error_cb and an
    # error_handler
    user, _ = scram_user("SCRAM-SHA-256")
    topic = new_topic(1)
    user_errors: list[KafkaError] = []
    handled: list[BaseException] = []
    consumer = KeyedConsumer(
        name=f"g-{uuid.uuid4().hex[:8]}",
        handler=lambda m: None,
        brokers=[sasl_bootstrap],
        topics=[topic],
        startup_timeout_s=15,
        error_handler=lambda err, msg: handled.append(err),
        config={
            "security.protocol": "SASL_PLAINTEXT",
            "sasl.mechanism": "SCRAM-SHA-256",
            "sasl.username": user,
            "sasl.password": "not-the-password",
            "error_cb": user_errors.append,
            "logger": logging.getLogger("test.librdkafka"),
        },
    )
    # when it runs
    t0 = time.monotonic()
    with pytest.raises(KafkaClientError) as info:
        consumer.run()
    took_s = time.monotonic() - t0
    # then it fails, not hangs, within startup_timeout_s, saying authentication failed
    assert took_s < 15, took_s
    err = info.value
    assert err.code == "_AUTHENTICATION" and err.fatal, (err.code, str(err))
    assert "authentication" in str(err).lower() and "invalid credentials" in str(err), str(err)
    assert "not-the-password" not in str(err)
    # and both error callbacks ran: the engine's (error_handler) and the user's error_cb
    assert any(isinstance(e, KafkaClientError) and e.code == "_AUTHENTICATION" for e in handled), handled
    assert any(e.code() == KafkaError._AUTHENTICATION for e in user_errors), user_errors


@pytest.mark.timeout(60)
def test_an_expired_oauthbearer_token_is_refused_clearly(
    sasl_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    # given an oauth_cb whose token expired an hour ago (the broker's validator checks exp)
    def oauth_cb(oauthbearer_config: str) -> tuple[str, float]:
        now = time.time()
        token = (
            _b64({"alg": "none"})
            + "."
            + _b64({"sub": "kc-oauth", "iat": int(now) - 7200, "exp": int(now) - 3600})
            + "."
        )
        return token, now + 3600

    consumer = KeyedConsumer(
        name=f"g-{uuid.uuid4().hex[:8]}",
        handler=lambda m: None,
        brokers=[sasl_bootstrap],
        topics=[new_topic(1)],
        startup_timeout_s=15,
        error_handler=lambda err, msg: None,
        config={"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "OAUTHBEARER", "oauth_cb": oauth_cb},
    )
    # when it runs, then the broker refuses it, and run() says so within startup_timeout_s
    t0 = time.monotonic()
    with pytest.raises(KafkaClientError) as info:
        consumer.run()
    assert time.monotonic() - t0 < 15
    assert info.value.code == "_AUTHENTICATION" and "invalid_token" in str(info.value), str(info.value)


@pytest.mark.timeout(150)
def test_the_cli_dead_letters_over_the_consumers_sasl_settings(
    kafka_bootstrap: str,
    sasl_bootstrap: str,
    new_topic: Callable[..., str],
    scram_user: Callable[[str], tuple[str, str]],
    tmp_path: Path,
) -> None:
    from .test_cli import read_log, start_run, stop

    # given a SCRAM user whose settings reach `keyedconsumer run` once (KEYEDCONSUMER_CONFIG), and
    # a topic of 8 good and 2 poison records
    user, password = scram_user("SCRAM-SHA-256")
    topic, dlq = new_topic(1), new_topic(1)
    produce(
        kafka_bootstrap,
        topic,
        [(b"k", b"poison-1" if i == 3 else b"poison-2" if i == 6 else b"good", 0) for i in range(10)],
    )
    config = {
        "security.protocol": "SASL_PLAINTEXT",
        "sasl.mechanism": "SCRAM-SHA-256",
        "sasl.username": user,
        "sasl.password": password,
    }
    log = tmp_path / "handled.log"
    group = f"cli-sasl-{uuid.uuid4().hex[:8]}"
    # when the CLI runs with a dead-letter topic and only the SASL listener as brokers
    proc = start_run(
        [
            "tests.integration.procs.cli_handlers:poison",
            "--topic",
            topic,
            "--group",
            group,
            "--brokers",
            sasl_bootstrap,
            "--dead-letter-topic",
            dlq,
            "--retry-attempts",
            "1",
        ],
        log,
        {"KEYEDCONSUMER_CONFIG": json.dumps(config)},
    )
    try:
        assert wait_until(
            lambda: sum(end_offsets(kafka_bootstrap, dlq, 1).values()) >= 2 or proc.poll() is not None, 60
        )
        assert wait_until(lambda: sum(1 for r in read_log(log) if r[0] == "ok") >= 8, 30)
    finally:
        code, output = stop(proc)
    # then its dead-letter producer wrote both poison records over the same SASL settings
    assert code == 0, output[-3000:]
    assert password not in output
    assert sorted(m.value() for m in read_all(kafka_bootstrap, dlq, 2)) == [b"poison-1", b"poison-2"]
    assert committed(kafka_bootstrap, group, topic, 1) == end_offsets(kafka_bootstrap, topic, 1)
