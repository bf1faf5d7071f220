"""Service fixtures: the real Kafka broker and Redis server.

``KAFKA_BOOTSTRAP_SERVERS`` / ``REDIS_URL`` name running services (``scripts/services up`` starts
both on loopback). Without them, testcontainers starts containers when a Docker engine answers.
Without either, a test that needs a service FAILS under ``CI=true`` and is skipped otherwise, with a
message naming the service script.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator

import pytest

HINT = "start the services with `scripts/services up` and export KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:9092 REDIS_URL=redis://127.0.0.1:6379/0"


def _unavailable(what: str, hint: str = HINT) -> None:
    msg = f"{what} is not available: {hint}"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(msg, pytrace=False)
    pytest.skip(msg)


def _docker_answers() -> bool:
    try:
        import docker  # type: ignore[import-untyped]

        docker.from_env(timeout=3).ping()
        return True
    except Exception:
        return False


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    """``host:port`` of a real Kafka broker."""
    env = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if env:
        yield env
        return
    if _docker_answers():
        from testcontainers.kafka import KafkaContainer  # type: ignore[import-untyped]

        with KafkaContainer("apache/kafka:4.1.1").with_kraft() as kc:
            yield kc.get_bootstrap_server()
        return
    _unavailable("Kafka")


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of a real Redis server."""
    env = os.environ.get("REDIS_URL")
    if env:
        yield env
        return
    if _docker_answers():
        from testcontainers.redis import RedisContainer  # type: ignore[import-untyped]

        with RedisContainer("redis:7") as rc:
            yield f"redis://{rc.get_container_host_ip()}:{rc.get_exposed_port(6379)}/0"
        return
    _unavailable("Redis")


@pytest.fixture
def new_topic(kafka_bootstrap: str) -> Callable[..., str]:
    """``new_topic(partitions=1) -> name``: create a fresh topic on the broker."""
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})

    def make(partitions: int = 1, prefix: str = "t") -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        fut = admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)])[name]
        fut.result(timeout=30)
        return name

    return make


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Under CI=true a skipped test is a failure: a CI run must never skip a real-service test."""
    if os.environ.get("CI", "").lower() not in ("1", "true", "yes"):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = len(reporter.stats.get("skipped", [])) if reporter is not None else 0
    if skipped and session.exitstatus == 0:
        session.exitstatus = 1
        if reporter is not None:
            reporter.write_line(
                f"CI: {skipped} test(s) were skipped; under CI=true that is a failure", red=True
            )
