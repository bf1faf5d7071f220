"""OAUTHBEARER token callbacks (``oauth_cb``) of every client the package builds (issue 25, item 18),
against the real broker's SASL_PLAINTEXT listener (OAUTHBEARER checked by Kafka's unsecured-JWT
validator, ``KAFKA_SASL_BOOTSTRAP_SERVERS``; see ``tests/integration/test_sasl.py``):

- a callback that returns nothing (or a malformed token) is a clear configuration error naming
  ``oauth_cb`` and what it returned, at once, for the consumer, its dead-letter producer and the
  admin clients of ``inspect`` and ``web``: not confluent-kafka's "OAuth token not set within 10
  seconds timeout" after 10 s;
- a callback that fails for a moment (an identity provider's hiccup) is retried, so the client
  starts;
- idle side clients keep valid tokens: ``tests/integration/test_oauth_refresh.py``, on a broker of
  its own that makes connections re-authenticate.
"""

from __future__ import annotations

import base64
import json
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from keyedconsumer.middleware import DeadLetter

from keyedconsumer import KafkaClientError, KeyedConsumer, Message, PublishError
from keyedconsumer.kafka import admin

from .kafkautil import produce, read_all, wait_until

pytestmark = pytest.mark.kafka


def _b64(data: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()


def unsecured_jwt(lifetime_s: float, sub: str = "kc-oauth") -> tuple[str, float]:
    """An unsecured JWT (alg none; sub, iat, exp) valid for ``lifetime_s`` seconds, and its expiry
    in seconds since the epoch: what the broker's development validator accepts."""
    now = time.time()
    exp = int(now + lifetime_s)  # the JWT's exp is whole seconds: the expiry told must not be later
    token = _b64({"alg": "none"}) + "." + _b64({"sub": sub, "iat": int(now), "exp": exp}) + "."
    return token, float(exp)


def oauth_config(oauth_cb: Callable[[str], Any]) -> dict[str, Any]:
    return {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "OAUTHBEARER", "oauth_cb": oauth_cb}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "returned, words",
    [
        (None, "returned NoneType"),
        (("", 0.0), "an empty token"),
        (("token",), "returned a tuple of 1"),
        (("token", "soon"), "expiry must be a number of seconds since the epoch"),
    ],
    ids=["none", "empty-token", "one-item", "text-expiry"],
)
def test_a_token_callback_that_returns_no_token_is_a_clear_configuration_error_at_once(
    sasl_bootstrap: str, new_topic: Callable[..., str], returned: Any, words: str
) -> None:
    # given an oauth_cb that returns no usable token
    def oauth_cb(_config: str) -> Any:
        return returned

    config = oauth_config(oauth_cb)
    topic = new_topic(1)
    # when a consumer with DeadLetter() is built (its producer takes the same callback), then it
    # fails at once, naming oauth_cb and what it returned
    t0 = time.monotonic()
    with pytest.raises(PublishError) as info:
        KeyedConsumer(
            name=f"g-{uuid.uuid4().hex[:8]}",
            handler=lambda m: None,
            brokers=[sasl_bootstrap],
            topics=[topic],
            middlewares=[DeadLetter()],
            config=config,
        )
    assert time.monotonic() - t0 < 5
    assert "oauth_cb" in str(info.value) and words in str(info.value), str(info.value)
    # and so does the consumer's own client when it runs, and the admin client of inspect and web
    consumer = KeyedConsumer(
        name=f"g-{uuid.uuid4().hex[:8]}",
        handler=lambda m: None,
        brokers=[sasl_bootstrap],
        topics=[topic],
        config=config,
    )
    t0 = time.monotonic()
    with pytest.raises(KafkaClientError) as run_info:
        consumer.run()
    assert "oauth_cb" in str(run_info.value) and words in str(run_info.value), str(run_info.value)
    with pytest.raises(KafkaClientError) as admin_info:
        admin.describe_group({"bootstrap.servers": sasl_bootstrap, **config}, "any-group", 5.0)
    assert "oauth_cb" in str(admin_info.value) and words in str(admin_info.value), str(admin_info.value)
    assert time.monotonic() - t0 < 10


class Poison(Exception):
    pass


@pytest.mark.timeout(120)
def test_a_token_callback_that_fails_for_a_moment_is_retried(
    kafka_bootstrap: str, sasl_bootstrap: str, new_topic: Callable[..., str], start: Any
) -> None:
    # given an oauth_cb whose identity provider fails the first two calls of every client
    calls: list[str] = []
    failures: dict[int, int] = {}
    lock = threading.Lock()

    def oauth_cb(config: str) -> tuple[str, float]:
        with lock:
            calls.append(config)
            n = len(calls)
        if n % 3 != 0:
            raise ConnectionError("identity provider: 503 Service Unavailable")
        return unsecured_jwt(3600)

    # when a consumer and its DeadLetter() are built and run on the SASL listener
    topic = new_topic(1)
    produce(kafka_bootstrap, topic, [(b"k", b"ok", 0), (b"k", b"poison", 0), (b"k", b"ok", 0)])
    seen: list[bytes] = []

    def handle(msg: Message) -> None:
        seen.append(msg.value or b"")
        if msg.value == b"poison":
            raise Poison()

    dead_letter = DeadLetter(topic="{topic}.dlq")
    consumer = KeyedConsumer(
        name=f"g-{uuid.uuid4().hex[:8]}",
        handler=handle,
        brokers=[sasl_bootstrap],
        topics=[topic],
        middlewares=[dead_letter],
        config={**oauth_config(oauth_cb), "sasl.oauthbearer.config": "scope=test"},
        startup_timeout_s=30,
    )
    running = start(consumer)
    # then each client got its token after the failures, and everything ran over SASL
    assert wait_until(lambda: len(seen) == 3 and dead_letter.published == 1, 60), (seen, failures)
    assert running.stop(30) and running.error is None, running.error
    assert [m.value() for m in read_all(kafka_bootstrap, f"{topic}.dlq", 1)] == [b"poison"]
    assert len(calls) >= 6 and set(calls) == {"scope=test"}, calls
