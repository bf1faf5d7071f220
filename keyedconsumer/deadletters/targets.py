"""Where a replay may send a dead letter, and to which partition.

A dead-letter record names its original topic and partition in headers that anyone allowed to write
to the dead-letter topic can set. So a replay never goes to a topic because a record says so: the
target is ``to`` when the operator gave one, else the record's original topic only if the operator
allowed it (a topic the dead letters' own consumer groups consume, or one listed explicitly).

The partition is the one the key has in the target **now**: the producers' partitioner
(:mod:`keyedconsumer.kafka.partitioners`, librdkafka's ``partitioner`` names; ``murmur2_random`` is
the Java producer's default) over the target's partition count now. A record whose key has no
partition of its own (a null key) goes where the producer's partitioner puts it. When the target is
the record's original topic and the key's partition now is not the partition the record came from,
either the topic gained partitions since or its producers use another partitioner: the record is
refused (left pending, with the reason) unless the operator says the topic was repartitioned.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from ..errors import KafkaClientError
from ..groups import consumed_topics
from ..kafka import admin
from ..kafka.partitioners import DEFAULT_PARTITIONER, PARTITIONERS, partition_for
from .records import H, header, int_header

__all__ = ["ReplayTargets", "Target", "Planner", "allowed_topics"]


@dataclasses.dataclass(frozen=True)
class ReplayTargets:
    """What the operator allows a replay to write to.

    Parameters
    ----------
    to:
        Send every record to this topic (the operator's choice, whatever the records' headers say).
    allowed:
        Without ``to``: the original topics a record may go back to (:func:`allowed_topics`).
    because:
        Why these are allowed, for a refusal's reason (``"consumed by group orders"``).
    partitioner:
        The target's producers' partitioner, a librdkafka ``partitioner`` name.
    repartitioned:
        The original topics gained partitions since the records failed: send a record whose key's
        partition now differs from the one it came from to the key's partition now (else refuse it).

    Raises
    ------
    ValueError
        An unknown ``partitioner``.
    """

    to: str | None = None
    allowed: frozenset[str] = frozenset()
    because: str = "no topic is allowed"
    partitioner: str = DEFAULT_PARTITIONER
    repartitioned: bool = False

    def __post_init__(self) -> None:
        if self.partitioner not in PARTITIONERS:
            raise ValueError(f"unknown partitioner {self.partitioner!r}: one of {', '.join(PARTITIONERS)}")


def allowed_topics(
    conf: dict[str, Any], groups: Iterable[str], topics: Iterable[str], timeout_s: float = 10.0
) -> tuple[frozenset[str], str]:
    """The topics a replay of these dead letters may go back to: each topic one of ``groups`` (the
    consumer groups whose dead letters they are) consumes, and ``topics`` (an explicit allow-list).

    Returns
    -------
    ``(topics, why)``: ``why`` says where they come from, for a refusal's reason.

    Raises
    ------
    KafkaClientError
        The brokers did not answer within ``timeout_s`` seconds.
    """
    groups, listed = sorted(set(groups)), frozenset(topics)
    found: set[str] = set(listed)
    for group in groups:
        found |= consumed_topics(conf, group, timeout_s)
    parts = [f"consumed by group(s) {', '.join(groups)}"] if groups else []
    parts += ["listed with --allow-topic"] if listed else []
    return frozenset(found), " or ".join(parts) or "no topic is allowed"


@dataclasses.dataclass(frozen=True)
class Target:
    """Where one record goes: ``topic`` and ``partition`` (``None``: the producer's partitioner picks,
    for a key without a partition of its own), or why it is not sent (``refused``); ``moved_from``:
    the partition it came from, when its key's partition changed and the operator allowed it."""

    topic: str | None
    partition: int | None
    refused: str | None = None
    moved_from: int | None = None

    def text(self) -> str:
        """``orders[3]``, ``orders[any]``, or ``not sent: <reason>``."""
        if self.refused is not None:
            return f"not sent: {self.refused}"
        where = "any" if self.partition is None else str(self.partition)
        moved = f" (came from partition {self.moved_from})" if self.moved_from is not None else ""
        return f"{self.topic}[{where}]{moved}"


class Planner:
    """Gives each record of dead-letter topic ``dlq`` its :class:`Target` under ``targets`` (partition
    counts are asked once per topic and planner).

    Raises
    ------
    KafkaClientError
        (from :meth:`target`) The brokers did not answer.
    """

    def __init__(self, conf: dict[str, Any], dlq: str, targets: ReplayTargets, timeout_s: float) -> None:
        self.conf, self.dlq, self.targets, self.timeout_s = conf, dlq, targets, timeout_s
        self._counts: dict[str, int | None] = {}

    def partitions_of(self, topic: str) -> int | None:
        """The partition count of ``topic`` (``None``: it does not exist)."""
        if topic not in self._counts:
            try:
                self._counts[topic] = admin.topic_partitions(self.conf, [topic], self.timeout_s)[topic]
            except KafkaClientError as exc:
                if exc.code != "UNKNOWN_TOPIC_OR_PART":
                    raise
                self._counts[topic] = None
        return self._counts[topic]

    def target(self, record: admin.Record) -> Target:
        t = self.targets
        original = header(record, H.H_TOPIC)
        topic = t.to or original
        if topic is None:
            return Target(None, None, f"no {H.H_TOPIC} header (give --to)")
        if topic == self.dlq:
            return Target(topic, None, "its target is the dead-letter topic itself")
        if t.to is None and topic not in t.allowed:
            return Target(topic, None, f"its header names topic {topic!r}, which is not {t.because}")
        count = self.partitions_of(topic)
        if count is None:
            return Target(topic, None, f"target topic {topic!r} does not exist")
        partition = partition_for(t.partitioner, record.key, count)
        came_from = int_header(record, H.H_PARTITION) if topic == original else None
        if partition is None or came_from is None or came_from == partition:
            return Target(topic, partition)
        if t.repartitioned:
            return Target(topic, partition, moved_from=came_from)
        return Target(
            topic,
            partition,
            f"its key is on partition {partition} of the {count} of {topic} under the {t.partitioner} "
            f"partitioner, but it came from partition {came_from}: its producers use another partitioner "
            "(--partitioner; confluent-kafka's own default is consistent_random, the Java client's "
            "murmur2_random) or the topic gained partitions since (replay with --repartitioned to send "
            "it to the key's partition now)",
        )
