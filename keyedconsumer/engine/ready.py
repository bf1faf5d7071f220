"""Lane heads waiting for a worker: ready now, due later (a retry's back-off), or held.

A *held* head may not start yet: the consumer is stopping, or its partition is being revoked, and
it is not below its partition's highest finished offset (only those start then, so the commit can
cover what already finished). It stays its lane's head until it may start or is dropped. Pure data:
the dispatcher's lock guards it.
"""

from __future__ import annotations

import heapq
import itertools
import weakref
from collections import deque
from collections.abc import Callable

from .delivery import Delivery

__all__ = ["ReadyQueue"]


class ReadyQueue:
    """Heads ready to run (oldest admitted first), delayed heads (by due time), held heads.

    Ready heads are served in admission order (:attr:`Delivery.order`), not in the order they
    became ready: a lane's next message that becomes ready goes before the heads of messages
    admitted after it. So every partition's offsets start close to offset order (at
    ``concurrency=1`` exactly in it), the committed offset follows the finished messages closely,
    and a stop or a revoke has little to finish below the highest finished offset (xkafka's
    proposal commits only up to the first unfinished offset: finishing out of order costs re-runs).

    Parameters
    ----------
    clock:
        Monotonic clock in seconds for due times (a fake one in :mod:`keyedconsumer.testing`).
    """

    __slots__ = ("clock", "_fifo", "_late", "_delayed", "_held", "_seq", "_alone")

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        # The ready heads, split in two for speed; together they are served lowest order first.
        # Heads pushed in increasing order (most of them: every new lane head at admission) append
        # to a FIFO, which stays sorted; the others (a lane's next message, a retry that is due,
        # a head given back) go to a heap of (order, head).
        self._fifo: deque[Delivery] = deque()
        self._late: list[tuple[int, Delivery]] = []
        self._delayed: list[tuple[float, int, Delivery]] = []  # heap of (due monotonic s, seq, head)
        self._held: list[Delivery] = []
        self._seq = itertools.count()
        # retries that failed with their whole batch: a batch handler gets each in a batch of its own
        self._alone: weakref.WeakSet[Delivery] = weakref.WeakSet()

    def __len__(self) -> int:
        """How many heads are ready."""
        return len(self._fifo) + len(self._late)

    def push(self, d: Delivery) -> None:
        """``d`` is ready."""
        fifo = self._fifo
        if not fifo or d.order > fifo[-1].order:
            fifo.append(d)
        else:
            heapq.heappush(self._late, (d.order, d))

    def oldest_order(self) -> int | None:
        """The admission order of the oldest ready head, or ``None`` when none is ready."""
        fifo, late = self._fifo, self._late
        if late:
            return min(late[0][0], fifo[0].order) if fifo else late[0][0]
        return fifo[0].order if fifo else None

    def take(
        self,
        n: int,
        behind: Callable[[Delivery], int | None],
        follow: Callable[[Delivery], Delivery] | None = None,
    ) -> list[Delivery]:
        """Up to ``n`` ready heads, oldest admitted first (some are ready).

        ``behind(d)`` is the admission order of the message queued behind ``d`` on its lane (it
        becomes ready when ``d`` ends), or ``None``. Without ``follow`` the taking stops before any
        head younger than such a message, so one worker running what was taken still runs in
        admission order. With ``follow``, when such a message is the oldest left, ``follow(d)``
        takes it off its lane (it runs right after ``d``, in the same unit) and the taking goes on:
        a lane's run goes to one worker in one hand-over, still in admission order.
        """
        fifo, late = self._fifo, self._late
        pop, push = heapq.heappop, heapq.heappush
        out: list[Delivery] = []
        # (order of the message queued behind d, d): the lanes taken so far with more behind them
        waiting: list[tuple[int, int, Delivery]] = []
        while len(out) < n:
            if late and (not fifo or late[0][0] < fifo[0].order):
                oldest: int | None = late[0][0]
            else:
                oldest = fifo[0].order if fifo else None
            if waiting and (oldest is None or waiting[0][0] < oldest):
                if follow is None:
                    break
                d = follow(pop(waiting)[2])
            elif oldest is None:
                break
            elif late and oldest == late[0][0]:
                d = pop(late)[1]
            else:
                d = fifo.popleft()
            out.append(d)
            b = behind(d)
            if b is not None:
                push(waiting, (b, d.order, d))
        return out

    def take_batch(self, size: int) -> list[Delivery]:
        """Up to ``size`` ready heads for one batch call, oldest admitted first. A head marked
        ``alone`` (:meth:`delay`) goes in a batch of its own: when it is the oldest, alone; else it
        waits for a later call."""
        batch = self.take(size, lambda d: None)
        alone = self._alone
        if not alone or not batch:
            return batch
        if batch[0] in alone:
            alone.discard(batch[0])
            for d in batch[1:]:
                self.push(d)
            return batch[:1]
        for d in batch:
            if d in alone:
                self.push(d)
        return [d for d in batch if d not in alone]

    # -- delayed ------------------------------------------------------------------------------------

    def delay(self, d: Delivery, delay_s: float, alone: bool = False) -> None:
        """``d`` runs again after ``delay_s`` seconds; ``alone``: in a batch of its own."""
        heapq.heappush(self._delayed, (self.clock() + delay_s, next(self._seq), d))
        if alone:
            self._alone.add(d)

    def next_due_s(self) -> float | None:
        """When the next delayed head is due (clock seconds), or ``None``."""
        return self._delayed[0][0] if self._delayed else None

    def release_due(self, now: float) -> int:
        """Make the delayed heads due at ``now`` ready; returns how many."""
        delayed = self._delayed
        added = 0
        while delayed and delayed[0][0] <= now:
            self.push(heapq.heappop(delayed)[2])
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
                self.push(d)
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
        if self._fifo:
            fifo: deque[Delivery] = deque()
            for d in self._fifo:
                if drop(d):
                    out.append(d)
                else:
                    fifo.append(d)
            self._fifo = fifo
        if self._late:
            late: list[tuple[int, Delivery]] = []
            for e in self._late:
                if drop(e[1]):
                    out.append(e[1])
                else:
                    late.append(e)
            heapq.heapify(late)
            self._late = late
        if self._delayed:
            out.extend(e[2] for e in self._delayed if drop(e[2]))
            self._delayed = [e for e in self._delayed if not drop(e[2])]
            heapq.heapify(self._delayed)
        return out

    def clear(self) -> list[Delivery]:
        """Remove every head; returns them."""
        out = self.ready_heads() + self._held + [e[2] for e in self._delayed]
        self._fifo = deque()
        self._late = []
        self._held = []
        self._delayed = []
        return out

    def ready_heads(self) -> list[Delivery]:
        """The ready heads (a copy, oldest admitted first)."""
        return sorted([*self._fifo, *(e[1] for e in self._late)], key=lambda d: d.order)

    def held(self) -> list[Delivery]:
        """The held heads (a copy, in order)."""
        return list(self._held)

    def delayed(self) -> list[Delivery]:
        """The delayed heads (a copy, in no order)."""
        return [e[2] for e in self._delayed]
