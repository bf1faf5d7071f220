"""Sequencers: who may run a lane's head, what happens when a lane's run ends, and periodic work.

The dispatcher (:mod:`keyedconsumer.engine.dispatcher`) keeps each lane in offset order inside one
process; a sequencer decides, per lane *head*, whether it may run now. The dispatcher calls the
:class:`Sequencer` protocol and never asks which sequencer it has:

- :class:`InMemorySequencer` (the default): every head may run at once; nothing else to do.
- :class:`~keyedconsumer.sequencing.RedisSequencer`: a head runs only under its key's lease in
  Redis (one instance at a time, fencing tokens); a key can be parked in Redis, and parked or
  scheduled messages come back through :meth:`~keyedconsumer.engine.dispatcher.Dispatcher.admit_external`.

Every method but :meth:`Sequencer.tick`, :meth:`Sequencer.settle_pending` and
:meth:`Sequencer.detach` runs under the dispatcher's lock, from the poll thread or a worker: it must
not block, and it acts on the engine only through the ``*_locked`` methods of the dispatcher, or by
returning what the dispatcher should make ready.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..engine.delivery import Delivery
    from ..engine.dispatcher import Dispatcher
    from ..engine.outcome import Outcome

__all__ = ["Sequencer", "InMemorySequencer"]


class Sequencer(Protocol):
    """What the engine asks of a sequencer. See the module docstring for the locking rules."""

    def attach(
        self,
        engine: Dispatcher,
        fatal: Callable[[BaseException], None],
        confirm: Callable[[], bool],
        session_timeout_s: float,
        commit_interval_s: float = 5.0,
    ) -> None:
        """Start serving ``engine`` (before the first poll). ``fatal(error)`` stops the consumer;
        ``confirm()`` tells whether this instance still owns its partitions in the consumer group;
        ``session_timeout_s``: the group's session timeout; ``commit_interval_s``: the longest
        between two commits of the stored offsets (seconds)."""

    def lane_id(self, topic: str, partition: int, lane: object) -> str | None:
        """The identity of a lane for this sequencer (e.g. the Redis lease key), or ``None``."""

    def on_head(self, d: Delivery) -> bool:
        """A lane got a new head. ``True``: it may be made ready now; ``False``: the sequencer keeps
        it and makes it ready later (``Dispatcher.make_ready_locked``), or drops it."""

    def may_start(self, d: Delivery) -> bool:
        """Just before ``d`` runs: may it (e.g. its key's lease is still this instance's)?"""

    def accepts(self, d: Delivery) -> bool:
        """``d``'s run ended: does its result count? ``False``: the sequencer took it back (it ran
        under a lease this instance lost); it stays its lane's head and runs again when it may."""

    def owns(self, d: Delivery) -> bool:
        """Would ``d``'s result count now (no side effect)? For ``Message.still_owned``."""

    def on_next(self, d: Delivery, nxt: Delivery) -> None:
        """``d`` ended and ``nxt`` follows it on its lane, under the same rights (e.g. the lease)."""

    def on_lane_end(self, d: Delivery) -> Delivery | None:
        """``d``'s lane ran dry. Returns another head that may run now (e.g. the same key's lane of
        another partition, waiting for the lease), for the dispatcher to make ready."""

    def park(self, d: Delivery, delay_s: float) -> bool:
        """``d`` asked to park its key, due again after ``delay_s`` seconds. ``True``: the
        sequencer took ``d`` (and will take its lane); ``False``: it does not park (the dispatcher
        retries ``d`` in memory)."""

    def on_drop(self, d: Delivery) -> None:
        """A head that will never run here (its partition was revoked or lost, the consumer halted)."""

    def drop(self, keep: Callable[[Delivery], bool]) -> list[Delivery]:
        """Drop the heads the sequencer keeps for which ``keep`` is false (revoke: those of the
        revoked partitions; halt: all): returns them, for the dispatcher to forget."""

    def on_external_end(self, d: Delivery, outcome: Outcome) -> Delivery | None:
        """A message the sequencer brought (``Dispatcher.admit_external``) ended. Returns the next
        one of its batch to run at once, if any."""

    def busy(self) -> bool:
        """Work under way that a stop's or revoke's catch-up should wait for (leases wanted,
        keys being parked)."""

    def tick(self) -> float | None:
        """Periodic work, in the poll thread, without the dispatcher's lock. Returns the longest
        the poll thread should wait before the next tick (seconds), or ``None``."""

    def settle_pending(self) -> None:
        """At a stop, after the running handlers ended: settle what finished (e.g. in Redis)."""

    def detach(self) -> None:
        """Stop serving (release what is held, best effort)."""


class InMemorySequencer:
    """The default sequencer: lanes are kept in order inside this process only, every head runs at
    once, and nothing is shared with other instances."""

    def attach(
        self,
        engine: Dispatcher,
        fatal: Callable[[BaseException], None],
        confirm: Callable[[], bool],
        session_timeout_s: float,
        commit_interval_s: float = 5.0,
    ) -> None:
        pass

    def lane_id(self, topic: str, partition: int, lane: object) -> str | None:
        return None

    def on_head(self, d: Delivery) -> bool:
        return True

    def may_start(self, d: Delivery) -> bool:
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
