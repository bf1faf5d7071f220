"""The lease table's bookkeeping of unconfirmed leases (no Redis: the table is the owner's state).

``expire_unconfirmed`` runs on every tick of the owner, so it looks at the held leases only once
the earliest may have expired; these tests check that the shortcut never keeps a lease that
Redis did not confirm within its TTL, whatever order acquires and renewals are answered in.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from keyedconsumer.sequencing.leases import LeaseTable

TTL_S = 3.0


def _holder() -> SimpleNamespace:
    return SimpleNamespace(fencing_token=None)


def _acquire(leases: LeaseTable, lid: str, asked_s: float, token: int = 1) -> None:
    """A lane of ``lid`` wants its lease; Redis granted an acquire sent at ``asked_s``."""
    leases.admit_head(_holder(), lid)
    ((got, owner),) = [a for a in leases.to_acquire(asked_s) if a[0] == lid]
    leases.acquired(got, owner, token, asked_s, asked_s)


def _held(leases: LeaseTable) -> set[str]:
    return {lid for lid, lease in leases.by_id.items() if lease.held}


def test_a_lease_is_lost_exactly_when_its_ttl_passes_unconfirmed_and_a_renewal_moves_that_later() -> None:
    # given lease a acquired at 100 and lease b at 101
    leases = LeaseTable(TTL_S)
    _acquire(leases, "a", 100.0)
    _acquire(leases, "b", 101.0)
    # when time passes short of a's TTL, nothing is lost
    leases.expire_unconfirmed(102.9)
    assert _held(leases) == {"a", "b"} and leases.lost == 0
    # then a is lost at 103, b still held
    leases.expire_unconfirmed(103.0)
    assert _held(leases) == {"b"} and leases.lost == 1
    # and b, renewed by a request sent at 103.5, outlives its first expiry (104) until 106.5
    owner = leases.by_id["b"].owner
    leases.renewed("b", owner, True, 103.5)
    leases.expire_unconfirmed(106.4)
    assert _held(leases) == {"b"}
    leases.expire_unconfirmed(106.5)
    assert _held(leases) == set() and leases.lost == 2


def test_a_late_answered_acquire_expires_on_time_after_a_sweep_found_a_later_expiry() -> None:
    # given lease b acquired by a request sent at 102, and a sweep at 102.5 (earliest expiry 105)
    leases = LeaseTable(TTL_S)
    _acquire(leases, "b", 102.0)
    leases.expire_unconfirmed(102.5)
    # when an acquire sent earlier, at 101, is answered only now (its TTL runs from 101)
    _acquire(leases, "c", 101.0)
    # then c is lost at 104, before b's expiry: the sweep is not skipped until 105
    leases.expire_unconfirmed(104.0)
    assert _held(leases) == {"b"} and leases.lost == 1


def test_a_lease_whose_renewal_failed_is_lost_at_once_and_a_sweep_skips_nothing_after_it() -> None:
    # given leases a and b acquired at 100
    leases = LeaseTable(TTL_S)
    _acquire(leases, "a", 100.0)
    _acquire(leases, "b", 100.0)
    # when Redis refuses a's renewal (another instance holds it now)
    leases.renewed("a", leases.by_id["a"].owner, False, 101.0)
    # then a is lost at once and b at its own expiry
    assert _held(leases) == {"b"} and leases.lost == 1
    leases.expire_unconfirmed(102.0)
    assert _held(leases) == {"b"}
    leases.expire_unconfirmed(103.0)
    assert _held(leases) == set() and leases.lost == 2


def test_a_lease_asked_for_is_not_asked_again_until_its_answer_and_is_kept_for_it() -> None:
    # given a lane of key a that wants its lease, asked for (the answer comes back later: the
    # lease I/O thread sends the acquire)
    leases = LeaseTable(TTL_S, linger_s=1.0)
    head = _holder()
    leases.admit_head(head, "a")
    ((lid, owner),) = leases.to_acquire(100.0)
    # then it is not asked for again while its answer is on its way
    assert leases.to_acquire(100.1) == []
    # when its lane goes before the answer (a revoke)
    leases.drop(head, "a")
    # then the lease is kept, so a grant that comes after is not leaked in Redis: it idles and is
    # released after the linger
    assert "a" in leases.by_id and "a" not in leases.want
    assert leases.release_all() == [("a", owner)]  # a stop releases it too, granted or not
    leases.admit_head(head, "a")
    ((lid, owner),) = leases.to_acquire(100.0)
    leases.drop(head, "a")
    assert leases.acquired(lid, owner, 7, 100.0, 100.2) is None
    idle_since = time.monotonic()  # (idle time is read on the real clock)
    assert leases.to_release(idle_since) == []
    assert leases.to_release(idle_since + 1.1) == [("a", owner)] and "a" not in leases.by_id


def test_a_refused_or_unsent_ask_is_asked_again_only_while_wanted() -> None:
    # given key a's lane waiting for its lease, asked for and refused (held elsewhere, 10 ms left)
    leases = LeaseTable(TTL_S)
    head = _holder()
    leases.admit_head(head, "a")
    ((lid, owner),) = leases.to_acquire(100.0)
    assert leases.acquired(lid, owner, -10, 100.0, 100.0) is None
    # then it is asked for again once the wait is over, with the same owner token
    assert leases.to_acquire(100.0) == []
    assert leases.to_acquire(100.1) == [("a", owner)]
    # when that ask is not sent (a stall or an ownership check came first), it is asked again
    leases.unanswered([("a", owner)])
    assert leases.to_acquire(100.2) == [("a", owner)]
    # and when the lane went meanwhile, an unsent or refused ask leaves nothing behind
    leases.drop(head, "a")
    leases.unanswered([("a", owner)])
    assert "a" not in leases.by_id and leases.to_acquire(100.3) == []
    leases.admit_head(head, "a")
    ((lid, owner),) = leases.to_acquire(100.4)
    leases.drop(head, "a")
    assert leases.acquired(lid, owner, -10, 100.4, 100.4) is None
    assert "a" not in leases.by_id and leases.release_all() == []


def test_a_lease_redis_may_hold_is_released_when_no_lane_wants_it_any_more() -> None:
    # given key a's lease asked for, and its lane gone before the answer
    leases = LeaseTable(TTL_S)
    head = _holder()
    leases.admit_head(head, "a")
    ((lid, owner),) = leases.to_acquire(100.0)
    leases.drop(head, "a")
    # when Redis answers "held on the master, no replica acknowledged it" (token 0)
    assert leases.acquired(lid, owner, 0, 100.0, 100.0) is None
    # then the lease is released with the next batch (it is held in Redis until then), once
    assert leases.to_release(100.0) == [("a", owner)] and leases.to_release(100.0) == []
    # and so is one whose acquire failed after Redis may have run it (a lost reply)
    leases.admit_head(head, "a")
    ((lid, owner),) = leases.to_acquire(100.0)
    leases.drop(head, "a")
    leases.unanswered([(lid, owner)], maybe_run=True)
    assert "a" not in leases.by_id and leases.release_all() == [("a", owner)]


def test_a_refusal_sent_before_the_lease_was_acquired_anew_does_not_lose_it() -> None:
    # given lease a acquired at 100, lost unconfirmed at 103, and acquired again (same owner) at 104
    leases = LeaseTable(TTL_S)
    _acquire(leases, "a", 100.0)
    owner = leases.by_id["a"].owner
    leases.expire_unconfirmed(103.0)
    assert _held(leases) == set() and leases.lost == 1
    _acquire(leases, "a", 104.0)
    assert leases.by_id["a"].owner == owner and _held(leases) == {"a"}
    # when a renewal sent at 102.5, before the new acquire, comes back refused
    leases.renewed("a", owner, False, 102.5)
    # then the lease acquired at 104 stays held: the refusal is about the old one
    assert _held(leases) == {"a"} and leases.lost == 1
    # and a refusal of a renewal sent after it still loses it
    leases.renewed("a", owner, False, 104.5)
    assert _held(leases) == set() and leases.lost == 2
