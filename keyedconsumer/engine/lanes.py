"""The lanes of one partition: what must run one message at a time, in offset order.

A lane is ``(partition, key)`` under ``ordering="key"`` (null keys share one lane per partition),
the partition under ``"partition"``. Its *head* is running, ready, delayed or held by the sequencer;
the rest wait here in offset order. Pure data: the dispatcher's lock guards it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from .delivery import Delivery

__all__ = ["Lanes"]


class Lanes:
    """Per lane key: ``None`` (a head, nothing queued) or the messages queued behind the head."""

    __slots__ = ("_q",)

    def __init__(self) -> None:
        self._q: dict[object, deque[Delivery] | None] = {}

    def push(self, d: Delivery) -> bool:
        """Queue ``d`` on its lane. Returns ``True`` when it is the lane's new head (the lane was
        empty): the caller decides where the head goes."""
        q = self._q
        key = d.lane
        if key in q:
            waiting = q[key]
            if waiting is None:
                q[key] = waiting = deque()
            waiting.append(d)
            return False
        q[key] = None
        return True

    def conflate(self, newest: Delivery) -> list[Delivery]:
        """Remove and return the messages queued on ``newest``'s lane before it (``newest`` was just
        queued behind a head): only it waits now."""
        waiting = self._q.get(newest.lane)
        if not waiting or len(waiting) < 2:
            return []
        older = list(waiting)
        older.pop()  # newest itself
        waiting.clear()
        waiting.append(newest)
        return older

    def advance(self, head: Delivery) -> Delivery | None:
        """``head`` ended: its lane's next message, now the head; ``None`` when the lane ran dry
        (it is removed)."""
        q = self._q
        waiting = q.get(head.lane)
        if waiting:
            return waiting.popleft()
        q.pop(head.lane, None)
        return None

    def next_order(self, head: Delivery) -> int | None:
        """The admission order of the message queued right behind ``head``, or ``None``."""
        waiting = self._q.get(head.lane)
        return waiting[0].order if waiting else None

    def take_rest(self, head: Delivery) -> list[Delivery]:
        """Remove and return the messages queued behind ``head`` (the lane stays, with its head)."""
        waiting = self._q.get(head.lane)
        if not waiting:
            return []
        rest = list(waiting)
        waiting.clear()
        return rest

    def take_next(self, head: Delivery) -> Delivery:
        """Remove and return the message queued right behind ``head`` (there is one): it is taken
        along with ``head`` (the lane stays, its head running)."""
        waiting = self._q[head.lane]
        assert waiting
        return waiting.popleft()

    def put_back(self, head: Delivery, rest: list[Delivery]) -> None:
        """Queue ``rest`` behind ``head`` again, before anything queued since."""
        if not rest:
            return
        q = self._q
        waiting = q.get(head.lane)
        if waiting is None:
            q[head.lane] = waiting = deque()
        waiting.extendleft(reversed(rest))

    def return_taken(self, ds: list[Delivery]) -> None:
        """Queue again messages of one lane taken from it with :meth:`take_next`, each before the
        messages admitted after it (their admission order)."""
        if not ds:
            return
        q = self._q
        lane = ds[0].lane
        waiting = q.get(lane)
        if waiting is None:
            q[lane] = waiting = deque()
        for d in sorted(ds, key=lambda d: d.order, reverse=True):
            i = 0
            while i < len(waiting) and waiting[i].order < d.order:
                i += 1
            waiting.insert(i, d)

    def end(self, head: Delivery) -> list[Delivery]:
        """Remove ``head``'s lane; returns what was queued behind it."""
        waiting = self._q.pop(head.lane, None)
        return list(waiting) if waiting else []

    def queued(self) -> Iterator[Delivery]:
        """Every message queued behind a head (not the heads)."""
        for waiting in self._q.values():
            if waiting:
                yield from waiting

    def clear_queued(self) -> list[Delivery]:
        """Remove every queued message (the heads' lanes stay); returns them."""
        out = list(self.queued())
        for waiting in self._q.values():
            if waiting:
                waiting.clear()
        return out

    def __contains__(self, lane: object) -> bool:
        return lane in self._q

    def __len__(self) -> int:
        return len(self._q)

    def get(self, lane: object) -> list[Delivery]:
        """The messages queued behind the head of ``lane`` (a copy)."""
        return list(self._q.get(lane) or ())
