"""Redis key names: every hash slot's fencing counter sits in the slot of the lease keys it serves
(checked against redis-py's ``key_slot``, which is Redis's ``CLUSTER KEYSLOT``)."""

from __future__ import annotations

import pytest
from redis.crc import key_slot

from keyedconsumer.sequencing import keys

pytestmark = [pytest.mark.timeout(60)]


def test_every_slot_has_a_tag_that_hashes_to_it() -> None:
    for slot in range(keys.SLOTS):
        tag = keys.slot_tag(slot)
        assert tag.startswith(f"_f{slot}.") and key_slot(f"kc:ns:{{{tag}}}:fence".encode()) == slot


def test_a_keys_counter_is_in_the_slot_of_its_lease_and_parked_list() -> None:
    for i in range(2000):
        lid = keys.lease_id(f"key-{i}".encode(), "t", 0)
        slot = key_slot(keys.lease("ns", lid).encode())
        assert keys.slot_of(lid) == slot == key_slot(keys.park("ns", lid).encode())
        assert key_slot(keys.slot_fence("ns", lid).encode()) == slot
    null_lane = keys.lease_id(None, "orders", 3)
    assert key_slot(keys.slot_fence("ns", null_lane).encode()) == key_slot(
        keys.lease("ns", null_lane).encode()
    )


def test_a_slot_outside_the_cluster_range_is_refused() -> None:
    with pytest.raises(ValueError, match="0..16383"):
        keys.slot_tag(keys.SLOTS)
