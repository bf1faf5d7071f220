"""The dead-letter replay marker (keyedconsumer.cli.marker): pure, no broker."""

from __future__ import annotations

import random

import pytest

from keyedconsumer.deadletters.marker import MAX_MARKER_CHARS, ReplayMarker


@pytest.mark.timeout(60)
def test_replay_marker_model_each_record_replayed_once_across_runs() -> None:
    # given a partition with gaps in its offsets, and many replays with random key filters and crashes
    rnd = random.Random(7)
    for _trial in range(200):
        offsets = sorted(rnd.sample(range(0, 400), rnd.randint(1, 60)))
        keys = {o: rnd.choice("abcd") for o in offsets}
        sent: list[int] = []
        committed_offset: int | None = None
        metadata = ""
        for _run in range(rnd.randint(1, 6)):
            wanted = set(rnd.sample("abcd", rnd.randint(1, 4))) if rnd.random() < 0.7 else set("abcd")
            marker = ReplayMarker.decode(committed_offset, metadata)
            crash_after = rnd.randint(0, len(offsets)) if rnd.random() < 0.3 else None
            batch: list[int] = []
            for i, o in enumerate(o for o in offsets if o >= marker.committed_offset):
                if crash_after is not None and i >= crash_after:
                    batch = []  # the open batch is aborted with the process
                    break
                if marker.is_replayed(o):
                    continue
                replay = keys[o] in wanted
                assert marker.mark(o, replayed=replay)
                if replay:
                    batch.append(o)
                    if len(batch) == 3:  # a committed transaction: records and marker together
                        sent.extend(batch)
                        batch = []
                        committed_offset, metadata = marker.committed_offset, marker.encode()
            else:
                sent.extend(batch)
                if batch or committed_offset is None:
                    committed_offset, metadata = marker.committed_offset, marker.encode()
                # then the committed marker reads back as the same state
                again = ReplayMarker.decode(committed_offset, metadata)
                assert [again.is_replayed(o) for o in offsets] == [marker.is_replayed(o) for o in offsets]
        # then no record was sent twice, and a final unfiltered replay sends exactly the rest
        assert len(sent) == len(set(sent))
        marker = ReplayMarker.decode(committed_offset, metadata)
        rest = [o for o in offsets if o >= marker.committed_offset and not marker.is_replayed(o)]
        assert sorted(sent + rest) == offsets


@pytest.mark.timeout(30)
def test_replay_marker_is_bounded_and_refuses_to_grow_past_it() -> None:
    # given a marker where every other record is left pending (interleaved keys)
    marker = ReplayMarker.decode(None, "")
    refused_at = None
    for o in range(100_000):
        if not marker.mark(o, replayed=o % 2 == 0):
            refused_at = o
            break
    # then it refuses before its metadata passes the bound, and what it holds still reads back
    assert refused_at is not None and len(marker.encode()) <= MAX_MARKER_CHARS
    again = ReplayMarker.decode(marker.committed_offset, marker.encode())
    assert all(again.is_replayed(o) == (o % 2 == 0) for o in range(refused_at))
    # and a contiguous pending stretch (e.g. --since skipping a prefix) costs one range
    m = ReplayMarker.decode(None, "")
    for o in range(0, 50_000, 3):
        assert m.mark(o, replayed=o >= 40_000)
    assert len(m.encode()) < 30 and m.committed_offset == 0
