"""One run of a consumer: the owner loop, from the first poll to the closed client.

The owner thread (the thread that calls :meth:`Run.serve`: ``KeyedConsumer.run()``'s, or the poll
thread ``run_async()`` starts) owns the run's :class:`~.engine.Engine` and its Kafka client. Each
*turn* it drains its :class:`~.workers.Mailbox` (the workers' outcomes, the sequencer's posts),
ticks the sequencer, makes due retries ready, hands ready work to the workers, waits (on the
mailbox while handlers run, else in the poll), polls and admits a batch of records, takes back work
from a worker stuck in a slow handler, stores (or commits) what advanced, and pauses or resumes
fetching under back-pressure. librdkafka runs the rebalance callbacks inside the poll, in this
thread (:mod:`.rebalance`): a revoke's catch-up and its wait for running handlers pump the mailbox
like a turn, without polling.

A stop (:class:`StopSignal`, from any thread) lets the loop end; :meth:`Run.serve` then catches up,
waits for running handlers, commits and closes, within the stop's deadline plus
:data:`SHUTDOWN_MARGIN_S`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ..config import ConsumerConfig
from ..errors import KafkaClientError
from ..kafka import MISSING_TOPIC, ClientFactory, KafkaClient
from ..kafka.logs import client_errors
from ..message import Message
from .batch import BatchRun
from .commits import (
    BLOCKING_CALL_S,
    FINAL_COMMIT_MIN_S,
    AutoCommit,
    CommitMode,
    ManualCommit,
)
from .engine import Engine
from .handler import Contract
from .handout import RESCUE_EVERY_S, HandOut
from .latch import Latch
from .partitions import Partition
from .rebalance import CATCH_UP_SHARE, Rebalance
from .results import Results
from .runner import AsyncRunner, Runner
from .sequencer import GroupTiming, Sequencer
from .settle import Settler
from .status import PartitionStatus, statuses
from .transactions import TransactionalCommit
from .workers import AsyncWorkers, Mailbox, ThreadWorkers, Workers

__all__ = ["Run", "StopSignal", "CLOSE_TIMEOUT_S", "SHUTDOWN_MARGIN_S"]

log = logging.getLogger("keyedconsumer")

#: How long ``close()`` of the Kafka client may take (seconds): leaving the group and librdkafka's
#: own commit at close wait on the broker, which may be stopped or gone (confluent-kafka-python
#: #1667). Past it the close is left to finish on its own and ``run()`` returns.
CLOSE_TIMEOUT_S = 5.0
#: ``run()`` returns within ``max(shutdown_timeout_s, BLOCKING_CALL_S) + SHUTDOWN_MARGIN_S`` seconds
#: of ``stop()``, whatever the broker does: the final commit, the bounded close, releasing Redis
#: leases and joining the workers fit in the margin.
SHUTDOWN_MARGIN_S = 10.0
#: The longest wait for workers' outcomes while Kafka may have records for idle workers (seconds);
#: it grows from 1 ms while nothing happens.
IDLE_SLICE_S = (0.001, 0.02)
#: How often the owner publishes the partitions' status (seconds).
STATUS_EVERY_S = 0.2


class StopSignal:
    """A graceful stop, requested from any thread (``KeyedConsumer.stop()``, a signal handler, a
    failure): a one-way latch and the stop's deadline (monotonic seconds). The owner clears it when
    its run ended."""

    def __init__(self) -> None:
        self.latch = Latch()
        self.deadline: float | None = None
        self.wake: Callable[[], None] | None = None  # wakes the owner waiting on its mailbox

    def request(self, timeout_s: float) -> None:
        if self.deadline is None:
            self.deadline = time.monotonic() + timeout_s
        self.latch.set()
        wake = self.wake
        if wake is not None:
            wake()

    def is_set(self) -> bool:
        return self.latch.on

    def clear(self) -> None:
        self.latch.clear()
        self.deadline = None


def _noop(_: Any) -> None:
    pass


class Run:
    """One run of a consumer (see the module docstring). Built by ``KeyedConsumer`` for each run.

    Parameters
    ----------
    config:
        The consumer's settings.
    factory:
        Builds the Kafka client.
    sequencer, clock:
        As ``KeyedConsumer``'s.
    handler:
        The composed handler chain, or the batch handler (with ``batch``).
    batch:
        The batch handler's run, or ``None``.
    is_async:
        Whether ``handler`` is ``async def`` (run by worker coroutines on ``loop``).
    loop:
        The event loop of ``async def`` handlers (``run_async``: the caller's); ``None``: a
        private loop in a thread of its own.
    error_handler, contract, results:
        As ``KeyedConsumer``'s: the settling step's.
    stop:
        The consumer's stop signal.
    on_conflated:
        ``on_conflated(message)`` for each conflated message, or ``None``.
    """

    def __init__(
        self,
        config: ConsumerConfig,
        factory: ClientFactory,
        sequencer: Sequencer,
        clock: Callable[[], float],
        handler: Any,
        batch: BatchRun | None,
        is_async: bool,
        loop: asyncio.AbstractEventLoop | None,
        error_handler: Callable[[BaseException, Message | None], Any] | None,
        contract: Contract,
        results: Results,
        stop: StopSignal,
        on_conflated: Callable[[Message], None] | None,
    ) -> None:
        self.config = cfg = config
        self._factory = factory
        self._seq = sequencer
        self._clock = clock
        self._results = results
        self._stop = stop
        self._on_conflated = on_conflated
        self._error_handler = error_handler
        self.error: BaseException | None = None
        self._error_lock = threading.Lock()
        self.mailbox = Mailbox()
        self.engine = Engine(
            cfg.ordering,
            sequencer,
            self.mailbox.post,
            clock,
            cfg.group,
            cfg.commit_metadata_max_bytes,
            cfg.max_in_flight,
            cfg.max_in_flight_bytes,
            cfg.conflate,
            stop.latch,
        )
        settle = Settler(
            self.engine, error_handler, self.fail, contract, results.finished if cfg.transactional else None
        )
        may_start = self.engine.may_start
        self._batch_size = cfg.handler_batch_size if batch is not None else 0
        self.workers: Workers
        if is_async:
            arunner = AsyncRunner(handler, settle, may_start, batch)
            self.workers = AsyncWorkers(
                arunner.run, self.mailbox, self._report, cfg.concurrency, loop, cfg.event_loop
            )
        else:
            runner = Runner(handler, settle, may_start, batch)
            self.workers = ThreadWorkers(runner.run, self.mailbox, self._report, cfg.concurrency)
        self.handout = HandOut(self.engine, self.workers, self._batch_size, cfg.handler_batch_linger_s)
        self._slice_s = IDLE_SLICE_S[0]
        self.client: KafkaClient | None = None
        self.rebalance: Rebalance | None = None
        #: When the loop last returned from a poll (monotonic seconds; 0.0 before the first).
        self.polled_at_s = 0.0
        #: The partitions' status, published by the owner every ``STATUS_EVERY_S``.
        self.status: list[PartitionStatus] = []
        self._meta_every_s = float(cfg.librdkafka().get("auto.commit.interval.ms", 5000)) / 1000.0

    # -- failures (any thread) ----------------------------------------------------------------------

    def fail(self, error: BaseException) -> None:
        """Stop the run with ``error`` (``run()`` raises it): nothing new starts from now on."""
        with self._error_lock:
            if self.error is None:
                self.error = error
                log.error("stopping: %s", error)
        self.engine.signal_halt()
        self._stop.request(self.config.shutdown_timeout_s)
        self.mailbox.post(self._halt)

    def _report(self, outcome: tuple[list[Any], float]) -> None:
        self.handout.report(outcome)

    def _halt(self, _: Any = None) -> None:
        self.engine.halt()

    def on_client_error(self, err: KafkaClientError) -> None:
        if err.fatal or (err.code == MISSING_TOPIC and self.config.require_topics):
            self.fail(err)
        elif self._error_handler is not None:
            try:
                self._error_handler(err, None)
            except BaseException as exc:
                self.fail(exc)
        else:
            client_errors.warning("%s", err)  # a repeat is counted, not logged (kafka/logs.py)

    def _budget(self, cap_s: float) -> float:
        """Seconds a blocking step may take now: ``cap_s``, cut to the stop's deadline when a stop
        is under way (at least 0.5 s, so one attempt is always made)."""
        left = cap_s
        deadline = self._stop.deadline
        if deadline is not None:
            left = min(left, deadline - time.monotonic())
        return max(0.5, left)

    # -- the owner loop -----------------------------------------------------------------------------

    def serve(self) -> None:
        """Poll, admit, hand out, settle, store; until stopped. Then shut down (see the module
        docstring).

        Raises
        ------
        BaseException
            What stopped the run (:meth:`fail`), after the shutdown.
        """
        cfg, engine, seq = self.config, self.engine, self._seq
        client = self.client = self._factory(cfg.librdkafka(), self.on_client_error)
        self._results.attach(client.publisher)
        self._stop.wake = lambda: self.mailbox.post(_noop)
        mode = self.mode = self._commit_mode(client)
        rebalance = self.rebalance = Rebalance(
            client,
            engine,
            cfg,
            mode,
            self._catch_up,
            self.wait_idle,
            self._budget,
            lambda: self._stop.deadline,
        )
        started = False
        try:
            client.check_brokers(cfg.startup_timeout_s)
            mode.start()
            seq.attach(engine.port, self.fail, mode.confirm_ownership, GroupTiming.of(cfg.librdkafka()))
            if not self._stop.is_set():  # stopped before it started: never join the group
                client.subscribe(cfg.topics, rebalance)
            self.workers.start()
            started = True
            self._loop(client, mode, rebalance)
        finally:
            self._shutdown(client, mode, rebalance, started)
            self._stop.wake = None
        if self.error is not None:
            raise self.error

    def _commit_mode(self, client: KafkaClient) -> CommitMode:
        cfg, engine = self.config, self.engine
        if cfg.transactional:
            return TransactionalCommit(client, engine, cfg, self._budget, self._results, self.fail)
        kind = ManualCommit if cfg.manual_commit else AutoCommit
        return kind(client, engine, cfg, self._budget, self.on_client_error, self._serving, self._rebalances)

    def _serving(self) -> bool:
        return self.rebalance is not None and self.rebalance.serving()

    def _rebalances(self) -> int:
        return self.rebalance.rebalances() if self.rebalance is not None else 0

    def _loop(self, client: KafkaClient, mode: CommitMode, rebalance: Rebalance) -> None:
        cfg, engine, mailbox, stop = self.config, self.engine, self.mailbox, self._stop
        flow = engine.flow
        batch, poll_timeout_s = cfg.batch_size, cfg.poll_timeout_s
        next_status = 0.0
        next_meta = time.monotonic() + self._meta_every_s
        while not stop.is_set():
            mailbox.hurry(False)  # see _pump
            mailbox.drain()
            self.handout.turn(mailbox.answered(), time.perf_counter())
            # refill the workers the drained outcomes freed before the sequencer's tick, which may
            # wait on Redis (the Redis sequencer's parking): they run meanwhile
            self.handout.dispatch()
            timeout_s = self._timers(poll_timeout_s)
            self.handout.dispatch()
            if mailbox or self.handout.more:
                timeout_s = 0.0
            elif rebalance.paused and timeout_s > 0.01 and not flow.running:
                timeout_s = 0.01  # paused: nothing arrives, so look again soon for room to resume
            if timeout_s > 0 and flow.running:
                # handlers run: their outcomes free lanes and room, so wait for them rather than
                # in the poll; in slices when workers are idle and Kafka may have records for them
                saturated = engine.ready_count() or rebalance.paused or flow.short_of_room(batch)
                wait_s = timeout_s if saturated else min(timeout_s, self._slice_s)
                if engine.chunk > 1:  # workers ring rarely: look for one stuck in a handler meanwhile
                    wait_s = min(wait_s, RESCUE_EVERY_S)
                if client.wait_outcomes(mailbox.wait, wait_s):
                    self._slice_s = IDLE_SLICE_S[0]
                    self.handout.dispatch()
                elif not saturated:
                    self._slice_s = min(IDLE_SLICE_S[1], self._slice_s * 2)
                timeout_s = 0.0
            asked = flow.poll_size(batch)
            msgs = client.poll_batch(asked, timeout_s)
            now = self.polled_at_s = time.monotonic()
            # a batch handler's partial batch is not cut while records are at hand
            self.handout.polled(len(msgs), asked)
            if msgs:
                self._slice_s = IDLE_SLICE_S[0]
                conflated = engine.admit(msgs)
                if conflated:
                    self._report_conflated(conflated)
                self.handout.dispatch()
            if now >= self.handout.next_rescue:
                self.handout.rescue(False)
            mode.store()
            rebalance.backpressure(flow.over(), flow.under_half())
            if now >= next_status:
                next_status = now + STATUS_EVERY_S
                self._refresh_status(client)
            if now >= next_meta and cfg.commit_metadata_max_bytes:
                next_meta = now + self._meta_every_s
                mode.commit_metadata()

    def _timers(self, timeout_s: float) -> float:
        """Tick the sequencer and make due retries ready; returns ``timeout_s`` cut to the next
        timer (the sequencer's hint, the next retry due, a batch's linger)."""
        engine = self.engine
        hint_s = self._seq.tick()
        conflated = engine.take_conflated()
        if conflated:
            self._report_conflated(conflated)
        if hint_s is not None and hint_s < timeout_s:
            timeout_s = hint_s
        if engine.next_due_s() is not None:
            due_s = engine.release_due(self._clock())
            if due_s is not None and due_s < timeout_s:
                timeout_s = max(0.0, due_s)
        linger_until = self.handout.linger_until
        if linger_until is not None:
            timeout_s = min(timeout_s, max(0.0, linger_until - time.monotonic()))
        return timeout_s

    def _pump(self, wait_s: float) -> None:
        """A turn without polling Kafka (inside a rebalance callback, or stopping): tick the
        sequencer, release due retries and held heads, settle outcomes, hand out work. The owner
        waits here for running handlers: workers ring on every outcome until the loop's next turn
        (:meth:`.workers.Mailbox.hurry`)."""
        self.mailbox.hurry(True)
        self._timers(0.0)
        self.engine.release_held()
        self.handout.rescue(False)
        self.handout.dispatch()
        if self.mailbox.wait(wait_s):
            self.handout.dispatch()

    def wait_idle(self, parts: list[Partition] | None, timeout_s: float) -> bool:
        """Wait until nothing of ``parts`` (all partitions when ``None``) runs; returns success.
        Messages a worker took but has not started are taken back meanwhile, and outcomes it has
        not reported yet are settled, so only handlers really running are waited for."""
        deadline = time.monotonic() + timeout_s
        engine = self.engine
        while True:
            stop = self._stop.deadline
            if stop is not None and stop < deadline:  # a stop came meanwhile: its deadline binds
                deadline = stop
            self.handout.rescue(True)
            self.mailbox.drain()
            if engine.running_in(parts) == 0:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._pump(min(left, 0.05))

    def _catch_up(
        self, parts: list[Partition], deadline: float, progress: Callable[[], None] | None = None
    ) -> None:
        """Let the messages below each partition's highest finished offset run (only those start:
        ``Engine.may_start``), until ``deadline`` (monotonic seconds; or the end of the catch-up
        share of a stop requested meanwhile, :data:`~.rebalance.CATCH_UP_SHARE`), so the offset
        stored next covers every finished message. Retries due within the time left run too; longer
        back-offs are not waited for. Calls ``progress()`` (a revoke's commit of what finished so
        far) every ``auto.commit.interval.ms``."""
        engine = self.engine
        next_progress = time.monotonic() + self._meta_every_s
        stop_deadline = self._stop.deadline
        if stop_deadline is not None:  # a stop under way: its own catch-up share
            deadline = min(deadline, stop_deadline - self.config.shutdown_timeout_s * (1 - CATCH_UP_SHARE))
        while time.monotonic() < deadline:
            if not engine.catching_up(parts, self._clock() + (deadline - time.monotonic())):
                return
            self._pump(min(0.005, max(0.0, deadline - time.monotonic())))
            if progress is not None and time.monotonic() >= next_progress:
                progress()
                next_progress = time.monotonic() + self._meta_every_s

    # -- reports ------------------------------------------------------------------------------------

    def _report_conflated(self, msgs: list[Message]) -> None:
        if self._on_conflated is None:
            return
        for m in msgs:
            try:
                self._on_conflated(m)
            except Exception:
                log.exception("on_conflated raised for %s[%d]@%d", m.topic, m.partition, m.offset)

    def _refresh_status(self, client: KafkaClient) -> None:
        """Each active partition's end offset (librdkafka's cached fetch state, no request), and
        the published status."""
        parts = self.engine.partitions.active()
        if parts:
            highs = client.high_watermarks([p.tp for p in parts])
            for p in parts:
                p.saw_high(highs.get(p.tp))
        self.status = statuses(parts, time.monotonic())

    # -- the end ------------------------------------------------------------------------------------

    def _shutdown(self, client: KafkaClient, mode: CommitMode, rebalance: Rebalance, started: bool) -> None:
        """Stop within the stop's deadline (``shutdown_timeout_s`` from ``stop()``) plus
        :data:`SHUTDOWN_MARGIN_S`: catch up, wait for running handlers, commit, close."""
        engine, cfg = self.engine, self.config
        deadline = self._stop.deadline or time.monotonic() + cfg.shutdown_timeout_s
        self.mailbox.drain()
        if started and self.error is None:
            self._catch_up(engine.partitions.active(), deadline)  # its share of the time: see _catch_up
        engine.halt()
        if started and not self.wait_idle(None, max(0.0, deadline - time.monotonic())):
            log.warning(
                "%d handler(s) still running after shutdown_timeout_s=%g; their offsets are not committed",
                engine.running,
                cfg.shutdown_timeout_s,
            )
        self._seq.settle_pending()
        conflated = engine.take_conflated()
        if conflated:
            self._report_conflated(conflated)
        try:
            mode.store()
            if started:
                mode.commit_final(max(deadline, time.monotonic() + FINAL_COMMIT_MIN_S))
        except KafkaClientError as exc:
            log.warning("final commit failed: %s (what finished after the last commit runs again)", exc)
        self.status = statuses(engine.partitions.active(), time.monotonic())
        rebalance.closing(engine.partitions.commit_offsets(engine.partitions.active()))
        try:
            if not client.close(timeout_s=CLOSE_TIMEOUT_S):
                log.warning(
                    "the Kafka client did not close within %g s (a stopped or unreachable broker?): "
                    "left to close on its own; the group drops this member after session.timeout.ms",
                    CLOSE_TIMEOUT_S,
                )
        except Exception as exc:  # closing must not hide the error that stopped us
            log.warning("closing the Kafka client failed: %s", exc)
        engine.close()
        self.workers.close()
        if started:
            self.workers.join(max(0.5, min(5.0, deadline - time.monotonic())))
        mode.close()
        self._results.detach()
        self._seq.detach()


__all__ += ["BLOCKING_CALL_S"]
