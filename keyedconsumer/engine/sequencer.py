"""The sequencer seam: who may run a lane's head, what happens when a lane's run ends, and the
narrow port through which a sequencer acts on the lanes.

The engine (:mod:`.engine`) keeps each lane in offset order inside one process; a sequencer decides,
per lane *head*, whether it may run now. The engine calls the :class:`Sequencer` protocol and never
asks which sequencer it has:

- :class:`InMemorySequencer` (the default): every head may run at once; nothing else to do.
- :class:`keyedconsumer.sequencing.RedisSequencer`: a head runs only under its key's lease in Redis
  (one instance at a time, fencing tokens); a key can be parked in Redis, and parked or scheduled
  messages come back through :meth:`LanePort.admit_external`.

Threads: every method of :class:`Sequencer` runs in the engine's owner thread (the poll thread),
except :meth:`Sequencer.may_start` and :meth:`Sequencer.owns`, which workers call and which must
only read. A sequencer acts on the engine only through the :class:`LanePort` handed to it at
:meth:`Sequencer.attach` (in the owner thread too), or by returning what the engine should make
ready. A thread of the sequencer's own (a lease renewer, a lease I/O thread) reaches the owner thread with
:meth:`LanePort.post`. This module imports nothing above the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ..message import Message
from .delivery import Delivery
from .outcome import Outcome

__all__ = ["Sequencer", "LanePort", "InMemorySequencer", "GroupTiming"]


@dataclass(frozen=True)
class GroupTiming:
    """The consumer group's timing a sequencer needs, from the consumer's librdkafka properties
    (seconds; :meth:`of`).

    ``session_timeout_s`` and ``heartbeat_interval_s``: ``session.timeout.ms`` and
    ``heartbeat.interval.ms`` (``None`` with ``group.protocol=consumer``, KIP-848, where they are the
    broker's ``group.consumer.*`` settings, which the client does not know);
    ``commit_interval_s``: ``auto.commit.interval.ms``, the longest between two commits of the
    stored offsets.
    """

    session_timeout_s: float | None = 45.0
    heartbeat_interval_s: float | None = 3.0
    commit_interval_s: float = 5.0

    @classmethod
    def of(cls, props: Mapping[str, Any]) -> GroupTiming:
        """From librdkafka properties ``props`` (librdkafka's defaults where absent)."""
        commit_s = float(props.get("auto.commit.interval.ms", 5000)) / 1000
        if str(props.get("group.protocol", "classic")).lower() == "consumer":
            return cls(None, None, commit_s)
        session_s = float(props.get("session.timeout.ms", 45000)) / 1000
        return cls(session_s, float(props.get("heartbeat.interval.ms", 3000)) / 1000, commit_s)

    @property
    def membership_stall_s(self) -> float | None:
        """The stall of this process (seconds) past which the group may have expelled it: half of
        the session timeout less the heartbeat interval (21 s with librdkafka's defaults); ``None``
        when the session timeout is not known.

        The coordinator expels a member it has not heard from for a session timeout (KIP-62).
        librdkafka heartbeats from its own thread, so a stall of the poll thread alone does not stop
        them, and a stopped process (SIGSTOP, a VM pause) sent its last heartbeat at most a heartbeat
        interval before it stopped: a shorter stall cannot have cost the membership (half of it, for
        a margin). ``max.poll.interval.ms`` is at least the session timeout (librdkafka refuses
        less), so a stall that made librdkafka leave the group is longer too."""
        if self.session_timeout_s is None:
            return None
        return max(self.session_timeout_s - (self.heartbeat_interval_s or 0.0), 0.0) / 2


class LanePort(Protocol):
    """What a sequencer may ask of the engine's lanes (owner thread only, but :meth:`post`)."""

    @property
    def ordering(self) -> str:
        """``"key"`` or ``"partition"``: what a lane is."""
        ...

    @property
    def conflate(self) -> bool:
        """Whether only the newest waiting message of a lane runs (``conflate=True``)."""
        ...

    @property
    def halted(self) -> bool:
        """Nothing new starts (a failure, or the run is over)."""
        ...

    @property
    def stopping(self) -> bool:
        """A graceful stop is under way."""
        ...

    def make_ready(self, d: Delivery) -> None:
        """A head the sequencer kept may run now."""

    def lane_rest(self, head: Delivery) -> list[Delivery]:
        """Remove and return the messages queued behind ``head`` on its lane."""
        ...

    def lane_put_back(self, head: Delivery, rest: list[Delivery]) -> None:
        """Queue ``rest`` behind ``head`` again, before anything queued since."""

    def lane_advance(self, head: Delivery) -> Delivery | None:
        """``head`` was settled by the sequencer (parked): its lane's next message, now the head
        (the sequencer decides where it goes), or ``None`` when the lane ran dry (it ends, and
        :meth:`Sequencer.on_lane_end` is asked)."""
        ...

    def parked(self, ds: Iterable[Delivery]) -> None:
        """The sequencer stored ``ds`` durably elsewhere (parked in Redis): their offsets count done."""

    def conflated(self, msgs: list[Message]) -> None:
        """The sequencer conflated ``msgs`` where it keeps them: counted and reported to the
        consumer's ``on_conflated``."""

    def admit_external(self, batch: list[Delivery]) -> None:
        """Messages the sequencer brought (a parked key's list, in order): they count in flight;
        the first is ready now, the sequencer hands out the rest (:meth:`Sequencer.on_external_end`)."""

    def forget(self, ds: Iterable[Delivery]) -> None:
        """Messages the sequencer brought that will not run here."""

    def count_retry(self) -> None:
        """A parked message was set to run again later (a retry the sequencer made)."""

    def post(self, fn: Callable[[Any], None], arg: Any = None) -> None:
        """Run ``fn(arg)`` in the owner thread soon (from any thread: the only method that may be
        called outside the owner thread)."""


class Sequencer(Protocol):
    """What the engine asks of a sequencer. See the module docstring for the threads."""

    def attach(
        self,
        port: LanePort,
        fatal: Callable[[BaseException], None],
        confirm: Callable[[], bool],
        timing: GroupTiming,
    ) -> None:
        """Start serving the lanes behind ``port`` (before the first poll). ``fatal(error)`` stops
        the consumer; ``confirm()`` tells whether this instance still owns its partitions in the
        consumer group; ``timing``: the group's session timeout, heartbeat and commit intervals."""

    def lane_id(self, topic: str, partition: int, lane: object) -> str | None:
        """The identity of a lane for this sequencer (e.g. the Redis lease key), or ``None``."""

    def on_head(self, d: Delivery) -> bool:
        """A lane got a new head. ``True``: it may be made ready now; ``False``: the sequencer keeps
        it and makes it ready later (:meth:`LanePort.make_ready`), or drops it."""

    def may_start(self, d: Delivery) -> bool:
        """Just before ``d`` runs (a worker thread; read only): may it (e.g. its key's lease is
        still this instance's, with a safety margin left)?"""

    def not_started(self, d: Delivery) -> bool:
        """``d`` did not start (:meth:`may_start` said no) and stays its lane's head. ``True``: it
        may be made ready again now; ``False``: the sequencer keeps it and makes it ready later
        (e.g. once its key's lease was renewed)."""

    def accepts(self, d: Delivery) -> bool:
        """``d``'s run ended: does its result count? ``False``: the sequencer took it back (it ran
        under a lease this instance lost); it stays its lane's head and runs again when it may."""

    def owns(self, d: Delivery) -> bool:
        """Would ``d``'s result count now (any thread; read only)? For ``Message.still_owned``."""

    def on_next(self, d: Delivery, nxt: Delivery) -> None:
        """``d`` ended and ``nxt`` follows it on its lane, under the same rights (e.g. the lease)."""

    def on_lane_end(self, d: Delivery) -> Delivery | None:
        """``d``'s lane ran dry. Returns another head that may run now (e.g. the same key's lane of
        another partition, waiting for the lease), for the engine to make ready."""

    def park(self, d: Delivery, delay_s: float) -> bool:
        """``d`` asked to park its key, due again after ``delay_s`` seconds. ``True``: the
        sequencer took ``d`` (and will take its lane); ``False``: it does not park (the engine
        retries ``d`` in memory)."""

    def on_drop(self, d: Delivery) -> None:
        """A head that will never run here (its partition was revoked or lost, the consumer halted)."""

    def drop(self, keep: Callable[[Delivery], bool]) -> list[Delivery]:
        """Drop the heads the sequencer keeps for which ``keep`` is false (revoke: those of the
        revoked partitions; halt: all): returns them, for the engine to forget."""

    def on_external_end(self, d: Delivery, outcome: Outcome) -> Delivery | None:
        """A message the sequencer brought (:meth:`LanePort.admit_external`) ended. Returns the next
        one of its batch to run now, if any."""

    def busy(self) -> bool:
        """Work under way that a stop's or revoke's catch-up should wait for (leases wanted,
        keys being parked)."""

    def tick(self) -> float | None:
        """Periodic work (Redis round trips). Returns the longest the owner should wait before the
        next tick (seconds), or ``None``."""

    def settle_pending(self) -> None:
        """At a stop, after the running handlers ended: settle what finished (e.g. in Redis)."""

    def detach(self) -> None:
        """Stop serving (release what is held, best effort)."""


class InMemorySequencer:
    """The default sequencer: lanes are kept in order inside this process only, every head runs at
    once, and nothing is shared with other instances.

    ``trivial = True`` tells the engine that every answer is the default one, so it may skip the
    calls on its hot path (a sequencer that keeps or refuses anything must not set it).
    """

    trivial = True

    def attach(
        self,
        port: LanePort,
        fatal: Callable[[BaseException], None],
        confirm: Callable[[], bool],
        timing: GroupTiming,
    ) -> None:
        pass

    def lane_id(self, topic: str, partition: int, lane: object) -> str | None:
        return None

    def on_head(self, d: Delivery) -> bool:
        return True

    def may_start(self, d: Delivery) -> bool:
        return True

    def not_started(self, d: Delivery) -> bool:
        return True

    def accepts(self, d: Delivery) -> bool:
        return True

    def owns(self, d: Delivery) -> bool:
        return True

    def on_next(self, d: Delivery, nxt: Delivery) -> None:
        pass

    def on_lane_end(self, d: Delivery) -> Delivery | None:
        return None

    def park(self, d: Delivery, delay_s: float) -> bool:
        return False

    def on_drop(self, d: Delivery) -> None:
        pass

    def drop(self, keep: Callable[[Delivery], bool]) -> list[Delivery]:
        return []

    def on_external_end(self, d: Delivery, outcome: Outcome) -> Delivery | None:
        return None

    def busy(self) -> bool:
        return False

    def tick(self) -> float | None:
        return None

    def settle_pending(self) -> None:
        pass

    def detach(self) -> None:
        pass
