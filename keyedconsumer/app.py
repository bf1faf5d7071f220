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
from dataclasses import replace
from typing import Any, TypeVar

from . import signals
from .config import ConsumerConfig
from .consumer import ErrorHandler, KeyedConsumer, Middleware, PartitionStatus
from .engine.batch import check_batch_middlewares
from .engine.handler import check_error_handler, check_handler
from .errors import KeyedConsumerError
from .health import unavailable_of
from .kafka import ClientFactory
from .routes import Route, differing, layered, route_settings
from .sequencing.base import Sequencer

__all__ = ["KeyedApp", "Route"]

log = logging.getLogger("keyedconsumer.app")

Hook = Callable[[], None] | Callable[[], Awaitable[None]]
H = TypeVar("H", bound=Callable[..., Any])


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
        produces: Sequence[str] | Mapping[str, Any] = (),
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
        produces:
            The topics the handler writes to with ``msg.produce``, as names or as
            ``{topic: pydantic model class or None}``: they appear in the AsyncAPI document
            (``keyedconsumer docs module:app``) with their payload schema. Documentation only:
            ``msg.produce`` is not checked against it.
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
        return self._register(
            topics, name, middlewares, error_handler, sequencer, produces, options, batch=False
        )

    def batch_handler(
        self,
        *topics: str,
        name: str | None = None,
        middlewares: Sequence[Middleware] = (),
        error_handler: ErrorHandler | None = None,
        sequencer: Callable[[], Sequencer] | None = None,
        produces: Sequence[str] | Mapping[str, Any] = (),
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
        return self._register(
            topics, name, middlewares, error_handler, sequencer, produces, options, batch=True
        )

    def _register(
        self,
        topics: tuple[str, ...],
        name: str | None,
        middlewares: Sequence[Middleware],
        error_handler: ErrorHandler | None,
        sequencer: Callable[[], Sequencer] | None,
        produces: Sequence[str] | Mapping[str, Any],
        options: dict[str, Any],
        *,
        batch: bool,
    ) -> Callable[[H], H]:
        if isinstance(produces, str):
            raise TypeError(f"produces= takes a list of topics or a mapping, got the string {produces!r}")
        declared = dict(produces) if isinstance(produces, Mapping) else dict.fromkeys(produces)
        if not topics:
            raise ValueError(f"@app.{'batch_handler' if batch else 'handler'} needs at least one topic")

        def register(fn: H) -> H:
            route_name = name or getattr(fn, "__name__", None) or "handler"
            if any(r.settings.name == route_name for r in self.routes):
                raise ValueError(f"a route named {route_name!r} exists already: pass name=")
            try:  # here, not at the first message
                check_handler(fn, batch=batch)
                check_error_handler(error_handler)
            except TypeError as exc:
                raise TypeError(f"route {route_name!r}: {exc}") from None
            own = {**options, "topics": list(topics), "name": route_name}
            merged = layered(self._options, own)
            settings = route_settings(route_name, merged, environment=True)
            self.routes.append(
                Route(
                    fn,
                    settings,
                    tuple(middlewares),
                    error_handler,
                    sequencer,
                    options=merged,
                    batch=batch,
                    own=own,
                    produces=declared,
                )
            )
            return fn

        return register

    def apply_defaults(self, defaults: Mapping[str, Any]) -> list[tuple[str, str]]:
        """Put ``defaults`` (:class:`~keyedconsumer.ConsumerConfig` fields) under every route's
        options: each route's settings become ``defaults``, then the app's options, then the
        route's own, validated again. Call it before :meth:`run`. Unlike :meth:`apply_settings`,
        the app's own options beat them.

        Returns ``[(route name, field)]``: each default a route's (or the app's) own option replaced
        with another value (a librdkafka property as ``config.<property>``). Raises as
        :meth:`apply_settings`.
        """
        return [(r, k) for r, k in self._apply(defaults, over_app=False) if r is not None]

    def apply_settings(self, settings: Mapping[str, Any]) -> list[tuple[str | None, str]]:
        """Put ``settings`` (:class:`~keyedconsumer.ConsumerConfig` fields) over the app's own
        options and under each route's: each route's settings become the app's options, then
        ``settings``, then the route's own, validated again; ``config`` (librdkafka properties)
        merges property by property the same way. ``keyedconsumer run module:app`` passes the
        settings of its flags, environment and TOML file this way: what the command line gives for
        every route beats what the code gives for every route (``KeyedApp(brokers=...)``), and a
        route's own option (``@app.handler(..., concurrency=16)``, a route on another cluster) beats
        both. Call it before :meth:`run`.

        Returns
        -------
        ``[(route name, field)]``: each setting a route's own option replaced with another value
        (a librdkafka property as ``config.<property>``), so the caller can say so; first
        ``[(None, field)]``: each of the app's own options a setting replaced.

        Raises
        ------
        ValueError
            ``topics`` or ``name`` among the settings (they belong to routes), or the app running.
        pydantic.ValidationError
            A bad value, naming the field and (its title) the route; no route is changed then.
        """
        return self._apply(settings, over_app=True)

    def _apply(self, values: Mapping[str, Any], *, over_app: bool) -> list[tuple[str | None, str]]:
        for own in ("topics", "name"):
            if own in values:
                raise ValueError(f"{own!r} belongs to a route: @app.handler(...)")
        replaced: list[tuple[str | None, str]] = []
        if over_app:
            replaced += [(None, k) for k in differing(values, self._options)]
        with self._lock:
            if self._running:
                raise ValueError("the app is running: apply settings before run()")
            routes = []
            for r in self.routes:
                # over the app's options and under the route's own; or, as defaults, under both
                beaten = r.own if over_app else r.options
                data = layered(self._options, values, r.own) if over_app else layered(values, r.options)
                settings = route_settings(str(r.own.get("name")), data)
                routes.append(replace(r, settings=settings))
                replaced += [(settings.name, k) for k in differing(values, beaten)]
            self.routes = routes
        return replaced

    @property
    def middlewares(self) -> tuple[Middleware, ...]:
        """The app's middleware, outside every route's own (first: the outermost)."""
        return tuple(self._middlewares)

    def use(self, *middlewares: Middleware) -> None:
        """Add middleware to every route, inside the app's earlier ones and outside each route's own
        (e.g. ``app.use(Metrics(http_port=9464))``); it takes effect at the next run."""
        self._middlewares.extend(middlewares)

    def on_startup(self, fn: H) -> H:
        """Run ``fn()`` (sync or ``async def``) before any consumer starts (after the brokers
        answered, see :meth:`run_async`), on the app's event loop, in registration order. If one
        raises, no consumer starts and :meth:`run` raises it."""
        self._startup.append(fn)
        return fn

    def on_shutdown(self, fn: H) -> H:
        """Run ``fn()`` (sync or ``async def``) after every consumer stopped and made its last
        commit, on the app's event loop, in reverse registration order: after the last handler run
        ended, except a handler left behind by ``shutdown_timeout_s`` (logged when the consumer
        stops; a plain function cannot be interrupted). Shutdown hooks run when every startup hook
        ran, also after a consumer failed; a raising hook is logged and the others still run."""
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
        event loop (``asyncio.run``). See :meth:`run_async`.

        Called from the main thread, it holds SIGINT and SIGTERM from its call to its return
        (:func:`keyedconsumer.signals.guard`): a signal at any moment of it (the startup hooks, the
        routes' runs, the shutdown hooks, the loop's own setup and teardown) stops the app once,
        gracefully; asyncio's own SIGINT handler (which would cancel the run) is not installed."""
        with signals.guard():
            asyncio.run(self.run_async(client_factory=client_factory, clock=clock))

    async def run_async(
        self, *, client_factory: ClientFactory | None = None, clock: Callable[[], float] | None = None
    ) -> None:
        """The brokers' check, the startup hooks, then every route's consumer
        (:meth:`KeyedConsumer.run_async`) on this loop, then, once all have stopped and committed,
        the shutdown hooks.

        With librdkafka's client (no ``client_factory``), each cluster of the routes (brokers and
        connection properties) must answer within the route's ``startup_timeout_s`` before any
        startup hook runs: a wrong address or refused credentials end the run before a hook opened
        anything (no hook runs, so no shutdown hook either).

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
        KafkaClientError
            A cluster did not answer, or refused the authentication, before the startup hooks.
        MessageError, HandlerContractError, KafkaClientError
            As :meth:`KeyedConsumer.run` raises them, from the first route that failed (the others'
            errors are logged).
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
            factory = client_factory or self._client_factory
            if factory is None and not await self._check_clusters():
                return  # stopped while the brokers were asked: no hook ran, no consumer starts
            for hook in self._startup:
                await _call(hook)
            try:
                await self._serve(factory, clock or self._clock)
            finally:
                await self._run_shutdown()
        finally:
            signals.unregister(self)
            with self._lock:
                self._running = False
                self._stopping = False
                self._consumers = []

    async def _check_clusters(self) -> bool:
        """Before the startup hooks, with librdkafka's client: each cluster of the routes (brokers
        and connection properties) answers within the route's ``startup_timeout_s``, so that a
        wrong address or refused credentials fail the run before a hook opens anything. Returns
        ``False`` when the app was stopped meanwhile (the check is then left to end on its own).

        Raises
        ------
        KafkaClientError
            The first cluster that did not answer, or refused the authentication.
        """
        from .kafka.client import check_cluster

        checks: dict[tuple[str, str], ConsumerConfig] = {}
        for r in self.routes:
            conf = r.settings.librdkafka()
            key = (str(conf["bootstrap.servers"]), repr(sorted(r.settings.connection_properties().items())))
            checks.setdefault(key, r.settings)
        for settings in checks.values():
            done = asyncio.ensure_future(
                asyncio.to_thread(check_cluster, settings.librdkafka(), settings.startup_timeout_s)
            )
            while not done.done():
                await asyncio.wait([done], timeout=0.1)
                if self._stopping:
                    done.add_done_callback(_retrieved)
                    return False
            done.result()
        return True

    async def _serve(self, client_factory: ClientFactory | None, clock: Callable[[], float]) -> None:
        with self._lock:
            if self._stopping:
                return
            self._consumers = [self._consumer(r, client_factory, clock) for r in self.routes]
        tasks = [asyncio.ensure_future(c.run_async()) for c in self._consumers]
        names: dict[asyncio.Future[None], str] = {
            t: c.config.name for t, c in zip(tasks, self._consumers, strict=True)
        }
        first: BaseException | None = None
        try:
            pending: set[asyncio.Future[None]] = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for t in done:  # every task's exception is retrieved: asyncio logs the others
                    error = None if t.cancelled() else t.exception()
                    if error is not None and first is None:
                        first = error
                    elif error is not None and str(error) != str(first):
                        log.error("route %s stopped too: %s", names[t], error)
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

    def unavailable(self) -> list[str]:
        """Why messages of a route wait now for a service its middleware needs (a ``Typed`` whose
        schema registry is out), one reason each: what makes ``Health(app)`` not ready."""
        return unavailable_of([*self._middlewares, *(m for r in self.routes for m in r.middlewares)])

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


def _retrieved(task: asyncio.Future[Any]) -> None:
    """Retrieve an abandoned task's exception (asyncio would log it as never retrieved)."""
    if not task.cancelled():
        task.exception()


async def _call(hook: Hook) -> None:
    result = hook()
    if inspect.isawaitable(result):
        await result
