"""How often a partition's offset is stored (``Partitions.advances`` paced by ``AutoCommit``).

A partition with offsets finished above its watermark carries commit metadata whose encoding costs
O(its unfinished offsets). With one blocked key, its held messages then finish one a turn, each
moving the watermark: encoding on every turn made the drain quadratic (bench W4: 0.19x raw on
d09a77e, 0.61x once paced). These tests check what is paced and that nothing is lost by it.
"""

from __future__ import annotations

import pytest

import keyedconsumer.engine.partitions as partitions_mod
from keyedconsumer.engine.partitions import Partitions
from keyedconsumer.offsets import FinishedOffsets

TP = ("t", 0)
EVERY_S = 0.5


def _partition_with_a_blocked_key(n: int, blocked_every: int) -> Partitions:
    """``n`` offsets received; every ``blocked_every``-th (from 0) not done, all others done."""
    parts = Partitions(metadata_max_bytes=4096)
    parts.assign([TP])
    part = parts.by_tp[TP]
    for off in range(n):
        assert parts.receive("t", 0, off, 0.0) is part
    for off in range(n):
        if off % blocked_every:
            parts.done(part, off)
    return parts


def test_the_blocked_keys_drain_encodes_metadata_once_per_interval_not_once_per_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # given 20,000 offsets, one in 100 held by a blocked key, the rest done
    parts = _partition_with_a_blocked_key(20_000, 100)
    part = parts.by_tp[TP]
    encodes = 0
    real = partitions_mod.encode_finished

    def counting(*args: object, **kwargs: object) -> str:
        nonlocal encodes
        encodes += 1
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(partitions_mod, "encode_finished", counting)
    # when the blocked key's messages finish one a turn, 10 turns a second for 10 s
    stored = []
    for i, off in enumerate(range(0, 10_000, 100)):
        parts.done(part, off)
        for p, wm, meta in parts.advances(i * 0.1, EVERY_S):
            p.mark_stored(wm)
            stored.append((wm, meta))
    # then the metadata was encoded once per 0.5 s (20 times), not once per turn (100 times)
    assert encodes == 20
    # and every stored offset is the first unfinished one then, with metadata naming all done above
    for wm, meta in stored:
        assert wm % 100 == 0
        fin = FinishedOffsets.decode(wm, meta)
        assert fin is not None and fin.count == 20_000 - wm - (20_000 - wm) // 100


def test_a_paced_partition_stays_due_and_is_stored_once_its_interval_passed() -> None:
    # given a partition stored at 0.0 with offsets finished above its watermark
    parts = _partition_with_a_blocked_key(1_000, 10)
    part = parts.by_tp[TP]
    parts.done(part, 0)
    ((_, wm, _),) = parts.advances(0.0, EVERY_S)
    part.mark_stored(wm)
    # when its watermark moves again at 0.1 and nothing else happens to it
    parts.done(part, 10)
    assert parts.advances(0.1, EVERY_S) == []
    # then a later call, with no new event, stores it once the interval passed
    assert parts.advances(0.49, EVERY_S) == []
    ((p, wm2, meta),) = parts.advances(0.5, EVERY_S)
    assert p is part and wm2 == 20 and meta


def test_a_partition_with_nothing_finished_above_its_watermark_is_stored_every_turn() -> None:
    # given a partition whose offsets finish in order
    parts = Partitions(metadata_max_bytes=4096)
    parts.assign([TP])
    part = parts.by_tp[TP]
    for off in range(10):
        parts.receive("t", 0, off, 0.0)
    # when each finishes on its own turn, all within one interval
    for off in range(10):
        parts.done(part, off)
        ((_, wm, meta),) = parts.advances(0.0, EVERY_S)
        part.mark_stored(wm)
        # then each turn stores it (its metadata is empty: nothing to encode)
        assert wm == off + 1 and meta == ""
