"""Store vs commit: getting the finished offsets to the group, from the poll thread.

The xkafka proposal (gojekfarm/xtools issue #25): an offset is stored only for a finished message, in
order, and only for a partition still assigned. ``enable.auto.offset.store`` is always false: after
each poll the first unfinished offset of every partition whose offset moved is *stored*
(librdkafka ``offsets_store``, one partition per call: librdkafka fails a call only when every
partition of it fails, so a mixed call could silently drop one), and librdkafka *commits* stored
offsets every ``auto.commit.interval.ms``; with ``manual_commit`` each advance is committed
synchronously instead. Every store and commit carries the metadata naming the offsets finished
above it (Confluent Parallel Consumer's offset map), and a partition held back by a slow message is
committed with it on the same cadence. Also here: the final commit of a stop, and the ownership
check the Redis sequencer asks for after a stall.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ..config import ConsumerConfig
from ..errors import CommitError, KafkaClientError
from ..kafka import TP, KafkaClient
from .dispatcher import Dispatcher

__all__ = ["Committer", "COMMIT_AGAIN", "BLOCKING_CALL_S"]

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

#: Longest wait of one blocking broker call in the poll thread or a rebalance callback (seconds):
#: the committed offsets read at assign, a synchronous commit (manual commit, the ownership check).
#: A call under way when ``stop()`` comes is waited for inside ``shutdown_timeout_s``.
BLOCKING_CALL_S = 5.0


class Committer:
    """The poll thread's offset work for one run of a consumer.

    Parameters
    ----------
    client, dispatcher, config:
        The run's Kafka client, dispatcher and settings.
    budget:
        ``budget(cap_s) -> seconds`` a blocking call may take now (cut to a stop's deadline).
    on_error:
        Receives a failed manual commit (the consumer's client-error path).
    in_rebalance:
        ``in_rebalance()``: whether a rebalance callback runs now (the ownership check then commits
        nothing, see :meth:`confirm_ownership`). Default: never.
    """

    def __init__(
        self,
        client: KafkaClient,
        dispatcher: Dispatcher,
        config: ConsumerConfig,
        budget: Callable[[float], float],
        on_error: Callable[[KafkaClientError], None],
        in_rebalance: Callable[[], bool] = lambda: False,
    ) -> None:
        self._client = client
        self._d = dispatcher
        self._manual = config.manual_commit
        self._budget = budget
        self._on_error = on_error
        self._in_rebalance = in_rebalance
        self._meta_sent: dict[TP, tuple[int, str]] = {}  # the last metadata commit sent per partition

    def store(self) -> None:
        """Store (or, with ``manual_commit``, commit) the partitions whose first unfinished offset
        moved, each with the metadata naming what finished above it."""
        advances = self._d.advances()
        if not advances:
            return
        client = self._client
        if self._manual:
            meta = {p.tp: m for p, _, m in advances if m}
            try:
                client.commit(
                    [(p.topic, p.partition, wm) for p, wm, _ in advances],
                    meta,
                    timeout_s=self._budget(BLOCKING_CALL_S),
                )
            except KafkaClientError as exc:
                self._on_error(exc)
                self._d.mark_dirty([p for p, _, _ in advances])
                return
            for p, wm, _ in advances:
                p.mark_stored(wm)
            return
        for p, wm, m in advances:
            try:
                client.store(p.topic, p.partition, wm, m)
                p.mark_stored(wm)
            except KafkaClientError as exc:  # e.g. the partition is no longer assigned
                log.debug("offset not stored: %s", exc)

    def commit_metadata(self) -> None:
        """Commit, without waiting, each partition whose offset is held back by an unfinished
        message while offsets above it finished, with the metadata naming those (the offset alone
        does not move, so librdkafka's auto commit would not send it). A crash then re-runs only
        what finished since the last of these commits, not everything above a slow key's message
        (Confluent Parallel Consumer's offset map, committed on its commit cadence)."""
        offsets, meta = self._d.commit_offsets(self._d.active())
        sent = self._meta_sent
        todo = [(t, p, o) for t, p, o in offsets if (t, p) in meta and sent.get((t, p)) != (o, meta[(t, p)])]
        if not todo:
            return
        client = self._client
        if not self._manual:
            # stored first: librdkafka's own auto commit, should it send the stored offset meanwhile,
            # then names as much as this commit does (a commit never names fewer than the one before)
            for t, p, o in todo:
                try:
                    client.store(t, p, o, meta[(t, p)])
                except KafkaClientError as exc:
                    log.debug("offset not stored: %s", exc)
        client.commit_async(todo, meta)
        for t, p, o in todo:
            sent[(t, p)] = (o, meta[(t, p)])

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
        d, client = self._d, self._client
        while True:
            parts = d.active()
            final, meta = d.commit_offsets(parts)
            if not final:
                return
            if meta and not self._manual:  # librdkafka's commit at close uses the stored metadata
                for topic, partition, offset in final:
                    if (topic, partition) in meta:
                        client.store(topic, partition, offset, meta[(topic, partition)])
            try:
                client.commit(final, meta, timeout_s=max(0.5, deadline - time.monotonic()))
            except CommitError as exc:
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

        Inside a rebalance callback (a revoke's catch-up ticks the sequencer) it commits nothing and
        returns ``False``: the commit, bounded, is made from a helper thread, which confluent-kafka
        lets into the client only once the poll serving the callback returned (measured here). It
        then lands after the revoke's own commit, with the offsets of before the catch-up, under
        whatever generation is current by then: the group's committed offset went back (below what
        the revoke, or the partition's next owner, committed), for a partition this member may no
        longer own (``tests/integration/test_revoke_commit.py``). The check is asked again after
        the callback.
        """
        offsets, meta = self._d.commit_offsets(self._d.active())
        if not offsets:
            return True
        if self._in_rebalance():
            log.info(
                "ownership check: not during a rebalance callback (its commit would land after the revoke's)"
            )
            return False
        client = self._client
        try:
            group = client.committed([(t, p) for t, p, _ in offsets], self._budget(BLOCKING_CALL_S))
        except KafkaClientError as exc:
            log.warning("ownership check: committed offsets unavailable (%s)", exc)
            return False
        ahead = [(t, p, o) for t, p, o in offsets if group.get((t, p), (-1, ""))[0] > o]
        if ahead:
            log.warning(
                "ownership check: the group committed past this instance's offsets %s: partitions lost", ahead
            )
            return False
        try:
            client.commit(offsets, meta, timeout_s=self._budget(BLOCKING_CALL_S))
        except KafkaClientError as exc:
            log.warning("ownership check: commit refused (%s): waiting for the rebalance", exc)
            return False
        log.info("ownership check passed for %d partition(s)", len(offsets))
        return True

    def refresh_high_watermarks(self) -> None:
        """Each active partition's end offset, from librdkafka's cached fetch state (no request)."""
        parts = self._d.active()
        if parts:
            highs = self._client.high_watermarks([p.tp for p in parts])
            for p in parts:
                p.saw_high(highs.get(p.tp))
