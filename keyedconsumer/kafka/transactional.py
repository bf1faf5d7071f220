"""The real :class:`~keyedconsumer.kafka.TransactionalProducer`, on ``confluent_kafka.Producer``.

librdkafka's transactional API (``INTRODUCTION.md``, "Transactional Producer"; ``rdkafka.h``):
``init_transactions`` once (it fences an older producer with the same ``transactional.id``, and
completes or aborts what that one left), then per transaction ``begin_transaction``, ``produce``,
``send_offsets_to_transaction`` with the consumer's ``consumer_group_metadata()`` (KIP-447: the
group coordinator checks the member's generation, or its member epoch under KIP-848, so a consumer
that lost its partitions cannot commit their offsets) and ``commit_transaction``.

Each error is classified by librdkafka's own flags, in this order:

- **fatal** (``is_fatal``): the producer is unusable. ``_FENCED`` (``PRODUCER_FENCED``,
  ``INVALID_PRODUCER_EPOCH``) means that the coordinator bumped the producer epoch: a newer producer
  with this ``transactional.id`` started (this one is a zombie), **or** the coordinator aborted a
  transaction left open longer than ``transaction.timeout.ms`` (KIP-98; a broker stall or an outage
  can do that). A transaction younger than ``transaction.timeout.ms`` cannot have timed out, so a
  fence then is a zombie's and final; after it, the broker's timeout abort is assumed: the producer
  is created again (``init_transactions`` with the same id) and the transaction's outcome read back
  (below). Any other fatal error is final.
- **abortable** (``txn_requires_abort``): ``abort_transaction``; nothing of the transaction is
  visible; another may run (e.g. the group rebalanced: ``ILLEGAL_GENERATION``, also for a stale
  KIP-848 member epoch, ``FENCED_MEMBER_EPOCH``, ``UNKNOWN_MEMBER_ID``; a record not delivered; an idle producer whose
  id the broker forgot, ``INVALID_PRODUCER_ID_MAPPING``, which librdkafka recovers from by bumping
  the epoch in the abort).
- **retriable** (``is_retriable``): the same call again. ``commit_transaction``,
  ``abort_transaction`` and ``init_transactions`` are *resumable* ("on timeout the application may
  call the function again"): they are called in slices of :data:`~.bounded.SLICE_S`, so a stop that comes
  meanwhile is noticed. A commit still unanswered when its time is up is **in doubt**: it may have
  committed; it is never aborted (librdkafka refuses an abort once the commit began) nor redone, but
  resumed by :meth:`KafkaTransactionalProducer.resolve` until the broker answers.
  ``send_offsets_to_transaction`` is retried with identical arguments, as ``rdkafka.h`` asks; it
  waits for its request's answer past its own timeout (up to ``socket.timeout.ms``, which librdkafka
  sets just under ``transaction.timeout.ms``), so it runs in a helper thread that is waited for only
  until the deadline: a transaction it leaves behind is aborted once it returned.
- anything else is treated as fatal, as ``rdkafka.h`` recommends (a record refused for good).

The outcome of a commit in doubt is read back, when the producer had to be created again, from the
group's committed offsets (with ``require_stable``, after ``init_transactions`` completed the old
transaction): the transaction committed if and only if every offset and metadata it sent are the
group's now (the engine runs a transaction only when an offset or its metadata moved).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from confluent_kafka import KafkaError, KafkaException, Producer, TopicPartition

from ..errors import KafkaClientError, TransactionError
from ..message import Record
from . import logs
from .bounded import Deadline, Pending
from .oauth import TokenCallbackError, with_token_source

if TYPE_CHECKING:
    from . import TP, TransactionalProducer

__all__ = ["KafkaTransactionalProducer", "CLOSE_ABORT_S", "TRANSIENT"]

log = logging.getLogger("keyedconsumer")

#: Bound of the best-effort abort of an open transaction at :meth:`KafkaTransactionalProducer.close`
#: (seconds). A transaction left open is aborted by the broker at ``transaction.timeout.ms``, or at
#: once when a producer with the same ``transactional.id`` starts.
CLOSE_ABORT_S = 1.0

#: Errors that a newer epoch of this ``transactional.id`` causes (librdkafka normalises them to ``_FENCED``).
_FENCED = frozenset({"_FENCED", "PRODUCER_FENCED", "INVALID_PRODUCER_EPOCH"})

#: Failures that pass by themselves, as opposed to a refusal for good (a record too large, no such
#: topic, not authorised): the broker did not answer in time, a coordinator or leader moves, the
#: group rebalances (the member rejoins with a new generation or member epoch), or the broker forgot
#: an idle producer (``transactional.id.expiration.ms``, ``producer.id.expiration.ms``).
TRANSIENT = frozenset(
    {
        "_TIMED_OUT",
        "_MSG_TIMED_OUT",
        "_TIMED_OUT_QUEUE",
        "_TRANSPORT",
        "_ALL_BROKERS_DOWN",
        "_WAIT_COORD",
        "_QUEUE_FULL",
        "_CONFLICT",
        "REQUEST_TIMED_OUT",
        "NETWORK_EXCEPTION",
        "NOT_COORDINATOR",
        "COORDINATOR_NOT_AVAILABLE",
        "COORDINATOR_LOAD_IN_PROGRESS",
        "CONCURRENT_TRANSACTIONS",
        "NOT_LEADER_OR_FOLLOWER",
        "LEADER_NOT_AVAILABLE",
        "NOT_ENOUGH_REPLICAS",
        "NOT_ENOUGH_REPLICAS_AFTER_APPEND",
        "REBALANCE_IN_PROGRESS",
        "ILLEGAL_GENERATION",
        "UNKNOWN_MEMBER_ID",
        "STALE_MEMBER_EPOCH",
        "FENCED_MEMBER_EPOCH",
        "INVALID_PRODUCER_ID_MAPPING",
        "UNKNOWN_PRODUCER_ID",
    }
)

# the producer's transaction state (librdkafka's own is finer; these are the ones that decide)
_READY = "ready"  # no transaction: the next may begin
_OPEN = "open"  # begun, its commit not sent
_ABORTING = "aborting"  # failed before its commit: to be aborted before the next begins
_COMMITTING = "committing"  # commit sent, not answered: in doubt
_RESTART = "restart"  # fenced by the broker's timeout abort: the producer must be created again
_FAILED = "failed"  # fatal, or closed


def _fatal(err: KafkaError, what: str) -> TransactionError:
    """The producer is unusable (librdkafka ``is_fatal``), or a refusal ``rdkafka.h`` says to treat so."""
    hint = (
        (
            " (another producer with this transactional_id started: this one is fenced off and can "
            "commit nothing more)"
        )
        if err.name() in _FENCED
        else ""
    )
    return TransactionError(f"{what}: {err.name()}: {err.str()}{hint}", code=err.name(), fatal=err.fatal())


def _aborted(err: KafkaError, what: str, transient: bool | None = None) -> TransactionError:
    """Nothing of the transaction is visible and another may run (``transient``: the failure passes by
    itself, default: by its code, :data:`TRANSIENT`)."""
    return TransactionError(
        f"{what}: {err.name()}: {err.str()}",
        code=err.name(),
        abortable=True,
        retriable=err.name() in TRANSIENT if transient is None else transient,
    )


class KafkaTransactionalProducer:
    """One transactional producer of one consumer (see the module docstring).

    Used from one thread (the consumer's poll thread).

    Parameters
    ----------
    conf:
        librdkafka producer properties: ``bootstrap.servers`` and the connection (security)
        properties; ``transactional.id``, ``enable.idempotence``, ``acks`` and
        ``transaction.timeout.ms`` are set here.
    transactional_id:
        librdkafka ``transactional.id``.
    group_metadata:
        ``group_metadata()``: the consumer's ``consumer_group_metadata()``, asked at each transaction
        (it changes with each rebalance's generation or member epoch).
    committed:
        ``committed(partitions, timeout_s) -> {(topic, partition): (offset, metadata)}``: the group's
        committed offsets (the consumer's, ``require_stable``), to read back the outcome of a commit
        in doubt; raises :class:`~keyedconsumer.KafkaClientError` without an answer.
    timeout_s:
        Bound in seconds of ``init_transactions``.
    transaction_timeout_s:
        librdkafka ``transaction.timeout.ms`` in seconds: a transaction left open longer (its
        producer crashed or stalled) is aborted by the broker.

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
        committed: Callable[[Sequence[TP], float], dict[TP, tuple[int, str]]],
        timeout_s: float,
        transaction_timeout_s: float,
    ) -> None:
        self._settings = dict(conf)
        self._settings.setdefault("logger", logs.librdkafka_log)  # librdkafka's lines into Python logging
        self._settings.update(
            {
                "transactional.id": transactional_id,
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": 5,
                "transaction.timeout.ms": max(1000, int(transaction_timeout_s * 1000)),
            }
        )
        self._id = transactional_id
        self._group_metadata = group_metadata
        self._committed = committed
        self._transaction_timeout_s = max(1.0, transaction_timeout_s)
        self._state = _RESTART
        self._producer: Any = None
        self._init_pending = False  # a new producer whose init_transactions is not done yet
        self._pending: Pending | None = None  # send_offsets_to_transaction still waiting for its answer
        self._began = 0.0  # when the transaction began (monotonic seconds)
        self._undelivered: list[KafkaError] = []  # delivery failures of the transaction's records
        self._doubt: tuple[list[tuple[str, int, int]], dict[TP, str]] | None = (
            None  # offsets of a commit in doubt
        )
        self._restart(Deadline(timeout_s, None), f"cannot start transactions as {transactional_id!r}")

    # -- the protocol ------------------------------------------------------------------------------

    def run(
        self,
        records: Sequence[Record],
        offsets: Sequence[tuple[str, int, int]],
        metadata: Mapping[TP, str],
        timeout_s: float,
        budget: Callable[[float], float] | None = None,
    ) -> None:
        """One transaction: ``records`` and ``offsets`` (see :class:`~keyedconsumer.kafka.TransactionalProducer`),
        within ``timeout_s`` seconds, cut further by ``budget`` (the engine's stop deadline).

        Raises
        ------
        TransactionError
            ``abortable``: it was aborted (or its abort is still to finish: the next call does it
            first), another may run. ``in_doubt``: its commit was not answered in time:
            :meth:`resolve` must tell its outcome before another transaction can run. ``fatal``: the
            producer is unusable. None of these: a record was refused for good (e.g. larger than
            ``message.max.bytes``); the transaction was aborted.
        """
        if self._doubt is not None:
            raise TransactionError(
                "the last transaction's outcome is not known yet (resolve() first)",
                code="_IN_DOUBT",
                retriable=True,
                in_doubt=True,
            )
        deadline = Deadline(timeout_s, budget)
        self._ready(deadline)
        p = self._producer
        try:
            p.begin_transaction()
        except KafkaException as exc:
            raise self._failure(exc.args[0], "cannot begin a transaction", deadline) from None
        self._state, self._began, self._undelivered = _OPEN, time.monotonic(), []
        try:
            self._produce(records, deadline)
            if offsets:
                tps = [
                    TopicPartition(t, n, o, metadata=metadata.get((t, n), ""))
                    if metadata.get((t, n))
                    else TopicPartition(t, n, o)
                    for t, n, o in offsets
                ]
                self._send_offsets(tps, self._group_metadata(), deadline)
        except KafkaException as exc:
            raise self._failure(exc.args[0], "the transaction was aborted", deadline) from None
        self._state = _COMMITTING
        self._doubt = (list(offsets), dict(metadata))
        failure = self._finish_commit(deadline)
        if failure is not None:
            raise failure

    def resolve(self, timeout_s: float, budget: Callable[[float], float] | None = None) -> bool:
        """The outcome of the transaction whose commit :meth:`run` left in doubt: ``True`` when it
        committed, ``False`` when it was aborted (nothing of it is visible: run it again). Resumes
        the commit, within ``timeout_s`` seconds cut by ``budget``; ``True`` when nothing is in doubt.

        Raises
        ------
        TransactionError
            ``in_doubt``: still no answer. ``fatal``: the producer is unusable.
        """
        if self._doubt is None:
            return True
        return self._finish_commit(Deadline(timeout_s, budget)) is None

    def close(self, timeout_s: float = CLOSE_ABORT_S) -> None:
        """Abort an open transaction (best effort, within ``timeout_s`` seconds; not a commit in
        doubt, which the broker completes) and release the producer. No flush: an aborted
        transaction's records were purged (confluent-kafka-python #865: a flush after a fatal error
        can raise ``SystemError``)."""
        if self._state in (_OPEN, _ABORTING) and self._pending is None:
            try:
                self._abort(Deadline(timeout_s, None))
            except KafkaException as exc:
                log.warning("abort_transaction at close failed: %s", exc.args[0].str())
        self._state, self._producer, self._pending = _FAILED, None, None

    # -- the steps ---------------------------------------------------------------------------------

    def _ready(self, deadline: Deadline) -> None:
        """Finish what an earlier transaction left (a call still waiting, an abort, a restart)."""
        if self._pending is not None:
            if not self._pending.wait(deadline):
                raise TransactionError(
                    "the broker has not answered the last transaction's offsets yet: it is aborted "
                    "once it does",
                    code="_TIMED_OUT",
                    abortable=True,
                    retriable=True,
                )
            self._pending = None
        if self._state in (_OPEN, _ABORTING):  # _OPEN: left by an unexpected exception
            self._state = _ABORTING
            try:
                self._abort(deadline)
            except KafkaException as exc:
                raise self._failure(exc.args[0], "the last transaction's abort failed", deadline) from None
        if self._state == _RESTART:
            self._restart(deadline, "cannot start the producer again")
        if self._state == _FAILED:
            raise TransactionError(
                "the transactional producer failed or was closed", code="_FATAL", fatal=True
            )

    def _produce(self, records: Sequence[Record], deadline: Deadline) -> None:
        p = self._producer
        for topic, key, value, headers in records:
            while True:
                try:
                    wire: Any = headers
                    p.produce(topic, value=value, key=key, headers=wire, on_delivery=self._delivered)
                    break
                except BufferError:  # the local queue is full: serve delivery reports, then again
                    if deadline.left() <= 0:
                        raise KafkaException(
                            KafkaError(
                                KafkaError._QUEUE_FULL, "the producer's queue stayed full", retriable=True
                            )
                        ) from None
                    p.poll(0.05)

    def _delivered(self, err: KafkaError | None, _msg: Any) -> None:
        if err is not None:
            self._undelivered.append(err)

    def _send_offsets(self, tps: list[TopicPartition], group: Any, deadline: Deadline) -> None:
        """``send_offsets_to_transaction`` again while retriable, with identical arguments, in a
        helper thread: it may wait for its request's answer past its timeout."""
        p = self._producer
        while True:
            pending = self._pending = Pending(
                functools.partial(p.send_offsets_to_transaction, tps, group, max(0.1, deadline.left())),
                "send-offsets",
            )
            if not pending.wait(deadline):  # still waiting: the transaction is aborted once it returns
                raise KafkaException(
                    KafkaError(
                        KafkaError._TIMED_OUT, "no answer to send_offsets_to_transaction", retriable=True
                    )
                )
            self._pending = None
            failed = pending.error
            if failed is None:
                return
            if not isinstance(failed, KafkaException):
                raise failed
            err = failed.args[0]
            if not err.retriable() or err.txn_requires_abort() or err.fatal() or deadline.left() <= 0:
                raise failed
            time.sleep(min(0.1, max(0.0, deadline.left())))

    def _resumable(self, call: Callable[[float], None], deadline: Deadline) -> None:
        """``call(timeout_s)`` in slices while librdkafka says retriable, until ``deadline``;
        raises the last error."""
        while True:
            started = time.monotonic()
            try:
                call(deadline.slice())
                return
            except KafkaException as exc:
                err = exc.args[0]
                if not err.retriable() or err.txn_requires_abort() or err.fatal() or deadline.left() <= 0:
                    raise
                if time.monotonic() - started < 0.05:  # refused at once (no coordinator yet): not a busy loop
                    time.sleep(min(0.05, max(0.0, deadline.left())))

    def _finish_commit(self, deadline: Deadline) -> TransactionError | None:
        """Commit (or resume the commit of) the transaction in doubt. Returns ``None`` when it
        committed, the abortable error when it was aborted.

        Raises
        ------
        TransactionError
            ``in_doubt`` when still unanswered at ``deadline``; ``fatal``.
        """
        assert self._doubt is not None
        if self._state == _COMMITTING:
            try:
                self._resumable(lambda left: self._producer.commit_transaction(left), deadline)
            except KafkaException as exc:
                err = exc.args[0]
                if err.retriable() and not err.txn_requires_abort() and not err.fatal():
                    raise TransactionError(
                        f"the commit was not answered in time ({err.name()}: {err.str()}): its outcome "
                        "is not known yet; it is resumed, neither aborted nor redone",
                        code=err.name(),
                        retriable=True,
                        in_doubt=True,
                    ) from None
                if not (err.fatal() and self._timed_out(err)):
                    self._doubt = None
                    if not err.fatal():
                        self._state = _ABORTING  # librdkafka: abortable (or refused): abort first
                    return self._failure(err, "the transaction was not committed", deadline)
                self._state = _RESTART  # the broker's timeout abort (or a commit whose answer was lost)
            else:
                self._state, self._doubt = _READY, None
                return None
        # fenced after transaction_timeout_s: start again (init_transactions completes the old
        # transaction), then read its outcome back from the group's offsets
        offsets, metadata = self._doubt
        try:
            self._restart(deadline, "cannot start the producer again")
            group = self._committed([(t, n) for t, n, _ in offsets], max(0.1, deadline.left()))
        except (TransactionError, KafkaClientError) as exc:
            if exc.fatal:
                self._doubt = None
                raise
            raise TransactionError(
                f"the commit's outcome is not known yet (the producer is being started again): {exc}",
                code=exc.code,
                retriable=True,
                in_doubt=True,
            ) from None
        self._doubt = None
        if all(group.get((t, n)) == (o, metadata.get((t, n), "")) for t, n, o in offsets):
            log.warning("the transaction in doubt had committed: the group's offsets are the ones it sent")
            return None
        return TransactionError(
            "the broker aborted the transaction (open longer than transaction_timeout_s): nothing of "
            "it is visible",
            code="_FENCED",
            abortable=True,
            retriable=True,
        )

    def _failure(self, err: KafkaError, what: str, deadline: Deadline) -> TransactionError:
        """The transaction failed before its commit was sent, or its commit was refused: leave the
        producer ready for the next one (aborted, or started again) and return the error to raise."""
        if err.fatal():
            if not self._timed_out(err):
                self._state = _FAILED
                return _fatal(err, what)
            self._state = _RESTART
            try:
                self._restart(deadline, "cannot start the producer again")
            except TransactionError as exc:
                if exc.fatal:
                    return exc
            return _aborted(
                err, f"{what}: the broker aborted it (open longer than transaction_timeout_s)", True
            )
        abortable = bool(err.txn_requires_abort() or err.retriable())
        cause, why = err, what
        if self._undelivered:  # say which record failed rather than "requires abort"
            cause, why = self._undelivered[0], "the transaction was aborted: a record was not delivered"
        if self._state in (_OPEN, _ABORTING):
            self._state = _ABORTING
            if self._pending is None:  # else: aborted once the pending call returned
                try:
                    self._abort(deadline)
                except KafkaException as exc:
                    failed = exc.args[0]
                    if failed.fatal() and not self._timed_out(failed):
                        self._state = _FAILED
                        return _fatal(failed, "abort_transaction failed")
                    if failed.fatal():
                        self._state = _RESTART
                    log.warning(
                        "abort_transaction not finished (%s): finished before the next one", failed.str()
                    )
        if not abortable:  # refused for good: rdkafka.h says treat it as fatal
            return TransactionError(f"{why}: {cause.name()}: {cause.str()}", code=cause.name())
        return _aborted(cause, why)

    def _abort(self, deadline: Deadline) -> None:
        self._resumable(lambda left: self._producer.abort_transaction(left), deadline)
        self._state = _READY

    def _timed_out(self, err: KafkaError) -> bool:
        """A fence of a transaction open longer than ``transaction.timeout.ms``: possibly the
        broker's timeout abort (KIP-98), not a newer producer (see the module docstring)."""
        open_s = time.monotonic() - self._began
        if err.name() in _FENCED and open_s >= self._transaction_timeout_s:
            log.warning(
                "transactional producer %r fenced (%s) after its transaction was open %.1f s, longer than "
                "transaction_timeout_s: taken as the broker's timeout abort, not a newer producer; "
                "starting it again",
                self._id,
                err.name(),
                open_s,
            )
            return True
        return False

    def _restart(self, deadline: Deadline, what: str) -> None:
        """Create the producer (again) and ``init_transactions``, resumed until ``deadline`` (a
        later call resumes it).

        Raises
        ------
        TransactionError
            ``abortable`` (nothing ran) when the broker did not answer in time; ``fatal``.
        """
        if not self._init_pending:
            try:
                self._producer = Producer(with_token_source(self._settings))  # the fenced one is released
            except TokenCallbackError as exc:  # oauth_cb's fault: a configuration error
                self._state = _FAILED
                raise TransactionError(f"{what}: {exc}", code=exc.code, fatal=True) from exc
            except KafkaException as exc:
                self._state = _FAILED
                raise _fatal(exc.args[0], what) from None
            self._init_pending = True
        self._state = _RESTART
        try:
            self._resumable(lambda left: self._producer.init_transactions(left), deadline)
        except KafkaException as exc:
            err = exc.args[0]
            if err.retriable() and not err.fatal():
                raise _aborted(err, what) from None
            self._state = _FAILED
            raise TransactionError(
                f"{what}: {err.name()}: {err.str()}", code=err.name(), fatal=True
            ) from None
        self._init_pending = False
        self._state = _READY


if TYPE_CHECKING:  # mypy checks that the real producer satisfies the seam

    def _is_a_transactional_producer(producer: KafkaTransactionalProducer) -> TransactionalProducer:
        return producer
