"""Metrics with prometheus-client (the optional extra ``keyedconsumer[metrics]``).

Names follow the OpenTelemetry messaging semantic conventions where they define one
(``messaging.client.consumed.messages``, ``messaging.process.duration``, with the attributes
``messaging.destination.name``, ``messaging.destination.partition.id`` and
``messaging.consumer.group.name``), written the Prometheus way (dots become underscores, units and
``_total`` suffixed). The rest are keyedconsumer's own:

================================================  ==========  ======================================
metric                                            type        labels
================================================  ==========  ======================================
``messaging_client_consumed_messages_total``      counter     destination, group, outcome
``messaging_process_duration_seconds``            histogram   destination, group, outcome
``keyedconsumer_messages_in_flight``              gauge       destination, group (handlers running)
``keyedconsumer_retries_total``                   counter     destination, group
``keyedconsumer_dead_lettered_total``             counter     destination, group
``keyedconsumer_partition_lag``                   gauge       destination, partition, group
``keyedconsumer_oldest_unfinished_age_seconds``   gauge       destination, partition, group
``keyedconsumer_unfinished_messages``             gauge       destination, partition, group
================================================  ==========  ======================================

The partition gauges come from :meth:`Metrics.bind` (``consumer.partition_status()``): a partition
whose lag is above zero while its oldest unfinished age keeps growing is stalled.
"""

from __future__ import annotations

import time
from typing import Any

from keyedconsumer import KeyedConsumer, Message

from ._kind import around
from .logging import outcome_of

__all__ = ["Metrics"]

try:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
    from prometheus_client.core import GaugeMetricFamily
except ImportError as _exc:  # pragma: no cover - depends on the installed extras
    _IMPORT_ERROR: ImportError | None = _exc
else:
    _IMPORT_ERROR = None

_DEST = "messaging_destination_name"
_GROUP = "messaging_consumer_group_name"
_PART = "messaging_destination_partition_id"


class _PartitionCollector:
    def __init__(self, consumer: KeyedConsumer) -> None:
        self._consumer = consumer

    def collect(self) -> Any:
        group = self._consumer.config.group
        lag = GaugeMetricFamily("keyedconsumer_partition_lag", "end offset minus stored offset", labels=[_DEST, _PART, _GROUP])
        age = GaugeMetricFamily(
            "keyedconsumer_oldest_unfinished_age_seconds",
            "seconds since the oldest unfinished message was received",
            labels=[_DEST, _PART, _GROUP],
        )
        unfinished = GaugeMetricFamily(
            "keyedconsumer_unfinished_messages", "received messages not done", labels=[_DEST, _PART, _GROUP]
        )
        for st in self._consumer.partition_status():
            labels = [st.topic, str(st.partition), group]
            if st.lag is not None:
                lag.add_metric(labels, st.lag)
            age.add_metric(labels, st.oldest_unfinished_age_s)
            unfinished.add_metric(labels, st.unfinished)
        yield lag
        yield age
        yield unfinished


class Metrics:
    """Count and time every message; optionally serve ``/metrics`` over HTTP.

    Parameters
    ----------
    registry:
        The prometheus-client registry (default: a new one, so two consumers never clash).
    http_port:
        When given, serve the registry on ``http_addr:http_port`` (``/metrics``).
    http_addr:
        Address to bind (default loopback).
    buckets_s:
        Histogram buckets in seconds.

    Raises
    ------
    ImportError
        prometheus-client is not installed (``pip install keyedconsumer[metrics]``).
    """

    def __init__(
        self,
        *,
        registry: Any = None,
        http_port: int | None = None,
        http_addr: str = "127.0.0.1",
        buckets_s: tuple[float, ...] = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
    ) -> None:
        if _IMPORT_ERROR is not None:
            raise ImportError("Metrics needs prometheus-client: pip install 'keyedconsumer[metrics]'") from _IMPORT_ERROR
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.consumed = Counter(
            "messaging_client_consumed_messages", "messages handled, by outcome", [_DEST, _GROUP, "outcome"], registry=r
        )
        self.duration = Histogram(
            "messaging_process_duration_seconds", "handler duration", [_DEST, _GROUP, "outcome"], buckets=buckets_s, registry=r
        )
        self.in_flight = Gauge("keyedconsumer_messages_in_flight", "handlers running", [_DEST, _GROUP], registry=r)
        self.retries = Counter("keyedconsumer_retries", "attempts that asked to be retried", [_DEST, _GROUP], registry=r)
        self.dead_lettered = Counter("keyedconsumer_dead_lettered", "messages dead-lettered", [_DEST, _GROUP], registry=r)
        self._server: Any = None
        if http_port is not None:
            self._server = start_http_server(http_port, addr=http_addr, registry=r)

    def bind(self, consumer: KeyedConsumer) -> KeyedConsumer:
        """Add the per-partition gauges (lag, oldest unfinished age) of ``consumer``; returns it."""
        self.registry.register(_PartitionCollector(consumer))
        return consumer

    def _record(self, msg: Message, exc: BaseException | None, t0: float) -> None:
        outcome = outcome_of(msg, exc)
        labels = (msg.topic, msg.group_id, outcome)
        self.consumed.labels(*labels).inc()
        self.duration.labels(*labels).observe(time.perf_counter() - t0)
        if outcome == "RETRY":
            self.retries.labels(msg.topic, msg.group_id).inc()
        elif outcome == "DEAD_LETTERED":
            self.dead_lettered.labels(msg.topic, msg.group_id).inc()

    def __call__(self, handler: Any) -> Any:
        return around(handler, self._before, self._after)

    def _before(self, msg: Message) -> tuple[Any, float]:
        gauge = self.in_flight.labels(msg.topic, msg.group_id)
        gauge.inc()
        return gauge, time.perf_counter()

    def _after(self, msg: Message, exc: BaseException | None, state: tuple[Any, float]) -> None:
        gauge, t0 = state
        gauge.dec()
        self._record(msg, exc, t0)
        if exc is not None:
            raise exc
