"""The real :class:`~keyedconsumer.kafka.TransactionalProducer`, on ``confluent_kafka.Producer``.

librdkafka's transactional API (``INTRODUCTION.md``, "Transactional Producer"): ``init_transactions``
once (it fences an older producer with the same ``transactional.id`` and aborts what it left
open), then per transaction ``begin_transaction``, ``produce``, ``send_offsets_to_transaction`` with
the consumer's ``consumer_group_metadata()`` (KIP-447: the group coordinator checks the member's
generation, so a consumer that lost its partitions in a rebalance cannot commit their offsets) and
``commit_transaction``. Its errors come in three kinds: *retriable* (the same call may be made
again), *abortable* (``txn_requires_abort()``: abort, then a new transaction may run) and *fatal*
(the producer is unusable, e.g. ``_FENCED``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from confluent_kafka import KafkaError, KafkaException, Producer, TopicPartition

from ..errors import TransactionError
from ..message import Record
from . import logs
from .oauth import TokenCallbackError, with_token_source

if TYPE_CHECKING:
    from . import TP, TransactionalProducer

__all__ = ["KafkaTransactionalProducer"]

log = logging.getLogger("keyedconsumer")


#: Errors that mean a newer producer with the same ``transactional.id`` started (this one is a zombie).
_FENCED = {"_FENCED", "PRODUCER_FENCED", "INVALID_PRODUCER_EPOCH"}


def _error(err: KafkaError, what: str) -> TransactionError:
    hint = (
        (
            " (another producer with this transactional_id started: this one is fenced off and can "
            "commit nothing more)"
        )
        if err.name() in _FENCED
        else ""
    )
    return TransactionError(
        f"{what}: {err.name()}: {err.str()}{hint}",
        code=err.name(),
        fatal=err.fatal(),
        abortable=bool(err.txn_requires_abort()),
    )


class KafkaTransactionalProducer:
    """One transactional producer of one consumer (see the module docstring).

    Parameters
    ----------
    conf:
        librdkafka producer properties: ``bootstrap.servers`` and the connection (security)
        properties; ``transactional.id``, ``enable.idempotence``, ``acks`` and
        ``transaction.timeout.ms`` are set here.
    transactional_id:
        librdkafka ``transactional.id``.
    group_metadata:
        ``group_metadata()``: the consumer's ``consumer_group_metadata()``, asked at each commit
        (it changes with each rebalance's generation).
    timeout_s:
        Bound in seconds of ``init_transactions``.
    transaction_timeout_s:
        librdkafka ``transaction.timeout.ms`` in seconds: a transaction left open longer (its
        producer crashed) is aborted by the broker.

    Raises
    ------
    TransactionError
        The producer could not be created or ``init_transactions`` failed (the brokers may not
        support transactions: they need the ``transaction.state.log.*`` topic).
    """

    def __init__(
        self,
        conf: Mapping[str, Any],
        transactional_id: str,
        group_metadata: Callable[[], Any],
        timeout_s: float,
        transaction_timeout_s: float,
    ) -> None:
        settings = dict(conf)
        settings.setdefault("logger", logs.librdkafka_log)  # librdkafka's lines into Python logging
        settings.update(
            {
                "transactional.id": transactional_id,
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": 5,
                "transaction.timeout.ms": max(1000, int(transaction_timeout_s * 1000)),
            }
        )
        self._group_metadata = group_metadata
        self._open = False
        try:
            self._producer = Producer(with_token_source(settings))
        except TokenCallbackError as exc:
            raise TransactionError(f"cannot create the transactional producer: {exc}", code=exc.code) from exc
        except KafkaException as exc:
            raise _error(exc.args[0], "cannot create the transactional producer") from None
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._producer.init_transactions(max(0.1, deadline - time.monotonic()))
                return
            except KafkaException as exc:
                err = exc.args[0]
                if err.retriable() and time.monotonic() < deadline:
                    continue
                raise _error(err, f"cannot start transactions as {transactional_id!r}") from None

    def run(
        self,
        records: Sequence[Record],
        offsets: Sequence[tuple[str, int, int]],
        metadata: Mapping[TP, str],
        timeout_s: float,
    ) -> None:
        """One transaction: ``records`` and ``offsets`` (see :class:`~keyedconsumer.kafka.TransactionalProducer`).

        Raises
        ------
        TransactionError
            ``abortable``: aborted, another may run. ``fatal``: the producer is unusable. Neither: a
            record was refused by the producer (e.g. larger than ``message.max.bytes``); the
            transaction was aborted.
        """
        p = self._producer
        deadline = time.monotonic() + timeout_s
        try:
            p.begin_transaction()
        except KafkaException as exc:
            raise _error(exc.args[0], "cannot begin a transaction") from None
        self._open = True
        failed: list[KafkaError] = []

        def on_delivery(err: KafkaError | None, _msg: Any) -> None:
            if err is not None:
                failed.append(err)

        try:
            for topic, key, value, headers in records:
                while True:
                    try:
                        wire: Any = headers
                        p.produce(topic, value=value, key=key, headers=wire, on_delivery=on_delivery)
                        break
                    except BufferError:  # the local queue is full: serve delivery reports, then again
                        if time.monotonic() >= deadline:
                            raise TransactionError(
                                "the producer's queue stayed full", code="_QUEUE_FULL", abortable=True
                            ) from None
                        p.poll(0.05)
            if offsets:
                tps = [
                    TopicPartition(t, n, o, metadata=metadata.get((t, n), ""))
                    if metadata.get((t, n))
                    else TopicPartition(t, n, o)
                    for t, n, o in offsets
                ]
                self._retry(
                    lambda left: p.send_offsets_to_transaction(tps, self._group_metadata(), left),
                    deadline,
                    "cannot send the offsets to the transaction",
                )
            self._retry(lambda left: p.commit_transaction(left), deadline, "cannot commit the transaction")
            self._open = False
        except KafkaException as exc:  # produce() refused a record (not a BufferError)
            err = exc.args[0]
            self._abort_after(err.fatal())
            refused = failed[0] if failed else err
            raise _error(refused, "a produced record was refused; the transaction was aborted") from None
        except TransactionError as exc:
            self._abort_after(exc.fatal)
            if failed and exc.abortable:  # say which record failed rather than "requires abort"
                cause = failed[0]
                raise TransactionError(
                    f"the transaction was aborted: a record was not delivered: {cause.name()}: {cause.str()}",
                    code=cause.name(),
                    abortable=True,
                ) from None
            raise

    @staticmethod
    def _retry(call: Callable[[float], None], deadline: float, what: str) -> None:
        """``call(timeout_s)`` again while librdkafka says the error is retriable, until ``deadline``."""
        while True:
            try:
                call(max(0.1, deadline - time.monotonic()))
                return
            except KafkaException as exc:
                err = exc.args[0]
                if err.retriable() and not err.txn_requires_abort() and time.monotonic() < deadline:
                    continue
                raise _error(err, what) from None

    def _abort_after(self, fatal: bool) -> None:
        """Abort the open transaction (not after a fatal error: the producer can do nothing more)."""
        if not self._open or fatal:
            self._open = False
            return
        self._open = False
        try:
            self._producer.abort_transaction(10.0)
        except KafkaException as exc:
            log.warning("abort_transaction failed: %s", exc.args[0].str())

    def close(self) -> None:
        """Abort an open transaction (best effort) and release the producer. No flush: an aborted
        transaction's records were purged (confluent-kafka-python #865: a flush after a fatal
        error can raise ``SystemError``)."""
        self._abort_after(False)


if TYPE_CHECKING:  # mypy checks that the real producer satisfies the seam

    def _is_a_transactional_producer(producer: KafkaTransactionalProducer) -> TransactionalProducer:
        return producer
