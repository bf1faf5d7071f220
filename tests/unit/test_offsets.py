"""The offset tracker never passes an unfinished offset and reaches the end once all are done."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from keyedconsumer.offsets import METADATA_PREFIX, FinishedOffsets, OffsetTracker, encode_finished


class TrackerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.t = OffsetTracker()
        self.received: list[int] = []
        self.done: set[int] = set()
        self.next = 0

    @rule(gap=st.integers(min_value=0, max_value=3))
    def receive(self, gap: int) -> None:
        # gaps model transaction markers and compacted records: offsets that never arrive (C3)
        off = self.next + gap
        assert self.t.add(off)
        self.received.append(off)
        self.next = off + 1

    @precondition(lambda self: len(self.done) < len(self.received))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        off = data.draw(st.sampled_from([o for o in self.received if o not in self.done]))
        self.t.done(off)
        self.done.add(off)

    @precondition(lambda self: self.received)
    @rule(data=st.data())
    def redeliver(self, data: st.DataObject) -> None:
        off = data.draw(st.sampled_from(self.received))
        assert not self.t.add(off)  # a re-delivery is never tracked twice

    @invariant()
    def watermark_is_first_unfinished(self) -> None:
        unfinished = [o for o in self.received if o not in self.done]
        wm = self.t.watermark()
        if not self.received:
            assert wm is None
        elif unfinished:
            assert wm == min(unfinished)  # never past an unfinished offset
        else:
            assert wm == self.received[-1] + 1  # the end, whatever the gaps
        assert self.t.pending == len(unfinished)


TrackerMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
test_tracker_machine = TrackerMachine.TestCase


def test_transactional_gaps_case_c3() -> None:
    # given data offsets 0, 2, 4, 6 (commit markers between them)
    t = OffsetTracker()
    for off in (0, 2, 4, 6):
        t.add(off)
    # when they complete 0, 2, 6, 4
    for off, expected in ((0, 2), (2, 4), (6, 4), (4, 7)):
        t.done(off)
        # then the watermark follows the received offsets and reaches 7
        assert t.watermark() == expected


@given(st.permutations(list(range(50))))
def test_any_completion_order_reaches_the_end(order: list[int]) -> None:
    t = OffsetTracker()
    for off in range(50):
        t.add(off)
    seen = 0
    for off in order:
        t.done(off)
        wm = t.watermark()
        assert wm is not None and wm >= seen  # never moves backwards
        seen = wm
    assert t.watermark() == 50


class CompactingTrackerMachine(TrackerMachine):
    """The same properties while done offsets behind a stuck head are compacted away often."""

    def __init__(self) -> None:
        import keyedconsumer.offsets as offsets

        offsets.COMPACT_MIN = 2
        super().__init__()

    def teardown(self) -> None:
        import keyedconsumer.offsets as offsets

        offsets.COMPACT_MIN = 4096


CompactingTrackerMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=80, deadline=None)
test_compacting_tracker_machine = CompactingTrackerMachine.TestCase


def test_memory_follows_unfinished_offsets_not_finished_ones() -> None:
    # given a stuck head and 100,000 later offsets that all finish
    t = OffsetTracker()
    for off in range(100_001):
        t.add(off)
    for off in range(1, 100_001):
        t.done(off)
    # then the tracker keeps about the unfinished one, not 100,000 done offsets
    assert t.watermark() == 0 and t.pending == 1
    assert len(t._pending) + len(t._done) < 10_000
    t.done(0)
    assert t.watermark() == 100_001 and t.pending == 0


# -- commit metadata: the offsets finished above the committed one ------------------------------------


@settings(max_examples=120, deadline=None)
@given(
    gaps=st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=400),
    done_mask=st.lists(st.booleans(), min_size=400, max_size=400),
    start=st.integers(min_value=0, max_value=2**40),
    max_bytes=st.sampled_from([24, 60, 200, 4096]),
)
def test_commit_metadata_names_only_finished_offsets_and_all_of_them_when_it_fits(
    gaps: list[int], done_mask: list[bool], start: int, max_bytes: int
) -> None:
    # given a tracker with offsets received (with gaps: transaction markers) and some of them done
    t = OffsetTracker()
    received = []
    nxt = start
    for g in gaps:
        nxt += g
        t.add(nxt)
        received.append(nxt)
        nxt += 1
    done = {o for o, d in zip(received, done_mask, strict=False) if d}
    for o in sorted(done, key=lambda o: hash((o, start))):
        t.done(o)
    wm = t.watermark()
    assert wm is not None
    # when its metadata is encoded within max_bytes and decoded against the committed watermark
    text = encode_finished(t, max_bytes)
    assert len(text) <= max_bytes
    fin = FinishedOffsets.decode(wm, text)
    named = {o for o in received if fin is not None and fin.covers(o)}
    # then it never names an offset that is not done, nor one below the watermark
    assert named <= done
    assert all(o >= wm for o in named)
    # and when it fits (nothing truncated), it names every done offset above the watermark
    if text and fin is not None and fin.end > max(done | {wm}):
        assert named == {o for o in done if o > wm}
    if max_bytes == 4096 and len(received) <= 200:
        assert named == {o for o in done if o > wm}
    # and metadata read against another committed offset, or not ours, or garbled, names nothing
    assert FinishedOffsets.decode(wm + 1, text) is None
    assert FinishedOffsets.decode(wm, "some other tool's metadata") is None
    assert FinishedOffsets.decode(wm, METADATA_PREFIX + "!!not base64!!") is None
    assert FinishedOffsets.decode(wm, METADATA_PREFIX + "eJwDAAAAAAE") is None  # zlib of b"": no runs


def test_no_metadata_when_nothing_above_the_watermark_is_done() -> None:
    t = OffsetTracker()
    for o in range(5):
        t.add(o)
    t.done(0)
    t.done(1)
    assert encode_finished(t, 4096) == ""
    t.done(3)
    assert encode_finished(t, 0) == ""
    fin = FinishedOffsets.decode(2, encode_finished(t, 4096))
    assert fin is not None and [o for o in range(6) if fin.covers(o)] == [3] and fin.end == 4


@given(
    prev_done=st.lists(st.booleans(), min_size=60, max_size=60),
    received=st.integers(min_value=0, max_value=60),
    now_done=st.lists(st.booleans(), min_size=60, max_size=60),
)
def test_a_new_owner_names_what_its_predecessor_finished_until_it_received_it(
    prev_done: list[bool], received: int, now_done: list[bool]
) -> None:
    # given the metadata of a previous owner, committed at 100, naming some of 101..159 finished
    prev = OffsetTracker()
    for o in range(100, 160):
        prev.add(o)
    for o in range(101, 160):
        if prev_done[o - 100]:
            prev.done(o)
    inherited = FinishedOffsets.decode(100, encode_finished(prev, 4096))
    named_before = {o for o in range(100, 160) if inherited is not None and inherited.covers(o)}
    # when the new owner has received 100..100+received, skipping what was named and running some of the rest
    t = OffsetTracker()
    for o in range(100, 100 + received):
        t.add(o)
        if o in named_before or now_done[o - 100]:
            t.done(o)
    wm = t.watermark()
    if wm is None or inherited is None:
        return
    # then its metadata names every inherited offset it has not received yet, and nothing unfinished
    fin = FinishedOffsets.decode(wm, encode_finished(t, 4096, inherited))
    named = {o for o in range(100, 200) if fin is not None and fin.covers(o)}
    assert {o for o in named_before if o >= 100 + received} <= named
    finished_here = {o for o in range(100, 100 + received) if o in named_before or now_done[o - 100]}
    assert named <= finished_here | {o for o in named_before if o >= 100 + received}
    assert all(o >= wm for o in named)
