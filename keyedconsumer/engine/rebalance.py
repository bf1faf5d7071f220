"""Rebalances and the pause set: assign, revoke and lost, and pausing fetching under back-pressure.

librdkafka runs the rebalance callbacks inside its poll call, in the poll thread. The engine never
calls ``assign()``/``unassign()`` in them (the incremental protocols, KIP-429 and KIP-848, refuse it); it keeps its
own assignment from the deltas (:class:`~.partitions.Partitions`).

- **Assign**: track the partitions, with the offsets their previous owner finished above its commit
  (its commit metadata): those are skipped, not run again.
- **Revoke**, within ``revoke_timeout_s`` (or a stop's deadline): for the first half, messages below
  a partition's highest finished offset still run (so the commit covers what finished); then their
  queued messages are dropped, their running handlers waited for, and their offsets committed with
  the metadata, again while the group refuses it because the rebalance moved on meanwhile
  (``STALE_MEMBER_EPOCH`` under KIP-848; KAFKA-16033 retries the commit before revocation too).
  While a stop is under way the commit is sent without waiting for its answer: a commit made in a
  rebalance callback cannot be bounded, and a stopped broker leaves it waiting for minutes
  (confluent-kafka-python #1667), past the stop's bound.
- **Lost**: everything of those partitions is dropped without committing.
- **Pause set**: above the back-pressure bounds the assigned partitions are paused, resumed below
  half of them; a revoked partition that was paused is resumed (librdkafka keeps an application's
  pause across a revoke and a re-assignment, so it would never be fetched again).
- **Serving**: whether a callback runs now (:meth:`Rebalance.serving`). A bounded call that the
  client makes from a helper thread must not be made meanwhile: confluent-kafka lets it into the
  client only once the poll serving the callback returned (measured here), so a commit would land
  after the revoke's own commit, with the offsets of before the catch-up, under whatever
  generation is current then (the ownership check asks, see :mod:`.commits`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ..config import ConsumerConfig
from ..errors import CommitError, KafkaClientError
from ..kafka import TP, KafkaClient
from ..offsets import FinishedOffsets
from .commits import BLOCKING_CALL_S, COMMIT_AGAIN
from .dispatcher import Dispatcher
from .partitions import Partition

__all__ = ["Rebalance", "CATCH_UP_SHARE", "FINAL_COMMIT_MIN_S", "COMMIT_RETRY_S"]

log = logging.getLogger("keyedconsumer")

#: Share of ``shutdown_timeout_s`` (of ``revoke_timeout_s`` for a revoke) during which a stop (revoke)
#: still starts messages below their partition's highest finished offset (the catch-up); the rest is
#: left to the handlers running then, so a long one started late is not cut short by the commit.
CATCH_UP_SHARE = 0.5
#: A final or revoke commit gets at least this long (seconds), even when the time was spent
#: waiting for handlers.
FINAL_COMMIT_MIN_S = 2.0
#: Pause between attempts of a commit the group refused during a rebalance (seconds).
COMMIT_RETRY_S = (0.05, 0.5)


class Rebalance:
    """The rebalance listener and the pause set of one run of a consumer.

    Parameters
    ----------
    client, dispatcher, config:
        The run's Kafka client, dispatcher and settings.
    catch_up:
        ``catch_up(parts, deadline)`` runs what lies below each partition's highest finished
        offset until ``deadline`` (monotonic seconds).
    budget:
        ``budget(cap_s) -> seconds`` a blocking call may take now (cut to a stop's deadline).
    stop_deadline:
        ``stop_deadline()``: when a stop under way must be over (monotonic seconds), or ``None``.
    commit_revoked:
        With ``transactional``: ``commit_revoked(parts, deadline)`` commits the revoked partitions
        in a transaction before they are closed (instead of the consumer client's commit).
    """

    def __init__(
        self,
        client: KafkaClient,
        dispatcher: Dispatcher,
        config: ConsumerConfig,
        catch_up: Callable[[list[Partition], float, Callable[[], None] | None], None],
        budget: Callable[[float], float],
        stop_deadline: Callable[[], float | None],
        commit_revoked: Callable[[list[Partition], float], None] | None = None,
    ) -> None:
        self._client = client
        self._commit_revoked = commit_revoked
        self._d = dispatcher
        self._config = config
        self._catch_up = catch_up
        self._budget = budget
        self._stop_deadline = stop_deadline
        self._closing = False
        self._paused: set[TP] = set()
        self._serving = 0  # rebalance callbacks running now (in the poll thread, or in close())

    def closing(self) -> None:
        """The client is being closed: its revoke commits at once, without a catch-up."""
        self._closing = True

    def serving(self) -> bool:
        """Whether a rebalance callback (assign, revoke, lost) is running now."""
        return self._serving > 0

    # -- the listener (librdkafka's rebalance callbacks) ------------------------------------------

    def on_assign(self, partitions: list[TP]) -> None:
        self._serving += 1
        try:
            self._assign(partitions)
        finally:
            self._serving -= 1

    def on_revoke(self, partitions: list[TP]) -> None:
        """Finish what lies below the highest finished offset, wait for the revoked partitions'
        running handlers, and commit, all within ``revoke_timeout_s`` (see the module docstring)."""
        self._serving += 1
        try:
            self._revoke(partitions)
        finally:
            self._serving -= 1

    def on_lost(self, partitions: list[TP]) -> None:
        self._serving += 1
        try:
            log.warning("lost %s: dropping their messages without committing", partitions)
            self._d.begin_revoke(partitions, lost=True)
            self._unpause(partitions)
        finally:
            self._serving -= 1

    def _assign(self, partitions: list[TP]) -> None:
        log.info("assigned %s", partitions)
        finished: dict[TP, FinishedOffsets] = {}
        if self._config.commit_metadata_max_bytes and partitions:
            # the offsets the previous owners finished above their commits: skipped, not re-run
            try:
                for tp, (offset, meta) in self._client.committed(
                    partitions, self._budget(BLOCKING_CALL_S)
                ).items():
                    fin = FinishedOffsets.decode(offset, meta)
                    if fin is not None:
                        finished[tp] = fin
                        log.info(
                            "%s[%d]: %d offsets above %d were finished by the previous owner: not run again",
                            tp[0],
                            tp[1],
                            fin.count,
                            offset,
                        )
            except KafkaClientError as exc:  # nothing skipped: they run again (at-least-once)
                log.warning(
                    "committed offsets of %s unavailable: finished offsets run again (%s)", partitions, exc
                )
        self._d.assign(partitions, finished)

    def _revoke(self, partitions: list[TP]) -> None:
        d = self._d
        timeout_s = 0.0 if self._closing else self._config.revoke_timeout_s
        deadline = time.monotonic() + timeout_s
        if not self._closing:  # finish what lies below the highest finished offset first: no re-runs
            catching = [p for tp in partitions if (p := d.partition(tp)) is not None]
            d.catch_up(catching)
            progress = None if self._commit_revoked is not None else self._commit_progress
            self._catch_up(catching, deadline - timeout_s * (1 - CATCH_UP_SHARE), progress)
        parts = d.begin_revoke(partitions)
        self._unpause(partitions)
        if not parts:
            return
        stop = self._stop_deadline()
        if stop is not None:
            deadline = min(deadline, stop)
        if not d.wait_idle(parts, max(0.0, deadline - time.monotonic())) and not self._closing:
            log.warning(
                "revoke: handlers of %s still running after %g s", partitions, self._config.revoke_timeout_s
            )
        if self._commit_revoked is not None:  # transactional: their records and offsets, before they close
            self._commit_revoked(parts, max(deadline, time.monotonic() + FINAL_COMMIT_MIN_S))
            d.close_parts(parts)
            log.info("revoked %s", partitions)
            return
        final, meta = d.close_parts(parts)
        if final:
            # Store as well as commit: with auto commit librdkafka commits the *stored* offsets of
            # the partitions it unassigns after this callback, which must not be older ones.
            if not self._config.manual_commit:
                for topic, partition, offset in final:
                    try:
                        self._client.store(topic, partition, offset, meta.get((topic, partition), ""))
                    except KafkaClientError as exc:
                        log.debug("store on revoke failed: %s", exc)
            outcome = self._commit(final, meta, max(deadline, time.monotonic() + FINAL_COMMIT_MIN_S))
            log.info("revoked %s, %s %s", partitions, outcome, final)
            return
        log.info("revoked %s", partitions)

    def _commit_progress(self) -> None:
        """During a revoke's catch-up, every ``auto.commit.interval.ms``: commit, without waiting,
        what every assigned partition finished so far (first unfinished offsets, with the metadata
        naming what finished above): the revoking ones, and the others, whose handlers go on while
        the poll thread serves this callback and stores nothing. The classic protocol's coordinator
        takes commits of the current generation while the group rebalances. Without it a SIGKILL
        during a long catch-up re-ran everything finished since the callback began (full
        fault-harness runs: 3,945 duplicates from one kill with nothing committed for 9 s; then, with
        only the revoking partitions committed, 2,098 from the partitions that kept running). Not
        with ``transactional`` (the offsets go with their records in the transaction)."""
        offsets, meta = self._d.commit_offsets(self._d.active())
        if offsets:
            try:
                self._client.commit_async(offsets, meta)
            except KafkaClientError as exc:
                log.debug("progress commit during the revoke's catch-up not sent: %s", exc)

    def _commit(self, offsets: list[tuple[str, int, int]], meta: dict[TP, str], deadline: float) -> str:
        """Commit the revoked partitions' offsets, again while the group refuses it for a rebalance
        that moved on, until ``deadline`` (monotonic seconds).

        The commit is made from this thread, the one serving the callback: a commit sent from
        another thread while a rebalance callback runs waits until the poll serving the callback
        returns (confluent-kafka serializes the calls on one consumer; measured here), so a commit
        in a callback cannot be bounded by a helper thread. Each attempt is bounded by librdkafka's
        own request timeout (``socket.timeout.ms``).

        While a stop is under way (``stop()`` came before this commit), the commit is sent without
        waiting for the group coordinator's answer (``commit_async``), so the stop keeps its bound
        when the broker does not answer (SIGSTOP, a network cut: measured here, a synchronous commit
        in the callback was still waiting 100 s later). Its fate is then unknown: at worst what
        finished since the last commit runs again (at-least-once). A stop that comes while a
        synchronous commit already waits is not bounded by this.

        Returns what is known of the commit, for the log line: ``"committed"`` (confirmed),
        ``"stopping: commit sent, answer not awaited:"`` or ``"not committed:"`` (logged as a
        warning).
        """
        if self._stop_deadline() is not None:
            self._client.commit_async(offsets, meta)
            return "stopping: commit sent, answer not awaited:"
        pause = COMMIT_RETRY_S[0]
        while True:
            try:
                self._client.commit(offsets, meta)
                return "committed"
            except CommitError as exc:
                if exc.code not in COMMIT_AGAIN or time.monotonic() + pause >= deadline:
                    log.warning(
                        "commit on revoke failed: %s (what finished after the last commit runs again)", exc
                    )
                    return "not committed:"
                log.info("commit on revoke refused (%s): trying again in %.2f s", exc.code, pause)
            except KafkaClientError as exc:
                log.warning("commit on revoke failed: %s", exc)
                return "not committed:"
            time.sleep(pause)
            pause = min(COMMIT_RETRY_S[1], pause * 2)

    # -- the pause set --------------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        """Whether back-pressure paused fetching now."""
        return bool(self._paused)

    def paused_partitions(self) -> list[TP]:
        """The partitions back-pressure paused now."""
        return list(self._paused)

    def backpressure(self, over: bool, under_half: bool) -> None:
        """Pause every assigned partition when ``over`` a bound; resume them when ``under_half``."""
        if over:
            new = [tp for tp in self._d.assigned() if tp not in self._paused]
            if new:
                self._client.pause(new)
                self._paused.update(new)
        elif self._paused and under_half:
            assigned = set(self._d.assigned())
            self._client.resume([tp for tp in self._paused if tp in assigned])
            self._paused.clear()

    def _unpause(self, partitions: list[TP]) -> None:
        """Resume the revoked partitions back-pressure paused: librdkafka keeps a partition's pause
        across a revoke and a later re-assignment, and the pause set forgets them here, so nothing
        would ever resume one assigned back (it would never be fetched again)."""
        stale = [tp for tp in partitions if tp in self._paused]
        self._paused.difference_update(partitions)
        if stale:
            try:
                self._client.resume(stale)
            except Exception as exc:  # a rebalance callback must not raise
                log.warning("resume of revoked partitions %s failed: %s", stale, exc)
