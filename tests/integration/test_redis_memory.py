"""Redis memory stays bounded however many distinct keys come (issue 27 §1), at a smoke size; the
10,000,000-key run is ``bench/redis_memory.py`` (its figures in docs/scaling.md).

A private Redis, so ``used_memory`` moves with this test only.
"""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from keyedconsumer.sequencing import keys
from keyedconsumer.sequencing.store import LeaseStore

from .redisnodes import RedisNode, free_ports

pytestmark = [pytest.mark.redis]


@pytest.fixture
def node() -> Iterator[RedisNode]:
    n = RedisNode(free_ports(1)[0], Path(tempfile.mkdtemp(prefix="kc-mem-")))
    n.start()
    try:
        yield n
    finally:
        n.stop()


def _through(store: LeaseStore, lo: int, hi: int) -> None:
    """Acquire and release the leases of keys ``lo..hi``, 2,000 at a time."""
    for b in range(lo, hi, 2000):
        req = [(keys.lease_id(b"d%08d" % i, "t", 0), "o") for i in range(b, min(hi, b + 2000))]
        assert all(tok > 0 for tok, _ in store.acquire(req, 30_000))
        assert all(store.release(req))


@pytest.mark.timeout(120)
def test_distinct_keys_leave_nothing_but_the_slot_counters(node: RedisNode) -> None:
    # given 100,000 distinct keys each leased and released (their slots' counters now exist)
    ns = f"mem{uuid.uuid4().hex[:6]}"
    store = LeaseStore(f"redis://127.0.0.1:{node.port}/0", ns)
    r = node.client()
    try:
        _through(store, 0, 100_000)
        before_keys = r.dbsize()
        before_mem = int(r.info("memory")["used_memory"])
        # when 100,000 more distinct keys come and go
        _through(store, 100_000, 200_000)
        # then what is left is only slots' fencing counters, at most one per hash slot...
        names = [n.decode() for n in r.scan_iter(match=f"kc:{ns}:*", count=5000)]
        assert all("{_f" in n and n.endswith("}:fence") for n in names), [n for n in names if "{_f" not in n][
            :5
        ]
        assert before_keys <= len(names) <= keys.SLOTS
        # ... so the second 100,000 keys added only the counters of slots not yet used (a few), and
        # under 1 MiB of memory (a per-key counter, as before, would have added ~9 MB)
        assert len(names) - before_keys <= keys.SLOTS - before_keys
        grown = int(r.info("memory")["used_memory"]) - before_mem
        assert grown < 1 << 20, grown
    finally:
        store.close()
        r.close()


@pytest.mark.timeout(30)
def test_a_key_whose_counter_an_earlier_version_left_keeps_its_tokens_going_up(redis_url: str) -> None:
    # given a key whose per-key fencing counter, left by an earlier version, is at 57
    ns = f"up{uuid.uuid4().hex[:6]}"
    lid = keys.lease_id(b"old-key", "t", 0)
    store = LeaseStore(redis_url, ns)
    r = store._r
    try:
        r.set(keys.fence(ns, lid), 57)
        # when the key is leased now
        token = store.acquire([(lid, "o")], 30_000)[0][0]
        # then its token is above the old counter, and the old counter goes with the lease
        assert token == 58
        assert store.release([(lid, "o")]) == [True] and not r.exists(keys.fence(ns, lid))
        assert store.acquire([(lid, "o2")], 30_000)[0][0] == 59
        store.release([(lid, "o2")])
    finally:
        store.close()
