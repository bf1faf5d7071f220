"""Consumers running in threads on an in-memory broker, for a test to wait on and stop.

Each :class:`Run` and :class:`AppRun` is hermetic (:mod:`keyedconsumer.hermetic`): from its start to
its stop, a real Kafka or Redis client that anything tries to start is refused with
:class:`~keyedconsumer.hermetic.NetworkRefusedError`, and the run raises that error (once) from its
next wait or from its stop, even when a handler or a middleware swallowed it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import TYPE_CHECKING

from .. import hermetic
from ..app import KeyedApp
from ..config import ConsumerConfig
from ..consumer import KeyedConsumer
from ..kafka.client import connect

if TYPE_CHECKING:
    from .broker import InMemoryBroker

__all__ = ["Run", "AppRun"]

log = logging.getLogger("keyedconsumer.testing")


class _Hermetic:
    """A run's hermetic scope, and the refusals it already raised."""

    def __init__(self, what: str) -> None:
        self._scope = hermetic.open_scope(what)
        self._raised = 0

    def raise_new(self) -> None:
        """Raise the refusals seen since the last call, if any (the scope stays open)."""
        self._raise(hermetic.refusals(self._scope))

    def close(self, *, raise_new: bool = True) -> None:
        """Close the scope (a second call does nothing); raise the refusals not raised yet, unless
        ``raise_new`` is false (another error is on its way)."""
        seen = hermetic.close_scope(self._scope)
        if raise_new:
            self._raise(seen)

    def _raise(self, seen: list[str]) -> None:
        if len(seen) > self._raised:
            new, self._raised = seen[self._raised :], len(seen)
            raise hermetic.NetworkRefusedError("; ".join(new))


class _Runner:
    """One consumer's ``run()`` in a thread, and the error that ended it."""

    def __init__(self, consumer: KeyedConsumer) -> None:
        self.consumer = consumer
        self.thread = threading.Thread(
            target=self._main, name=f"keyedconsumer-run-{consumer.config.name}", daemon=True
        )
        self._error: BaseException | None = None
        self._reported = False

    def _main(self) -> None:
        try:
            self.consumer.run()
        except BaseException as exc:  # kept for the test thread, which re-raises it
            self._error = exc

    def take_error(self) -> BaseException | None:
        """The error that ended ``run()``, once: ``None`` while it runs, and after the first call."""
        if self._error is None or self._reported or self.thread.is_alive():
            return None
        self._reported = True
        return self._error


def _left(broker: InMemoryBroker, configs: Iterable[ConsumerConfig]) -> str:
    """What is not committed yet of the consumers' topics, per group: ``""`` when nothing."""
    groups: dict[str, set[str]] = {}
    for cfg in configs:
        groups.setdefault(cfg.group, set()).update(cfg.topics)
    committed = {g: broker.committed(g) for g in groups}
    parts = []
    for g, topics in sorted(groups.items()):
        for (topic, p), lag in sorted(broker.lag(g, sorted(topics)).items()):
            if lag > 0:
                c = committed[g].get((topic, p))
                end = (c or 0) + lag
                parts.append(f"group {g!r} {topic}[{p}] committed {c} of end {end} ({lag} left)")
    return ", ".join(parts)


class Run:
    """Consumers running in threads on an :class:`InMemoryBroker`; made by :meth:`InMemoryBroker.run`.

    Use it as a context manager: on exit every consumer is stopped and joined, and an error that
    ended a consumer's ``run()`` (a :class:`~keyedconsumer.MessageError` from an unhandled handler
    failure, a fatal :class:`~keyedconsumer.KafkaClientError`) is raised, unless one of the methods
    below raised it already. Each error is raised once.
    """

    def __init__(self, broker: InMemoryBroker, consumers: Iterable[KeyedConsumer]) -> None:
        self._broker = broker
        self._runners: list[_Runner] = []
        consumers = list(consumers)
        self._hermetic = _Hermetic(f"InMemoryBroker.run({', '.join(c.config.name for c in consumers)})")
        try:
            for c in consumers:
                self.add(c)
        except BaseException:
            self._hermetic.close()
            raise

    def add(self, consumer: KeyedConsumer) -> None:
        """Start one more consumer (for example a second member of a group, mid-run).

        Raises
        ------
        ValueError
            ``consumer`` uses the real Kafka client (it was built without ``client_factory``).
        """
        if getattr(consumer, "_factory", None) is connect:
            raise ValueError(
                "the consumer uses the real Kafka client: build it with broker.consumer(...) "
                "or KeyedConsumer(client_factory=broker.client_factory, clock=broker.clock, ...)"
            )
        runner = _Runner(consumer)
        self._runners.append(runner)
        runner.thread.start()

    def stop(self, consumer: KeyedConsumer | None = None) -> None:
        """Stop ``consumer`` (default: all, and the run's hermetic scope ends) and wait until its
        ``run()`` returned.

        Raises
        ------
        BaseException
            The error that ended its ``run()``, if not raised before.
        NetworkRefusedError
            Something tried to reach the network during the run (not raised before).
        TimeoutError
            ``run()`` did not return within ``shutdown_timeout_s`` + 10 s.
        """
        chosen = [r for r in self._runners if consumer is None or r.consumer is consumer]
        for r in chosen:
            r.consumer.stop()
        for r in chosen:
            r.thread.join(r.consumer.config.shutdown_timeout_s + 10.0)
            if r.thread.is_alive():
                raise TimeoutError(f"consumer {r.consumer.config.name!r} did not stop")
        try:
            self._raise_errors(chosen)
        except BaseException:
            if consumer is None:
                self._hermetic.close(raise_new=False)
            raise
        if consumer is None:
            self._hermetic.close()

    def _raise_errors(self, runners: Iterable[_Runner]) -> None:
        for r in runners:
            error = r.take_error()
            if error is not None:
                raise error
        self._hermetic.raise_new()

    def wait_for(
        self, condition: Callable[[], bool], timeout_s: float = 5.0, what: str = "the condition"
    ) -> None:
        """Wait until ``condition()`` is true, polling every millisecond of real time.

        Raises
        ------
        BaseException
            The error that ended a consumer's ``run()`` meanwhile.
        TimeoutError
            Not true within ``timeout_s`` real seconds.
        """
        deadline = time.monotonic() + timeout_s
        while not condition():
            self._raise_errors(self._runners)
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{what} did not happen within {timeout_s:g} s")
            time.sleep(0.001)

    def until_idle(self, timeout_s: float = 5.0) -> None:
        """Wait until every record of every topic the consumers subscribe to is committed by their
        groups (committed offset = end offset). The consumers go on running.

        Raises
        ------
        BaseException
            The error that ended a consumer's ``run()`` (e.g. ``MessageError``), once.
        RuntimeError
            Every consumer stopped, without error, before that.
        TimeoutError
            Not idle within ``timeout_s`` real seconds; the message names each partition left,
            with its committed and end offsets, and the messages in flight.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            seen = self._broker.version()
            self._raise_errors(self._runners)
            left = self._left()
            if not left:
                return
            if all(not r.thread.is_alive() for r in self._runners):
                self._raise_errors(self._runners)
                raise RuntimeError(f"the consumers stopped before every record was committed: {left}")
            if time.monotonic() >= deadline:
                in_flight = {r.consumer.config.name: r.consumer.in_flight for r in self._runners}
                raise TimeoutError(f"not idle after {timeout_s:g} s: {left}; messages in flight: {in_flight}")
            self._broker.wait_for_change(seen, 0.002)

    def _left(self) -> str:
        return _left(self._broker, [r.consumer.config for r in self._runners])

    def __enter__(self) -> Run:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        _stop_on_exit(self.stop, exc)


class AppRun:
    """A :class:`~keyedconsumer.KeyedApp` running in a thread on an :class:`InMemoryBroker`, its
    routes, hooks and middleware as written (``app.run(client_factory=broker.client_factory,
    clock=broker.clock)``); made by :meth:`InMemoryBroker.run_app`.

    Use it as a context manager: on exit the app is stopped (its shutdown hooks run) and the error
    that ended ``app.run()``, if any, is raised (once), unless the body raised.
    """

    def __init__(self, broker: InMemoryBroker, app: KeyedApp) -> None:
        self._broker = broker
        self.app = app
        self._error: BaseException | None = None
        self._reported = False
        self._hermetic = _Hermetic("InMemoryBroker.run_app(app)")
        self.thread = threading.Thread(target=self._main, name="keyedconsumer-app", daemon=True)
        self.thread.start()

    def _main(self) -> None:
        try:
            self.app.run(client_factory=self._broker.client_factory, clock=self._broker.clock)
        except BaseException as exc:  # kept for the test thread, which re-raises it
            self._error = exc

    def _raise_error(self) -> None:
        if self._error is not None and not self._reported and not self.thread.is_alive():
            self._reported = True
            raise self._error
        self._hermetic.raise_new()

    def until_idle(self, timeout_s: float = 5.0) -> None:
        """Wait until every record of every route's topics is committed by the route's group.

        Raises
        ------
        BaseException
            The error that ended ``app.run()`` (e.g. ``MessageError``), once.
        RuntimeError
            The app stopped, without error, before that.
        TimeoutError
            Not idle within ``timeout_s`` real seconds (the message names what is left).
        """
        deadline = time.monotonic() + timeout_s
        configs = [r.settings for r in self.app.routes]
        while True:
            seen = self._broker.version()
            self._raise_error()
            left = _left(self._broker, configs)
            if not left and self.app.consumers:
                return
            if not self.thread.is_alive():
                self._raise_error()
                raise RuntimeError(f"the app stopped before every record was committed: {left}")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"not idle after {timeout_s:g} s: {left or 'the routes did not start'}")
            self._broker.wait_for_change(seen, 0.002)

    def stop(self) -> None:
        """Stop the app (every route drains and commits, the shutdown hooks run) and wait for it.

        Raises
        ------
        BaseException
            The error that ended ``app.run()``, if not raised before.
        NetworkRefusedError
            Something tried to reach the network during the run (not raised before).
        TimeoutError
            It did not stop within the longest route's ``shutdown_timeout_s`` + 10 s.
        """
        self.app.stop()
        self.thread.join(max((r.settings.shutdown_timeout_s for r in self.app.routes), default=30.0) + 10.0)
        if self.thread.is_alive():
            raise TimeoutError("the app did not stop")
        try:
            self._raise_error()
        except BaseException:
            self._hermetic.close(raise_new=False)
            raise
        self._hermetic.close()

    def __enter__(self) -> AppRun:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        _stop_on_exit(self.stop, exc)


def _stop_on_exit(stop: Callable[[], None], exc: BaseException | None) -> None:
    """Leaving a ``with`` block: stop; when the body raised, its exception wins and an error the
    stop raises (what ended a run) is only logged."""
    if exc is None:
        stop()
        return
    try:
        stop()
    except BaseException as err:
        log.warning("a run also ended with: %r", err)
