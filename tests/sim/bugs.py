"""Bugs the simulation must catch, planted by the tests (never by the package): each replaces one
engine method for the duration of a ``with`` block."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from keyedconsumer.engine.engine import Engine
from keyedconsumer.engine.lanes import Lanes
from keyedconsumer.engine.outcome import Retry
from keyedconsumer.offsets import OffsetTracker

__all__ = ["BUGS", "planted"]


def _store_past_unfinished(self: OffsetTracker) -> int | None:
    """The offset to store is the last received + 1, finished or not (an offset past unfinished work)."""
    return self.received_end


def _no_lanes(self: Lanes, d: Any) -> bool:
    """Every message is its lane's head at once (two messages of one key in flight)."""
    return True


_keep = Engine._keep


def _drop_retries(self: Engine, d: Any, part: Any, outcome: Any, live: bool) -> bool:
    """A retry ends its message instead of keeping it (a failed message lost, its key goes on)."""
    if type(outcome) is Retry:
        return False
    return _keep(self, d, part, outcome, live)


#: name -> (class, method name, replacement)
BUGS: dict[str, tuple[type, str, Any]] = {
    "store_past_unfinished": (OffsetTracker, "watermark", _store_past_unfinished),
    "two_in_flight_per_key": (Lanes, "push", _no_lanes),
    "lose_retried_messages": (Engine, "_keep", _drop_retries),
}


@contextlib.contextmanager
def planted(name: str) -> Iterator[None]:
    cls, method, bug = BUGS[name]
    original = cls.__dict__[method]
    setattr(cls, method, bug)
    try:
        yield
    finally:
        setattr(cls, method, original)
