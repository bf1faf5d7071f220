"""Lane heads waiting for a worker: ready now, due later (a retry's back-off), or held.

A *held* head may not start yet: the consumer is stopping, or its partition is being revoked, and
it is not below its partition's highest finished offset (only those start then, so the commit can
cover what already finished). It stays its lane's head until it may start or is dropped. Pure data:
the dispatcher's lock guards it.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable

from .delivery import Delivery

__all__ = ["ReadyQueue"]


class ReadyQueue:
    """Heads ready to run (first in, first out), delayed heads (by due time), held heads.

    Parameters
    ----------
    clock:
        Monotonic clock in seconds for due times (a fake one in :mod:`keyedconsumer.testing`).
    """

    __slots__ = ("clock", "ready", "_delayed", "_held", "_seq")

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.ready: deque[Delivery] = deque()
        self._delayed: list[tuple[float, int, Delivery]] = []  # heap of (due monotonic s, seq, head)
        self._held: list[Delivery] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self.ready)

    def push(self, d: Delivery) -> None:
        self.ready.append(d)

    def push_front(self, d: Delivery) -> None:
        self.ready.appendleft(d)

    def take(self, n: int) -> list[Delivery]:
        """Up to ``n`` ready heads, oldest first."""
        ready = self.ready
        if n <= 1 or len(ready) == 1:
            return [ready.popleft()]
        return [ready.popleft() for _ in range(min(n, len(ready)))]

    # -- delayed ------------------------------------------------------------------------------------

    def delay(self, d: Delivery, delay_s: float) -> None:
        """``d`` runs again after ``delay_s`` seconds."""
        heapq.heappush(self._delayed, (self.clock() + delay_s, next(self._seq), d))

    def next_due_s(self) -> float | None:
        """When the next delayed head is due (clock seconds), or ``None``."""
        return self._delayed[0][0] if self._delayed else None

    def release_due(self, now: float) -> int:
        """Make the delayed heads due at ``now`` ready; returns how many."""
        delayed = self._delayed
        added = 0
        while delayed and delayed[0][0] <= now:
            self.ready.append(heapq.heappop(delayed)[2])
            added += 1
        return added

    # -- held ---------------------------------------------------------------------------------------

    def hold(self, d: Delivery) -> None:
        self._held.append(d)

    def release_held(self, may_start: Callable[[Delivery], bool]) -> int:
        """Make ready the held heads ``may_start`` now allows; returns how many."""
        keep: list[Delivery] = []
        added = 0
        for d in self._held:
            if may_start(d):
                self.ready.append(d)
                added += 1
            else:
                keep.append(d)
        self._held = keep
        return added

    # -- removing -----------------------------------------------------------------------------------

    def remove(self, drop: Callable[[Delivery], bool]) -> list[Delivery]:
        """Remove the heads (ready, delayed or held) for which ``drop`` is true; returns them."""
        out: list[Delivery] = []
        if self._held:
            out.extend(d for d in self._held if drop(d))
            self._held = [d for d in self._held if not drop(d)]
        if self.ready:
            keep: deque[Delivery] = deque()
            for d in self.ready:
                (out if drop(d) else keep).append(d)
            self.ready = keep
        if self._delayed:
            out.extend(e[2] for e in self._delayed if drop(e[2]))
            self._delayed = [e for e in self._delayed if not drop(e[2])]
            heapq.heapify(self._delayed)
        return out

    def clear(self) -> list[Delivery]:
        """Remove every head; returns them."""
        out = list(self.ready) + self._held + [e[2] for e in self._delayed]
        self.ready.clear()
        self._held = []
        self._delayed = []
        return out

    def held(self) -> list[Delivery]:
        """The held heads (a copy, in order)."""
        return list(self._held)

    def delayed(self) -> list[Delivery]:
        """The delayed heads (a copy, in no order)."""
        return [e[2] for e in self._delayed]
