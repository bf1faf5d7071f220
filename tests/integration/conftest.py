"""Fixtures shared by the integration tests."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from keyedconsumer import KeyedConsumer

from ..conftest import _unavailable


class Running:
    """``consumer.run()`` in a thread; keeps the error it raised and when it returned."""

    def __init__(self, consumer: KeyedConsumer) -> None:
        self.consumer = consumer
        self.error: BaseException | None = None
        self.ended_at: float | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.consumer.run()
        except BaseException as exc:
            self.error = exc
        finally:
            self.ended_at = time.monotonic()

    def join(self, timeout_s: float) -> bool:
        self.thread.join(timeout_s)
        return not self.thread.is_alive()

    def stop(self, timeout_s: float = 30.0) -> bool:
        """Stop the consumer; True when ``run()`` returned within ``timeout_s`` seconds."""
        self.consumer.stop()
        return self.join(timeout_s)


@pytest.fixture
def start() -> Iterator[Callable[[KeyedConsumer], Running]]:
    """``start(consumer) -> Running``; every consumer still running at teardown is stopped."""
    started: list[Running] = []

    def go(consumer: KeyedConsumer) -> Running:
        r = Running(consumer)
        started.append(r)
        return r

    yield go
    for r in started:
        r.consumer.stop()
    for r in started:
        r.thread.join(30)


@pytest.fixture(scope="session")
def sasl_bootstrap() -> str:
    """``host:port`` of the broker's SASL_PLAINTEXT listener (``KAFKA_SASL_BOOTSTRAP_SERVERS``)."""
    env = os.environ.get("KAFKA_SASL_BOOTSTRAP_SERVERS")
    if not env:
        _unavailable("Kafka's SASL_PLAINTEXT listener (KAFKA_SASL_BOOTSTRAP_SERVERS=127.0.0.1:9094)")
    return env  # type: ignore[return-value]
