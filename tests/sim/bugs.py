"""Bugs the simulation must catch, planted by the tests (never by the package): each replaces one
engine method for the duration of a ``with`` block."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from keyedconsumer.engine.engine import Engine
from keyedconsumer.engine.lanes import Lanes
from keyedconsumer.engine.outcome import Retry
from keyedconsumer.engine.workers import Slot
from keyedconsumer.offsets import OffsetTracker

__all__ = ["BUGS", "RUN_BUGS", "planted"]


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


def _run_after_failure(self: Slot, done: Any) -> None:
    """A worker runs a message taken along behind its lane's head even when the head did not end
    done (a retry's key goes on out of order; caught as the owner and the worker disagreeing on
    what runs, since the owner put that message back on its lane)."""
    self.results.append(done)


def _keep_run_out(self: Engine, d: Any) -> list[Any]:
    """The owner forgets the messages a worker skipped behind a head that did not end done (they
    never go back to their lane: lost, and counted running for ever)."""
    d.cut_run()
    return []


#: name -> (class, method name, replacement)
BUGS: dict[str, tuple[type, str, Any]] = {
    "store_past_unfinished": (OffsetTracker, "watermark", _store_past_unfinished),
    "two_in_flight_per_key": (Lanes, "push", _no_lanes),
    "lose_retried_messages": (Engine, "_keep", _drop_retries),
}
#: Bugs only lanes' runs show (the simulation's ``fast`` shape): name -> as :data:`BUGS`.
RUN_BUGS: dict[str, tuple[type, str, Any]] = {
    "run_after_failure": (Slot, "_record", _run_after_failure),
    "lose_skipped_run": (Engine, "_return_run", _keep_run_out),
}


@contextlib.contextmanager
def planted(name: str) -> Iterator[None]:
    cls, method, bug = BUGS[name] if name in BUGS else RUN_BUGS[name]
    original = cls.__dict__[method]
    setattr(cls, method, bug)
    try:
        yield
    finally:
        setattr(cls, method, original)
