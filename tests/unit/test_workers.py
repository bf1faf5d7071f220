"""The owner's mailbox and the worker pools' hand-over (keyedconsumer.engine.workers), with real
threads: what a quiet post, a ring and the owner's hurry promise, and that a unit handed over is
run by one worker or taken back by the owner, never both and never neither."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from keyedconsumer.engine.handout import RESERVE_MAX, WINDOW_S, HandOut
from keyedconsumer.engine.workers import AsyncWorkers, Mailbox, Slot, ThreadWorkers, Workers, low_water

pytestmark = pytest.mark.timeout(60)


def test_a_quiet_post_does_not_end_the_owners_wait_and_a_ring_does() -> None:
    box = Mailbox()
    got: list[int] = []
    box.post_quiet(got.append, 1)
    assert not box  # no ring: the owner is not asked back
    t0 = time.monotonic()
    assert box.wait(0.2) == 1  # waited out the time-out, then ran the quiet post
    assert time.monotonic() - t0 >= 0.19
    assert got == [1]

    threading.Timer(0.05, lambda: (box.post_quiet(got.append, 2), box.ring())).start()
    t0 = time.monotonic()
    assert box.wait(5.0) == 1
    assert time.monotonic() - t0 < 4.0  # the ring ended the wait
    assert got == [1, 2]


def test_a_post_rings_and_posts_run_in_the_order_posted() -> None:
    box = Mailbox()
    got: list[int] = []
    box.post_quiet(got.append, 1)
    box.post(got.append, 2)
    box.post_quiet(got.append, 3)
    assert box  # the plain post rang
    assert box.wait(5.0) == 3
    assert got == [1, 2, 3]
    assert not box  # the drain answered the ring


def test_while_the_owner_hurries_pending_quiet_posts_are_not_waited_on() -> None:
    box = Mailbox()
    got: list[int] = []
    box.hurry(True)
    box.post_quiet(got.append, 1)
    t0 = time.monotonic()
    assert box.wait(5.0) == 1
    assert time.monotonic() - t0 < 4.0
    box.hurry(False)
    assert not box.eager


def _pool(concurrency: int, gate: threading.Event, ran: list[int]) -> tuple[ThreadWorkers, Mailbox, list]:
    """A pool whose units wait at ``gate``, then record their items in ``ran``."""
    box = Mailbox()
    reports: list = []

    def run(slot: Slot, unit: list) -> tuple[list, float]:
        gate.wait(10)
        ran.extend(unit)
        return [], 0.0

    return ThreadWorkers(run, box, reports.append, concurrency), box, reports


def test_every_unit_is_run_by_one_worker_or_taken_back_never_both() -> None:
    gate, ran = threading.Event(), []
    workers, box, reports = _pool(4, gate, ran)
    workers.start()
    workers.submit([[i] for i in range(40)])  # 4 start (and wait at the gate), 36 stay queued
    deadline = time.monotonic() + 10
    while len(workers._units) > 36 and time.monotonic() < deadline:  # the 4 workers took theirs
        time.sleep(0.01)
    back = workers.take_queued()
    gate.set()
    workers.close()
    workers.join(10)
    box.drain()
    taken_back = [u[0] for u in back]
    assert len(taken_back) == 36
    assert sorted(ran + taken_back) == list(range(40))  # each unit exactly once, run or taken back
    assert not set(ran) & set(taken_back)
    assert len(reports) == 4  # one report a unit run
    assert not any(t.is_alive() for t in workers._threads)  # close still ends every thread


class _CountingMailbox(Mailbox):
    def __init__(self) -> None:
        super().__init__()
        self.rings = 0

    def ring(self) -> None:
        self.rings += 1
        super().ring()


def test_a_worker_rings_only_when_the_queued_units_run_low() -> None:
    """16 workers, 32 units queued before they start: a worker's first end finds at least 16 units
    still queued (each worker holds one unit at a time), so it does not wake the owner; the ends
    of the last 5 units taken find at most ``low_water(16)`` = 4 queued, so they do."""
    box = _CountingMailbox()
    reports: list = []
    ran: list[int] = []

    def run(slot: Slot, unit: list) -> tuple[list, float]:
        ran.extend(unit)
        return [], 0.0

    workers = ThreadWorkers(run, box, reports.append, 16)
    workers.submit([[i] for i in range(32)])
    workers.start()
    deadline = time.monotonic() + 10
    while len(reports) < 32 and time.monotonic() < deadline:
        box.wait(0.05)
    workers.close()
    workers.join(10)
    assert sorted(ran) == list(range(32))
    assert len(reports) == 32
    assert low_water(16) + 1 <= box.rings < 32


def test_async_workers_hand_back_units_no_worker_took() -> None:
    box = Mailbox()
    reports: list = []
    ran: list[int] = []
    release = threading.Event()

    async def run(slot: Slot, unit: list) -> tuple[list, float]:
        while not release.is_set():
            await asyncio.sleep(0.01)
        ran.extend(unit)
        return [], 0.0

    workers = AsyncWorkers(run, box, reports.append, 2, event_loop="asyncio")
    workers.start()
    workers.submit([[i] for i in range(10)])
    deadline = time.monotonic() + 10
    back: list = []
    while len(back) < 8 and time.monotonic() < deadline:  # the feed reaches the loop soon
        back += workers.take_queued()
        time.sleep(0.01)
    release.set()
    workers.close()
    workers.join(10)
    taken_back = [u[0] for u in back]
    assert len(taken_back) == 8
    assert sorted(ran + taken_back) == list(range(10))


@pytest.mark.parametrize("kind", ["threads", "async"])
def test_a_worker_that_finds_no_unit_to_take_rings_for_its_quiet_outcomes(kind: str) -> None:
    """Whatever the queue's length said when a worker posted quietly, it rings before it waits for
    work: else the owner would hear of those outcomes only at its wait's time-out. The low-water
    mark is set below zero so that every post is quiet: only that ring can end the owner's wait."""
    box = Mailbox()
    reports: list = []

    def run(slot: Slot, unit: list) -> tuple[list, float]:
        return [], 0.0

    async def arun(slot: Slot, unit: list) -> tuple[list, float]:
        return [], 0.0

    workers = (
        ThreadWorkers(run, box, reports.append, 2)
        if kind == "threads"
        else AsyncWorkers(arun, box, reports.append, 2, event_loop="asyncio")
    )
    workers._low = -1
    workers.start()
    try:
        for n in (3, 1, 2):
            before = len(reports)
            workers.submit([[i] for i in range(n)])
            t0 = time.monotonic()
            while len(reports) < before + n:
                box.wait(30.0)  # may return 0: a ring answered by an earlier drain wakes it once more
            assert time.monotonic() - t0 < 20.0  # rings ended the waits, not their 30 s time-out
    finally:
        workers.close()
        workers.join(10)


class _Pool(Workers):
    """A pool that only records the reserve the owner sets."""

    def __init__(self, concurrency: int) -> None:
        self.concurrency = concurrency
        self.slots = []
        self._low = low_water(concurrency)
        self.reserves: list[int] = []

    def set_reserve(self, units: int) -> None:
        super().set_reserve(units)
        self.reserves.append(units)


def _windows(handout: HandOut, windows: int, units_per_window: int, answer_s: float, t: float) -> float:
    """Play ``windows`` windows of the owner's turns: ``units_per_window`` units reported in each,
    every ring answered after ``answer_s`` seconds; returns the clock after them."""
    for _ in range(windows):
        for _ in range(units_per_window):
            handout.report(([], 0.0))
        t += WINDOW_S
        handout.turn(answer_s, t)
    return t


def test_the_reserve_follows_the_owners_answer_to_a_ring_within_its_bounds() -> None:
    pool = _Pool(256)
    handout = HandOut(None, pool)  # type: ignore[arg-type]  # turn and report need no engine
    handout.turn(0.0, 1.0)  # the first turn opens the first window
    # 20,000 units a second (2,000 a window), rings answered within 1 ms: 4 x 20,000 x 0.001 = 80
    # units would last, under the floor of one unit a worker: nothing changes
    t = _windows(handout, 5, 2_000, 0.001, 1.0)
    assert pool.reserves == [] and pool._low == 64
    # answers of 10 ms (the owner waiting for the GIL beside 256 threads): the reserve grows to
    # 4 x 20,000 x 0.010 = 800 units, capped at RESERVE_MAX x 256 = 768; the ring comes at a quarter
    t = _windows(handout, 10, 2_000, 0.010, t)
    assert pool.reserves[0] > 256 and pool.reserves == sorted(pool.reserves)
    assert pool.reserves[-1] == RESERVE_MAX * 256 and pool._low == 192
    # prompt answers again: back to one unit a worker
    _windows(handout, 10, 2_000, 0.0, t)
    assert pool.reserves[-1] == 256 and pool._low == 64


def test_the_mailbox_tells_how_long_the_owner_took_to_answer_a_ring() -> None:
    box = Mailbox()
    got: list[int] = []
    box.post_quiet(got.append, 1)
    box.drain()
    assert got == [1] and box.answered() == 0.0  # no ring came
    box.ring()
    time.sleep(0.02)
    box.ring()  # a second ring before the drain: the answer counts from the first
    box.drain()
    assert box.answered() >= 0.02
    assert box.answered() == 0.0  # told once
