"""The group coordinator of the in-memory broker: one consumer group's members, assignment and offsets.

:class:`ConsumerGroup` owns everything the coordinator knows of a group: who is a member and what
each subscribes to, where each partition should be (the target) and where it is (each member's
assignment), the rebalance callbacks still to run, the offsets each member stored and the group's
committed offsets. Only its own methods change that state; :class:`~keyedconsumer.testing.InMemoryBroker`
calls them with its lock held (a group has no lock of its own) and exposes them to the members.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

from ..kafka import TP

__all__ = ["Commit", "ConsumerGroup", "EventKind", "matches"]

#: A rebalance callback a member is to run: ``"assign"``, ``"revoke"`` or ``"lost"``.
EventKind = Literal["assign", "revoke", "lost"]


@dataclasses.dataclass(frozen=True)
class Commit:
    """One committed offset, in commit order. ``offset`` is the next offset to consume;
    ``automatic`` is ``True`` for librdkafka-style auto commits of stored offsets."""

    group: str
    topic: str
    partition: int
    offset: int
    member: str
    automatic: bool
    metadata: str = ""


def matches(patterns: Iterable[str], topic: str) -> bool:
    """Whether a subscription (names, ``^regex`` patterns as in librdkafka) covers ``topic``."""
    return any(re.search(p, topic) if p.startswith("^") else p == topic for p in patterns)


class _Member:
    """One member as the coordinator sees it. Written only by :class:`ConsumerGroup`."""

    __slots__ = ("member_id", "topics", "assignment", "stored", "to_assign", "to_revoke", "to_lose")

    def __init__(self, member_id: str) -> None:
        self.member_id = member_id
        self.topics: list[str] = []
        self.assignment: set[TP] = set()  # partitions it owns (assigned, revoke not yet finished)
        self.stored: dict[TP, tuple[int, str]] = {}  # offset and metadata for the next (auto) commit
        self.to_assign: set[TP] = set()
        self.to_revoke: set[TP] = set()
        self.to_lose: set[TP] = set()


class ConsumerGroup:
    """One consumer group: membership, incremental (cooperative-sticky) assignment, offsets.

    Not thread-safe: the broker calls every method with its lock held. Methods taking
    ``partitions: Mapping[str, int]`` get the broker's ``{topic: partition count}``, from which the
    partitions each member's subscription covers are found.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._members: dict[str, _Member] = {}  # in join order
        self._committed: dict[TP, int] = {}
        self._metadata: dict[TP, str] = {}  # committed metadata per partition
        self._history: list[Commit] = []
        self._target: dict[TP, _Member] = {}  # where each partition should be
        self._callbacks: list[tuple[str, str, list[TP]]] = []
        self._delivered = 0

    # -- membership -------------------------------------------------------------------------------

    def join(self, member_id: str, topics: Sequence[str], partitions: Mapping[str, int]) -> None:
        """Add the member (or change its subscription) and move partitions for balance."""
        member = self._members.get(member_id)
        if member is None:
            member = self._members[member_id] = _Member(member_id)
        member.topics = list(topics)
        self._retarget(partitions, full=False)

    def leave(self, member_id: str, partitions: Mapping[str, int]) -> None:
        """Remove the member with what it holds and stored; its partitions go to the others."""
        if self._members.pop(member_id, None) is not None:
            self._retarget(partitions, full=False)

    def subscribes_to(self, topic: str) -> bool:
        """Whether some member's subscription covers ``topic``."""
        return any(matches(m.topics, topic) for m in self._members.values())

    def topics_changed(self, partitions: Mapping[str, int]) -> None:
        """A topic appeared (a metadata refresh): give its partitions to the subscribed members."""
        self._retarget(partitions, full=False)

    def rebalance(self, lost: bool, partitions: Mapping[str, int]) -> None:
        """Take every partition back and deal them out again, each to another member where there is
        one; with ``lost`` the partitions are lost (stored offsets dropped, free at once)."""
        for m in self._members.values():
            m.to_assign.clear()
            if lost:
                m.to_lose |= m.assignment
                self._drop(m, list(m.assignment))
                m.to_revoke.clear()
            else:
                m.to_revoke |= m.assignment
        self._retarget(partitions, full=True)

    # -- a member's rebalance callbacks -----------------------------------------------------------

    def next_event(self, member_id: str) -> tuple[EventKind, list[TP]] | None:
        """The member's next callback to run, lost first, then revoke, then assign (``None``: none).

        The partitions of an ``"assign"`` are the member's from now on; those of a ``"revoke"`` stay
        its own until :meth:`revoked`. ``"assign"`` and ``"lost"`` are recorded now (the member runs
        them at once), ``"revoke"`` when it returned.
        """
        m = self._members.get(member_id)
        if m is None:
            return None
        if m.to_lose:
            tps = sorted(m.to_lose)
            m.to_lose.clear()
            self.record(member_id, "lost", tps)
            return "lost", tps
        revoke = sorted(m.to_revoke & m.assignment)
        m.to_revoke.clear()
        if revoke:
            return "revoke", revoke
        if m.to_assign:
            tps = sorted(m.to_assign)
            m.to_assign.clear()
            m.assignment.update(tps)
            self.record(member_id, "assign", tps)
            return "assign", tps
        return None

    def revoked(self, member_id: str, tps: Sequence[TP]) -> None:
        """The member's ``on_revoke`` of ``tps`` returned: it no longer holds them (stored offsets
        dropped), and they go to their new owners."""
        m = self._members.get(member_id)
        if m is not None:
            self._drop(m, tps)
        self._reconcile()

    def record(self, member_id: str, kind: EventKind, tps: list[TP]) -> None:
        """Note a rebalance callback the member ran (see :meth:`callbacks`)."""
        self._callbacks.append((member_id, kind, tps))

    def assignment(self, member_id: str) -> list[TP]:
        """The partitions the member owns now, sorted."""
        m = self._members.get(member_id)
        return sorted(m.assignment) if m is not None else []

    def owns(self, member_id: str, tp: TP) -> bool:
        m = self._members.get(member_id)
        return m is not None and tp in m.assignment

    # -- offsets ----------------------------------------------------------------------------------

    def store(self, member_id: str, tp: TP, offset: int, metadata: str) -> bool:
        """Keep ``offset`` for the member's next auto commit. ``False``: the member does not own ``tp``."""
        m = self._members.get(member_id)
        if m is None or tp not in m.assignment:
            return False
        m.stored[tp] = (offset, metadata)
        return True

    def commit(self, member_id: str, tp: TP, offset: int, metadata: str, automatic: bool = False) -> bool:
        """Commit ``offset`` for ``tp``. ``False`` (nothing committed): the member does not own ``tp``."""
        if not self.owns(member_id, tp):
            return False
        self._committed[tp] = offset
        self._metadata[tp] = metadata
        self._history.append(Commit(self.name, tp[0], tp[1], offset, member_id, automatic, metadata))
        return True

    def commit_stored(self, member_id: str, tps: Iterable[TP] | None = None) -> int:
        """Auto-commit the member's stored offsets of ``tps`` (default: all it owns) that differ from
        the committed ones.

        Returns
        -------
        The number of offsets committed.
        """
        m = self._members.get(member_id)
        if m is None:
            return 0
        done = 0
        for tp in sorted(m.assignment) if tps is None else tps:
            stored = m.stored.get(tp)
            if stored is not None and stored[0] != self._committed.get(tp):
                done += self.commit(member_id, tp, stored[0], stored[1], automatic=True)
        return done

    def committed_of(self, tps: Iterable[TP]) -> dict[TP, tuple[int | None, str]]:
        """``{tp: (committed offset or None, its metadata)}``."""
        return {tp: (self._committed.get(tp), self._metadata.get(tp, "")) for tp in tps}

    def count_delivered(self, records: int) -> None:
        self._delivered += records

    # -- what tests observe -----------------------------------------------------------------------

    def committed(self) -> dict[TP, int]:
        return dict(self._committed)

    def history(self) -> list[Commit]:
        return list(self._history)

    def callbacks(self) -> list[tuple[str, str, list[TP]]]:
        return list(self._callbacks)

    def delivered(self) -> int:
        return self._delivered

    def stored(self) -> dict[TP, int]:
        return {tp: offset for m in self._members.values() for tp, (offset, _) in m.stored.items()}

    def assignments(self) -> dict[str, list[TP]]:
        return {m.member_id: sorted(m.assignment) for m in self._members.values()}

    # -- assignment -------------------------------------------------------------------------------

    @staticmethod
    def _drop(m: _Member, tps: Iterable[TP]) -> None:
        for tp in tps:
            m.assignment.discard(tp)
            m.stored.pop(tp, None)

    def _retarget(self, partitions: Mapping[str, int], full: bool) -> None:
        """Compute where each partition should be, then schedule the moves."""
        members = list(self._members.values())
        wanted: dict[TP, list[_Member]] = {}  # eligible members per partition, in join order
        for m in members:
            for topic, count in partitions.items():
                if matches(m.topics, topic):
                    for p in range(count):
                        wanted.setdefault((topic, p), []).append(m)
        tps = sorted(wanted)
        target: dict[TP, _Member] = {}
        load = {m: 0 for m in members}
        if full:  # each partition to another eligible member where there is one, least loaded first
            for tp in tps:
                others = [m for m in wanted[tp] if m is not self._target.get(tp)] or wanted[tp]
                best = target[tp] = min(others, key=load.__getitem__)
                load[best] += 1
        else:  # cooperative-sticky: keep owners, give out free partitions, move only for balance
            for tp in tps:
                old = self._target.get(tp)
                if old is not None and old in wanted[tp]:
                    target[tp] = old
                    load[old] += 1
            for tp in tps:
                if tp not in target:
                    best = min(wanted[tp], key=load.__getitem__)
                    target[tp] = best
                    load[best] += 1
            moved = True
            while moved:  # each move lowers the sum of squared loads, so this ends
                moved = False
                for tp in reversed(tps):
                    cur, best = target[tp], min(wanted[tp], key=load.__getitem__)
                    if load[cur] - load[best] > 1:
                        target[tp] = best
                        load[cur] -= 1
                        load[best] += 1
                        moved = True
        self._target = target
        self._reconcile()

    def _reconcile(self) -> None:
        """Schedule revokes of partitions held away from their target, and assigns of free ones."""
        held: set[TP] = set()
        for m in self._members.values():
            m.to_assign = {tp for tp in m.to_assign if self._target.get(tp) is m}
            m.to_revoke |= {tp for tp in m.assignment if self._target.get(tp) is not m}
            held |= m.assignment | m.to_assign
        for tp, m in self._target.items():
            if tp not in held:
                m.to_assign.add(tp)
