"""KeyedConsumer: what a user builds and runs. Its settings, its handler chain and its runs.

Each ``run()`` (or ``run_async()``) is one :class:`~keyedconsumer.engine.run.Run`: the thread that
serves it owns the run's engine and Kafka client (poll, admit, hand out, settle, store; serve
rebalances), workers run the handler chain (:mod:`keyedconsumer.engine.runner`) and post outcomes
back to it. This module builds the chain (the handler under its time limit, the records it produces,
the handler contract, the middleware) once, and answers status questions from any thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from . import signals
from .config import ConsumerConfig
from .engine.batch import BatchHandler, BatchRun, check_batch_middlewares
from .engine.commits import BLOCKING_CALL_S
from .engine.handler import (
    Contract,
    ErrorHandler,
    Handler,
    Middleware,
    bind,
    check_error_handler,
    check_handler,
    compose,
    is_async,
)
from .engine.results import Results
from .engine.run import CLOSE_TIMEOUT_S, SHUTDOWN_MARGIN_S, Run, StopSignal
from .engine.sequencer import InMemorySequencer, Sequencer
from .engine.status import PartitionStatus
from .engine.timelimit import TimeLimit
from .errors import KeyedConsumerError
from .kafka import TP, ClientFactory, publishers_of
from .message import Message

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
        (``ack_success``) before it, and each one's retry then comes in a batch of its own (so a
        poison message does not take its batch-mates to the dead-letter topic with it).
        ``handler_timeout_s`` is the limit of one batch call. Only
        outcome middlewares (``Retry``, ``DeadLetter``, ``Recover``) are taken, applied to each
        message's end; see :mod:`keyedconsumer.engine.batch`.
    middlewares:
        A list of handler-in, handler-out callables (instances: ``Retry(...)``, not ``Retry``); the
        first given is the outermost. A middleware with a ``bind_settings(settings: ConsumerConfig)``
        method gets this consumer's settings first (outermost first, before the chain is composed),
        so that, e.g., ``DeadLetter()`` publishes with the consumer's brokers and security settings
        without the user repeating them; one with ``bind_publishers(factory)`` gets, before that,
        the factory of its producers (:func:`~keyedconsumer.kafka.publishers_of` ``client_factory``).
    error_handler:
        ``error_handler(error, message_or_None)`` for failures no middleware handled and for Kafka
        client errors: a plain callable (not ``async def``: it is not awaited) taking these two
        arguments. Returning normally marks a failed message handled (status ``FAIL``, done);
        raising, or no handler at all, stops the consumer and ``run()`` raises.
    client_factory:
        Builds the Kafka client (default: librdkafka via confluent-kafka); tests may pass another.
        A :class:`~keyedconsumer.kafka.Connector` (``InMemoryBroker.client_factory``) also makes
        the middleware's producers (``DeadLetter``, ``Audit``).
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
        ``handler`` (``batch_handler``) is not callable or cannot be called with one argument (the
        message; the list of messages), checked here, not at the first message; ``middlewares`` is
        not a list, or one is not callable, is a
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
        if self.config.transactional and getattr(sequencer, "settles_outside_kafka", False):
            raise ValueError(
                "transactional=True does not combine with the RedisSequencer: parked messages are "
                "settled in Redis, outside the Kafka transaction (docs/exactly-once.md)"
            )
        check_error_handler(error_handler)
        if (handler is None) == (batch_handler is None):
            raise TypeError(
                "give one of handler= (one message per call) or batch_handler= (a list of messages)"
            )
        check_handler(handler if handler is not None else batch_handler, batch=handler is None)
        if batch_handler is not None:
            check_batch_middlewares(middlewares)
        self._sequencer: Sequencer = sequencer if sequencer is not None else InMemorySequencer()
        self._clock = clock
        self._on_conflated = on_conflated
        self._conflated_before = 0  # conflated by earlier runs (each run has an engine of its own)
        #: The handler contract: a plain handler returning an awaitable is recorded where it
        #: returns, inside every middleware, so that no middleware can hide it.
        self._contract = Contract()
        bind(middlewares, self.config, publishers_of(client_factory))
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
        self._stop = StopSignal()
        self._active = False
        self._peak = 0
        self._run: Run | None = None  # the run serving now, or the last one
        self._skipped_before = 0

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
            self._serve(self._new_run(None))
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
        run = self._new_run(loop)
        # a thread of its own (the run's owner), not the loop's default executor (a few threads,
        # shared): an app of many consumers on one loop must never wait for a free thread to start one
        done: concurrent.futures.Future[None] = concurrent.futures.Future()

        def serve() -> None:
            try:
                self._serve(run)
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

    def _new_run(self, loop: asyncio.AbstractEventLoop | None) -> Run:
        if self._active:
            raise KeyedConsumerError("this consumer is already running")
        # the stop signal is not cleared here: a stop() that came before this run started must stop
        # it. It is cleared when a run ends.
        self._contract.clear()
        last = self._run
        if last is not None:
            self._peak = max(self._peak, last.engine.flow.peak)
            self._conflated_before += last.engine.conflated
            self._skipped_before += last.engine.skipped_finished
        run = Run(
            self.config,
            self._factory,
            self._sequencer,
            self._clock,
            self._handler,
            self._batch,
            self._async,
            loop,
            self._error_handler,
            self._contract,
            self._results,
            self._stop,
            self._on_conflated,
        )
        self._run = run
        return run

    def _serve(self, run: Run) -> None:
        self._active = True
        try:
            run.serve()
        finally:
            self._stop.clear()
            self._active = False

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
        # a one-way latch workers read before starting each message: only messages below their
        # partition's highest finished offset still start (up to shutdown_timeout_s), so the
        # committed offset reaches what already finished and nothing finished runs again.
        self._stop.request(self.config.shutdown_timeout_s)

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
        schedule = getattr(self._sequencer, "schedule", None)
        if schedule is None:
            raise KeyedConsumerError(
                "schedule() needs sequencer=RedisSequencer(...): scheduled messages live in Redis"
            )
        return schedule(  # type: ignore[no-any-return]
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
        run = self._run
        return self._conflated_before + (run.engine.conflated if run is not None else 0)

    @property
    def skipped_finished(self) -> int:
        """Messages not run because the partition's previous owner had finished them (named in its
        commit metadata; see ``commit_metadata_max_bytes``), over every run."""
        run = self._run
        return self._skipped_before + (run.engine.skipped_finished if run is not None else 0)

    @property
    def in_flight(self) -> int:
        """Messages buffered or running now."""
        run = self._run
        return run.engine.in_flight if run is not None and self._active else 0

    @property
    def peak_in_flight(self) -> int:
        """The highest number of buffered + running messages seen (over every run)."""
        run = self._run
        return max(self._peak, run.engine.flow.peak if run is not None else 0)

    @property
    def polled_at_s(self) -> float:
        """When the poll loop last returned from a poll (monotonic seconds; 0.0 before the first):
        liveness for health checks."""
        run = self._run
        return run.polled_at_s if run is not None else 0.0

    def partition_status(self) -> list[PartitionStatus]:
        """One :class:`PartitionStatus` per assigned partition (for metrics, health, inspection).

        Safe from any thread: the run's owner publishes it every 0.2 s (``end_offset`` is refreshed
        then from librdkafka's cached fetch state).
        """
        run = self._run
        return list(run.status) if run is not None and self._active else []

    @property
    def assignment(self) -> list[TP]:
        """The partitions assigned now, as ``(topic, partition)``."""
        run = self._run
        return list(run.engine.assignment) if run is not None and self._active else []

    @property
    def paused(self) -> list[TP]:
        """The partitions back-pressure paused now (``max_in_flight`` / ``max_in_flight_bytes``)."""
        run = self._run
        rebalance = run.rebalance if run is not None else None
        return rebalance.paused_partitions() if rebalance is not None else []
