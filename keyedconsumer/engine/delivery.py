"""The engine's record of one message it holds: the public :class:`~keyedconsumer.Message` (what a
handler sees) and what the engine tracks about it."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from ..message import Message

if TYPE_CHECKING:
    from .partitions import Partition

__all__ = ["Delivery", "NULL_KEY"]


class _NullKey:
    """The lane key of null-key messages under ``ordering="key"``: they share one lane per
    partition (``None`` means "no lane" in :attr:`Delivery.lane`)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "NULL_KEY"


NULL_KEY = _NullKey()

#: Admission order: every delivery takes the next number when it is made (``next`` on an
#: ``itertools.count`` is atomic under the GIL).
_ORDER = itertools.count()


class Delivery:
    """One message in the engine's hands, from admission to its end.

    Attributes
    ----------
    msg:
        The message handed to the handler.
    part:
        The assignment of its partition; ``None`` for a message a sequencer brought from elsewhere
        (a parked or scheduled message run from Redis): no offset of it is tracked.
    lane:
        Its lane key: the Kafka key (``ordering="key"``; :data:`NULL_KEY` for a null key, whose
        messages share one lane per partition), ``0`` (``ordering="partition"``), or ``None`` with
        ``ordering="none"`` (no lane at all).
    lease_id:
        Its lane's identity for the sequencer (the Redis lease of its key), or ``None``.
    offset, size:
        The record's offset and key + value bytes, fixed when admitted (a handler may change the
        message's own fields).
    order:
        Its admission number, unique and increasing: the ready queue serves the lowest first, so
        every partition's offsets start (and finish) close to offset order.
    prev, follower:
        A lane's run handed to one worker (:meth:`.engine.Engine.take`): ``follower`` is the
        message of the same lane taken along right behind this one, in the same unit; ``prev`` is
        set on a message taken along while the one before it has not ended done yet (it runs only
        once that one is done, else it goes back to its lane). Written by the owner only; a worker
        reads ``follower`` (:meth:`.workers.Slot.next`).
    """

    __slots__ = (
        "msg",
        "part",
        "lane",
        "lease_id",
        "offset",
        "size",
        "order",
        "prev",
        "follower",
        "__weakref__",
    )

    def __init__(
        self, msg: Message, part: Partition | None, lane: object | None, lease_id: str | None, size: int
    ) -> None:
        self.msg = msg
        self.part = part
        self.lane = lane
        self.lease_id = lease_id
        self.offset = msg.offset
        self.size = size
        self.order = next(_ORDER)
        self.prev: Delivery | None = None
        self.follower: Delivery | None = None

    # -- a lane's run (see prev, follower) --------------------------------------------------------

    def take_along(self, f: Delivery) -> None:
        """``f``, queued right behind this message on its lane, is taken along: it runs after this
        one, in the same unit, if this one ends done."""
        self.follower = f
        f.prev = self

    def hand_over(self) -> None:
        """This message ended done: the one taken along behind it is its lane's head now."""
        f = self.follower
        if f is not None:
            self.follower = f.prev = None

    def cut_run(self) -> list[Delivery]:
        """This message did not end done (or is still running while the rest of its unit is taken
        back): unlink and return the messages taken along behind it, in lane order (they did not
        start and go back to their lane)."""
        run: list[Delivery] = []
        f, self.follower = self.follower, None
        while f is not None:
            run.append(f)
            nxt = f.follower
            f.prev = f.follower = None
            f = nxt
        return run

    @property
    def fencing_token(self) -> int | None:
        """The fencing token of the lease it runs under (on its message, for the handler)."""
        return self.msg.fencing_token

    @fencing_token.setter
    def fencing_token(self, token: int | None) -> None:
        self.msg.fencing_token = token

    def __repr__(self) -> str:
        return f"Delivery({self.msg.topic}[{self.msg.partition}]@{self.offset}, lane={self.lane!r})"
