"""KeyedConsumer: the story of a run. Poll, admit, store, commit; stop.

One poll thread owns the Kafka client: it polls, admits the records to the dispatcher
(:mod:`keyedconsumer.engine.dispatcher`), stores or commits what the workers finished
(:mod:`keyedconsumer.engine.commits`), pauses fetching under back-pressure and serves rebalances
(:mod:`keyedconsumer.engine.rebalance`, whose callbacks librdkafka runs inside its poll call, in the
same thread). Workers (:mod:`keyedconsumer.engine.executors`) run the handler chain
(:mod:`keyedconsumer.engine.handler`) and settle each end (:mod:`keyedconsumer.engine.settle`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from . import signals
from .config import ConsumerConfig
from .engine.batch import (
    AsyncBatchExecutor,
    BatchHandler,
    BatchRun,
    ThreadBatchExecutor,
    check_batch_middlewares,
)
from .engine.commits import BLOCKING_CALL_S, Committer
from .engine.dispatcher import Dispatcher
from .engine.executors import AsyncExecutor, Executor, ThreadExecutor
from .engine.handler import (
    Contract,
    ErrorHandler,
    Handler,
    Middleware,
    bind,
    check_error_handler,
    compose,
    is_async,
)
from .engine.partitions import Partition
from .engine.rebalance import CATCH_UP_SHARE, FINAL_COMMIT_MIN_S, Rebalance
from .engine.results import Results
from .engine.settle import Settler
from .engine.timelimit import TimeLimit
from .engine.transactions import TransactionalCommitter
from .errors import KafkaClientError, KeyedConsumerError
from .kafka import TP, ClientFactory, KafkaClient
from .message import Message
from .sequencing import RedisSequencer
from .sequencing.base import InMemorySequencer, Sequencer

__all__ = [
    "KeyedConsumer",
    "Handler",
    "BatchHandler",
    "Middleware",
    "ErrorHandler",
    "PartitionStatus",
    "compose",
    "BLOCKING_CALL_S",
    "CLOSE_TIMEOUT_S",
    "SHUTDOWN_MARGIN_S",
]

log = logging.getLogger("keyedconsumer")

#: How long ``close()`` of the Kafka client may take (seconds): leaving the group and librdkafka's
#: own commit at close wait on the broker, which may be stopped or gone (confluent-kafka-python
#: #1667). Past it the close is left to finish on its own and ``run()`` returns.
CLOSE_TIMEOUT_S = 5.0
#: ``run()`` returns within ``max(shutdown_timeout_s, BLOCKING_CALL_S) + SHUTDOWN_MARGIN_S`` seconds
#: of ``stop()``, whatever the broker does: the final commit, the bounded close, releasing Redis
#: leases and joining the workers fit in the margin.
SHUTDOWN_MARGIN_S = 10.0


class KeyedConsumer:
    """Consume Kafka topics concurrently, one message at a time per key, storing only finished offsets.

    Parameters
    ----------
    handler:
        ``def handle(msg: Message) -> None`` (run on a pool of ``concurrency`` threads) or
        ``async def`` (run as ``concurrency`` coroutines on one event loop). Raise, or call
        ``msg.ack_fail(err)``, to fail; ``msg.ack_skip()`` to skip. A plain function must not return
        an awaitable (``lambda m: handle_async(m)``): nothing would await it, so the engine stops
        the consumer and ``run()`` raises :class:`HandlerContractError` (see there).
    batch_handler:
        Instead of ``handler``: ``def handle(msgs: list[Message]) -> None`` or ``async def``, called
        with up to ``handler_batch_size`` messages, **at most one per key** (per partition with
        ``ordering="partition"``), so per-key order and one message in flight per key hold as with
        ``handler``. Each message ends on its own: raise :class:`~keyedconsumer.BatchFailed`
        ``({msg: exc})`` to fail some (the others are done); call ``msg.ack_skip()`` /
        ``msg.ack_fail(err)`` per message; any other exception fails every message not acknowledged
        (``ack_success``) before it. ``handler_timeout_s`` is the limit of one batch call. Only
        outcome middlewares (``Retry``, ``DeadLetter``, ``Recover``) are taken, applied to each
        message's end; see :mod:`keyedconsumer.engine.batch`.
    middlewares:
        A list of handler-in, handler-out callables (instances: ``Retry(...)``, not ``Retry``); the
        first given is the outermost. A middleware with a ``bind_settings(settings: ConsumerConfig)``
        method gets this consumer's settings first (outermost first, before the chain is composed),
        so that, e.g., ``DeadLetter()`` publishes with the consumer's brokers and security settings
        without the user repeating them.
    error_handler:
        ``error_handler(error, message_or_None)`` for failures no middleware handled and for Kafka
        client errors: a plain callable (not ``async def``: it is not awaited) taking these two
        arguments. Returning normally marks a failed message handled (status ``FAIL``, done);
        raising, or no handler at all, stops the consumer and ``run()`` raises.
    client_factory:
        Builds the Kafka client (default: librdkafka via confluent-kafka); tests may pass another.
    sequencer:
        ``RedisSequencer(...)`` for per-key leases across instances; default in-memory sequencing.
    clock:
        Monotonic clock in seconds that times ``RetryLater`` delays (default ``time.monotonic``;
        :mod:`keyedconsumer.testing` passes a fake clock, so back-off runs without sleeping).
    on_conflated:
        With ``conflate=True``: ``on_conflated(message)`` for each message replaced by a newer one
        of its key before it ran (it counts done; called from the poll thread, keep it short: a
        log line, a counter, ``Audit.conflated``). Exceptions it raises are logged and ignored.
    settings:
        A ready :class:`ConsumerConfig`. ``**options`` are its fields (``name``, ``brokers``,
        ``topics``, ``concurrency``, ``ordering``, ``manual_commit``, ``max_in_flight``, ``config``
        ...), also readable from ``KEYEDCONSUMER_*`` variables; given next to ``settings``, they
        replace its fields and the result is validated again (:meth:`ConsumerConfig.override`).

    Raises
    ------
    pydantic.ValidationError
        A bad option, naming the field.
    TypeError
        Neither or both of ``handler`` and ``batch_handler``; a batch handler with a middleware that
        does not act on outcomes only (``Typed``, ``Logging``, ``Metrics``, ``Tracing``, ``Audit``);
        ``handler`` is not callable; ``middlewares`` is not a list, or one is not callable, is a
        class passed instead of an instance (the message says what to write), or returned a
        non-callable; ``error_handler`` is a class, not callable, ``async def``, or cannot take
        ``(error, message)``.
    Exception
        What a middleware's ``bind_settings`` raises (``DeadLetter``: ``PublishError`` when its
        producer cannot be built, ``ValueError`` when it is bound to two different clusters).
    """

    def __init__(
        self,
        *,
        handler: Handler | None = None,
        batch_handler: BatchHandler | None = None,
        middlewares: Sequence[Middleware] = (),
        error_handler: ErrorHandler | None = None,
        client_factory: ClientFactory | None = None,
        settings: ConsumerConfig | None = None,
        sequencer: Sequencer | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_conflated: Callable[[Message], None] | None = None,
        **options: Any,
    ) -> None:
        if settings is None:
            self.config = ConsumerConfig(**options)
        else:
            self.config = settings.override(**options) if options else settings
        if sequencer is not None and self.config.ordering == "none":
            raise ValueError("a sequencer orders keys or partitions: it needs ordering='key' or 'partition'")
        if self.config.transactional and isinstance(sequencer, RedisSequencer):
            raise ValueError(
                "transactional=True does not combine with the RedisSequencer: parked messages are "
                "settled in Redis, outside the Kafka transaction (docs/exactly-once.md)"
            )
        check_error_handler(error_handler)
        if (handler is None) == (batch_handler is None):
            raise TypeError(
                "give one of handler= (one message per call) or batch_handler= (a list of messages)"
            )
        if batch_handler is not None:
            check_batch_middlewares(middlewares)
        self._sequencer: Sequencer = sequencer if sequencer is not None else InMemorySequencer()
        self._clock = clock
        self._on_conflated = on_conflated
        self._conflated_before = 0  # conflated by earlier runs (each run has a dispatcher of its own)
        #: The handler contract: a plain handler returning an awaitable is recorded where it
        #: returns, inside every middleware, so that no middleware can hide it.
        self._contract = Contract()
        bind(middlewares, self.config)
        self._time_limit = TimeLimit(self.config.handler_timeout_s)
        #: the records handlers produce (msg.produce): written before their message counts done
        self._results = Results(
            self.config.transactional, self.config.produce_timeout_s, self.config.concurrency
        )
        self._batch: BatchRun | None = None
        if batch_handler is not None:
            self._batch = BatchRun(self._time_limit.wrap_batch(batch_handler), middlewares, self._results)
            self._handler: Any = self._batch.handler
            self._async = self._batch.is_async
        else:
            assert handler is not None
            self._handler = compose(
                self._contract.wrap(self._results.wrap(self._time_limit.wrap(handler))), middlewares
            )
            self._async = is_async(self._handler)
        self._error_handler = error_handler
        if client_factory is None:
            from .kafka.client import connect

            client_factory = connect
        self._factory: ClientFactory = client_factory
        self._stop = threading.Event()
        # when the stop in progress must be over (monotonic seconds; None: no stop requested)
        self._stop_deadline: float | None = None
        self._error: BaseException | None = None
        self._error_lock = threading.Lock()
        self._active = False
        self._peak = 0
        self._rebalance: Rebalance | None = None  # the run's rebalance listener and pause set
        self._d = self._dispatcher()
        #: When the poll loop last returned from a poll (monotonic seconds; 0.0 before the first):
        #: liveness for health checks.
        self.polled_at_s = 0.0

    def _dispatcher(self) -> Dispatcher:
        cfg = self.config
        return Dispatcher(
            cfg.ordering,
            cfg.concurrency,
            self._sequencer,
            self._clock,
            cfg.group,
            cfg.commit_metadata_max_bytes,
            cfg.max_in_flight,
            cfg.max_in_flight_bytes,
            cfg.conflate,
        )

    # -- public ---------------------------------------------------------------------------------

    def run(self) -> None:
        """Consume until :meth:`stop`, SIGINT/SIGTERM, or an unhandled error.

        While it runs, the consumer is registered with :mod:`keyedconsumer.signals`: SIGINT and
        SIGTERM stop every registered consumer of the process. Their handler is installed when a
        consumer registers from the main thread, and the previous handlers are restored when the
        last one ends; a consumer run in another thread is stopped by it whenever it is installed.

        Raises
        ------
        MessageError
            A message failed and nothing handled it (after the graceful stop; offsets were committed
            up to, never past, that message).
        HandlerContractError
            The handler (or the composed chain) returned an awaitable instead of running it: declare
            the handler ``async def``. Stopped the same way; never retried, dead-lettered or given to
            ``error_handler``.
        KafkaClientError
            A fatal client error, no answer from the brokers within ``startup_timeout_s``, or an
            invalid librdkafka property.
        """
        signals.register(self)
        try:
            self._reset()
            self._serve(self._executor(None))
        finally:
            signals.unregister(self)

    async def run_async(self) -> None:
        """Like :meth:`run`, awaited. ``async def`` handlers run on the caller's event loop.

        SIGINT and SIGTERM stop it gracefully, as :meth:`run` (registered with
        :mod:`keyedconsumer.signals`; the handler is installed when it runs on the main thread's
        loop, replacing asyncio's own SIGINT handler while any consumer runs), so
        ``asyncio.gather(c1.run_async(), c2.run_async())`` stops both on one signal. Cancelling the
        awaiting task stops the consumer gracefully, then re-raises the cancellation.
        """
        loop = asyncio.get_running_loop()
        self._reset()
        # a thread of its own, not the loop's default executor (a few threads, shared): an app of
        # many consumers on one loop must never wait for a free thread to start one
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        executor = self._executor(loop)

        def serve() -> None:
            try:
                self._serve(executor)
            except BaseException as exc:  # handed to the awaiting task
                done.set_exception(exc)
            else:
                done.set_result(None)

        threading.Thread(target=serve, name=f"keyedconsumer-{self.config.name}", daemon=True).start()
        fut = asyncio.wrap_future(done)
        signals.register(self)
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            self.stop()
            await fut
            raise
        finally:
            signals.unregister(self)

    def _executor(self, loop: asyncio.AbstractEventLoop | None) -> Executor:
        settle = Settler(
            self._d,
            self._error_handler,
            self._fail,
            self._contract,
            self._results.finished if self.config.transactional else None,
        )
        cfg = self.config
        if self._batch is not None:
            size, linger_s = cfg.handler_batch_size, cfg.handler_batch_linger_s
            if self._async:
                return AsyncBatchExecutor(
                    self._d, self._batch, settle, cfg.concurrency, size, linger_s, loop, cfg.event_loop
                )
            return ThreadBatchExecutor(self._d, self._batch, settle, cfg.concurrency, size, linger_s)
        if self._async:
            return AsyncExecutor(
                self._d, self._handler, settle, self.config.concurrency, loop, self.config.event_loop
            )
        return ThreadExecutor(self._d, self._handler, settle, self.config.concurrency)

    def _reset(self) -> None:
        if self._active:
            raise KeyedConsumerError("this consumer is already running")
        # _stop is not cleared here: a stop() that came before this run started must stop it.
        # It is cleared when a run ends.
        self._error = None
        self._contract.clear()
        self._peak = self.peak_in_flight
        self._conflated_before += self._d.conflated
        self._d = self._dispatcher()

    def stop(self) -> None:
        """Stop gracefully: start nothing new (from this call on) except messages below their
        partition's highest finished offset, so that the committed offset can reach every message
        that finished (otherwise they would run again after the restart or rebalance), let running
        handlers finish (all of this within ``shutdown_timeout_s``), commit the finished offsets,
        close the client (leaving the group). Safe from any thread, from a handler and from a signal handler; returns at once.
        A ``stop()`` before ``run()`` makes that run stop at once.

        ``run()`` returns within ``max(shutdown_timeout_s, 5 s) + 10 s`` of the first ``stop()``
        (:data:`SHUTDOWN_MARGIN_S`), whatever the broker does (stopped, gone, in a rebalance): what
        could not be committed by then is logged and runs again after the restart or rebalance."""
        # lock-free: workers check it before starting each message. Only messages below their
        # partition's highest finished offset still start (up to shutdown_timeout_s), so the
        # committed offset reaches what already finished and nothing finished runs again.
        if self._stop_deadline is None:
            self._stop_deadline = time.monotonic() + self.config.shutdown_timeout_s
        self._d.stop_starting()
        self._stop.set()

    def schedule(
        self,
        key: bytes | None,
        value: bytes | None,
        headers: list[tuple[str, bytes | None]] | None = None,
        *,
        delay_s: float | None = None,
        at: float | None = None,
        topic: str | None = None,
    ) -> str:
        """Deliver a message to the handler at its due time, in its key's order (go-distr-ep's
        ScheduleEvent, BigBen's delayed execution). Needs a :class:`RedisSequencer`.

        ``delay_s``: seconds from now; or ``at``: seconds since the epoch. ``topic`` (default the
        first subscribed topic) is what the handler sees; the message is not written to Kafka.
        Returns the scheduled message's id. See :meth:`RedisSequencer.schedule`.

        Raises
        ------
        KeyedConsumerError
            No Redis sequencer.
        ValueError
            Neither or both of ``delay_s`` and ``at``, or a bad time.
        """
        if not isinstance(self._sequencer, RedisSequencer):
            raise KeyedConsumerError(
                "schedule() needs sequencer=RedisSequencer(...): scheduled messages live in Redis"
            )
        return self._sequencer.schedule(
            topic or self.config.topics[0], key, value, headers, delay_s=delay_s, at=at
        )

    @property
    def running(self) -> bool:
        """True while :meth:`run` / :meth:`run_async` is serving (from its start to its return)."""
        return self._active

    @property
    def handler_timeouts(self) -> int:
        """Handler runs that exceeded ``handler_timeout_s`` so far (cancelled or overran)."""
        return self._time_limit.overruns

    @property
    def overrunning(self) -> int:
        """Plain handler runs past ``handler_timeout_s`` that still run now (health: not ready)."""
        return self._time_limit.overrunning

    @property
    def store_available(self) -> bool:
        """``False`` while the sequencer's store (Redis) does not answer (health: not ready)."""
        return bool(getattr(self._sequencer, "available", True))

    @property
    def conflated(self) -> int:
        """Messages conflated so far, over every run (``conflate=True``): replaced by a newer
        message of their key before they ran; they count done and never ran."""
        return self._conflated_before + self._d.conflated

    def _report_conflated(self, msgs: list[Message]) -> None:
        assert self._on_conflated is not None
        for m in msgs:
            try:
                self._on_conflated(m)
            except Exception:
                log.exception("on_conflated raised for %s[%d]@%d", m.topic, m.partition, m.offset)

    def _report_sequencer_conflated(self, d: Dispatcher) -> None:
        """Report the messages the sequencer conflated (a parked key's list in Redis)."""
        msgs = d.take_conflated()
        if msgs and self._on_conflated is not None:
            self._report_conflated(msgs)

    @property
    def skipped_finished(self) -> int:
        """Messages of this run not run because the partition's previous owner had finished them
        (named in its commit metadata; see ``commit_metadata_max_bytes``)."""
        return self._d.skipped_finished

    @property
    def in_flight(self) -> int:
        """Messages buffered or running now."""
        return self._d.in_flight

    @property
    def peak_in_flight(self) -> int:
        """The highest number of buffered + running messages seen (over every run)."""
        return max(self._peak, self._d.flow.peak)

    def partition_status(self) -> list[PartitionStatus]:
        """One :class:`PartitionStatus` per assigned partition (for metrics, health, inspection).

        Safe from any thread. ``end_offset`` is refreshed about once a second from librdkafka's
        cached fetch state.
        """
        now = time.monotonic()
        d = self._d
        with d.lock:  # the trackers change under the workers' hands
            return [_status(p, now) for p in d.partitions.active()]

    @property
    def assignment(self) -> list[TP]:
        """The partitions assigned now, as ``(topic, partition)``."""
        return self._d.assigned()

    @property
    def paused(self) -> list[TP]:
        """The partitions back-pressure paused now (``max_in_flight`` / ``max_in_flight_bytes``)."""
        rebalance = self._rebalance
        return rebalance.paused_partitions() if rebalance is not None else []

    # -- failures -------------------------------------------------------------------------------

    def _fail(self, error: BaseException) -> None:
        with self._error_lock:
            if self._error is None:
                self._error = error
                log.error("stopping: %s", error)
        if self._stop_deadline is None:
            self._stop_deadline = time.monotonic() + self.config.shutdown_timeout_s
        self._stop.set()
        self._d.halt()

    def _on_client_error(self, err: KafkaClientError) -> None:
        if err.fatal:
            self._fail(err)
        elif self._error_handler is not None:
            try:
                self._error_handler(err, None)
            except BaseException as exc:
                self._fail(exc)
        else:
            log.warning("%s", err)

    def _budget(self, cap_s: float) -> float:
        """Seconds a blocking step may take now: ``cap_s``, cut to the stop's deadline when a stop
        is under way (at least 0.5 s, so one attempt is always made)."""
        left = cap_s
        if self._stop_deadline is not None:
            left = min(left, self._stop_deadline - time.monotonic())
        return max(0.5, left)

    # -- the poll thread ------------------------------------------------------------------------

    def _serve(self, executor: Executor) -> None:
        """Poll, admit, store, commit; until stopped. Then :meth:`_shutdown`."""
        self._active = True
        cfg, d, seq = self.config, self._d, self._sequencer
        client = self._factory(cfg.librdkafka(), self._on_client_error)
        self._results.attach(client.publisher)
        txn: TransactionalCommitter | None = None

        def commit_revoked(parts: list[Partition], deadline: float) -> None:
            assert txn is not None
            txn.commit_revoked(parts, deadline)

        rebalance = self._rebalance = Rebalance(
            client,
            d,
            cfg,
            self._catch_up,
            self._budget,
            lambda: self._stop_deadline,
            commit_revoked if cfg.transactional else None,
        )
        commits: Committer
        if cfg.transactional:
            txn = TransactionalCommitter(
                client,
                d,
                cfg,
                self._budget,
                self._on_client_error,
                self._results,
                self._fail,
                rebalance.serving,
            )
            commits = txn
        else:
            commits = Committer(client, d, cfg, self._budget, self._on_client_error, rebalance.serving)
        started = False
        try:
            client.check_brokers(cfg.startup_timeout_s)
            if isinstance(commits, TransactionalCommitter):
                commits.start()
            session_s = float(cfg.librdkafka().get("session.timeout.ms", 45000)) / 1000
            commit_s = float(cfg.librdkafka().get("auto.commit.interval.ms", 5000)) / 1000
            seq.attach(d, self._fail, commits.confirm_ownership, session_s, commit_interval_s=commit_s)
            if not self._stop.is_set():  # stopped before it started: never join the group
                client.subscribe(cfg.topics, rebalance)
            executor.start()
            started = True
            batch, poll_timeout_s = cfg.batch_size, cfg.poll_timeout_s
            meta_every_s = float(cfg.librdkafka().get("auto.commit.interval.ms", 5000)) / 1000.0
            next_status = 0.0
            next_meta = time.monotonic() + meta_every_s
            while not self._stop.is_set():
                timeout_s = poll_timeout_s
                hint_s = seq.tick()
                self._report_sequencer_conflated(d)
                if hint_s is not None and hint_s < timeout_s:
                    timeout_s = hint_s
                if d.next_due_s() is not None:
                    due_s = d.release_due(self._clock())
                    if due_s is not None and due_s < timeout_s:
                        timeout_s = due_s
                if rebalance.paused and timeout_s > 0.01:
                    timeout_s = 0.01  # paused: nothing arrives, so look again soon for room to resume
                elif d.flow.short_of_room(batch) and not d.wait_room(batch, timeout_s):
                    # Near the in-flight bound, wait for running messages to end rather than poll a
                    # few records and pause (a pause drops librdkafka's prefetched queue, fetched
                    # again on resume). Still short: poll at once (back-pressure pauses if over).
                    timeout_s = 0.0
                msgs = client.poll_batch(d.flow.poll_size(batch), timeout_s)
                self.polled_at_s = time.monotonic()
                if msgs:
                    conflated = d.admit(msgs)
                    if conflated and self._on_conflated is not None:
                        self._report_conflated(conflated)
                d.rescue()
                commits.store()
                rebalance.backpressure(d.flow.over(), d.flow.under_half())
                now = time.monotonic()
                if now >= next_status:
                    next_status = now + 1.0
                    commits.refresh_high_watermarks()
                if now >= next_meta and cfg.commit_metadata_max_bytes:
                    next_meta = now + meta_every_s
                    commits.commit_metadata()
        finally:
            self._shutdown(client, executor, commits, rebalance, started)
            self._stop.clear()
            self._stop_deadline = None
            self._active = False
        if self._error is not None:
            raise self._error

    def _catch_up(
        self, parts: list[Partition], deadline: float, progress: Callable[[], None] | None = None
    ) -> None:
        """Let the messages below each partition's highest finished offset run (only those start:
        ``Dispatcher.may_start``), until ``deadline`` (monotonic seconds; or the end of the catch-up
        share of a stop requested meanwhile, :data:`~keyedconsumer.engine.rebalance.CATCH_UP_SHARE`),
        so the offset stored next covers every finished message. Retries due within the time left
        run too; longer back-offs are not waited for. Ticks the sequencer meanwhile (this runs in
        the poll thread, which does not poll Kafka here), and calls ``progress()`` (a revoke's commit
        of what finished so far) every ``auto.commit.interval.ms``."""
        d, seq = self._d, self._sequencer
        every_s = float(self.config.librdkafka().get("auto.commit.interval.ms", 5000)) / 1000.0
        next_progress = time.monotonic() + every_s
        if self._stop_deadline is not None:  # a stop under way: its own catch-up share
            deadline = min(
                deadline, self._stop_deadline - self.config.shutdown_timeout_s * (1 - CATCH_UP_SHARE)
            )
        while time.monotonic() < deadline:
            if not d.catching_up(parts, self._clock() + (deadline - time.monotonic())):
                return
            seq.tick()
            self._report_sequencer_conflated(d)
            d.release_due(self._clock())
            d.release_held()
            d.rescue()
            if progress is not None and time.monotonic() >= next_progress:
                progress()
                next_progress = time.monotonic() + every_s
            time.sleep(0.005)

    def _shutdown(
        self, client: KafkaClient, executor: Executor, commits: Committer, rebalance: Rebalance, started: bool
    ) -> None:
        """Stop within the stop's deadline (``shutdown_timeout_s`` from ``stop()``) plus
        :data:`SHUTDOWN_MARGIN_S`: catch up, wait for running handlers, commit, close."""
        d, cfg = self._d, self.config
        deadline = self._stop_deadline or time.monotonic() + cfg.shutdown_timeout_s
        if started and self._error is None:
            d.stop_starting()
            self._catch_up(d.active(), deadline)  # its share of the time: see _catch_up
        d.halt()
        if started and not d.wait_idle(None, max(0.0, deadline - time.monotonic())):
            log.warning(
                "%d handler(s) still running after shutdown_timeout_s=%g; their offsets are not committed",
                d.running,
                cfg.shutdown_timeout_s,
            )
        self._sequencer.settle_pending()
        self._report_sequencer_conflated(d)
        try:
            commits.store()
            if started:
                commits.commit_final(max(deadline, time.monotonic() + FINAL_COMMIT_MIN_S))
        except KafkaClientError as exc:
            log.warning("final commit failed: %s (what finished after the last commit runs again)", exc)
        rebalance.closing()
        try:
            if not client.close(timeout_s=CLOSE_TIMEOUT_S):
                log.warning(
                    "the Kafka client did not close within %g s (a stopped or unreachable broker?): "
                    "left to close on its own; the group drops this member after session.timeout.ms",
                    CLOSE_TIMEOUT_S,
                )
        except Exception as exc:  # closing must not hide the error that stopped us
            log.warning("closing the Kafka client failed: %s", exc)
        d.close()
        if started:
            executor.join(max(0.5, min(5.0, deadline - time.monotonic())))
        if isinstance(commits, TransactionalCommitter):
            commits.close()
        self._results.detach()
        self._sequencer.detach()


def _status(part: Partition, now: float) -> PartitionStatus:
    """The :class:`PartitionStatus` of ``part`` at ``now`` (monotonic seconds; lock held)."""
    tracker = part.tracker
    wm = tracker.watermark()
    since = tracker.oldest_received_s()
    base = part.stored if part.stored is not None else wm  # nothing stored yet: where it is
    high = part.high
    return PartitionStatus(
        topic=part.topic,
        partition=part.partition,
        first_unfinished_offset=wm,
        stored_offset=part.stored,
        unfinished=tracker.pending,
        oldest_unfinished_age_s=(now - since) if since is not None else 0.0,
        end_offset=high,
        lag=max(0, high - base) if high is not None and base is not None else None,
    )


@dataclasses.dataclass(frozen=True)
class PartitionStatus:
    """The state of one assigned partition.

    ``first_unfinished_offset``: the offset the engine would store now (``None`` before any
    message); ``stored_offset``: the last offset stored (or committed, with manual commit);
    ``unfinished``: received messages not done; ``oldest_unfinished_age_s``: seconds since the
    oldest of them was received (0 when none); ``end_offset``: the partition's high watermark as
    last seen; ``lag``: ``end_offset - stored_offset`` (before the first store of the assignment,
    ``end_offset - first_unfinished_offset``; ``None`` while either is unknown).
    """

    topic: str
    partition: int
    first_unfinished_offset: int | None
    stored_offset: int | None
    unfinished: int
    oldest_unfinished_age_s: float
    end_offset: int | None
    lag: int | None
