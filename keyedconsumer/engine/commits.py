"""Commit modes: how the finished offsets reach the consumer group, in the owner thread.

The xkafka proposal (gojekfarm/xtools issue #25): an offset is stored only for a finished message, in
order, and only for a partition still assigned. Three modes implement :class:`CommitMode`
(Confluent Parallel Consumer's ``CommitMode`` enum, as objects):

- :class:`AutoCommit` (the default): ``enable.auto.offset.store`` is always false; after each turn
  the first unfinished offset of every partition whose offset moved is *stored* (librdkafka
  ``offsets_store``, one partition per call: librdkafka fails a call only when every partition of it
  fails, so a mixed call could silently drop one), and librdkafka *commits* stored offsets every
  ``auto.commit.interval.ms``.
- :class:`ManualCommit` (``manual_commit=True``): each advance is committed synchronously instead.
- ``TransactionalCommit`` (``transactional=True``, :mod:`.transactions`): offsets go with the
  records handlers produced, in Kafka transactions.

Every store and commit carries the metadata naming the offsets finished above it (Confluent Parallel
Consumer's offset map), and a partition held back by a slow message is committed with it on the same
cadence. Also here: a revoke's commits, the final commit of a stop, and the ownership check the Redis
sequencer asks for after a stall.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from ..config import ConsumerConfig
from ..errors import CommitError, KafkaClientError
from ..kafka import TP, KafkaClient
from .engine import Engine
from .partitions import Partition

__all__ = [
    "CommitMode",
    "AutoCommit",
    "ManualCommit",
    "COMMIT_AGAIN",
    "BLOCKING_CALL_S",
    "FINAL_COMMIT_MIN_S",
    "COMMIT_RETRY_S",
]

log = logging.getLogger("keyedconsumer")

#: Commit errors that a later attempt of the same commit can get past: the group is in the middle
#: of a rebalance and this member has not rejoined the new generation (classic protocol) or epoch
#: (KIP-848) yet, or the group coordinator is not known or not ready (a broker restart).
COMMIT_AGAIN = frozenset(
    {
        "ILLEGAL_GENERATION",
        "REBALANCE_IN_PROGRESS",
        "STALE_MEMBER_EPOCH",
        "_WAIT_COORD",
        "COORDINATOR_NOT_AVAILABLE",
        "NOT_COORDINATOR",
        "COORDINATOR_LOAD_IN_PROGRESS",
    }
)

#: Longest wait of one blocking broker call in the owner thread or a rebalance callback (seconds):
#: the committed offsets read at assign, a synchronous commit (manual commit, the ownership check).
#: A call under way when ``stop()`` comes is waited for inside ``shutdown_timeout_s``.
BLOCKING_CALL_S = 5.0

#: A partition with offsets finished above its watermark is stored at most every this share of
#: ``auto.commit.interval.ms``: librdkafka commits the stored offset only once per interval, so a
#: store in between only moves what the next commit sends, and each costs an encoding of the
#: partition's commit metadata, O(its unfinished offsets) (at 0.1 the next commit sends an offset
#: at most a tenth of the interval older than it could have).
STORE_SHARE = 0.1
#: A final or revoke commit gets at least this long (seconds), even when the time was spent
#: waiting for handlers.
FINAL_COMMIT_MIN_S = 2.0
#: Pause between attempts of a commit the group refused during a rebalance (seconds).
COMMIT_RETRY_S = (0.05, 0.5)


#: Pauses of the ownership check after the group coordinator did not answer (seconds: the first,
#: doubled each time up to the last).
OWNERSHIP_BACKOFF_S = (0.2, 5.0)
#: Commit errors that say nothing of this member (the coordinator did not answer, or is moving):
#: the ownership check is asked again after a pause, not only after a rebalance.
NO_ANSWER = frozenset(
    {
        "_TIMED_OUT",
        "REQUEST_TIMED_OUT",
        "_TRANSPORT",
        "_WAIT_COORD",
        "COORDINATOR_NOT_AVAILABLE",
        "NOT_COORDINATOR",
        "COORDINATOR_LOAD_IN_PROGRESS",
    }
)


class CommitMode(Protocol):
    """What the owner asks of a commit mode (all in the owner thread)."""

    def start(self) -> None:
        """Before the first poll (a transactional producer starts here)."""

    def store(self) -> None:
        """After each turn: store (or commit) what advanced."""

    def commit_metadata(self) -> None:
        """Every ``auto.commit.interval.ms``: partitions held back by an unfinished message."""

    def progress(self) -> None:
        """During a revoke's catch-up, every ``auto.commit.interval.ms``: what finished so far."""

    def revoke(self, parts: list[Partition], deadline: float, stopping: bool) -> str:
        """Commit the revoked ``parts`` (their handlers are over) and close them, until
        ``deadline`` (monotonic seconds); ``stopping``: a stop is under way. Returns what is known
        of the commit, for the log line (``""``: nothing to commit)."""

    def commit_final(self, deadline: float) -> None:
        """The stop's commit of every active partition, until ``deadline`` (monotonic seconds).

        Raises
        ------
        KafkaClientError
            The commit failed (logged by the caller: what finished after the last commit runs again).
        """

    def confirm_ownership(self) -> bool:
        """After a stall: does this instance still own its partitions in the group? At most one
        check with broker requests per rebalance once the answer was no (see
        :meth:`AutoCommit.confirm_ownership`)."""

    def close(self) -> None:
        """The run ended."""


class _OffsetCommits:
    """What :class:`AutoCommit` and :class:`ManualCommit` share: commits made by the consumer client.

    Parameters
    ----------
    client, engine, config:
        The run's Kafka client, engine and settings.
    budget:
        ``budget(cap_s) -> seconds`` a blocking call may take now (cut to a stop's deadline).
    on_error:
        Receives a failed manual commit (the consumer's client-error path).
    in_rebalance:
        ``in_rebalance()``: whether a rebalance callback runs now (the ownership check then commits
        nothing, see :meth:`confirm_ownership`).
    rebalances:
        ``rebalances()``: how many rebalance callbacks were served so far (a refused ownership check
        is asked again only after one more).
    """

    def __init__(
        self,
        client: KafkaClient,
        engine: Engine,
        config: ConsumerConfig,
        budget: Callable[[float], float],
        on_error: Callable[[KafkaClientError], None],
        in_rebalance: Callable[[], bool] = lambda: False,
        rebalances: Callable[[], int] = lambda: 0,
    ) -> None:
        self._client = client
        self._engine = engine
        self._budget = budget
        self._on_error = on_error
        self._in_rebalance = in_rebalance
        self._rebalances = rebalances
        #: Ownership checks that went to the broker (each a committed-offsets fetch, and a commit).
        self.ownership_checks = 0
        self._refused_in: int | None = None  # the rebalance count when the group said no
        self._refused_s = 0.0
        self._recheck_s = float(config.librdkafka().get("session.timeout.ms", 45000)) / 1000
        self._unavailable_s = 0.0  # the pause after the coordinator did not answer
        self._next_check_s = 0.0
        self._meta_sent: dict[TP, tuple[int, str]] = {}  # the last metadata commit sent per partition

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass

    def _stage(self, offsets: list[tuple[str, int, int]], meta: dict[TP, str]) -> None:
        """Before a commit of ``offsets``: :class:`AutoCommit` stores them too (librdkafka commits
        the *stored* offsets on its own cadence and at close, which must not name fewer)."""

    def commit_metadata(self) -> None:
        """Commit, without waiting, each partition whose offset is held back by an unfinished
        message while offsets above it finished, with the metadata naming those (the offset alone
        does not move, so librdkafka's auto commit would not send it). A crash then re-runs only
        what finished since the last of these commits, not everything above a slow key's message."""
        offsets, meta = self._engine.partitions.commit_offsets(self._engine.partitions.active())
        sent = self._meta_sent
        todo = [(t, p, o) for t, p, o in offsets if (t, p) in meta and sent.get((t, p)) != (o, meta[(t, p)])]
        if not todo:
            return
        self._stage(todo, meta)
        self._client.commit_async(todo, meta)
        for t, p, o in todo:
            sent[(t, p)] = (o, meta[(t, p)])

    def progress(self) -> None:
        """During a revoke's catch-up, every ``auto.commit.interval.ms``: commit, without waiting,
        what every assigned partition finished so far (the revoking ones, and the others, whose
        handlers go on while the owner serves the callback and stores nothing). The classic
        protocol's coordinator takes commits of the current generation while the group rebalances.
        Without it a SIGKILL during a long catch-up re-ran everything finished since the callback
        began (full fault-harness runs: 3,945 duplicates from one kill)."""
        offsets, meta = self._engine.partitions.commit_offsets(self._engine.partitions.active())
        if offsets:
            try:
                self._client.commit_async(offsets, meta)
            except KafkaClientError as exc:
                log.debug("progress commit during the revoke's catch-up not sent: %s", exc)

    def revoke(self, parts: list[Partition], deadline: float, stopping: bool) -> str:
        """Commit the revoked partitions' offsets (stored too), again while the group refuses it
        for a rebalance that moved on, until ``deadline``; then they are closed.

        The commit is made from this thread, the one serving the callback: a commit sent from
        another thread while a rebalance callback runs waits until the poll serving the callback
        returns (confluent-kafka serializes the calls on one consumer; measured here), so a commit
        in a callback cannot be bounded by a helper thread. Each attempt is bounded by librdkafka's
        own request timeout (``socket.timeout.ms``).

        While a stop is under way (``stopping``), the commit is sent without waiting for the group
        coordinator's answer (``commit_async``), so the stop keeps its bound when the broker does
        not answer (SIGSTOP, a network cut: a synchronous commit in the callback was still waiting
        100 s later, confluent-kafka-python #1667). Its fate is then unknown: at worst what finished
        since the last commit runs again (at-least-once).

        Returns what is known of it, with the offsets: ``"committed [...]"`` (confirmed),
        ``"stopping: commit sent, answer not awaited: [...]"`` or ``"not committed: [...]"``.
        """
        final, meta = self._engine.close_parts(parts)
        if not final:
            return ""
        self._stage(final, meta)
        if stopping:
            self._client.commit_async(final, meta)
            return f"stopping: commit sent, answer not awaited: {final}"
        pause = COMMIT_RETRY_S[0]
        while True:
            try:
                self._client.commit(final, meta)
                return f"committed {final}"
            except CommitError as exc:
                if exc.code not in COMMIT_AGAIN or time.monotonic() + pause >= deadline:
                    log.warning(
                        "commit on revoke failed: %s (what finished after the last commit runs again)", exc
                    )
                    return f"not committed: {final}"
                log.info("commit on revoke refused (%s): trying again in %.2f s", exc.code, pause)
            except KafkaClientError as exc:
                log.warning("commit on revoke failed: %s", exc)
                return f"not committed: {final}"
            time.sleep(pause)
            pause = min(COMMIT_RETRY_S[1], pause * 2)

    def commit_final(self, deadline: float) -> None:
        """Commit every active partition's first unfinished offset, with the metadata naming what
        finished above it. A group in the middle of a rebalance refuses the commit (this member has
        not rejoined the new generation yet), and a coordinator may be unknown for a moment: then
        the client is polled, which serves the rebalance (a revoke commits its partitions itself),
        and the rest is committed again, until ``deadline`` (monotonic seconds). Records polled
        meanwhile are not run (nor stored). Each attempt waits at most until ``deadline``.

        Raises
        ------
        KafkaClientError
            Another commit error, no answer by ``deadline``, or still refused at ``deadline``.
        """
        engine, client = self._engine, self._client
        while True:
            parts = engine.partitions.active()
            final, meta = engine.partitions.commit_offsets(parts)
            if not final:
                return
            self._stage(final, meta)
            try:
                client.commit(final, meta, timeout_s=max(0.5, deadline - time.monotonic()))
            except CommitError as exc:
                # a commit with no answer by the deadline (_TIMED_OUT) is not polled past: its call
                # still holds the client, and a poll would wait for it (a stopped broker: for ever)
                if exc.code not in COMMIT_AGAIN or time.monotonic() >= deadline:
                    raise
                log.info(
                    "final commit refused (%s): polling (a rebalance, the coordinator), then committing again",
                    exc.code,
                )
                until = min(deadline, time.monotonic() + 0.5)
                while time.monotonic() < until:
                    client.poll_batch(1, 0.05)  # stopping: what it returns is not run, nor stored
                continue
            committed = {(t, p): o for t, p, o in final}
            for p in parts:
                p.mark_stored(committed.get(p.tp, p.stored))
            log.info("stopping: committed %s (confirmed)", final)
            return

    def confirm_ownership(self) -> bool:
        """After a stall of this process (or a lost lease), is it still the group's owner of its
        partitions? Asked by the Redis sequencer before it acquires leases again.

        A stopped process (SIGSTOP, a VM pause) may have lost its partitions while it could not
        tell; until librdkafka serves the revoke, a fresh lease would let it re-run messages the
        new owner already ran and committed. So: the group's committed offsets must not be past
        this instance's first unfinished ones (else another member has run them), and a
        synchronous commit of those offsets must succeed (the coordinator refuses a commit from a
        member it expelled: ``UNKNOWN_MEMBER_ID``, ``ILLEGAL_GENERATION``, KIP-848's
        ``FENCED_MEMBER_EPOCH``). Returns ``False`` while either fails (the caller asks again).

        Its cost is bounded by rebalances, not by how often it is asked: once the group said no
        (offsets ahead, commit refused), only a rebalance can change the answer, so it answers
        ``False`` without a broker request until a rebalance callback was served (or a session
        timeout passed, should a rebalance go unseen); a coordinator that did not answer is asked
        again after :data:`OWNERSHIP_BACKOFF_S` pauses, doubling. :attr:`ownership_checks` counts
        the checks that went to the broker.

        Inside a rebalance callback (a revoke's catch-up ticks the sequencer) it commits nothing and
        returns ``False``: a bounded commit is made from a helper thread, which confluent-kafka lets
        into the client only once the poll serving the callback returned, so it would land after the
        revoke's own commit with the offsets of before the catch-up, under whatever generation is
        current by then (``tests/integration/test_revoke_commit.py``). It is asked again after.
        """
        offsets, meta = self._engine.partitions.commit_offsets(self._engine.partitions.active())
        if not offsets:
            return True
        if self._in_rebalance():
            log.info(
                "ownership check: not during a rebalance callback (its commit would land after the revoke's)"
            )
            return False
        now = time.monotonic()
        if self._refused_in is not None:
            if self._refused_in == self._rebalances() and now < self._refused_s + self._recheck_s:
                return False  # the group said no: only a rebalance changes that
            self._refused_in = None
        if now < self._next_check_s:
            return False  # the coordinator did not answer: backing off
        self.ownership_checks += 1
        client = self._client
        try:
            group = client.committed([(t, p) for t, p, _ in offsets], self._budget(BLOCKING_CALL_S))
        except KafkaClientError as exc:
            self._back_off()
            log.warning(
                "ownership check: committed offsets unavailable (%s); asked again in %.1f s",
                exc,
                self._unavailable_s,
            )
            return False
        ahead = [(t, p, o) for t, p, o in offsets if group.get((t, p), (-1, ""))[0] > o]
        if ahead:
            self._refused(now)
            log.warning(
                "ownership check: the group committed past this instance's offsets %s: partitions lost; "
                "asked again after a rebalance",
                ahead,
            )
            return False
        try:
            client.commit(offsets, meta, timeout_s=self._budget(BLOCKING_CALL_S))
        except KafkaClientError as exc:
            if exc.code in NO_ANSWER:
                self._back_off()
                log.warning(
                    "ownership check: commit not answered (%s); asked again in %.1f s",
                    exc,
                    self._unavailable_s,
                )
                return False
            self._refused(now)
            log.warning("ownership check: commit refused (%s): asked again after a rebalance", exc)
            return False
        self._unavailable_s = self._next_check_s = 0.0
        log.info("ownership check passed for %d partition(s)", len(offsets))
        return True

    def _refused(self, now: float) -> None:
        self._refused_in, self._refused_s = self._rebalances(), now
        self._unavailable_s = self._next_check_s = 0.0

    def _back_off(self) -> None:
        first, last = OWNERSHIP_BACKOFF_S
        self._unavailable_s = min(last, self._unavailable_s * 2 or first)
        self._next_check_s = time.monotonic() + self._unavailable_s


class AutoCommit(_OffsetCommits):
    """Store finished offsets; librdkafka commits them every ``auto.commit.interval.ms``."""

    def __init__(
        self, client: KafkaClient, engine: Engine, config: ConsumerConfig, *args: Any, **kwargs: Any
    ) -> None:
        super().__init__(client, engine, config, *args, **kwargs)
        interval_s = float(config.librdkafka().get("auto.commit.interval.ms", 5000)) / 1000.0
        self._store_every_s = STORE_SHARE * interval_s if config.commit_metadata_max_bytes else 0.0

    def store(self) -> None:
        """Store the partitions whose first unfinished offset moved, each with the metadata naming
        what finished above it. A partition with offsets finished above its watermark is stored at
        most every :data:`STORE_SHARE` of ``auto.commit.interval.ms`` (librdkafka commits what is
        stored only that often; its metadata costs O(unfinished offsets) to encode)."""
        advances = self._engine.partitions.advances(time.monotonic(), self._store_every_s)
        if not advances:
            return
        client = self._client
        for p, wm, m in advances:
            try:
                client.store(p.topic, p.partition, wm, m)
                p.mark_stored(wm)
            except KafkaClientError as exc:  # e.g. the partition is no longer assigned
                log.debug("offset not stored: %s", exc)

    def _stage(self, offsets: list[tuple[str, int, int]], meta: dict[TP, str]) -> None:
        # stored first: librdkafka's own auto commit (and its commit at close), should it send the
        # stored offset meanwhile, then names as much as this commit does
        client = self._client
        for topic, partition, offset in offsets:
            try:
                client.store(topic, partition, offset, meta.get((topic, partition), ""))
            except KafkaClientError as exc:
                log.debug("offset not stored: %s", exc)


class ManualCommit(_OffsetCommits):
    """Commit each advance synchronously (``manual_commit=True``)."""

    def store(self) -> None:
        """Commit the partitions whose first unfinished offset moved, with their metadata."""
        advances = self._engine.partitions.advances()
        if not advances:
            return
        meta = {p.tp: m for p, _, m in advances if m}
        try:
            self._client.commit(
                [(p.topic, p.partition, wm) for p, wm, _ in advances],
                meta,
                timeout_s=self._budget(BLOCKING_CALL_S),
            )
        except KafkaClientError as exc:
            self._on_error(exc)
            self._engine.partitions.mark_dirty([p for p, _, _ in advances])
            return
        for p, wm, _ in advances:
            p.mark_stored(wm)
