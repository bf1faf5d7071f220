"""KeyedConsumer: poll -> sequence -> run -> store offsets; run / run_async / stop.

One poll thread owns the Kafka client: it polls, admits messages to the dispatcher, stores (or
commits) the offsets the workers finished, pauses and resumes fetching, and handles rebalances
(whose callbacks librdkafka runs inside its poll call, in the same thread).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from . import signals
from .config import ConsumerConfig
from .dispatch import ACTIVE, Dispatcher, Park, Partition
from .errors import (
    CommitError,
    HandlerContractError,
    HandlerContractViolation,
    KafkaClientError,
    KeyedConsumerError,
    MessageError,
)
from .executors import AsyncExecutor, Executor, ThreadExecutor, not_awaited
from .kafka import TP, ClientFactory, KafkaClient
from .kafka import client as kafka  # kafka.connect: the real client
from .message import Message, Status
from .offsets import FinishedOffsets
from .outcomes import RetryLater, SkipMessage
from .sequencing import RedisSequencer

__all__ = ["KeyedConsumer", "Handler", "Middleware", "ErrorHandler", "PartitionStatus"]

log = logging.getLogger("keyedconsumer")

#: Commit errors that a later attempt of the same commit can get past: the group is in the middle
#: of a rebalance and this member has not rejoined the new generation (classic protocol) or epoch
#: (KIP-848) yet, or the group coordinator is not known or not ready (a broker restart).
_COMMIT_AGAIN = frozenset({
    "ILLEGAL_GENERATION", "REBALANCE_IN_PROGRESS", "STALE_MEMBER_EPOCH",
    "_WAIT_COORD", "COORDINATOR_NOT_AVAILABLE", "NOT_COORDINATOR", "COORDINATOR_LOAD_IN_PROGRESS",
})

#: Longest wait of one blocking broker call in the poll thread or a rebalance callback (seconds):
#: the committed offsets read at assign, a synchronous commit (manual commit, revoke, the ownership
#: check). A call under way when ``stop()`` comes is waited for inside ``shutdown_timeout_s``.
BLOCKING_CALL_S = 5.0
#: The final commit of a stop gets at least this long (seconds), even when ``shutdown_timeout_s``
#: was spent waiting for handlers.
FINAL_COMMIT_MIN_S = 2.0
#: How long ``close()`` of the Kafka client may take (seconds): leaving the group and librdkafka's
#: own commit at close wait on the broker, which may be stopped or gone (confluent-kafka-python
#: #1667). Past it the close is left to finish on its own and ``run()`` returns.
CLOSE_TIMEOUT_S = 5.0
#: ``run()`` returns within ``max(shutdown_timeout_s, BLOCKING_CALL_S) + SHUTDOWN_MARGIN_S`` seconds
#: of ``stop()``, whatever the broker does: the final commit, the bounded close, releasing Redis
#: leases and joining the workers fit in the margin.
SHUTDOWN_MARGIN_S = 10.0
#: Share of ``shutdown_timeout_s`` (of ``revoke_timeout_s`` for a revoke) during which a stop (revoke)
#: still starts messages below their partition's highest finished offset (the catch-up); the rest is
#: left to the handlers running then, so a long one started late is not cut short by the commit.
CATCH_UP_SHARE = 0.5
#: Pause between attempts of a commit the group refused during a rebalance (seconds).
COMMIT_RETRY_S = (0.05, 0.5)

#: A handler: ``def handle(msg) -> None`` or ``async def handle(msg) -> None``.
Handler = Callable[[Message], None] | Callable[[Message], Awaitable[None]]
#: A middleware takes a handler and returns a handler of the same kind (sync or async).
Middleware = Callable[[Any], Any]
#: ``error_handler(error, message_or_None)``; returning normally marks the failure handled.
ErrorHandler = Callable[[BaseException, Message | None], Any]


def compose(handler: Handler, middlewares: Sequence[Middleware]) -> Handler:
    """Wrap ``handler`` in ``middlewares``; the first given is the outermost (xkafka order).

    Raises
    ------
    TypeError
        ``handler`` is not callable; ``middlewares`` is not a list; one of them is not callable, is
        a class passed instead of an instance (``[Retry]`` for ``[Retry(...)]``; a class whose
        constructor takes the handler is a middleware), or returned something not callable.
    """
    if not callable(handler):
        raise TypeError(f"handler must be callable, got {type(handler).__name__}")
    if isinstance(middlewares, (str, bytes)) or callable(middlewares) or not hasattr(middlewares, "__iter__"):
        raise TypeError(
            f"middlewares must be a list of middleware, e.g. [Retry(...)], got {type(middlewares).__name__}"
        )
    chain = list(middlewares)
    for i, mw in enumerate(chain):
        if isinstance(mw, type) and not _takes_one_argument(mw):
            raise TypeError(_class_given(i, mw))
        if not callable(mw):
            raise TypeError(
                f"middlewares[{i}] is a {type(mw).__name__}, not a middleware: a middleware is a callable "
                "that takes a handler and returns one, e.g. Retry(...)"
            )
    wrapped: Any = handler
    for i in reversed(range(len(chain))):
        mw = chain[i]
        try:
            wrapped = mw(wrapped)
        except TypeError as exc:
            if isinstance(mw, type):  # e.g. Typed, whose constructor wants a model, not the handler
                raise TypeError(_class_given(i, mw)) from exc
            raise
        if not callable(wrapped):
            raise TypeError(f"middleware {mw!r} returned a non-callable {type(wrapped).__name__}")
    return wrapped  # type: ignore[no-any-return]


def _class_given(i: int, cls: type) -> str:
    name = cls.__name__
    return f"middlewares[{i}] is the class {name}: pass an instance, e.g. {name}(...)"


def _takes_one_argument(fn: Any) -> bool:
    """True when ``fn(x)`` binds (or the signature cannot be read)."""
    try:
        inspect.signature(fn).bind(None)
    except TypeError:
        return False
    except ValueError:  # no signature to read
        return True
    return True


def _check_error_handler(error_handler: Any) -> None:
    """Raise ``TypeError`` unless ``error_handler`` is ``None`` or a plain callable taking
    ``(error, message)``."""
    if error_handler is None:
        return
    if isinstance(error_handler, type):
        name = error_handler.__name__
        raise TypeError(
            f"error_handler is the class {name}: pass an instance, e.g. {name}(...), "
            "or a function `def on_error(error, message) -> None`"
        )
    if not callable(error_handler):
        raise TypeError(
            f"error_handler must be callable as error_handler(error, message), got a {type(error_handler).__name__}"
        )
    if _is_async(error_handler):
        raise TypeError(
            "error_handler must be a plain function: the engine calls it and does not await it, so an "
            "async def one would never run (and every failure would count as handled)"
        )
    try:
        signature = inspect.signature(error_handler)
    except (TypeError, ValueError):  # no signature to read (some builtins): trust it
        return
    try:
        signature.bind(None, None)
    except TypeError:
        raise TypeError(
            f"error_handler{signature} cannot be called as error_handler(error, message): write "
            "`def on_error(error: BaseException, message: Message | None) -> None`"
        ) from None


def _is_async(fn: Any) -> bool:
    """True for ``async def`` functions and for objects whose ``__call__`` is ``async def``."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


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
    middlewares:
        A list of handler-in, handler-out callables (instances: ``Retry(...)``, not ``Retry``); the
        first given is the outermost.
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
        ``handler`` is not callable; ``middlewares`` is not a list, or one is not callable, is a
        class passed instead of an instance (the message says what to write), or returned a
        non-callable; ``error_handler`` is a class, not callable, ``async def``, or cannot take
        ``(error, message)``.
    """

    def __init__(
        self,
        *,
        handler: Handler,
        middlewares: Sequence[Middleware] = (),
        error_handler: ErrorHandler | None = None,
        client_factory: ClientFactory | None = None,
        settings: ConsumerConfig | None = None,
        sequencer: RedisSequencer | None = None,
        clock: Callable[[], float] = time.monotonic,
        **options: Any,
    ) -> None:
        if settings is None:
            self.config = ConsumerConfig(**options)
        else:
            self.config = settings.override(**options) if options else settings
        if sequencer is not None and self.config.ordering == "none":
            raise ValueError("a sequencer orders keys or partitions: it needs ordering='key' or 'partition'")
        _check_error_handler(error_handler)
        self._sequencer = sequencer
        self._clock = clock
        #: Messages whose handler broke the contract (returned an awaitable), recorded where it
        #: happened, so that no middleware can hide it: ``_settle`` stops the consumer for them.
        self._broken: dict[Message, HandlerContractError] = {}
        inner = handler if not callable(handler) or _is_async(handler) else self._checked(handler)
        self._handler = compose(inner, middlewares)
        self._async = _is_async(self._handler)
        self._error_handler = error_handler
        self._factory: ClientFactory = client_factory or kafka.connect
        self._stop = threading.Event()
        # when the stop in progress must be over (monotonic seconds; None: no stop requested)
        self._stop_deadline: float | None = None
        self._error: BaseException | None = None
        self._error_lock = threading.Lock()
        self._active = False
        self._closing = False
        self._paused: set[TP] = set()
        self._meta_sent: dict[TP, tuple[int, str]] = {}  # last metadata commit sent per partition
        self._client: KafkaClient | None = None
        self._d = Dispatcher(self.config.ordering, self.config.concurrency, self.config.group, self._clock)
        self._d.metadata_max_bytes = self.config.commit_metadata_max_bytes
        self.peak_in_flight = 0  # highest number of buffered + running messages seen
        #: When the poll loop last returned from a poll (monotonic seconds; 0.0 before the first):
        #: liveness for health checks.
        self.polled_at_s = 0.0

    def _checked(self, handler: Callable[[Message], Any]) -> Callable[[Message], Any]:
        """``handler`` (a plain function) checked right where it returns, inside every middleware: an
        awaitable result is closed, recorded and raised as :class:`HandlerContractViolation` (a
        ``BaseException``, which ``Retry``, ``DeadLetter`` and ``Recover`` let through)."""
        broken = self._broken

        def checked(msg: Message) -> Any:
            result = handler(msg)
            if result is not None and inspect.isawaitable(result):
                violation = not_awaited(msg, result)
                broken[msg] = violation.error
                raise violation
            return result

        return checked

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
            executor: Executor
            if self._async:
                executor = AsyncExecutor(self._d, self._handler, self._settler(), self.config.concurrency)  # type: ignore[arg-type]
            else:
                executor = ThreadExecutor(self._d, self._handler, self._settler(), self.config.concurrency)
            self._serve(executor)
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
        executor: Executor
        if self._async:
            executor = AsyncExecutor(self._d, self._handler, self._settler(), self.config.concurrency, loop)  # type: ignore[arg-type]
        else:
            executor = ThreadExecutor(self._d, self._handler, self._settler(), self.config.concurrency)
        fut = loop.run_in_executor(None, self._serve, executor)
        signals.register(self)
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            self.stop()
            await fut
            raise
        finally:
            signals.unregister(self)

    def _reset(self) -> None:
        if self._active:
            raise KeyedConsumerError("this consumer is already running")
        # _stop is not cleared here: a stop() that came before this run started must stop it.
        # It is cleared when a run ends.
        self._error = None
        self._closing = False
        self._broken.clear()
        self._paused.clear()
        self._meta_sent.clear()
        self._d = Dispatcher(self.config.ordering, self.config.concurrency, self.config.group, self._clock)
        self._d.metadata_max_bytes = self.config.commit_metadata_max_bytes

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
        self._d.stopping = True
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
        if self._sequencer is None:
            raise KeyedConsumerError("schedule() needs sequencer=RedisSequencer(...): scheduled messages live in Redis")
        return self._sequencer.schedule(
            topic or self.config.topics[0], key, value, headers, delay_s=delay_s, at=at
        )

    @property
    def running(self) -> bool:
        """True while :meth:`run` / :meth:`run_async` is serving (from its start to its return)."""
        return self._active

    @property
    def skipped_finished(self) -> int:
        """Messages of this run not run because the partition's previous owner had finished them
        (named in its commit metadata; see ``commit_metadata_max_bytes``)."""
        return self._d.skipped_finished

    @property
    def in_flight(self) -> int:
        """Messages buffered or running now."""
        return self._d.buffered

    def partition_status(self) -> list[PartitionStatus]:
        """One :class:`PartitionStatus` per assigned partition (for metrics, health, inspection).

        Safe from any thread. ``end_offset`` is refreshed about once a second from librdkafka's
        cached fetch state.
        """
        d = self._d
        now = time.monotonic()
        out = []
        with d.lock:
            for part in d.parts.values():
                wm = part.tracker.watermark()
                since = part.tracker.oldest_received_s()
                base = part.stored if part.stored is not None else wm  # nothing stored yet: where it is
                out.append(
                    PartitionStatus(
                        topic=part.topic,
                        partition=part.partition,
                        first_unfinished_offset=wm,
                        stored_offset=part.stored,
                        unfinished=part.tracker.pending,
                        oldest_unfinished_age_s=(now - since) if since is not None else 0.0,
                        end_offset=part.high,
                        lag=max(0, part.high - base) if part.high is not None and base is not None else None,
                    )
                )
        return out

    @property
    def assignment(self) -> list[TP]:
        """The partitions assigned now, as ``(topic, partition)``."""
        return self._d.assigned()

    # -- outcome of a message (worker threads / event loop) --------------------------------------

    def _settler(self) -> Callable[[Message, BaseException | None], bool | float]:
        """``_settle`` bound to this run: a handler of an earlier run that ends late (after its
        run's shutdown timeout) changes nothing in a later run."""
        d = self._d

        def settle(msg: Message, exc: BaseException | None) -> bool | float:
            if d is not self._d or d.closed:
                return False  # the run is over: nothing of it counts any more
            return self._settle(msg, exc)

        return settle

    def _settle(self, msg: Message, exc: BaseException | None) -> bool | float:
        """Decide a message's outcome after its handler ended (raised ``exc``, or ``None``).

        Returns ``True`` (done), ``False`` (not done: the consumer stops) or a ``float`` delay in
        seconds (run it again then). A broken handler contract (:class:`HandlerContractError`)
        stops the consumer whatever the middleware made of it, without ``error_handler``.
        """
        broken = self._broken.get(msg) if self._broken else None
        if broken is None and isinstance(exc, HandlerContractViolation):
            broken = exc.error
        if broken is not None:  # a programming error: not retried, not dead-lettered, not handled
            msg.status = Status.FAIL
            msg.error = broken
            self._fail(broken)
            return False
        if exc is None:
            if msg.status is Status.PENDING:
                msg.status = Status.SUCCESS
                return True
            if msg.status is not Status.FAIL:
                return True
            exc = msg.error if msg.error is not None else RuntimeError("ack_fail() without an error")
        elif isinstance(exc, RetryLater):
            msg.status = Status.PENDING
            msg.last_error = exc.__cause__ if exc.__cause__ is not None else exc
            if exc.park and self._d.parking:
                return Park(exc.delay_s)
            return exc.delay_s
        elif isinstance(exc, SkipMessage):
            msg.status = Status.SKIP
            return True
        msg.status = Status.FAIL
        msg.error = exc
        if self._error_handler is not None:
            try:
                self._error_handler(exc, msg)
                return True
            except BaseException as handler_exc:
                failure = MessageError(msg.topic, msg.partition, msg.offset, handler_exc)
                failure.__cause__ = handler_exc
                self._fail(failure)
                return False
        failure = MessageError(msg.topic, msg.partition, msg.offset, exc)
        failure.__cause__ = exc
        self._fail(failure)
        return False

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

    # -- the poll thread ------------------------------------------------------------------------

    def _serve(self, executor: Executor) -> None:
        self._active = True
        cfg = self.config
        d = self._d
        client = self._factory(cfg.librdkafka(), self._on_client_error)
        self._client = client
        started = False
        seq = self._sequencer
        try:
            client.check_brokers(cfg.startup_timeout_s)
            if seq is not None:
                session_ms = float(cfg.librdkafka().get("session.timeout.ms", 45000))
                seq.attach(d, self._fail, confirm=lambda: self._confirm_ownership(client), session_timeout_s=session_ms / 1000)
            if not self._stop.is_set():  # stopped before it started: never join the group
                client.subscribe(cfg.topics, _Listener(self, client))
            executor.start()
            started = True
            max_in_flight, batch, max_bytes = cfg.max_in_flight, cfg.batch_size, cfg.max_in_flight_bytes
            poll_timeout_s = cfg.poll_timeout_s
            next_status = 0.0
            meta_every_s = float(cfg.librdkafka().get("auto.commit.interval.ms", 5000)) / 1000.0
            next_meta = time.monotonic() + meta_every_s
            while not self._stop.is_set():
                timeout_s = poll_timeout_s
                if seq is not None:
                    hint_s = seq.tick()
                    if hint_s is not None and hint_s < timeout_s:
                        timeout_s = hint_s
                if d.delayed:
                    next_due_s = d.release_due(self._clock())
                    if next_due_s is not None and next_due_s < timeout_s:
                        timeout_s = next_due_s
                if self._paused and timeout_s > 0.01:
                    timeout_s = 0.01  # paused: nothing arrives, so look again soon for room to resume
                room = max_in_flight - d.buffered
                n = batch if room >= batch else max(1, room)
                room_bytes = max_bytes - d.buffered_bytes
                avg_size = d.avg_size
                if avg_size is None:  # sizes unknown yet: one message first
                    n = 1
                elif room_bytes < n * avg_size:  # the byte bound limits the batch too
                    n = max(1, int(room_bytes // avg_size))
                msgs = client.poll_batch(n, timeout_s)
                self.polled_at_s = time.monotonic()
                if msgs:
                    d.admit(msgs)
                    if d.buffered > self.peak_in_flight:
                        self.peak_in_flight = d.buffered
                d.rescue()
                self._store(client)
                self._backpressure(client)
                now = time.monotonic()
                if now >= next_status:
                    next_status = now + 1.0
                    self._refresh_high_watermarks(client)
                if now >= next_meta and cfg.commit_metadata_max_bytes:
                    next_meta = now + meta_every_s
                    self._commit_metadata(client)
        finally:
            self._shutdown(client, executor, started)
            self._stop.clear()
            self._stop_deadline = None
            self._active = False
        if self._error is not None:
            raise self._error

    def _budget(self, cap_s: float, deadline: float | None = None) -> float:
        """Seconds a blocking step may take now: ``cap_s``, cut to ``deadline`` and to the stop's
        deadline when a stop is under way (at least 0.5 s, so one attempt is always made)."""
        now = time.monotonic()
        left = cap_s
        for end in (deadline, self._stop_deadline):
            if end is not None:
                left = min(left, end - now)
        return max(0.5, left)

    def _commit_metadata(self, client: KafkaClient) -> None:
        """Commit, without waiting, each partition whose committed offset is held back by an
        unfinished message while offsets above it finished, with the metadata naming those (the
        offset alone does not move, so librdkafka's auto commit would not send it). A crash then
        re-runs only what finished since the last of these commits, not everything above a slow
        key's message (Confluent Parallel Consumer's offset map, committed on its commit cadence,
        ``auto.commit.interval.ms``)."""
        d = self._d
        with d.lock:
            parts = [p for p in d.parts.values() if p.state == ACTIVE]
        offsets, meta = d.commit_offsets(parts)
        sent = self._meta_sent
        todo = [(t, p, o) for t, p, o in offsets if (t, p) in meta and sent.get((t, p)) != (o, meta[(t, p)])]
        if not todo:
            return
        if not self.config.manual_commit:
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

    def _confirm_ownership(self, client: KafkaClient) -> bool:
        """After a stall of this process (or a lost lease), is it still the group's owner of its
        partitions? Called by the Redis sequencer before it acquires leases again.

        A stopped process (SIGSTOP, a VM pause) may have lost its partitions while it could not
        tell; until librdkafka serves the revoke, a fresh lease would let it re-run messages the
        new owner already ran and committed. So: the group's committed offsets must not be past
        this instance's first unfinished ones (else another member has run them), and a
        synchronous commit of those offsets must succeed (the coordinator refuses a commit from a
        member it expelled: ``UNKNOWN_MEMBER_ID``, ``ILLEGAL_GENERATION``, KIP-848's
        ``FENCED_MEMBER_EPOCH``). Returns ``False`` while either fails (the caller asks again).
        """
        d = self._d
        with d.lock:
            parts = [p for p in d.parts.values() if p.state == ACTIVE]
        offsets, meta = d.commit_offsets(parts)
        if not offsets:
            return True
        try:
            group = client.committed([(t, p) for t, p, _ in offsets], self._budget(BLOCKING_CALL_S))
        except KafkaClientError as exc:
            log.warning("ownership check: committed offsets unavailable (%s)", exc)
            return False
        ahead = [(t, p, o) for t, p, o in offsets if group.get((t, p), (-1, ""))[0] > o]
        if ahead:
            log.warning("ownership check: the group committed past this instance's offsets %s: partitions lost", ahead)
            return False
        try:
            client.commit(offsets, meta, timeout_s=self._budget(BLOCKING_CALL_S))
        except KafkaClientError as exc:
            log.warning("ownership check: commit refused (%s): waiting for the rebalance", exc)
            return False
        log.info("ownership check passed for %d partition(s)", len(offsets))
        return True

    def _refresh_high_watermarks(self, client: KafkaClient) -> None:
        parts = list(self._d.parts.values())
        if parts:
            highs = client.high_watermarks([p.tp for p in parts])
            for p in parts:
                p.high = highs.get(p.tp)

    def _store(self, client: KafkaClient) -> None:
        """Store (or, with ``manual_commit``, commit) the partitions whose first unfinished offset
        moved, each with the metadata naming what finished above it."""
        advances = self._d.advances()
        if not advances:
            return
        if self.config.manual_commit:
            meta = {(p.topic, p.partition): m for p, _, m in advances if m}
            try:
                client.commit([(p.topic, p.partition, wm) for p, wm, _ in advances], meta,
                              timeout_s=self._budget(BLOCKING_CALL_S))
            except KafkaClientError as exc:
                self._on_client_error(exc)
                self._d.mark_dirty([p for p, _, _ in advances])
                return
            for p, wm, _ in advances:
                p.stored = wm
            return
        for p, wm, m in advances:
            try:
                client.store(p.topic, p.partition, wm, m)
                p.stored = wm
            except KafkaClientError as exc:  # e.g. the partition is no longer assigned
                log.debug("offset not stored: %s", exc)

    def _backpressure(self, client: KafkaClient) -> None:
        d, cfg = self._d, self.config
        if d.buffered >= cfg.max_in_flight or d.buffered_bytes >= cfg.max_in_flight_bytes:
            new = [tp for tp in d.assigned() if tp not in self._paused]
            if new:
                client.pause(new)
                self._paused.update(new)
        elif (
            self._paused
            and d.buffered <= cfg.max_in_flight // 2
            and d.buffered_bytes <= cfg.max_in_flight_bytes // 2
        ):
            assigned = set(d.assigned())
            client.resume([tp for tp in self._paused if tp in assigned])
            self._paused.clear()

    def _catch_up(self, parts: list[Partition], deadline: float) -> None:
        """Let the messages below each partition's highest finished offset run (only those start:
        ``Dispatcher.may_start``), until ``deadline`` (monotonic seconds; or the end of the catch-up
        share of a stop requested meanwhile, :data:`CATCH_UP_SHARE`), so the offset stored next
        covers every finished message. Retries due
        within the time left run too; longer back-offs are not waited for. Serves the Redis
        sequencer meanwhile (this runs in the poll thread, which does not poll Kafka here)."""
        d, seq = self._d, self._sequencer
        if self._stop_deadline is not None:  # a stop under way: its own catch-up share
            deadline = min(deadline, self._stop_deadline - self.config.shutdown_timeout_s * (1 - CATCH_UP_SHARE))
        while time.monotonic() < deadline:
            now = self._clock()
            with d.lock:
                behind = [p for p in parts if p.state == ACTIVE and p.tracker.behind_done()]
                # a retry due before the deadline is waited for; a longer back-off is not
                soon = bool(d.delayed) and d.delayed[0][0] - now < deadline - time.monotonic()
                idle = d.running == 0 and not d.ready and not soon and not (d.leases is not None and d.leases.want)
            if not behind or (idle and not d.to_park):
                return
            if seq is not None and d.leases is not None:
                seq.tick()
            if soon:
                d.release_due(now)
            d.release_held()
            d.rescue()
            time.sleep(0.005)

    def _shutdown(self, client: KafkaClient, executor: Executor, started: bool) -> None:
        """Stop within the stop's deadline (``shutdown_timeout_s`` from ``stop()``) plus
        :data:`SHUTDOWN_MARGIN_S`: catch up, wait for running handlers, commit, close."""
        d, cfg = self._d, self.config
        deadline = self._stop_deadline or time.monotonic() + cfg.shutdown_timeout_s
        if started and self._error is None:
            d.stopping = True
            self._catch_up(list(d.parts.values()), deadline)  # its share of the time: see _catch_up
        d.halt()
        if started and not d.wait_idle(None, max(0.0, deadline - time.monotonic())):
            log.warning(
                "%d handler(s) still running after shutdown_timeout_s=%g; their offsets are not committed",
                d.running,
                cfg.shutdown_timeout_s,
            )
        if self._sequencer is not None and d.leases is not None:
            self._sequencer.settle_pending()
        try:
            self._store(client)
            if started:
                self._commit_final(client, max(deadline, time.monotonic() + FINAL_COMMIT_MIN_S))
        except KafkaClientError as exc:
            log.warning("final commit failed: %s (what finished after the last commit runs again)", exc)
        self._closing = True
        try:
            if not client.close(timeout_s=CLOSE_TIMEOUT_S):
                log.warning("the Kafka client did not close within %g s (a stopped or unreachable broker?): "
                            "left to close on its own; the group drops this member after session.timeout.ms",
                            CLOSE_TIMEOUT_S)
        except Exception as exc:  # closing must not hide the error that stopped us
            log.warning("closing the Kafka client failed: %s", exc)
        d.close()
        if started:
            executor.join(max(0.5, min(5.0, deadline - time.monotonic())))
        if self._sequencer is not None and d.leases is not None:
            self._sequencer.detach()

    def _commit_final(self, client: KafkaClient, deadline: float) -> None:
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
        d, cfg = self._d, self.config
        while True:
            final, meta = d.commit_offsets([p for p in list(d.parts.values()) if p.state == ACTIVE])
            if not final:
                return
            if meta and not cfg.manual_commit:  # librdkafka's commit at close uses the stored metadata
                for topic, partition, offset in final:
                    if (topic, partition) in meta:
                        client.store(topic, partition, offset, meta[(topic, partition)])
            try:
                client.commit(final, meta, timeout_s=max(0.5, deadline - time.monotonic()))
            except CommitError as exc:
                if exc.code not in _COMMIT_AGAIN or time.monotonic() >= deadline:
                    raise
                log.info("final commit refused (%s): polling (a rebalance, the coordinator), then committing again", exc.code)
                until = min(deadline, time.monotonic() + 0.5)
                while time.monotonic() < until:
                    client.poll_batch(1, 0.05)  # stopping: what it returns is not run, nor stored
                continue
            for p in d.parts.values():
                p.stored = p.tracker.watermark()
            return


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


class _Listener:
    """Rebalance callbacks (run by librdkafka inside ``poll_batch``, in the poll thread)."""

    def __init__(self, consumer: KeyedConsumer, client: KafkaClient) -> None:
        self._c = consumer
        self._client = client

    def on_assign(self, partitions: list[TP]) -> None:
        log.info("assigned %s", partitions)
        finished: dict[TP, FinishedOffsets] = {}
        if self._c.config.commit_metadata_max_bytes and partitions:
            # the offsets the previous owners finished above their commits: skipped, not re-run
            try:
                for tp, (offset, meta) in self._client.committed(partitions, self._c._budget(BLOCKING_CALL_S)).items():
                    fin = FinishedOffsets.decode(offset, meta)
                    if fin is not None:
                        finished[tp] = fin
                        log.info("%s[%d]: %d offsets above %d were finished by the previous owner: not run again",
                                 tp[0], tp[1], fin.count, offset)
            except KafkaClientError as exc:  # nothing skipped: they run again (at-least-once)
                log.warning("committed offsets of %s unavailable: finished offsets run again (%s)", partitions, exc)
        self._c._d.assign(partitions, finished)

    def on_revoke(self, partitions: list[TP]) -> None:
        """Finish what lies below the highest finished offset, wait for the revoked partitions'
        running handlers, and commit, all within ``revoke_timeout_s`` (or the deadline of a stop
        under way). A commit the group refuses because the rebalance moved on meanwhile
        (``STALE_MEMBER_EPOCH`` under KIP-848, ``ILLEGAL_GENERATION`` / ``REBALANCE_IN_PROGRESS``,
        an unknown coordinator) is made again within that budget: the heartbeat, which runs in
        librdkafka's own thread, brings the member's new epoch (as the Java consumer retries its
        commit before revocation, KAFKA-16033)."""
        c = self._c
        d = c._d
        timeout_s = 0.0 if c._closing else c.config.revoke_timeout_s
        deadline = time.monotonic() + timeout_s
        if not c._closing:  # finish what lies below the highest finished offset first: no re-runs
            catching = [p for tp in partitions if (p := d.parts.get(tp)) is not None]
            for p in catching:
                p.catching_up = True
            c._catch_up(catching, deadline - timeout_s * (1 - CATCH_UP_SHARE))
        parts = d.begin_revoke(partitions)
        self._unpause(partitions)
        if not parts:
            return
        if c._stop_deadline is not None:
            deadline = min(deadline, c._stop_deadline)
        if not d.wait_idle(parts, max(0.0, deadline - time.monotonic())) and not c._closing:
            log.warning("revoke: handlers of %s still running after %g s", partitions, c.config.revoke_timeout_s)
        final, meta = d.close_parts(parts)
        if final:
            # Store as well as commit: with auto commit librdkafka commits the *stored* offsets of
            # the partitions it unassigns after this callback, which must not be older ones.
            if not c.config.manual_commit:
                for topic, partition, offset in final:
                    try:
                        self._client.store(topic, partition, offset, meta.get((topic, partition), ""))
                    except KafkaClientError as exc:
                        log.debug("store on revoke failed: %s", exc)
            self._commit(final, meta, max(deadline, time.monotonic() + FINAL_COMMIT_MIN_S))
        log.info("revoked %s, committed %s", partitions, final)

    def _commit(self, offsets: list[tuple[str, int, int]], meta: dict[TP, str], deadline: float) -> None:
        """Commit the revoked partitions' offsets, again while the group refuses it for a rebalance
        that moved on, until ``deadline`` (monotonic seconds).

        The commit is made from this thread, the one serving the callback: librdkafka does not
        serve a commit sent from another thread while a rebalance callback runs (measured here: it
        waits until the callback returns), so a commit in a callback cannot be bounded by a helper
        thread. Each attempt is bounded by librdkafka's own request timeout (``socket.timeout.ms``).
        """
        pause = COMMIT_RETRY_S[0]
        while True:
            try:
                self._client.commit(offsets, meta)
                return
            except CommitError as exc:
                if exc.code not in _COMMIT_AGAIN or time.monotonic() + pause >= deadline:
                    log.warning("commit on revoke failed: %s (what finished after the last commit runs again)", exc)
                    return
                log.info("commit on revoke refused (%s): trying again in %.2f s", exc.code, pause)
            except KafkaClientError as exc:
                log.warning("commit on revoke failed: %s", exc)
                return
            time.sleep(pause)
            pause = min(COMMIT_RETRY_S[1], pause * 2)

    def on_lost(self, partitions: list[TP]) -> None:
        log.warning("lost %s: dropping their messages without committing", partitions)
        self._c._d.begin_revoke(partitions, lost=True)
        self._unpause(partitions)

    def _unpause(self, partitions: list[TP]) -> None:
        """Resume the revoked partitions back-pressure paused: librdkafka keeps a partition's pause
        across a revoke and a later re-assignment, and ``_paused`` forgets them here, so nothing
        would ever resume one assigned back (it would never be fetched again)."""
        paused = self._c._paused
        stale = [tp for tp in partitions if tp in paused]
        paused.difference_update(partitions)
        if stale:
            try:
                self._client.resume(stale)
            except Exception as exc:  # a rebalance callback must not raise
                log.warning("resume of revoked partitions %s failed: %s", stale, exc)
