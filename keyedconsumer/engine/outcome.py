"""The outcome of one run of a message, as the engine acts on it: a small closed set of types.

The xkafka proposal (gojekfarm/xtools issue #25) names a message's end (success, skip, fail); the engine
needs a little more, because a run may not count yet:

==================  ================================================================================
outcome             what the engine does
==================  ================================================================================
``Done``            its offset may be stored; the lane's next message goes on. ``dead_lettered``:
                    it ended in a dead-letter topic (a parked key may then be quarantined).
``NotStarted``      it did not run (the consumer is stopping, its partition is being revoked, its
                    key's lease is unconfirmed): it stays its lane's head.
``Retry``           run it again after ``delay_s`` seconds, in memory: only its key waits
                    (``alone``: a batch handler gets it in a batch of its own).
``Park``            park its key (with a sequencer that parks) due again after ``delay_s``; else
                    as ``Retry``.
``Halt``            a failure nothing handled (the consumer stops), or the run is over: not done.
==================  ================================================================================

Settled with ``match`` in :mod:`keyedconsumer.engine.dispatcher`.
"""

from __future__ import annotations

import dataclasses

__all__ = [
    "Outcome",
    "Done",
    "NotStarted",
    "Retry",
    "Park",
    "Halt",
    "DONE",
    "DEAD_LETTERED",
    "NOT_STARTED",
    "HALT",
]


@dataclasses.dataclass(frozen=True, slots=True)
class Done:
    """The message is done; ``dead_lettered``: it ended in a dead-letter topic."""

    dead_lettered: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class NotStarted:
    """The message did not run: it stays its lane's head."""


@dataclasses.dataclass(frozen=True, slots=True)
class Retry:
    """Run the message again after ``delay_s`` seconds (it stays its lane's head); ``alone``: in a
    batch of its own (it failed with its whole batch, which said nothing of each message)."""

    delay_s: float
    alone: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class Park:
    """Park the message's key, due again after ``delay_s`` seconds (``Retry`` without a parking
    sequencer)."""

    delay_s: float


@dataclasses.dataclass(frozen=True, slots=True)
class Halt:
    """Not done, and nothing more of its lane runs in this run of the consumer."""


Outcome = Done | NotStarted | Retry | Park | Halt

DONE = Done()
DEAD_LETTERED = Done(dead_lettered=True)
NOT_STARTED = NotStarted()
HALT = Halt()
