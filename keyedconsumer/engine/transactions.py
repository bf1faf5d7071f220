"""Exactly-once results: the records and the offsets they advance, in one Kafka transaction.

With ``transactional=True`` offsets are never stored nor committed by the consumer client: every
``transaction_interval_s``, at a revoke (before the partitions are given up) and at the stop, the
poll thread runs one transaction (:class:`~keyedconsumer.kafka.TransactionalProducer`):

1. it reads what to commit: each partition's first unfinished offset and the commit metadata
   naming the offsets finished above it (``Engine.commit_offsets``);
2. then it takes the records of the messages settled done meanwhile
   (:meth:`~.results.Results.take_finished`): a message is queued there by its worker *before* the
   engine marks it done, so every message that step 1 counted done has its records in hand;
3. it writes the records of the messages step 1 covers (below the offset, or named in the
   metadata as decoded, so a truncated metadata never covers more than it names), in the order
   they finished, and keeps the others for a later transaction (and every later record of that
   partition, so records keep their partition's, hence their key's, order); records of a partition
   no longer assigned are dropped (its next owner runs those messages again);
4. it sends the offsets with the consumer's group metadata (``send_offsets_to_transaction``,
   KIP-447: a member of an older generation is refused) and commits.

So every record in a committed transaction belongs to a message whose offset that transaction
commits, and every committed offset's messages have their records in it or an earlier one; a crash
before the commit leaves an open transaction that the broker aborts (at ``transaction_timeout_s``,
or at once when a producer with the same ``transactional_id`` starts), and its messages run again.
Confluent Parallel Consumer makes workers produce into the open transaction under a shared
"produce lock" and the committer take it exclusively; here the poll thread alone uses the
producer, so a transaction is open only while it is being committed and no worker ever waits for
one.

An *abortable* failure (e.g. ``REBALANCE_IN_PROGRESS`` / ``ILLEGAL_GENERATION`` while the group
rebalances) aborts; the same records stay in hand and go out in the next transaction, with the
offsets as they are then. A commit left *in doubt* (not answered in time: a broker stall) is neither
redone nor given up: the next transaction first asks the producer how it ended
(:meth:`~keyedconsumer.kafka.TransactionalProducer.resolve`), then counts its records written, or
sends them again. Failures that pass by themselves (``retriable``: no answer, the group moving) may
last up to librdkafka's ``max.poll.interval.ms``; other abortable ones up to
``transaction_timeout_s``; past that, or on a record refused for good or a fatal error
(``_FENCED``: another producer with the same ``transactional_id``), the consumer stops with a
:class:`~keyedconsumer.TransactionError`; nothing more is committed, and a restart runs everything
after the last committed transaction again. While stopping, a failure is logged, not raised.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable

from ..config import ConsumerConfig
from ..errors import TransactionError
from ..kafka import TP, KafkaClient, TransactionalProducer
from ..message import Record
from ..offsets import FinishedOffsets
from .engine import Engine
from .partitions import CLOSED, Partition
from .results import Finished, Results

__all__ = ["TransactionalCommit", "TRANSACTION_RETRY_S", "HELD_WARNING"]

log = logging.getLogger("keyedconsumer")

#: Pause before the next transaction after an abortable failure (seconds), doubling up to the second.
TRANSACTION_RETRY_S = (0.1, 2.0)
#: Finished messages whose records wait for the committed offsets to cover them (commit metadata
#: cut to ``commit_metadata_max_bytes`` names fewer finished offsets) above which a warning is logged:
#: they are held in memory, outside the ``max_in_flight`` bounds, until the offset passes them.
HELD_WARNING = 10_000


class TransactionalCommit:
    """The owner's offset work with ``transactional=True`` (a :class:`~.commits.CommitMode`; see
    the module docstring).

    Parameters
    ----------
    client, engine, config:
        The run's Kafka client, engine and settings.
    budget:
        ``budget(cap_s) -> seconds`` a blocking call may take now (cut to a stop's deadline).
    results:
        The consumer's produced records.
    fail:
        ``fail(error)`` stops the consumer with ``error``.
    """

    def __init__(
        self,
        client: KafkaClient,
        engine: Engine,
        config: ConsumerConfig,
        budget: Callable[[float], float],
        results: Results,
        fail: Callable[[BaseException], None],
    ) -> None:
        self._client = client
        self._engine = engine
        self._budget = budget
        self._config = config
        self._results = results
        self._fail = fail
        self._producer: TransactionalProducer | None = None
        self._kept: list[Finished] = []  # records in hand, not committed yet, oldest first
        self._committed: dict[TP, tuple[int, str]] = {}  # what the last transaction committed
        self._next_s = 0.0  # when the next periodic transaction is due (monotonic seconds)
        self._pause_s = TRANSACTION_RETRY_S[0]
        self._failing_since: float | None = None  # abortable refusals since (monotonic seconds)
        self._retrying_since: float | None = None  # retriable failures (no answer, the group moving) since
        self._outage_s = float(config.librdkafka().get("max.poll.interval.ms", 300_000)) / 1000.0
        #: the transaction whose commit is in doubt: (records not in it, offsets, metadata, partitions, records)
        self._doubt: (
            tuple[list[Finished], list[tuple[str, int, int]], dict[TP, str], dict[TP, Partition], int] | None
        ) = None
        self._stopping = False
        self._broken = False
        self._warned = False
        #: Transactions committed, and the records they wrote.
        self.transactions = 0
        self.records = 0

    def start(self) -> None:
        """Build and start the transactional producer (``init_transactions``: fences an older
        producer of the same ``transactional_id`` and aborts what it left open).

        Raises
        ------
        TransactionError
            The producer could not be started.
        """
        cfg = self._config
        tid = cfg.transactional_id or f"{cfg.group}-{uuid.uuid4().hex[:12]}"
        self._producer = self._client.transactional_producer(
            tid, cfg.startup_timeout_s, cfg.transaction_timeout_s
        )
        log.info("transactional producer started as %r", tid)

    def close(self) -> None:
        """Release the producer (an open transaction, which only a failure leaves, is aborted)."""
        producer, self._producer = self._producer, None
        if producer is not None:
            producer.close()

    # -- the commit mode --------------------------------------------------------------------------

    def store(self) -> None:
        """After each turn: a transaction when ``transaction_interval_s`` passed."""
        now = time.monotonic()
        if now >= self._next_s:
            self._next_s = now + self._config.transaction_interval_s
            self.commit(self._engine.partitions.active(), self._budget(self._config.transaction_timeout_s))

    def commit_metadata(self) -> None:
        """Nothing: every transaction commits the metadata with the offsets."""

    def progress(self) -> None:
        """Nothing: a revoke's catch-up commits in its transaction at the end (the offsets go with
        their records)."""

    def commit_final(self, deadline: float) -> None:
        """The stop's transaction, tried again after abortable failures until ``deadline``."""
        self._stopping = True
        while not self._broken:
            if self.commit(self._engine.partitions.active(), max(0.5, deadline - time.monotonic())):
                return
            if time.monotonic() + self._pause_s >= deadline:
                if self._doubt is not None:
                    log.warning(
                        "final transaction in doubt (no answer from the broker): the broker completes or "
                        "aborts it; the next owner reads the committed offsets once it did (require_stable)"
                    )
                else:
                    log.warning(
                        "final transaction not committed: what finished after the last one runs again"
                    )
                return
            time.sleep(self._pause_s)

    def revoke(self, parts: list[Partition], deadline: float, stopping: bool) -> str:
        """A revoke: commit the revoked (and every other) partition's offsets and records before they
        are given up, tried again after abortable failures until ``deadline``; then close them.
        Returns what is known of the commit, for the log line."""
        outcome = "not committed (a transaction failed)"
        while not self._broken:
            if self.commit(
                [*self._engine.partitions.active(), *parts], max(0.5, deadline - time.monotonic())
            ):
                outcome = "committed in a transaction"
                break
            if time.monotonic() + self._pause_s >= deadline:
                log.warning("revoke: transaction not committed: what finished after the last one runs again")
                break
            time.sleep(self._pause_s)
        self._engine.close_parts(parts)
        return outcome

    def confirm_ownership(self) -> bool:
        """Not used: ``transactional`` refuses the Redis sequencer, the only caller."""
        return True

    # -- one transaction --------------------------------------------------------------------------

    def commit(self, parts: list[Partition], timeout_s: float) -> bool:
        """One transaction for ``parts`` (see the module docstring). Returns ``True`` when it was
        committed or nothing needed one, ``False`` when it failed (an abortable failure: its records
        stay in hand; or the consumer is stopping with the error)."""
        if self._broken or self._producer is None:
            return False
        end = time.monotonic() + timeout_s
        if self._doubt is not None and not self._resolve(timeout_s):
            return False
        offsets, meta = self._engine.partitions.commit_offsets(parts)  # first: what counts done now
        kept = self._kept
        kept.extend(self._results.take_finished())  # then: their records are all in hand
        done: dict[int, tuple[int, FinishedOffsets | None]] = {}
        by_tp = {p.tp: p for p in parts}
        for t, n, o in offsets:
            part = by_tp.get((t, n))
            if part is not None:
                done[id(part)] = (o, FinishedOffsets.decode(o, meta.get((t, n))))
        records: list[Record] = []
        later: list[Finished] = []
        held: set[int] = set()
        for entry in kept:
            part, offset, recs = entry
            if part is None or part.state == CLOSED:
                continue  # no longer this instance's: its next owner runs the message again
            key = id(part)
            mark = done.get(key)
            if (
                key in held
                or mark is None
                or not (offset < mark[0] or (mark[1] is not None and mark[1].covers(offset)))
            ):
                held.add(key)
                later.append(entry)
                continue
            records.extend(recs)
        if len(later) >= HELD_WARNING and not self._warned:
            self._warned = True
            log.warning(
                "%d finished messages' records wait for the committed offsets to cover them (the commit "
                "metadata is cut to commit_metadata_max_bytes): held in memory until the offsets pass them",
                len(later),
            )
        moved = [(t, n, o) for t, n, o in offsets if self._committed.get((t, n)) != (o, meta.get((t, n), ""))]
        if not records and not moved:
            self._kept = later
            return True
        try:
            self._producer.run(records, offsets, meta, max(0.5, end - time.monotonic()), self._budget)
        except TransactionError as exc:
            if exc.in_doubt:  # asked first next time; nothing is sent again meanwhile
                self._doubt = (later, offsets, meta, by_tp, len(records))
            return self._failed(exc)
        self._succeeded(later, offsets, meta, by_tp, len(records))
        return True

    def _resolve(self, timeout_s: float) -> bool:
        """The last transaction's commit was not answered: its outcome decides what is in hand
        (nothing was taken since). ``False`` while it is still unknown."""
        assert self._producer is not None and self._doubt is not None
        try:
            committed = self._producer.resolve(timeout_s, self._budget)
        except TransactionError as exc:
            return self._failed(exc)
        later, offsets, meta, tps, count = self._doubt
        self._doubt = None
        if committed:
            self._succeeded(later, offsets, meta, tps, count)
        else:
            log.warning("the transaction in doubt was aborted: its records and offsets go in the next one")
        return True

    def _succeeded(
        self,
        later: list[Finished],
        offsets: list[tuple[str, int, int]],
        meta: dict[TP, str],
        tps: dict[TP, Partition],
        count: int,
    ) -> None:
        self._kept = later
        self._failing_since = self._retrying_since = None
        self._pause_s = TRANSACTION_RETRY_S[0]
        self.transactions += 1
        self.records += count
        for t, n, o in offsets:
            self._committed[(t, n)] = (o, meta.get((t, n), ""))
            part = tps.get((t, n))
            if part is not None:
                part.mark_stored(o)

    def _failed(self, exc: TransactionError) -> bool:
        """Try again later (back-off), unless the failure is final or has lasted too long: then stop
        the consumer. While stopping, only a final failure stops it with an error."""
        now = time.monotonic()
        if not exc.fatal and (exc.abortable or exc.in_doubt):
            if self._stopping:
                log.warning("transaction not committed while stopping: %s", exc)
                return False
            if exc.retriable:  # no answer, the group moving: up to max.poll.interval.ms
                if self._retrying_since is None:
                    self._retrying_since = now
                since, limit = self._retrying_since, self._outage_s
            else:
                if self._failing_since is None:
                    self._failing_since = now
                since, limit = self._failing_since, self._config.transaction_timeout_s
            if now - since < limit:
                if exc.in_doubt:
                    log.warning("transaction in doubt (%s): its outcome is asked again first", exc)
                else:
                    log.warning("transaction aborted (%s): its records and offsets go in the next one", exc)
                self._next_s = now + self._pause_s
                self._pause_s = min(TRANSACTION_RETRY_S[1], self._pause_s * 2)
                return False
            if exc.retriable:
                exc = TransactionError(
                    f"transactions failed for {limit:g} s (max.poll.interval.ms) without getting through (no "
                    "answer from the brokers, or the group kept rebalancing): stopping; a restart runs what the "
                    f"last committed transaction did not cover: {exc}",
                    code=exc.code,
                    abortable=exc.abortable,
                    retriable=True,
                    in_doubt=exc.in_doubt,
                )
        self._broken = True
        self._fail(exc)
        return False
