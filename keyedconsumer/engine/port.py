"""The engine as a sequencer sees it: the :class:`~.sequencer.LanePort` an :class:`~.engine.Engine`
hands its sequencer at attach, and nothing more of the engine."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from ..message import Message
from .delivery import Delivery

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["Port"]


class Port:
    """A :class:`~.sequencer.LanePort` over an engine: owner thread only, but :meth:`post`.

    Parameters
    ----------
    engine:
        The engine whose lanes it reaches.
    post:
        ``post(fn, arg)`` runs ``fn(arg)`` in the owner thread (its mailbox); ``None``: the engine
        has no mailbox (a test driving it by hand), and posting raises ``RuntimeError``.
    """

    __slots__ = ("_e", "_post", "_conflated_out", "conflated_count", "retries")

    def __init__(self, engine: Engine, post: Callable[[Callable[[Any], None], Any], None] | None) -> None:
        self._e = engine
        self._post = post
        self._conflated_out: list[Message] = []  # conflated by the sequencer, not reported yet
        #: Messages the sequencer conflated so far, and retries it made (parked messages set to run
        #: again later).
        self.conflated_count = 0
        self.retries = 0

    def post(self, fn: Callable[[Any], None], arg: Any = None) -> None:
        if self._post is None:
            raise RuntimeError("this engine has no owner mailbox to post to")
        self._post(fn, arg)

    @property
    def ordering(self) -> str:
        return self._e.ordering

    @property
    def conflate(self) -> bool:
        return self._e.conflate

    @property
    def halted(self) -> bool:
        return self._e.halted

    @property
    def stopping(self) -> bool:
        return self._e.stopping

    def make_ready(self, d: Delivery) -> None:
        self._e.queue.push(d)

    def lane_rest(self, head: Delivery) -> list[Delivery]:
        return head.part.lanes.take_rest(head) if head.part is not None else []

    def lane_put_back(self, head: Delivery, rest: list[Delivery]) -> None:
        if head.part is not None:
            head.part.lanes.put_back(head, rest)

    def lane_advance(self, head: Delivery) -> Delivery | None:
        e = self._e
        if head.part is None:
            return None
        nxt = head.part.lanes.advance(head)
        if nxt is None:
            ready = e.seq.on_lane_end(head)
            if ready is not None:
                e.queue.push(ready)
        return nxt

    def parked(self, ds: Iterable[Delivery]) -> None:
        e = self._e
        for d in ds:
            if d.part is not None:
                e.partitions.done(d.part, d.offset)
            e.flow.forget(d.size)

    def conflated(self, msgs: list[Message]) -> None:
        group = self._e.group
        for m in msgs:
            m.group_id = group
        self.conflated_count += len(msgs)
        self._conflated_out.extend(msgs)

    def take_conflated(self) -> list[Message]:
        """The messages :meth:`conflated` since the last call (the owner reports them)."""
        out, self._conflated_out = self._conflated_out, []
        return out

    def admit_external(self, batch: list[Delivery]) -> None:
        e = self._e
        for d in batch:
            d.msg.group_id = e.group
            d.msg._bind(e.owns, d)
            e.flow.admit(1, d.size)
        if batch:
            e.queue.push(batch[0])

    def forget(self, ds: Iterable[Delivery]) -> None:
        for d in ds:
            self._e.flow.forget(d.size)

    def count_retry(self) -> None:
        self.retries += 1
