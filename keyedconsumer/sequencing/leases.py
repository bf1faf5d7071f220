"""The instance's view of its per-key leases (no Redis here: the caller talks to the store).

A lane's head may run only while this instance holds the lease of the lane's *lease id* (its Kafka
key, or its partition for null keys). One lease serves, one after the other, every local lane with
that id (the same key on several partitions), and the lane's later messages run under it without a
Redis round trip. A lease is released when no local lane needs it.

A lease's *holders* are the lane heads (:class:`~keyedconsumer.engine.delivery.Delivery`) and the
drain jobs of a parked key that wait for it or run under it: anything with a ``fencing_token``.

All methods run in the engine's owner thread (the lease I/O thread gets lists of leases to acquire
and release, and its answers come back to the owner; the renewer thread only reads the list of leases
the owner publishes for it: :meth:`LeaseTable.to_renew` builds it).
"""

from __future__ import annotations

import itertools
import math
import os
import time
import uuid
from collections import deque
from typing import Any

__all__ = ["Lease", "LeaseTable", "Holder"]

#: A lease holder: a lane head or a drain job, with a ``fencing_token`` attribute.
Holder = Any

#: The shortest wait before asking again for a lease another instance holds (seconds).
RETRY_MIN_S = 0.02
#: The longest such wait (seconds).
RETRY_MAX_S = 0.25


class Lease:
    __slots__ = (
        "lid",
        "owner",
        "fence",
        "held",
        "renewed_s",
        "active",
        "waiting",
        "retry_s",
        "parked",
        "renewing",
        "asking",
    )

    def __init__(self, lid: str) -> None:
        self.lid = lid
        self.owner = ""
        self.fence = 0
        self.held = False
        self.renewed_s = 0.0  # when Redis last confirmed it (monotonic seconds)
        self.active: Holder | None = None  # the lane head running (or ready, or delayed) under it
        self.waiting: deque[Holder] = deque()  # lane heads waiting for it
        self.retry_s = 0.0  # not asked again before this time
        self.parked = False  # the key has a parked list in Redis (known while the lease is held)
        self.renewing: list[Holder] = []  # heads that did not start for lack of time left: renew first
        self.asking = False  # an acquire of it is on its way to Redis (its answer not seen yet)


class LeaseTable:
    """Leases wanted, held and idle. ``ttl_s``: the lease TTL in seconds; ``linger_s``: how long
    an idle lease is kept before it is released, so a key that comes back soon pays no Redis round
    trip (a held idle lease is renewed like any other)."""

    def __init__(self, ttl_s: float, linger_s: float = 0.0) -> None:
        self.ttl_s = ttl_s
        #: A head starts only while at least this much of its lease's TTL is left (seconds): half the
        #: TTL, which renewals every ``renew_interval_s`` (a third of the TTL at most) keep.
        self.start_margin_s = ttl_s / 2
        self.linger_s = linger_s
        self.by_id: dict[str, Lease] = {}
        self.want: set[str] = set()
        self.idle: dict[str, float] = {}  # lease id -> since when idle (monotonic seconds)
        self.lost = 0  # leases lost so far (expired unconfirmed or taken over), not released
        #: ``[(lease id, owner)]`` forgotten here while Redis may hold them (an ask answered "held,
        #: not acknowledged by a replica", or failed after Redis may have run it, once no lane
        #: wanted the lease any more): released with the next batch (:meth:`to_release`).
        self._stray: list[tuple[str, str]] = []
        #: No held lease expires unconfirmed before this (monotonic seconds): the earliest
        #: ``renewed_s + ttl_s`` of the held leases, kept by :meth:`acquired` and
        #: :meth:`expire_unconfirmed` (renewals only move a lease's expiry later).
        self._expiry_s = math.inf
        self._instance = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._n = itertools.count()

    # -- lanes ----------------------------------------------------------------------------------

    def admit_head(self, msg: Holder, lid: str) -> bool:
        """A lane got a head. ``True``: it may be made ready now (the lease is held and free)."""
        lease = self.by_id.get(lid)
        if lease is None:
            lease = self.by_id[lid] = Lease(lid)
        if lease.active is None and self.valid(lease, time.monotonic()):
            lease.active = msg
            msg.fencing_token = lease.fence
            self.idle.pop(lid, None)
            return True
        lease.waiting.append(msg)
        if not lease.held:
            self.want.add(lid)
        return False

    def handover(self, msg: Holder, nxt: Holder, lid: str) -> None:
        """The lane's next message runs under the same lease."""
        nxt.fencing_token = msg.fencing_token
        lease = self.by_id.get(lid)
        if lease is not None:
            lease.active = nxt

    def lane_dry(self, msg: Holder, lid: str) -> Holder | None:
        """The lane of ``msg`` ran dry. Returns another local lane head that takes the lease over."""
        lease = self.by_id.get(lid)
        if lease is None:
            return None
        if lease.active is msg:
            lease.active = None
        if lease.waiting and lease.active is None and self.valid(lease, time.monotonic()):
            head = lease.waiting.popleft()
            lease.active = head
            head.fencing_token = lease.fence
            return head
        if not lease.waiting and lease.active is None:
            if lease.held:
                self._set_idle(lid)
            else:
                self._forget(lease)
        return None

    def may_start(self, msg: Holder, lid: str) -> bool:
        """True if ``msg`` may start now under its key's lease: the lease is this instance's and at
        least :attr:`start_margin_s` of its TTL is left (so a run does not begin under a lease about
        to lapse, which another instance could take while the run goes on)."""
        lease = self.by_id.get(lid)
        if lease is None or lease.active is not msg or not lease.held:
            return False
        if getattr(msg, "fencing_token", None) != lease.fence:
            return False
        return time.monotonic() - lease.renewed_s < self.ttl_s - self.start_margin_s

    def await_renewal(self, msg: Holder, lid: str) -> None:
        """``msg`` did not start for lack of time left on its key's lease: it waits, still the
        lease's head, for the next renewal (:meth:`renewed` returns it), or for the lease again when
        it is lost."""
        lease = self.by_id.get(lid)
        if lease is None or lease.active is not msg or not self.valid(lease, time.monotonic()):
            self.requeue(msg, lid)
            return
        lease.renewing.append(msg)

    def still_valid(self, msg: Holder, lid: str) -> bool:
        """True if ``msg`` ran under a lease this instance still holds (its result may count)."""
        lease = self.by_id.get(lid)
        if lease is None or lease.active is not msg:
            return False
        return bool(getattr(msg, "fencing_token", None) == lease.fence) and self.valid(
            lease, time.monotonic()
        )

    def requeue(self, msg: Holder, lid: str) -> None:
        """``msg`` ran under a lost lease: it waits, first in line, to run again once re-acquired."""
        lease = self.by_id.get(lid)
        if lease is None:
            lease = self.by_id[lid] = Lease(lid)
        if lease.active is msg:
            lease.active = None
        lease.held = False
        lease.waiting.appendleft(msg)
        self.want.add(lid)
        self.idle.pop(lid, None)

    def drop(self, msg: Holder, lid: str) -> None:
        """Forget a lane head that will never run here (revoked partition, halt)."""
        lease = self.by_id.get(lid)
        if lease is None:
            return
        if lease.active is msg:
            lease.active = None
        try:
            lease.waiting.remove(msg)
        except ValueError:
            pass
        if msg in lease.renewing:
            lease.renewing.remove(msg)
        if lease.active is None and not lease.waiting:
            if lease.held:
                self._set_idle(lid)
            else:
                self._forget(lease)

    def waiting_heads(self) -> list[Holder]:
        return [m for lease in self.by_id.values() for m in lease.waiting]

    def drop_waiting(self, drop: Any) -> list[Holder]:
        """Remove the waiting holders (for the lease, or for its renewal) for which ``drop(holder)``
        is true; returns them."""
        out: list[Holder] = []
        for lease in list(self.by_id.values()):
            gone = [m for m in [*lease.waiting, *lease.renewing] if drop(m)]
            for m in gone:
                self.drop(m, lease.lid)
            out.extend(gone)
        return out

    def renewals_awaited(self) -> bool:
        """Whether a head waits for its lease's renewal (:meth:`await_renewal`)."""
        return any(lease.renewing for lease in self.by_id.values())

    def owner(self, lid: str) -> str | None:
        """The owner token of the lease ``lid`` while this instance holds it, else ``None``."""
        lease = self.by_id.get(lid)
        return lease.owner if lease is not None and lease.held else None

    def activate(self, lid: str, current: Holder, nxt: Holder) -> bool:
        """``nxt`` runs under the held lease ``lid`` in place of ``current`` (or of nobody).
        ``False``: the lease is not held here, or another holder is active."""
        lease = self.by_id.get(lid)
        if lease is None or not lease.held or (lease.active is not current and lease.active is not None):
            return False
        lease.active = nxt
        nxt.fencing_token = lease.fence
        return True

    def step_aside(self, lid: str, head: Holder) -> Holder | None:
        """``head`` cannot go on now (its key's parked list is full): it waits for the lease again,
        behind whoever already waits, who takes the lease over (returned: it may run now)."""
        lease = self.by_id.get(lid)
        if lease is None:
            return None
        head.fencing_token = lease.fence
        lease.active = None
        other = None
        if lease.waiting:  # a drain job (or another lane) goes first
            other = lease.waiting.popleft()
            lease.active = other
            other.fencing_token = lease.fence
        lease.waiting.append(head)
        return other

    def take_free(self, lid: str) -> Holder | None:
        """The first waiting holder of ``lid``, made active, when the lease is held and free."""
        lease = self.by_id.get(lid)
        if lease is None or not lease.waiting or lease.active is not None or not lease.held:
            return None
        head = lease.waiting.popleft()
        lease.active = head
        head.fencing_token = lease.fence
        return head

    def has_waiting(self, lid: str) -> bool:
        lease = self.by_id.get(lid)
        return lease is not None and bool(lease.waiting)

    # -- Redis round trips (the caller calls the store between these) ---------------------------

    def valid(self, lease: Lease, now: float) -> bool:
        return lease.held and now - lease.renewed_s < self.ttl_s

    def to_acquire(self, now: float) -> list[tuple[str, str]]:
        """``[(lease id, owner)]`` to ask Redis for, each now marked as asked: it is not asked again
        until its answer (:meth:`acquired`) or its failure (:meth:`unanswered`) is seen, and it is
        kept here until then, so a grant that comes after its lane went is released, not leaked.
        A lease asked for again keeps its owner token: if an earlier ask was granted but its answer
        was lost (or not yet acknowledged by a replica), Redis gives the same owner the same lease
        and token back instead of making it wait for its own lease to expire."""
        out = []
        for lid in self.want:
            lease = self.by_id.get(lid)
            if lease is None or lease.asking or lease.retry_s > now:
                continue
            if not lease.owner:
                lease.owner = f"{self._instance}-{next(self._n)}"
            lease.asking = True
            out.append((lid, lease.owner))
        return out

    def unanswered(self, asks: list[tuple[str, str]], retry_s: float = 0.0, maybe_run: bool = False) -> None:
        """Acquires that were not sent, or got no answer: asked again, with the same owner token,
        from ``retry_s`` on (monotonic seconds) if still wanted. ``maybe_run``: Redis may have run
        them (a reply lost, a partial answer): one no lane wants any more is released."""
        for lid, owner in asks:
            lease = self.by_id.get(lid)
            if lease is None or lease.owner != owner:
                continue
            lease.asking = False
            lease.retry_s = max(lease.retry_s, retry_s)
            if not lease.held and lease.active is None and not lease.waiting:
                self._forget(lease)
                if maybe_run:
                    self._stray.append((lid, owner))

    def is_parked(self, lid: str) -> bool:
        """True if the key's lease is held here and its key has a parked list in Redis."""
        lease = self.by_id.get(lid)
        return lease is not None and lease.parked

    def set_parked(self, lid: str, parked: bool) -> None:
        lease = self.by_id.get(lid)
        if lease is not None:
            lease.parked = parked

    def acquired(
        self, lid: str, owner: str, token: int, asked_s: float, now: float, depth: int = 0
    ) -> Holder | None:
        """Redis answered an acquire sent at ``asked_s``: ``token`` > 0 granted, else
        ``-(ms left on the holder's lease)``; ``depth``: the key's parked messages. Returns a lane
        head to route."""
        lease = self.by_id.get(lid)
        if lease is None or lease.owner != owner:
            return None
        lease.asking = False
        if token <= 0:
            lease.retry_s = now + min(RETRY_MAX_S, max(RETRY_MIN_S, -token / 1000.0))
            if lease.active is None and not lease.waiting:  # its lanes went while it was asked
                self._forget(lease)
                if token == 0:  # held on its master, no replica acknowledged it yet
                    self._stray.append((lid, owner))
            return None
        self.want.discard(lid)
        lease.held = True
        lease.parked = depth > 0
        lease.fence = token
        lease.renewed_s = asked_s  # the TTL started no earlier than the request was sent
        if asked_s + self.ttl_s < self._expiry_s:
            self._expiry_s = asked_s + self.ttl_s
        if lease.active is None and lease.waiting:
            head = lease.waiting.popleft()
            lease.active = head
            head.fencing_token = token
            return head
        if lease.active is None:
            self._set_idle(lid)
        return None

    def to_renew(self) -> list[tuple[str, str]]:
        return [(lease.lid, lease.owner) for lease in self.by_id.values() if lease.held]

    def renewed(self, lid: str, owner: str, ok: bool, asked_s: float) -> list[Holder]:
        """Redis answered a renewal sent at ``asked_s``. Returns the heads that waited for it
        (:meth:`await_renewal`): they may start now."""
        lease = self.by_id.get(lid)
        if lease is None or lease.owner != owner or not lease.held:
            return []
        if ok:
            lease.renewed_s = max(lease.renewed_s, asked_s)
            heads, lease.renewing = lease.renewing, []
            return heads
        if asked_s < lease.renewed_s:  # refused before Redis confirmed it again (acquired anew)
            return []
        self.lose(lease)
        return []

    def expire_unconfirmed(self, now: float) -> None:
        """Leases Redis did not confirm within the TTL (Redis down, a long pause) are lost. Looks
        at the held leases only once the earliest of them may have expired, so a tick costs nothing
        while every lease is renewed in time."""
        if now < self._expiry_s:
            return
        ttl_s, earliest = self.ttl_s, math.inf
        for lease in list(self.by_id.values()):
            if not lease.held:
                continue
            if now - lease.renewed_s >= ttl_s:
                self.lose(lease)
            elif lease.renewed_s + ttl_s < earliest:
                earliest = lease.renewed_s + ttl_s
        self._expiry_s = earliest

    def lose(self, lease: Lease) -> None:
        self.lost += 1
        lease.held = False
        self.idle.pop(lease.lid, None)
        if lease.renewing:  # they wait for the lease again, first in line
            for m in reversed(lease.renewing):
                if lease.active is m:
                    lease.active = None
                lease.waiting.appendleft(m)
            lease.renewing = []
        if lease.waiting or lease.active is not None:
            self.want.add(lease.lid)
        else:
            self._forget(lease)

    def _set_idle(self, lid: str) -> None:
        """``lid`` is idle from now: last in :attr:`idle`, which stays in order of idle time."""
        idle = self.idle
        idle.pop(lid, None)
        idle[lid] = time.monotonic()

    def to_release(self, now: float | None = None) -> list[tuple[str, str]]:
        """Idle leases whose linger is over, and leases forgotten while Redis may hold them:
        ``[(lease id, owner)]``, forgotten here. Reads :attr:`idle` from the oldest and stops at
        the first lease idle for less than the linger (the rest are younger), so a tick costs the
        leases released, not every idle one."""
        now = time.monotonic() if now is None else now
        out = []
        drop = []
        linger_s = self.linger_s
        for lid, since in self.idle.items():
            lease = self.by_id.get(lid)
            if lease is None or not lease.held or lease.active is not None or lease.waiting:
                drop.append(lid)  # not idle any more: out of the list
                continue
            if now - since < linger_s:
                break
            drop.append(lid)
            out.append((lid, lease.owner))
        idle, by_id = self.idle, self.by_id
        for lid in drop:
            del idle[lid]
        for lid, _ in out:
            del by_id[lid]
        stray, self._stray = self._stray, []
        return stray + out

    def release_all(self) -> list[tuple[str, str]]:
        """Every lease held, or asked for with its answer not seen (Redis may have granted it:
        releasing a lease another owner holds changes nothing), forgotten here."""
        out = [(lease.lid, lease.owner) for lease in self.by_id.values() if lease.held or lease.asking]
        out += self._stray
        self._stray = []
        self.by_id.clear()
        self.want.clear()
        self.idle.clear()
        return out

    def _forget(self, lease: Lease) -> None:
        self.want.discard(lease.lid)
        self.idle.pop(lease.lid, None)
        if not lease.asking:  # else kept until its answer: a grant is then idle, and released
            self.by_id.pop(lease.lid, None)
