"""Where a middleware's producer comes from: the one rule of ``DeadLetter`` and ``Audit``.

Three cases, in this order:

1. ``publisher=`` given: that one, always.
2. ``brokers=`` given: a producer of that cluster with ``producer_config`` only (another cluster
   gets none of the consumer's credentials).
3. Neither: a producer of the consumer's cluster, its ``brokers`` and its connection properties
   (:meth:`~keyedconsumer.ConsumerConfig.connection_properties`) with ``producer_config`` laid over
   them, known once a consumer binds the middleware (``bind_settings``).

In cases 2 and 3 the producer is built by the consumer's publisher factory
(``bind_publishers``: the in-memory broker's under :mod:`keyedconsumer.testing`, else
:class:`~keyedconsumer.Publisher`), when a consumer binds the middleware; nothing is built before,
so defining a middleware at import time reaches no broker. Used without a consumer, case 2 builds a
real :class:`~keyedconsumer.Publisher` at first use and case 3 fails with a message saying what to
pass.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any, Generic, TypeVar

from keyedconsumer import ConsumerConfig, Publisher, PublisherFactory, RecordPublisher

__all__ = ["PublisherSource"]

P = TypeVar("P", bound=RecordPublisher)


class PublisherSource(Generic[P]):
    """The producer of one middleware instance (``owner`` names it in errors, e.g. ``"DeadLetter"``).

    Parameters
    ----------
    brokers, publisher, producer_config:
        The middleware's own arguments (see the module docstring).
    delivery_timeout_s:
        The built producer's ``message.timeout.ms``, in seconds.
    """

    def __init__(
        self,
        owner: str,
        *,
        brokers: Sequence[str] | None,
        publisher: P | None,
        producer_config: Mapping[str, Any] | None,
        delivery_timeout_s: float,
    ) -> None:
        self._owner = owner
        self._given = publisher
        self._brokers = tuple(brokers) if brokers and publisher is None else None
        self._config = dict(producer_config or {})
        self._timeout_s = delivery_timeout_s
        self._factory: PublisherFactory | None = None
        self._built: P | None = None
        #: what the built producer was built by and for: (factory, brokers, inherited properties)
        self._built_for: tuple[PublisherFactory, tuple[str, ...], dict[str, Any]] | None = None
        self._lock = threading.Lock()

    @property
    def from_consumer(self) -> bool:
        """Neither ``brokers`` nor ``publisher`` was given: the consumer's cluster."""
        return self._given is None and self._brokers is None

    def bind_publishers(self, factory: PublisherFactory | None) -> None:
        """The middleware hook: the consumer's publisher factory, used by :meth:`bind_settings`
        (``None``: :class:`~keyedconsumer.Publisher`)."""
        with self._lock:
            self._factory = factory

    def bind_settings(self, settings: ConsumerConfig) -> None:
        """The middleware hook: build the producer (cases 2 and 3) with the bound factory. Bound
        again with the same factory and cluster (one instance in several consumers) it keeps its
        producer; with another factory (a run on the in-memory broker, then on Kafka) it builds a
        new one.

        Raises
        ------
        ValueError
            Case 3, already bound with this factory to a consumer of other brokers or connection
            properties.
        PublishError
            The producer cannot be built (an invalid property).
        """
        if self._given is not None:
            return
        if self._brokers is not None:
            brokers, inherited = self._brokers, {}
        else:
            brokers, inherited = tuple(settings.brokers), settings.connection_properties()
        with self._lock:
            factory = self._factory or Publisher
            done = self._built_for
            if done is not None and done[0] == factory:
                if (done[1], done[2]) != (brokers, inherited):
                    raise ValueError(
                        f"this {self._owner}() is already bound to a consumer of other brokers or "
                        f"connection settings: give each consumer its own {self._owner}(), or pass brokers=[...]"
                    )
                return
            self._built = self._build(factory, brokers, {**inherited, **self._config})
            self._built_for = (factory, brokers, inherited)

    def _build(self, factory: PublisherFactory, brokers: Sequence[str], config: dict[str, Any]) -> P:
        built: Any = factory(list(brokers), config, delivery_timeout_s=self._timeout_s)
        return built  # type: ignore[no-any-return]

    def get(self) -> P:
        """The producer.

        Raises
        ------
        ValueError
            Case 3 and no consumer bound it: the message says what to pass.
        PublishError
            Case 2 unbound, and the producer cannot be built.
        """
        if self._given is not None:
            return self._given
        with self._lock:
            if self._built is not None:
                return self._built
            if self._brokers is None:
                raise ValueError(
                    f"{self._owner}() has no brokers: use it in KeyedConsumer(middlewares=[...]), which gives "
                    "it the consumer's brokers and security settings, or pass brokers=[...] or publisher=..."
                )
            factory = self._factory or Publisher
            self._built = self._build(factory, self._brokers, self._config)
            self._built_for = (factory, self._brokers, {})
            return self._built

    def current(self) -> P | None:
        """The producer given or built so far, or ``None`` (nothing is built here)."""
        with self._lock:
            return self._given if self._given is not None else self._built
