"""``KeyedApp``: several handlers in one process, their lifecycle hooks and one stop for all.

Modelled on faststream's ``FastStream`` + ``@broker.subscriber``, Karafka's routes and Spring's
``@KafkaListener``: a route is a topic (or topics) and a handler with its own options, and the app
runs a :class:`~keyedconsumer.KeyedConsumer` per route, the engine underneath, unchanged::

    app = KeyedApp(brokers=["kafka:9092"], group_id="billing")

    @app.on_startup
    async def open_pool() -> None: ...

    @app.handler("payments", concurrency=16, middlewares=[Retry(max_attempts=5)])
    async def payment(msg: Message) -> None: ...

    @app.handler("refunds", ordering="partition")
    def refund(msg: Message) -> None: ...

    app.run()   # or: await app.run_async()

All routes and hooks share one event loop (the one :meth:`KeyedApp.run_async` runs on; ``run()``
makes one), so an async pool opened in an ``on_startup`` hook is used by ``async def`` handlers and
closed by an ``on_shutdown`` hook after the last commit.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from . import signals
from .config import ConsumerConfig
from .consumer import ErrorHandler, Handler, KeyedConsumer, Middleware, PartitionStatus
from .engine.batch import check_batch_middlewares
from .errors import KeyedConsumerError
from .kafka import ClientFactory
from .sequencing.base import Sequencer

__all__ = ["KeyedApp", "Route"]

log = logging.getLogger("keyedconsumer.app")

Hook = Callable[[], None] | Callable[[], Awaitable[None]]
H = TypeVar("H", bound=Callable[..., Any])


@dataclass(frozen=True)
class Route:
    """One handler of a :class:`KeyedApp`: what :meth:`KeyedApp.handler` registered.

    ``settings`` is validated when the route is registered; ``sequencer`` is a factory, called once
    per run (a :class:`~keyedconsumer.RedisSequencer` belongs to one consumer). ``options`` are the
    :class:`~keyedconsumer.ConsumerConfig` fields the app and the route gave (the route's winning),
    ``topics`` and ``name`` included: what :meth:`KeyedApp.apply_defaults` keeps.
    """

    handler: Handler
    settings: ConsumerConfig
    middlewares: Sequence[Middleware] = ()
    error_handler: ErrorHandler | None = None
    sequencer: Callable[[], Sequencer] | None = None
    consumer_options: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    #: ``handler`` is a batch handler (:meth:`KeyedApp.batch_handler`): it takes a list of messages.
    batch: bool = False


class KeyedApp:
    """Routes (topic → handler), lifecycle hooks, and one run and one stop for all of them.

    Parameters
    ----------
    client_factory:
        Builds each route's Kafka client (default: librdkafka); tests pass
        ``InMemoryBroker.client_factory``.
    clock:
        Monotonic clock in seconds for ``RetryLater`` delays (``InMemoryBroker.clock`` in tests).
    middlewares:
        Middleware of every route, outside the route's own (the first given is the outermost);
        :meth:`use` adds more before a run.
    **options:
        :class:`~keyedconsumer.ConsumerConfig` fields shared by every route (``brokers``,
        ``group_id``, ``config`` with the security settings, ``shutdown_timeout_s`` ...); a route's
        own options replace them. ``topics`` and ``name`` belong to routes.

    Consumer groups: a route's group is its own ``group_id``, else the app's ``group_id`` (every
    such route joins that one group, each member subscribed to its route's topics, as Spring's
    listeners of one container factory do), else the route's name (the handler's function name
    unless ``name=`` is given).

    Raises
    ------
    ValueError
        An option that is not a ``ConsumerConfig`` field, or ``topics`` / ``name``.
    """

    def __init__(
        self,
        *,
        client_factory: ClientFactory | None = None,
        clock: Callable[[], float] = time.monotonic,
        middlewares: Sequence[Middleware] = (),
        **options: Any,
    ) -> None:
        fields = set(ConsumerConfig.model_fields)
        unknown = sorted(set(options) - fields)
        if unknown:
            raise ValueError(f"not a ConsumerConfig field: {', '.join(unknown)}")
        for own in ("topics", "name"):
            if own in options:
                raise ValueError(f"{own!r} belongs to a route: @app.handler(...)")
        self._options = options
        self._middlewares: list[Middleware] = list(middlewares)
        self._client_factory = client_factory
        self._clock = clock
        self.routes: list[Route] = []
        self._startup: list[Hook] = []
        self._shutdown: list[Hook] = []
        self._consumers: list[KeyedConsumer] = []
        self._lock = threading.RLock()  # re-entrant: stop() may run in a signal handler on this thread
        self._stopping = False
        self._running = False

    # -- registration ---------------------------------------------------------------------------

    def handler(
        self,
        *topics: str,
        name: str | None = None,
        middlewares: Sequence[Middleware] = (),
        error_handler: ErrorHandler | None = None,
        sequencer: Callable[[], Sequencer] | None = None,
        **options: Any,
    ) -> Callable[[H], H]:
        """Register the decorated function as the handler of ``topics``.

        Parameters
        ----------
        topics:
            One or more topic names (at least one).
        name:
            The route's consumer name (default: the function's ``__name__``); its group id when
            neither the route nor the app gives ``group_id``. Names must be unique in the app.
        middlewares, error_handler:
            As :class:`~keyedconsumer.KeyedConsumer` takes them.
        sequencer:
            A zero-argument factory of the route's sequencer, e.g.
            ``lambda: RedisSequencer(url, "billing")`` (called once per run).
        **options:
            :class:`~keyedconsumer.ConsumerConfig` fields for this route (``concurrency``,
            ``ordering``, ``group_id`` ...), replacing the app's.

        Returns the function unchanged, so it can still be called (and tested) directly.

        Raises
        ------
        pydantic.ValidationError
            A bad option, naming the field (at registration, not at run).
        ValueError
            No topic, or a name already used by another route.
        """
        return self._register(topics, name, middlewares, error_handler, sequencer, options, batch=False)

    def batch_handler(
        self,
        *topics: str,
        name: str | None = None,
        middlewares: Sequence[Middleware] = (),
        error_handler: ErrorHandler | None = None,
        sequencer: Callable[[], Sequencer] | None = None,
        **options: Any,
    ) -> Callable[[H], H]:
        """Register the decorated function as the *batch* handler of ``topics``: it takes a list of
        messages, at most one per key (``KeyedConsumer(batch_handler=...)``); ``handler_batch_size``
        and ``handler_batch_linger_s`` are among ``options``. Parameters as :meth:`handler`.

        Raises
        ------
        pydantic.ValidationError
            A bad option, naming the field (at registration, not at run).
        ValueError
            No topic, or a name already used by another route.
        TypeError
            A route middleware that cannot wrap a batch handler (only ``Retry``, ``DeadLetter``,
            ``Recover`` can); an app middleware that cannot is refused when the app runs.
        """
        check_batch_middlewares(middlewares)
        return self._register(topics, name, middlewares, error_handler, sequencer, options, batch=True)

    def _register(
        self,
        topics: tuple[str, ...],
        name: str | None,
        middlewares: Sequence[Middleware],
        error_handler: ErrorHandler | None,
        sequencer: Callable[[], Sequencer] | None,
        options: dict[str, Any],
        *,
        batch: bool,
    ) -> Callable[[H], H]:
        if not topics:
            raise ValueError(f"@app.{'batch_handler' if batch else 'handler'} needs at least one topic")

        def register(fn: H) -> H:
            route_name = name or getattr(fn, "__name__", None) or "handler"
            if any(r.settings.name == route_name for r in self.routes):
                raise ValueError(f"a route named {route_name!r} exists already: pass name=")
            merged = {**self._options, **options, "topics": list(topics), "name": route_name}
            settings = ConsumerConfig(**merged)
            self.routes.append(
                Route(fn, settings, tuple(middlewares), error_handler, sequencer, options=merged, batch=batch)
            )
            return fn

        return register

    def apply_defaults(self, defaults: Mapping[str, Any]) -> list[tuple[str, str]]:
        """Put ``defaults`` (:class:`~keyedconsumer.ConsumerConfig` fields) under every route's
        options: each route's settings become ``defaults``, then the app's options, then the
        route's own, validated again. ``keyedconsumer run module:app`` passes the settings of its
        flags, environment and TOML file this way. Call it before :meth:`run`.

        Returns
        -------
        ``[(route name, field)]``: each default a route's (or the app's) own option replaced with
        another value, so the caller can say so.

        Raises
        ------
        ValueError
            ``topics`` or ``name`` among the defaults (they belong to routes), or the app running.
        pydantic.ValidationError
            A bad value, naming the field; no route is changed then.
        """
        for own in ("topics", "name"):
            if own in defaults:
                raise ValueError(f"{own!r} belongs to a route: @app.handler(...)")
        with self._lock:
            if self._running:
                raise ValueError("the app is running: apply defaults before run()")
            routes = [
                replace(r, settings=ConsumerConfig.model_validate({**defaults, **r.options}))
                for r in self.routes
            ]
            self.routes = routes
        return [
            (r.settings.name, k)
            for r in routes
            for k, v in defaults.items()
            if k in r.options and r.options[k] != v
        ]

    def use(self, *middlewares: Middleware) -> None:
        """Add middleware to every route, inside the app's earlier ones and outside each route's own
        (e.g. ``app.use(Metrics(http_port=9464))``); it takes effect at the next run."""
        self._middlewares.extend(middlewares)

    def on_startup(self, fn: H) -> H:
        """Run ``fn()`` (sync or ``async def``) before any consumer starts, on the app's event loop,
        in registration order. If one raises, no consumer starts and :meth:`run` raises it."""
        self._startup.append(fn)
        return fn

    def on_shutdown(self, fn: H) -> H:
        """Run ``fn()`` (sync or ``async def``) after every consumer stopped and made its last
        commit, on the app's event loop, in reverse registration order. Shutdown hooks run when
        every startup hook ran, also after a consumer failed; a raising hook is logged and the
        others still run."""
        self._shutdown.append(fn)
        return fn

    # -- running --------------------------------------------------------------------------------

    @property
    def consumers(self) -> list[KeyedConsumer]:
        """The running consumers, one per route, in route order (empty before a run)."""
        return list(self._consumers)

    def run(
        self, *, client_factory: ClientFactory | None = None, clock: Callable[[], float] | None = None
    ) -> None:
        """Run every route until :meth:`stop`, SIGINT/SIGTERM, or a route's unhandled error, on a new
        event loop (``asyncio.run``). See :meth:`run_async`."""
        asyncio.run(self.run_async(client_factory=client_factory, clock=clock))

    async def run_async(
        self, *, client_factory: ClientFactory | None = None, clock: Callable[[], float] | None = None
    ) -> None:
        """Startup hooks, then every route's consumer (:meth:`KeyedConsumer.run_async`) on this loop,
        then, once all have stopped and committed, the shutdown hooks.

        ``client_factory`` and ``clock`` replace the app's for this run only: the same app object,
        routes and middleware run on :class:`~keyedconsumer.testing.InMemoryBroker`
        (``broker.run_app(app)`` passes them).

        SIGINT and SIGTERM stop the app (also during the startup hooks: then no consumer starts):
        every consumer drains and commits (:mod:`keyedconsumer.signals` is the one owner of these
        signals in the process). When one route's consumer ends with an error, the others are
        stopped gracefully too, and the first error is raised after the shutdown hooks.

        Raises
        ------
        KeyedConsumerError
            No route registered, or the app is running already.
        MessageError, HandlerContractError, KafkaClientError
            As :meth:`KeyedConsumer.run` raises them, from the first route that failed.
        Exception
            What a startup hook raised.
        """
        if not self.routes:
            raise KeyedConsumerError("the app has no route: register a handler with @app.handler(topic)")
        with self._lock:
            if self._running:
                raise KeyedConsumerError("this app is already running")
            self._running = True
        signals.register(self)
        try:
            for hook in self._startup:
                await _call(hook)
            try:
                await self._serve(client_factory or self._client_factory, clock or self._clock)
            finally:
                await self._run_shutdown()
        finally:
            signals.unregister(self)
            with self._lock:
                self._running = False
                self._stopping = False
                self._consumers = []

    async def _serve(self, client_factory: ClientFactory | None, clock: Callable[[], float]) -> None:
        with self._lock:
            if self._stopping:
                return
            self._consumers = [self._consumer(r, client_factory, clock) for r in self.routes]
        tasks = [asyncio.ensure_future(c.run_async()) for c in self._consumers]
        first: BaseException | None = None
        try:
            pending: set[asyncio.Future[None]] = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    if first is None and not t.cancelled() and t.exception() is not None:
                        first = t.exception()
                if pending:  # one route ended (an error, or a stop): the app ends
                    self.stop()
        except asyncio.CancelledError:
            self.stop()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        if first is not None:
            raise first

    def _consumer(
        self, route: Route, client_factory: ClientFactory | None, clock: Callable[[], float]
    ) -> KeyedConsumer:
        handlers: dict[str, Any] = {"batch_handler" if route.batch else "handler": route.handler}
        return KeyedConsumer(
            **handlers,
            middlewares=[*self._middlewares, *route.middlewares],
            error_handler=route.error_handler,
            client_factory=client_factory,
            settings=route.settings,
            sequencer=route.sequencer() if route.sequencer is not None else None,
            clock=clock,
        )

    async def _run_shutdown(self) -> None:
        for hook in reversed(self._shutdown):
            try:
                await _call(hook)
            except Exception:
                log.exception("on_shutdown hook %s raised", getattr(hook, "__name__", hook))

    # -- health (a keyedconsumer.health.HealthSource: Health(app) works) ------------------------

    @property
    def polled_at_s(self) -> float:
        """When the route that polled least recently last returned from a poll (monotonic seconds;
        0.0 before every route polled once): the app is live while all its poll loops run."""
        consumers = self.consumers
        if not consumers:
            return 0.0
        return min(c.polled_at_s for c in consumers)

    @property
    def assignment(self) -> list[tuple[str, int]]:
        """The partitions assigned to any route now."""
        return [tp for c in self.consumers for tp in c.assignment]

    @property
    def overrunning(self) -> int:
        """Plain handler runs past ``handler_timeout_s`` still running, over every route."""
        return sum(c.overrunning for c in self.consumers)

    @property
    def store_available(self) -> bool:
        """``False`` while any route's sequencer store (Redis) does not answer."""
        return all(c.store_available for c in self.consumers)

    def partition_status(self) -> list[PartitionStatus]:
        """Every route's partition status (two routes on one topic list its partitions twice)."""
        return [s for c in self.consumers for s in c.partition_status()]

    def stop(self) -> None:
        """Stop every route gracefully (each drains and commits, see :meth:`KeyedConsumer.stop`);
        a stop during the startup hooks starts no consumer. Safe from any thread, a handler and a
        signal handler; returns at once."""
        with self._lock:
            self._stopping = True
            consumers = list(self._consumers)
        for c in consumers:
            c.stop()


async def _call(hook: Hook) -> None:
    result = hook()
    if inspect.isawaitable(result):
        await result
