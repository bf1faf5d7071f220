"""Sequencers: who may run a lane's head (the protocol: :mod:`keyedconsumer.engine.sequencer`).

The default, :class:`InMemorySequencer`, keeps order inside one process. :class:`RedisSequencer`
adds per-key leases in Redis, so that one key never runs on two instances at once: across a
rebalance, a long pause of the old owner (SIGSTOP, GC, network stall), or when one key's messages
arrive on several partitions or topics; and parking and scheduled messages.
"""

from __future__ import annotations

from .base import GroupTiming, InMemorySequencer, Sequencer
from .config import RedisSequencerConfig, RedisUrl, redact_url
from .redis import RedisSequencer, cancel_scheduled, inspect_redis, unpark_now

__all__ = [
    "Sequencer",
    "InMemorySequencer",
    "GroupTiming",
    "RedisSequencer",
    "RedisSequencerConfig",
    "RedisUrl",
    "redact_url",
    "inspect_redis",
    "unpark_now",
    "cancel_scheduled",
]
