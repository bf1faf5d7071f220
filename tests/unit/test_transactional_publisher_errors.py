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


@pytest.mark.parametrize(
    "abort",
    [
        KafkaError(KafkaError._FENCED, "Producer fenced by newer instance", fatal=True),
        KafkaError(KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED, "not authorised", fatal=True),
    ],
    ids=["fenced", "another-fatal-error"],
)
def test_a_commit_that_fails_otherwise_and_an_abort_that_meets_a_fatal_error_report_that_error(
    abort: KafkaError,
) -> None:
    producer = _Producer(_UNKNOWN, abort)
    with pytest.raises(KafkaClientError) as raised:
        _publisher(producer).commit({}, reader=None)  # type: ignore[arg-type]
    assert raised.value.fatal and raised.value.code == abort.name(), raised.value
    assert "UNKNOWN" in str(raised.value)  # the commit's own error is kept in the message
    assert producer.aborts == 1


def test_a_commit_that_fails_and_is_aborted_cleanly_is_a_publish_error() -> None:
    producer = _Producer(_UNKNOWN, None)
    with pytest.raises(PublishError, match="nothing of it was published: UNKNOWN"):
        _publisher(producer).commit({}, reader=None)  # type: ignore[arg-type]
    assert producer.aborts == 1


def test_an_abort_that_is_not_confirmed_does_not_claim_nothing_was_published() -> None:
    timed_out = KafkaError(KafkaError._TIMED_OUT, "abort timed out", retriable=True)
    producer = _Producer(_UNKNOWN, timed_out)
    with pytest.raises(KafkaClientError) as raised:
        _publisher(producer).commit({}, reader=None)  # type: ignore[arg-type]
    assert not isinstance(raised.value, PublishError) and not raised.value.fatal
    assert "not known" in str(raised.value) and "UNKNOWN" in str(raised.value)
    assert producer.aborts == 1


def test_a_commit_unanswered_in_time_is_not_aborted_and_its_outcome_is_not_known() -> None:
    # librdkafka goes on with such a commit (the broker may commit it) and refuses an abort meanwhile
    timed_out = KafkaError(KafkaError._TIMED_OUT, "commit timed out", retriable=True)
    conflict = KafkaError(KafkaError._CONFLICT, "commit_transaction already in progress")
    producer = _Producer(timed_out, conflict)
    publisher = _publisher(producer)
    publisher.timeout_s = 0.2
    with pytest.raises(KafkaClientError) as raised:
        publisher.commit({}, reader=None)  # type: ignore[arg-type]
    assert not isinstance(raised.value, PublishError) and not raised.value.fatal
    assert "not known" in str(raised.value) and raised.value.code == "_TIMED_OUT"
    assert producer.aborts == 0


def test_a_fatal_commit_error_is_raised_without_an_abort() -> None:
    fenced = KafkaError(KafkaError._FENCED, "Producer fenced by newer instance", fatal=True)
    producer = _Producer(fenced, None)
    with pytest.raises(KafkaClientError) as raised:
        _publisher(producer).commit({}, reader=None)  # type: ignore[arg-type]
    assert raised.value.fatal and raised.value.code == "_FENCED"
    assert producer.aborts == 0
