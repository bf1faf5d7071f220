"""The lease table's bookkeeping of unconfirmed leases (no Redis: the table is the owner's state).

``expire_unconfirmed`` runs on every tick of the owner, so it looks at the held leases only once
the earliest may have expired; these tests check that the shortcut never keeps a lease that
Redis did not confirm within its TTL, whatever order acquires and renewals are answered in.
"""

from __future__ import annotations

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
