"""Admission: from polled records to lane heads (owner thread).

Each polled record is tracked by its partition's offset tracker; a re-delivery, or a record its
partition's previous owner finished (the commit metadata, :mod:`keyedconsumer.offsets`), goes no
further; the others become a :class:`~.delivery.Delivery` queued on its lane
(:mod:`.lanes`). A lane's new head is ready at once with the in-memory sequencer, or goes to the
sequencer (``on_head``), which may keep it (for its key's lease). With ``conflate`` a message queued
behind a head replaces the ones waiting before it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..message import Message
from .delivery import NULL_KEY, Delivery
from .flow import InFlight
from .partitions import Partition, Partitions
from .ready import ReadyQueue
from .sequencer import Sequencer

__all__ = ["Admission"]


class Admission:
    """Admits polled records into the engine's partitions, lanes and ready queue (owner thread).

    Parameters
    ----------
    ordering:
        ``"key"``, ``"partition"`` or ``"none"``.
    partitions, queue, flow, sequencer:
        The engine's objects it acts on (through their methods).
    owns:
        ``owns(delivery) -> bool``: bound to every admitted message (``Message.still_owned``).
    group:
        The consumer group, set on every message admitted (``Message.group_id``).
    conflate:
        Only the newest waiting message of a lane runs.
    """

    __slots__ = (
        "_by_key",
        "_sequenced",
        "_plain",
        "_partitions",
        "_queue",
        "_flow",
        "_seq",
        "_owns",
        "_group",
        "_conflate",
    )

    def __init__(
        self,
        ordering: str,
        partitions: Partitions,
        queue: ReadyQueue,
        flow: InFlight,
        sequencer: Sequencer,
        owns: Callable[[Delivery], bool],
        group: str,
        conflate: bool,
    ) -> None:
        self._by_key = ordering == "key"
        self._sequenced = ordering != "none"
        self._plain = bool(getattr(sequencer, "trivial", False))
        self._partitions = partitions
        self._queue = queue
        self._flow = flow
        self._seq = sequencer
        self._owns = owns
        self._group = group
        self._conflate = conflate

    def admit(self, msgs: list[Message]) -> list[Message]:
        """Track ``msgs`` (as polled, in runs of one partition) and queue them on their lanes.

        Returns the messages conflated meanwhile (``conflate``): they count done and never run."""
        by_key, sequenced, plain = self._by_key, self._sequenced, self._plain
        seq = self._seq
        lane_id = seq.lane_id
        push = self._queue.push
        partitions, flow = self._partitions, self._flow
        group, owns = self._group, self._owns
        admitted = nbytes = 0
        conflated: list[Message] = []
        now = time.monotonic()
        # a poll returns runs of records of one partition: the partition is looked up once a run
        run_of: tuple[str, int] | None = None
        part: Partition | None = None
        add = lanes_push = None
        for msg in msgs:
            topic, partition = msg.topic, msg.partition
            if run_of is None or run_of[1] != partition or run_of[0] != topic:
                run_of = (topic, partition)
                part = partitions.get(run_of)
                if part is None:
                    add = None
                    continue
                add = part.tracker.add
                lanes_push = part.lanes.push
            elif add is None:
                continue  # not assigned (any more)
            assert part is not None and lanes_push is not None
            offset = msg.offset
            if not add(offset, now):
                continue  # a re-delivery
            if part.finished is not None and partitions.skip_finished(part, offset):
                continue  # finished by the previous owner (its commit metadata)
            key, value = msg.key, msg.value
            size = (len(key) if key else 0) + (len(value) if value else 0)
            msg.group_id = group
            if sequenced:
                lane: object = (key if key is not None else NULL_KEY) if by_key else 0
                d = Delivery(msg, part, lane, None if plain else lane_id(topic, partition, lane), size)
            else:
                d = Delivery(msg, part, None, None, size)
            msg._bind(owns, d)
            admitted += 1
            nbytes += size
            if sequenced and not lanes_push(d):
                if self._conflate:  # queued behind its lane's head: the older waiting ones go
                    for old in part.lanes.conflate(d):
                        partitions.done(part, old.offset)
                        flow.forget(old.size)
                        conflated.append(old.msg)
                continue
            if sequenced and not plain and not seq.on_head(d):
                continue  # kept by the sequencer
            push(d)
        flow.admit(admitted, nbytes)
        flow.observe_batch(len(msgs), nbytes)
        return conflated
