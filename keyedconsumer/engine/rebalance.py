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
from ..errors import KafkaClientError
from ..kafka import TP, KafkaClient
from ..offsets import FinishedOffsets
from .commits import BLOCKING_CALL_S, FINAL_COMMIT_MIN_S, CommitMode
from .engine import Engine
from .partitions import Partition

__all__ = ["Rebalance", "CATCH_UP_SHARE"]

log = logging.getLogger("keyedconsumer")

#: Share of ``shutdown_timeout_s`` (of ``revoke_timeout_s`` for a revoke) during which a stop (revoke)
#: still starts messages below their partition's highest finished offset (the catch-up); the rest is
#: left to the handlers running then, so a long one started late is not cut short by the commit.
CATCH_UP_SHARE = 0.5


class Rebalance:
    """The rebalance listener and the pause set of one run of a consumer (owner thread).

    Parameters
    ----------
    client, engine, config:
        The run's Kafka client, engine and settings.
    mode:
        The run's commit mode: it commits (and closes) the revoked partitions.
    catch_up:
        ``catch_up(parts, deadline, progress)`` runs what lies below each partition's highest
        finished offset until ``deadline`` (monotonic seconds), calling ``progress()`` every
        ``auto.commit.interval.ms``.
    wait_idle:
        ``wait_idle(parts, timeout_s) -> bool``: wait until nothing of ``parts`` runs.
    budget:
        ``budget(cap_s) -> seconds`` a blocking call may take now (cut to a stop's deadline).
    stop_deadline:
        ``stop_deadline()``: when a stop under way must be over (monotonic seconds), or ``None``.
    """

    def __init__(
        self,
        client: KafkaClient,
        engine: Engine,
        config: ConsumerConfig,
        mode: CommitMode,
        catch_up: Callable[[list[Partition], float, Callable[[], None] | None], None],
        wait_idle: Callable[[list[Partition], float], bool],
        budget: Callable[[float], float],
        stop_deadline: Callable[[], float | None],
    ) -> None:
        self._client = client
        self._engine = engine
        self._config = config
        self._mode = mode
        self._catch_up = catch_up
        self._wait_idle = wait_idle
        self._budget = budget
        self._stop_deadline = stop_deadline
        self._closing = False
        self._at_close: tuple[list[tuple[str, int, int]], dict[TP, str]] = ([], {})
        self._paused: set[TP] = set()
        self._serving = 0  # rebalance callbacks running now (in the owner thread, or in close())
        self._rebalances = 0  # rebalance callbacks served so far (assign, revoke, lost)

    def closing(self, final: tuple[list[tuple[str, int, int]], dict[TP, str]]) -> None:
        """The client is being closed, after the stop's final commit of ``final`` (as
        ``Engine.commit_offsets``). The bounded close may serve a last revoke in a helper thread
        while the owner waits for it: that revoke touches nothing of the engine, and sends
        ``final``'s offsets of its partitions again without waiting (not with ``transactional``:
        the final transaction committed them)."""
        self._closing = True
        self._at_close = final

    def serving(self) -> bool:
        """Whether a rebalance callback (assign, revoke, lost) is running now."""
        return self._serving > 0

    def rebalances(self) -> int:
        """How many rebalance callbacks (assign, revoke, lost) were served so far."""
        return self._rebalances

    # -- the listener (librdkafka's rebalance callbacks) ------------------------------------------

    def on_assign(self, partitions: list[TP]) -> None:
        self._serving += 1
        self._rebalances += 1
        try:
            if not self._closing:
                self._assign(partitions)
        finally:
            self._serving -= 1

    def on_revoke(self, partitions: list[TP]) -> None:
        """Finish what lies below the highest finished offset, wait for the revoked partitions'
        running handlers, and commit, all within ``revoke_timeout_s`` (see the module docstring)."""
        self._serving += 1
        self._rebalances += 1
        try:
            if self._closing:
                self._revoke_at_close(partitions)
            else:
                self._revoke(partitions)
        finally:
            self._serving -= 1

    def _revoke_at_close(self, partitions: list[TP]) -> None:
        offsets, meta = self._at_close
        mine = set(partitions)
        final = [(t, p, o) for t, p, o in offsets if (t, p) in mine]
        if final and not self._config.transactional:
            try:
                self._client.commit_async(final, meta)
            except KafkaClientError as exc:
                log.debug("commit at close not sent: %s", exc)
            else:
                log.info(
                    "revoked %s at close: the final commit's offsets sent once more, answer not awaited: %s",
                    partitions,
                    final,
                )
                return
        log.info("revoked %s at close", partitions)

    def on_lost(self, partitions: list[TP]) -> None:
        self._serving += 1
        self._rebalances += 1
        try:
            log.warning("lost %s: dropping their messages without committing", partitions)
            if not self._closing:
                self._engine.begin_revoke(partitions, lost=True)
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
        self._engine.assign(partitions, finished)

    def _revoke(self, partitions: list[TP]) -> None:
        engine = self._engine
        timeout_s = self._config.revoke_timeout_s
        deadline = time.monotonic() + timeout_s
        # finish what lies below the highest finished offset first: no re-runs
        catching = [p for tp in partitions if (p := engine.partitions.get(tp)) is not None]
        engine.catch_up(catching)
        self._catch_up(catching, deadline - timeout_s * (1 - CATCH_UP_SHARE), self._mode.progress)
        parts = engine.begin_revoke(partitions)
        self._unpause(partitions)
        if not parts:
            return
        stop = self._stop_deadline()
        if stop is not None:
            deadline = min(deadline, stop)
        if not self._wait_idle(parts, max(0.0, deadline - time.monotonic())):
            log.warning(
                "revoke: handlers of %s still running after %g s", partitions, self._config.revoke_timeout_s
            )
        # a stop that came meanwhile makes the commit one that does not wait (see CommitMode.revoke)
        stopping = self._stop_deadline() is not None
        outcome = self._mode.revoke(parts, max(deadline, time.monotonic() + FINAL_COMMIT_MIN_S), stopping)
        log.info("revoked %s%s", partitions, f", {outcome}" if outcome else "")

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
            new = [tp for tp in self._engine.assignment if tp not in self._paused]
            if new:
                self._client.pause(new)
                self._paused.update(new)
        elif self._paused and under_half:
            assigned = set(self._engine.assignment)
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
