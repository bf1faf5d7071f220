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
    """

    __slots__ = ("msg", "part", "lane", "lease_id", "offset", "size", "order", "__weakref__")

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

    @property
    def fencing_token(self) -> int | None:
        """The fencing token of the lease it runs under (on its message, for the handler)."""
        return self.msg.fencing_token

    @fencing_token.setter
    def fencing_token(self, token: int | None) -> None:
        self.msg.fencing_token = token

    def __repr__(self) -> str:
        return f"Delivery({self.msg.topic}[{self.msg.partition}]@{self.offset}, lane={self.lane!r})"
