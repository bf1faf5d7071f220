"""The dispatcher never runs two messages of one lane together, starts each lane in offset order,
and never reports an offset past an unfinished message, across revokes and re-assignments."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from keyedconsumer.dispatch import ACTIVE, Dispatcher
from keyedconsumer.message import Message

TPS = [("t", 0), ("t", 1)]
KEYS = [b"a", b"b", b"c", None, b""]


class DispatchMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.d = Dispatcher("key", concurrency=2)
        self.d.assign(TPS)
        self.next_offset = {tp: 0 for tp in TPS}
        self.running: list[Message] = []
        self.started: dict[tuple[str, int, object], list[int]] = {}
        self.finished: dict[tuple[str, int], set[int]] = {tp: set() for tp in TPS}
        self.received: dict[tuple[str, int], list[int]] = {tp: [] for tp in TPS}
        self.retried: list[Message] = []

    @rule(tp=st.sampled_from(TPS), keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=5))
    def poll(self, tp: tuple[str, int], keys: list[bytes | None]) -> None:
        msgs = []
        for key in keys:
            off = self.next_offset[tp]
            self.next_offset[tp] = off + 1
            msgs.append(Message(tp[0], tp[1], off, key, b"v"))
            if tp in self.d.parts:
                self.received[tp].append(off)
        self.d.admit(msgs)

    @precondition(lambda self: self.d.ready)
    @rule()
    def take(self) -> None:
        with self.d.lock:
            chunk = self.d.take_locked()
        for msg in chunk:
            self.start(msg)

    def start(self, msg: Message) -> None:
        """A worker starts a taken message (or ends it at once when it may not start)."""
        while not self.d.may_start(msg):
            nxt = self.d.finish(msg, False)
            if nxt is None:
                return
            msg = nxt
        lane = (msg.topic, msg.partition, msg.key)
        assert all((m.topic, m.partition, m.key) != lane for m in self.running), "same key twice"
        self.started.setdefault(lane, []).append(msg.offset)
        self.running.append(msg)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), ok=st.sampled_from([True, False, 0.0]))
    def finish(self, data: st.DataObject, ok: bool | float) -> None:
        # True: done; False: not done (failed, unhandled); 0.0: RetryLater(0) -> delayed
        msg = data.draw(st.sampled_from(self.running))
        self.running.remove(msg)
        active = msg._part.state == ACTIVE
        nxt = self.d.finish(msg, ok)
        if ok is True and active:
            self.finished[(msg.topic, msg.partition)].add(msg.offset)
        if type(ok) is float and active:
            self.retried.append(msg)
        if nxt is not None:  # the worker keeps the lane and runs its next message itself
            assert nxt.key == msg.key and nxt.partition == msg.partition and nxt.offset > msg.offset
            self.start(nxt)

    @rule()
    def release_due(self) -> None:
        self.d.release_due(float("inf"))

    @rule(tp=st.sampled_from(TPS))
    def revoke_and_reassign(self, tp: tuple[str, int]) -> None:
        parts = self.d.begin_revoke([tp])
        self.d.close_parts(parts)
        self.d.assign([tp])
        self.received[tp] = []
        self.finished[tp] = set()

    @invariant()
    def each_lane_starts_in_offset_order(self) -> None:
        for offsets in self.started.values():
            # a lane's offsets never go back; a retried message starts again at the same offset
            assert offsets == sorted(offsets)

    @invariant()
    def a_delayed_message_holds_its_lane(self) -> None:
        for _, _, m in self.d.delayed:
            assert m._lanes is not None and m.key in m._lanes  # its key waits behind it
            assert all((r.partition, r.key) != (m.partition, m.key) for r in self.running)

    @invariant()
    def watermark_never_passes_unfinished(self) -> None:
        for tp in TPS:
            part = self.d.parts.get(tp)
            if part is None or not self.received[tp]:
                continue
            wm = part.tracker.watermark()
            unfinished = [o for o in self.received[tp] if o not in self.finished[tp]]
            if unfinished:
                assert wm == min(unfinished)
            else:
                assert wm == self.received[tp][-1] + 1

    @invariant()
    def accounting(self) -> None:
        assert self.d.running == len(self.running)
        assert self.d.buffered >= self.d.running


DispatchMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=80, deadline=None)
test_dispatch_machine = DispatchMachine.TestCase


def test_halt_starts_nothing_new() -> None:
    d = Dispatcher("key", 4)
    d.assign([("t", 0)])
    d.admit([Message("t", 0, i, b"k%d" % (i % 2), b"") for i in range(6)])
    with d.lock:
        first = d.take_locked()
    d.halt()
    assert not d.ready and all(not d.may_start(m) for m in first)
    for m in first:
        assert d.finish(m, True) is None  # halted: no next message is handed out
    assert d.buffered == 0 and not d.ready


def test_ordering_none_and_partition() -> None:
    d = Dispatcher("none", 4)
    d.assign([("t", 0)])
    d.admit([Message("t", 0, i, b"same", b"") for i in range(4)])
    assert len(d.ready) == 4  # no sequencing at all
    d = Dispatcher("partition", 4)
    d.assign([("t", 0)])
    d.admit([Message("t", 0, i, b"k%d" % i, b"") for i in range(4)])
    assert len(d.ready) == 1  # one at a time per partition


def test_retry_later_keeps_the_lane_and_the_offset() -> None:
    # given two messages of key a and one of key b
    d = Dispatcher("key", 2)
    d.assign([("t", 0)])
    a0, a1, b2 = Message("t", 0, 0, b"a"), Message("t", 0, 1, b"a"), Message("t", 0, 2, b"b")
    d.admit([a0, a1, b2])
    with d.lock:
        taken = d.take_locked() + d.take_locked()
    assert taken == [a0, b2]
    # when a0 asks to be retried later while b2 succeeds
    assert d.finish(a0, 5.0) is None
    d.finish(b2, True)
    # then a1 waits behind a0, the offset stays at a0, and a0's attempt grew
    assert not d.ready and a0.attempt == 2 and d.parts[("t", 0)].tracker.watermark() == 0
    assert d.release_due(0.0) is not None and not d.ready  # not due yet
    d.release_due(float("inf"))
    assert list(d.ready) == [a0]
    with d.lock:
        again = d.take_locked()
    d.finish(again[0], 5.0)
    parts = d.begin_revoke([("t", 0)])
    d.close_parts(parts)
    assert not d.delayed and d.buffered == 0 and d.running == 0


def _leased_dispatcher() -> Dispatcher:
    from keyedconsumer.sequencing.leases import LeaseTable

    d = Dispatcher("key", 2)
    d.leases = LeaseTable(ttl_s=3.0)
    d.assign([("t", 0)])
    return d


def _grant(d: Dispatcher, lid: str, token: int = 1) -> None:
    import time

    assert d.leases is not None
    with d.lock:
        ((wanted, owner),) = [a for a in d.leases.to_acquire(time.monotonic()) if a[0] == lid]
        head = d.leases.acquired(wanted, owner, token, time.monotonic(), time.monotonic())
        if head is not None:
            d.route(head)


def test_a_message_not_started_under_a_briefly_invalid_lease_stays_its_lanes_head() -> None:
    # given key a's messages 0 and 1, its lease held, message 0 taken by a worker
    d = _leased_dispatcher()
    a0, a1 = Message("t", 0, 0, b"a"), Message("t", 0, 1, b"a")
    d.admit([a0, a1])
    _grant(d, d.lid(a0))
    with d.lock:
        (taken,) = d.take_locked()
    assert taken is a0
    # when the worker did not start it (its lease was not confirmed in time: a late renewal) and
    # the lease is valid again when it reports so
    assert d.finish(a0, False) is None
    # then a0 is ready again, first, and a1 still waits behind it: the lane did not go on without it
    assert list(d.ready) == [a0]
    assert list(d.parts[("t", 0)].lanes[b"a"] or []) == [a1]
    assert d.parts[("t", 0)].tracker.watermark() == 0 and d.buffered == 2


def test_a_head_waiting_to_be_parked_whose_lease_was_lost_waits_for_the_lease_again() -> None:
    from keyedconsumer.sequencing.parking import Parker

    class NoRedis:
        def totals(self) -> tuple[int, int]:
            return 0, 0

    # given key a's head waiting to be parked under its lease
    d = _leased_dispatcher()
    d.parking = True
    a0, a1 = Message("t", 0, 0, b"a"), Message("t", 0, 1, b"a")
    d.admit([a0, a1])
    lid = d.lid(a0)
    _grant(d, lid)
    with d.lock:
        d.ready.clear()
        d.to_park.append((a0, 0.5))
        assert d.leases is not None
        lease = d.leases.by_id[lid]
        # when the lease is lost before the park is sent
        d.leases.lose(lease)
    parker = Parker(d, NoRedis(), max_parked_per_key=10, max_parked_bytes_per_key=1 << 20, max_parked_total=100,
                    max_parked_bytes_total=1 << 20, seen_retention_s=60.0, quarantine_on_dead_letter=False, max_drains=4)
    parker.park_pending()
    # then the head waits, first in line, for the lease; once granted again it goes on
    assert list(lease.waiting) == [a0] and lid in d.leases.want and lease.active is None
    _grant(d, lid, token=2)
    assert list(d.ready) == [a0] and a0.fencing_token == 2


def test_a_head_not_started_during_a_revoke_catch_up_waits_and_its_lane_does_not_go_on_without_it() -> None:
    # given key k at offsets 1 and 2 and key y at offset 3, all of one partition being revoked
    d = Dispatcher("key", 4)
    d.assign([("t", 0)])
    k1, k2, y3 = Message("t", 0, 1, b"k"), Message("t", 0, 2, b"k"), Message("t", 0, 3, b"y")
    d.admit([k1, k2, y3])
    part = d.parts[("t", 0)]
    part.catching_up = True  # on_revoke: only messages below the highest finished offset start
    with d.lock:
        taken = d.take_locked() + d.take_locked()
    assert taken == [k1, y3]
    # when k1 may not start yet (nothing finished above it) and its worker reports it not started
    assert not d.may_start(k1)
    assert d.finish(k1, False) is None
    # then k2 is not made ready in its place: k1 waits, still its lane's head
    assert not d.ready and d.held == [k1] and list(part.lanes[b"k"] or []) == [k2]
    # when y3 finishes (the highest finished offset is now above k1), k1 may run, and only then k2
    d.finish(y3, True)
    d.release_held()
    assert list(d.ready) == [k1] and d.may_start(k1)
    with d.lock:
        (again,) = d.take_locked()
    nxt = d.finish(again, True)
    assert nxt is k2 and part.tracker.watermark() == 2
    # and a revoke drops what is still held, forgetting it (nothing is left buffered)
    d.finish(k2, False)
    parts = d.begin_revoke([("t", 0)])
    d.close_parts(parts)
    assert d.held == [] and d.buffered == 0
