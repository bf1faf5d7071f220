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

**librdkafka's statistics.** Pass :meth:`Metrics.stats_cb` as the consumer's ``stats_cb`` with a
``statistics.interval.ms`` (``config={"stats_cb": metrics.stats_cb, "statistics.interval.ms":
5000}``) and the figures of its last report (librdkafka's STATISTICS.md; label ``client``: the
report's ``name``, e.g. ``rdkafka#consumer-1``) are served too:

==================================================  ==========  ==========================================
metric                                              type        from the report (labels)
==================================================  ==========  ==========================================
``keyedconsumer_librdkafka_replyq``                 gauge       ``replyq``: events waiting for the poll
``keyedconsumer_librdkafka_rx_messages_total``      counter     ``rxmsgs``: messages fetched
``keyedconsumer_librdkafka_rx_bytes_total``         counter     ``rxmsg_bytes``
``keyedconsumer_librdkafka_rebalances_total``       counter     ``cgrp.rebalance_cnt``
``keyedconsumer_librdkafka_broker_rtt_seconds``     gauge       ``brokers.*.rtt.avg`` (``broker``)
``keyedconsumer_librdkafka_consumer_lag``           gauge       ``topics.*.partitions.*.consumer_lag``:
                                                                high watermark minus committed offset
                                                                (destination, partition)
==================================================  ==========  ==========================================
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from keyedconsumer import KeyedConsumer, Message

from ._kind import around
from .logging import outcome_of

__all__ = ["Metrics"]

try:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
except ImportError as _exc:  # pragma: no cover - depends on the installed extras
    _IMPORT_ERROR: ImportError | None = _exc
else:
    _IMPORT_ERROR = None

_DEST = "messaging_destination_name"
_GROUP = "messaging_consumer_group_name"
_PART = "messaging_destination_partition_id"

log = logging.getLogger("keyedconsumer.middleware.metrics")


class _PartitionCollector:
    def __init__(self, consumer: KeyedConsumer) -> None:
        self._consumer = consumer

    def collect(self) -> Any:
        group = self._consumer.config.group
        lag = GaugeMetricFamily(
            "keyedconsumer_partition_lag", "end offset minus stored offset", labels=[_DEST, _PART, _GROUP]
        )
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


class _StatsCollector:
    """The figures of the last librdkafka statistics report of each client (``name``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[str, dict[str, Any]] = {}

    def update(self, stats: dict[str, Any]) -> None:
        with self._lock:
            self._last[str(stats.get("name", ""))] = stats

    def collect(self) -> Any:
        with self._lock:
            reports = list(self._last.items())
        replyq = GaugeMetricFamily(
            "keyedconsumer_librdkafka_replyq", "librdkafka events waiting for the poll", labels=["client"]
        )
        rx_msgs = CounterMetricFamily(
            "keyedconsumer_librdkafka_rx_messages", "messages fetched by librdkafka", labels=["client"]
        )
        rx_bytes = CounterMetricFamily(
            "keyedconsumer_librdkafka_rx_bytes", "message bytes fetched by librdkafka", labels=["client"]
        )
        rebalances = CounterMetricFamily(
            "keyedconsumer_librdkafka_rebalances", "rebalances of the client's group", labels=["client"]
        )
        rtt = GaugeMetricFamily(
            "keyedconsumer_librdkafka_broker_rtt_seconds",
            "average broker round-trip time",
            labels=["client", "broker"],
        )
        lag = GaugeMetricFamily(
            "keyedconsumer_librdkafka_consumer_lag",
            "high watermark minus committed offset (librdkafka)",
            labels=["client", _DEST, _PART],
        )
        for name, st in reports:
            replyq.add_metric([name], float(st.get("replyq", 0)))
            rx_msgs.add_metric([name], float(st.get("rxmsgs", 0)))
            rx_bytes.add_metric([name], float(st.get("rxmsg_bytes", 0)))
            cgrp = st.get("cgrp")
            if isinstance(cgrp, dict):
                rebalances.add_metric([name], float(cgrp.get("rebalance_cnt", 0)))
            for broker in (st.get("brokers") or {}).values():
                if broker.get("nodeid", -1) >= 0 and isinstance(broker.get("rtt"), dict):
                    rtt.add_metric([name, str(broker.get("nodename", ""))], broker["rtt"].get("avg", 0) / 1e6)
            for topic, t in (st.get("topics") or {}).items():
                for part, pst in (t.get("partitions") or {}).items():
                    if int(part) >= 0 and pst.get("consumer_lag", -1) >= 0:
                        lag.add_metric([name, topic, str(part)], float(pst["consumer_lag"]))
        yield from (replyq, rx_msgs, rx_bytes, rebalances, rtt, lag)


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
            raise ImportError(
                "Metrics needs prometheus-client: pip install 'keyedconsumer[metrics]'"
            ) from _IMPORT_ERROR
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.consumed = Counter(
            "messaging_client_consumed_messages",
            "messages handled, by outcome",
            [_DEST, _GROUP, "outcome"],
            registry=r,
        )
        self.duration = Histogram(
            "messaging_process_duration_seconds",
            "handler duration",
            [_DEST, _GROUP, "outcome"],
            buckets=buckets_s,
            registry=r,
        )
        self.in_flight = Gauge(
            "keyedconsumer_messages_in_flight",
            "handlers running",
            [_DEST, _GROUP],
            registry=r,
            multiprocess_mode="livesum",  # PROMETHEUS_MULTIPROC_DIR: the sum over the live processes
        )
        self.retries = Counter(
            "keyedconsumer_retries", "attempts that asked to be retried", [_DEST, _GROUP], registry=r
        )
        self.dead_lettered = Counter(
            "keyedconsumer_dead_lettered", "messages dead-lettered", [_DEST, _GROUP], registry=r
        )
        self._stats = _StatsCollector()
        r.register(self._stats)
        self._server: Any = None
        if http_port is not None:
            self._server = start_http_server(http_port, addr=http_addr, registry=r)

    def bind(self, consumer: KeyedConsumer) -> KeyedConsumer:
        """Add the per-partition gauges (lag, oldest unfinished age) of ``consumer``; returns it."""
        self.registry.register(_PartitionCollector(consumer))
        return consumer

    def stats_cb(self, stats_json: str) -> None:
        """librdkafka's statistics callback: give it as the consumer's ``stats_cb`` (with a
        ``statistics.interval.ms``, milliseconds, above 0), and the figures of each report are
        served (the module's table). A report that is not JSON is logged and ignored.

        ``config={"stats_cb": metrics.stats_cb, "statistics.interval.ms": 5000}``
        """
        try:
            stats = json.loads(stats_json)
        except ValueError:
            log.warning("librdkafka statistics that are not JSON ignored")
            return
        if isinstance(stats, dict):
            self._stats.update(stats)

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
