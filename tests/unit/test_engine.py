"""The engine never runs two messages of one lane together, starts each lane in offset order,
and never reports an offset past an unfinished message, across revokes and re-assignments."""

from __future__ import annotations

import random

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from keyedconsumer.engine.delivery import NULL_KEY, Delivery
from keyedconsumer.engine.engine import Engine
from keyedconsumer.engine.outcome import DONE, NOT_STARTED, Outcome, Retry
from keyedconsumer.engine.partitions import ACTIVE
from keyedconsumer.engine.workers import Slot
from keyedconsumer.message import Message


def outcome(ok: bool | float) -> Outcome:
    """The engine outcome of the tests' shorthand: True done, False not started, a float a retry."""
    if ok is True:
        return DONE
    if ok is False:
        return NOT_STARTED
    return Retry(float(ok))


def take(d: Engine) -> list[Delivery]:
    """The next chunk of ready heads (empty when none is ready)."""
    chunks = d.take(1)
    return chunks[0] if chunks else []


def finish(d: Engine, dl: Delivery, outcome: Outcome) -> None:
    d.finish([(dl, outcome)])


def ready(d: Engine) -> list[Message]:
    return [x.msg for x in d.queue.ready_heads()]


TPS = [("t", 0), ("t", 1)]
KEYS = [b"a", b"b", b"c", None, b""]


class DispatchMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.d = Engine("key")
        self.d.assign(TPS)
        self.next_offset = {tp: 0 for tp in TPS}
        self.running: list[Delivery] = []
        self.started: dict[tuple[str, int, object], list[int]] = {}
        self.finished: dict[tuple[str, int], set[int]] = {tp: set() for tp in TPS}
        self.received: dict[tuple[str, int], list[int]] = {tp: [] for tp in TPS}
        self.retried: list[Delivery] = []

    @rule(tp=st.sampled_from(TPS), keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=5))
    def poll(self, tp: tuple[str, int], keys: list[bytes | None]) -> None:
        msgs = []
        for key in keys:
            off = self.next_offset[tp]
            self.next_offset[tp] = off + 1
            msgs.append(Message(tp[0], tp[1], off, key, b"v"))
            if tp in self.d.partitions.by_tp:
                self.received[tp].append(off)
        self.d.admit(msgs)

    @precondition(lambda self: len(self.d.queue) > 0)
    @rule()
    def take(self) -> None:
        for dl in take(self.d):
            self.start(dl)

    def start(self, dl: Delivery) -> None:
        """A worker starts a taken message (or ends it at once when it may not start)."""
        if not self.d.may_start(dl):
            finish(self.d, dl, NOT_STARTED)
            return
        msg = dl.msg
        lane = (msg.topic, msg.partition, msg.key)
        assert all((r.msg.topic, r.msg.partition, r.msg.key) != lane for r in self.running), "same key twice"
        self.started.setdefault(lane, []).append(msg.offset)
        self.running.append(dl)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), ok=st.sampled_from([True, False, 0.0]))
    def finish(self, data: st.DataObject, ok: bool | float) -> None:
        # True: done; False: not done (not started); 0.0: RetryLater(0) -> delayed
        dl = data.draw(st.sampled_from(self.running))
        msg = dl.msg
        self.running.remove(dl)
        active = dl.part is not None and dl.part.state == ACTIVE
        finish(self.d, dl, outcome(ok))
        if ok is True and active:
            self.finished[(msg.topic, msg.partition)].add(msg.offset)
        if type(ok) is float and active:
            self.retried.append(dl)

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
        for dl in self.d.queue.delayed():
            assert dl.part is not None and dl.lane in dl.part.lanes  # its key waits behind it
            m = dl.msg
            assert all((r.msg.partition, r.msg.key) != (m.partition, m.key) for r in self.running)

    @invariant()
    def watermark_never_passes_unfinished(self) -> None:
        for tp in TPS:
            part = self.d.partitions.by_tp.get(tp)
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
        assert self.d.in_flight >= self.d.running


DispatchMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=80, deadline=None)
test_dispatch_machine = DispatchMachine.TestCase


def test_halt_starts_nothing_new() -> None:
    d = Engine("key")
    d.assign([("t", 0)])
    d.admit([Message("t", 0, i, b"k%d" % (i % 2), b"") for i in range(6)])
    first = take(d)
    d.halt()
    assert not d.queue and all(not d.may_start(m) for m in first)
    for m in first:
        finish(d, m, DONE)  # halted: no next message is made ready
    assert d.in_flight == 0 and not d.queue


def test_ordering_none_and_partition() -> None:
    d = Engine("none")
    d.assign([("t", 0)])
    d.admit([Message("t", 0, i, b"same", b"") for i in range(4)])
    assert len(d.queue) == 4  # no sequencing at all
    d = Engine("partition")
    d.assign([("t", 0)])
    d.admit([Message("t", 0, i, b"k%d" % i, b"") for i in range(4)])
    assert len(d.queue) == 1  # one at a time per partition


def test_retry_later_keeps_the_lane_and_the_offset() -> None:
    # given two messages of key a and one of key b
    d = Engine("key")
    d.assign([("t", 0)])
    a0, a1, b2 = Message("t", 0, 0, b"a"), Message("t", 0, 1, b"a"), Message("t", 0, 2, b"b")
    d.admit([a0, a1, b2])
    taken = take(d) + take(d)
    assert [x.msg for x in taken] == [a0, b2]
    # when a0 asks to be retried later while b2 succeeds
    finish(d, taken[0], Retry(5.0))
    finish(d, taken[1], DONE)
    # then a1 waits behind a0, the offset stays at a0, and a0's attempt grew
    assert not d.queue and a0.attempt == 2 and d.partitions.by_tp[("t", 0)].tracker.watermark() == 0
    assert d.release_due(0.0) is not None and not d.queue  # not due yet
    d.release_due(float("inf"))
    assert ready(d) == [a0]
    again = take(d)
    finish(d, again[0], Retry(5.0))
    parts = d.begin_revoke([("t", 0)])
    d.close_parts(parts)
    assert not d.queue.delayed() and d.in_flight == 0 and d.running == 0


class _NoRedis:
    def totals(self) -> tuple[int, int]:
        return 0, 0


def _leased_engine() -> tuple[Engine, object]:
    """An engine with a Redis sequencer whose lease table is used, and no Redis behind it."""
    from keyedconsumer.sequencing import RedisSequencer
    from keyedconsumer.sequencing.leases import LeaseTable
    from keyedconsumer.sequencing.parking import Parker

    seq = RedisSequencer("redis://127.0.0.1:1/0", "t", lease_ttl_s=3.0)
    d = Engine("key", seq)
    seq._port = d.port
    seq._leases = LeaseTable(ttl_s=3.0)
    seq.parker = Parker(
        d.port,
        seq._leases,
        _NoRedis(),
        seq._route,
        max_parked_per_key=10,  # type: ignore[arg-type]
        max_parked_bytes_per_key=1 << 20,
        max_parked_total=100,
        max_parked_bytes_total=1 << 20,
        seen_retention_s=60.0,
        quarantine_on_dead_letter=False,
        max_drains=4,
    )
    d.assign([("t", 0)])
    return d, seq


def _grant(d: Engine, seq: object, lid: str, token: int = 1) -> None:
    import time

    leases = seq._leases  # type: ignore[attr-defined]
    ((wanted, owner),) = [a for a in leases.to_acquire(time.monotonic()) if a[0] == lid]
    head = leases.acquired(wanted, owner, token, time.monotonic(), time.monotonic())
    if head is not None:
        dl = seq._route(head)  # type: ignore[attr-defined]
        if dl is not None:
            d.port.make_ready(dl)


def _lid(d: Engine, msg: Message) -> str:
    lid = d.seq.lane_id(msg.topic, msg.partition, msg.key if msg.key is not None else NULL_KEY)
    assert lid is not None
    return lid


def test_a_message_not_started_under_a_briefly_invalid_lease_stays_its_lanes_head() -> None:
    # given key a's messages 0 and 1, its lease held, message 0 taken by a worker
    d, seq = _leased_engine()
    a0, a1 = Message("t", 0, 0, b"a"), Message("t", 0, 1, b"a")
    d.admit([a0, a1])
    _grant(d, seq, _lid(d, a0))
    (taken,) = take(d)
    assert taken.msg is a0
    # when the worker did not start it (its lease was not confirmed in time: a late renewal) and
    # the lease is valid again when it reports so
    finish(d, taken, NOT_STARTED)
    # then a0 is ready again, first, and a1 still waits behind it: the lane did not go on without it
    assert ready(d) == [a0]
    assert [x.msg for x in d.partitions.by_tp[("t", 0)].lanes.get(b"a")] == [a1]
    assert d.partitions.by_tp[("t", 0)].tracker.watermark() == 0 and d.in_flight == 2


def test_a_head_waiting_to_be_parked_whose_lease_was_lost_waits_for_the_lease_again() -> None:
    # given key a's head waiting to be parked under its lease
    d, seq = _leased_engine()
    a0, a1 = Message("t", 0, 0, b"a"), Message("t", 0, 1, b"a")
    d.admit([a0, a1])
    lid = _lid(d, a0)
    _grant(d, seq, lid)
    leases = seq._leases  # type: ignore[attr-defined]
    (head,) = d.queue.remove(lambda x: True)
    seq.parker.park(head, 0.5)  # type: ignore[attr-defined]
    lease = leases.by_id[lid]
    # when the lease is lost before the park is sent
    leases.lose(lease)
    seq.parker.park_pending()  # type: ignore[attr-defined]
    # then the head waits, first in line, for the lease; once granted again it goes on
    assert [x.msg for x in lease.waiting] == [a0] and lid in leases.want and lease.active is None
    _grant(d, seq, lid, token=2)
    assert ready(d) == [a0] and a0.fencing_token == 2


def test_a_head_not_started_during_a_revoke_catch_up_waits_and_its_lane_does_not_go_on_without_it() -> None:
    # given key k at offsets 1 and 2 and key y at offset 3, all of one partition being revoked
    d = Engine("key")
    d.assign([("t", 0)])
    k1, k2, y3 = Message("t", 0, 1, b"k"), Message("t", 0, 2, b"k"), Message("t", 0, 3, b"y")
    d.admit([k1, k2, y3])
    part = d.partitions.by_tp[("t", 0)]
    d.catch_up([part])  # on_revoke: only messages below the highest finished offset start
    taken = take(d) + take(d)
    assert [x.msg for x in taken] == [k1, y3]
    dk1, dy3 = taken
    # when k1 may not start yet (nothing finished above it) and its worker reports it not started
    assert not d.may_start(dk1)
    finish(d, dk1, NOT_STARTED)
    # then k2 is not made ready in its place: k1 waits, still its lane's head
    assert (
        not d.queue
        and [x.msg for x in d.queue.held()] == [k1]
        and [x.msg for x in part.lanes.get(b"k")] == [k2]
    )
    # when y3 finishes (the highest finished offset is now above k1), k1 may run, and only then k2
    finish(d, dy3, DONE)
    d.release_held()
    assert ready(d) == [k1] and d.may_start(dk1)
    (again,) = take(d)
    finish(d, again, DONE)
    assert ready(d) == [k2] and part.tracker.watermark() == 2
    (nxt,) = take(d)
    # and a revoke drops what is still held, forgetting it (nothing is left buffered)
    finish(d, nxt, NOT_STARTED)
    parts = d.begin_revoke([("t", 0)])
    d.close_parts(parts)
    assert d.queue.held() == [] and d.in_flight == 0


def test_one_worker_runs_a_partition_in_offset_order() -> None:
    """With one worker, messages start in offset order even when a lane's next message becomes
    ready after later offsets of other keys (a FIFO of ready heads would run b@1, c@3 before a@2,
    so a@2 would finish after c@3 and hold the committed offset back), and when the worker gets
    chunks of many (fast handlers): a chunk ends before a message younger than one queued behind
    its heads."""
    rng = random.Random(3)
    for keys in (
        [b"a", b"b", b"a", b"c", b"b", b"a", b"d", b"c"],
        [b"k%d" % rng.randrange(40) for _ in range(3000)],
    ):
        d = Engine("key")
        d.assign([("t", 0)])
        d.admit([Message("t", 0, off, key, b"v") for off, key in enumerate(keys)])
        order: list[int] = []
        while d.queue:
            (chunk,) = d.take(1)  # one unit at a time for one worker (HandOut)
            results = []
            for dl in chunk:
                assert d.may_start(dl)
                order.append(dl.offset)
                results.append((dl, DONE))
            d.finish(results, 1e-7 * len(results))
        assert order == list(range(len(keys)))
        assert d.partitions.commit_offsets(d.partitions.active())[0] == [("t", 0, len(keys))]


def test_short_of_room_for_a_poll_near_the_bound() -> None:
    """Short of room for a poll's batch (``max_in_flight`` 10, batch 4: 8 in flight leaves room
    for 2), the owner waits for outcomes rather than poll a few records and pause; with nothing in
    flight a small bound never waits."""
    d = Engine("key", max_in_flight=10)
    d.assign([("t", 0)])
    d.admit([Message("t", 0, off, b"k%d" % off, b"v") for off in range(8)])
    assert d.flow.short_of_room(4)
    chunk = take(d) + take(d)
    d.finish([(x, DONE) for x in chunk[:2]], 0.0)  # two ending leave 6 in flight: room for 4
    assert not d.flow.short_of_room(4)
    empty = Engine("key", max_in_flight=2)
    assert not empty.flow.short_of_room(500)


def _run_unit(
    slot: Slot, unit: list[Delivery], fail: set[int], order: list[int]
) -> list[tuple[Delivery, Outcome]]:
    """A worker's run of one unit through its slot: offsets in ``fail`` end in a retry."""
    slot.load(unit)
    done: tuple[Delivery, Outcome] | None = None
    while (dl := slot.next(done)) is not None:
        order.append(dl.offset)
        done = (dl, Retry(0.0) if dl.offset in fail else DONE)
        fail.discard(dl.offset)
    return slot.unload()


def test_a_hot_lane_runs_a_chunk_per_hand_over_and_stops_at_a_failure() -> None:
    """``ordering="partition"`` (one lane): with fast handlers one unit carries the lane's run, not
    one message per turn of the owner; a retry in the middle stops the run there, and the rest
    runs after the retry, in offset order, each offset done once."""
    d = Engine("partition")
    d.assign([("t", 0)])
    d.admit([Message("t", 0, off, b"k%d" % off, b"v") for off in range(600)])
    slot, order, units = Slot(), [], 0
    fail = {5, 300}
    d.finish([], 0.0)
    while d.queue or d.next_due_s() is not None:
        d.release_due(float("inf"))
        (unit,) = d.take(1)
        units += 1
        results = _run_unit(slot, unit, fail, order)
        d.finish(results, 1e-7 * len(results))  # fast handlers: the chunk grows to MAX_CHUNK
        assert d.running == 0
    # then every offset ran in order (5 and 300 twice: their retries), in few units
    assert order == sorted(order) and sorted(set(order)) == list(range(600))
    assert [o for o in order if order.count(o) > 1] == [5, 5, 300, 300]
    assert units < 100, units  # 56 (the chunk grows with the handlers' average); one per message: 602
    assert d.partitions.commit_offsets(d.partitions.active())[0] == [("t", 0, 600)]


def test_a_run_taken_back_from_a_stuck_worker_goes_back_to_its_lane() -> None:
    """A worker stuck in a lane's head: the messages taken along behind it go back to the lane
    (not to other workers: that would run the key's later messages beside it), and run after it."""
    d = Engine("key")
    d.assign([("t", 0)])
    d.admit([Message("t", 0, off, b"hot", b"v") for off in range(4)])
    d.finish([], 0.0)
    d._chunk = 4  # as fast handlers make it
    (unit,) = d.take(1)
    assert [x.offset for x in unit] == [0, 1, 2, 3]
    slot = Slot()
    slot.load(unit)
    head = slot.next(None)  # offset 0 starts and gets stuck
    assert head is not None and head.offset == 0
    rest, results = slot.take_back(True, 0.0)
    d.give_back(reversed(rest))
    d.finish(results)
    assert not d.queue and d.running == 1  # nothing of the key is ready while 0 runs
    d.finish([(head, DONE)])
    assert [x.offset for x in d.queue.ready_heads()] == [1]
