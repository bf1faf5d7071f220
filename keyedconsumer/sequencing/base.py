"""The sequencer protocol and the in-memory sequencer, which live in the engine
(:mod:`keyedconsumer.engine.sequencer`); kept importable from here."""

from __future__ import annotations

from ..engine.sequencer import GroupTiming, InMemorySequencer, LanePort, Sequencer

__all__ = ["Sequencer", "InMemorySequencer", "LanePort", "GroupTiming"]
