"""How the replay tool's transactional publisher names a failed commit.

Seen in CI (Kafka 4.1.1, librdkafka 2.16): a replay's commit raced the fencing by a newer replay of
the same dead-letter topic, and the transaction coordinator answered its EndTxn with
UNKNOWN_SERVER_ERROR (abortable, not fatal). The publisher reported "aborted: UNKNOWN", and the
fence, which the abort that followed met, was only logged, so the user never learned that another
replay had taken over. The race is rare against a real broker, so these tests drive the
publisher's error handling with a stand-in for librdkafka's producer (the real fencing path is in
``tests/integration/test_transactional_publisher.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from keyedconsumer.errors import KafkaClientError, PublishError
from keyedconsumer.kafka import admin


class _Producer:
    def __init__(self, commit: KafkaError, abort: KafkaError | None) -> None:
        self.commit, self.abort, self.aborts = commit, abort, 0

    def commit_transaction(self, timeout: float) -> None:
        raise KafkaException(self.commit)

    def abort_transaction(self, timeout: float) -> None:
        self.aborts += 1
        if self.abort is not None:
            raise KafkaException(self.abort)


def _publisher(producer: Any) -> admin.TransactionalPublisher:
    publisher = object.__new__(admin.TransactionalPublisher)
    publisher.timeout_s = 1.0
    publisher._producer = producer
    publisher._results = []
    publisher._open = True
    return publisher


_UNKNOWN = KafkaError(
    KafkaError.UNKNOWN, "EndTxn commit failed: Unknown broker error", txn_requires_abort=True
)


def test_a_commit_that_fails_otherwise_and_an_abort_that_meets_the_fence_report_the_fence() -> None:
    fenced = KafkaError(KafkaError._FENCED, "Producer fenced by newer instance", fatal=True)
    producer = _Producer(_UNKNOWN, fenced)
    with pytest.raises(KafkaClientError) as raised:
        _publisher(producer).commit({}, reader=None)  # type: ignore[arg-type]
    assert raised.value.fatal and raised.value.code == "_FENCED", raised.value
    assert "UNKNOWN" in str(raised.value)  # the commit's own error is kept in the message
    assert producer.aborts == 1


def test_a_commit_that_fails_and_is_aborted_cleanly_is_a_publish_error() -> None:
    producer = _Producer(_UNKNOWN, None)
    with pytest.raises(PublishError, match="nothing of it was published: UNKNOWN"):
        _publisher(producer).commit({}, reader=None)  # type: ignore[arg-type]
    assert producer.aborts == 1


def test_an_abort_that_fails_without_a_fence_still_reports_the_commit_error() -> None:
    timed_out = KafkaError(KafkaError._TIMED_OUT, "abort timed out", retriable=True)
    producer = _Producer(_UNKNOWN, timed_out)
    with pytest.raises(PublishError, match="UNKNOWN"):
        _publisher(producer).commit({}, reader=None)  # type: ignore[arg-type]
