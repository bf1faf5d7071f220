"""Health: liveness, readiness and stall detection with a fake consumer and a fake clock."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import pytest

from keyedconsumer import PartitionStatus
from keyedconsumer.health import Health

pytestmark = [pytest.mark.timeout(30)]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeConsumer:
    polled_at_s: float = 0.0
    assignment: list[tuple[str, int]] = field(default_factory=list)
    statuses: dict[tuple[str, int], PartitionStatus] = field(default_factory=dict)

    def partition_status(self) -> list[PartitionStatus]:
        return list(self.statuses.values())

    def set(self, partition: int, stored: int | None, end: int | None, unfinished: int = 0) -> None:
        lag = None if end is None else end - (stored or 0)
        self.statuses[("t", partition)] = PartitionStatus(
            "t", partition, stored, stored, unfinished, 0.0, end, lag
        )
        if ("t", partition) not in self.assignment:
            self.assignment.append(("t", partition))


@pytest.fixture
def setup() -> tuple[FakeConsumer, Clock, Health]:
    consumer, clock = FakeConsumer(), Clock()
    return consumer, clock, Health(consumer, stall_after_s=10.0, live_within_s=5.0, clock=clock)


def test_live_only_while_the_poll_loop_returns(setup: tuple[FakeConsumer, Clock, Health]) -> None:
    consumer, clock, health = setup
    # given a consumer that has not polled yet: not live, not ready
    r = health.check()
    assert not r.live and not r.ready and r.polled_ago_s is None
    # when it polls: live
    consumer.polled_at_s = clock.now
    clock.now += 5.0
    assert health.live()
    # when the loop stops returning for longer than live_within_s: not live
    clock.now += 0.01
    assert not health.live()


def test_ready_needs_live_and_an_assignment(setup: tuple[FakeConsumer, Clock, Health]) -> None:
    consumer, clock, health = setup
    consumer.polled_at_s = clock.now
    assert health.live() and not health.ready()  # live, nothing assigned
    consumer.set(0, None, None)
    assert health.ready()
    clock.now += 6.0
    assert not health.ready()  # assigned but the loop is not running


def test_not_ready_while_the_sequencers_store_does_not_answer(
    setup: tuple[FakeConsumer, Clock, Health],
) -> None:
    consumer, clock, health = setup
    # given a live consumer with a partition, ready
    consumer.polled_at_s = clock.now
    consumer.set(0, None, None)
    assert health.ready()
    # when its sequencer's store (Redis) stops answering: live, not ready, and the report says why
    consumer.store_available = False  # type: ignore[attr-defined]
    report = health.check()
    assert report.live and not report.ready and report.to_dict()["store_available"] is False
    # and ready again once it answers
    consumer.store_available = True  # type: ignore[attr-defined]
    assert health.ready()


def test_a_lagging_partition_whose_offset_stands_still_is_stalled(
    setup: tuple[FakeConsumer, Clock, Health],
) -> None:
    consumer, clock, health = setup
    consumer.polled_at_s = clock.now
    # given partition 0 with lag 5 at stored offset 100, and partition 1 caught up
    consumer.set(0, 100, 105, unfinished=5)
    consumer.set(1, 50, 50)
    assert health.stalled() == ()
    # when the stored offset stays at 100 for just under stall_after_s: not yet stalled
    clock.now += 9.99
    consumer.polled_at_s = clock.now
    assert health.stalled() == ()
    # when it stays for stall_after_s: stalled (only partition 0), and not healthy
    clock.now += 0.01
    r = health.check()
    assert [(s.partition, s.stored_offset, s.lag, s.unfinished) for s in r.stalled] == [(0, 100, 5, 5)]
    assert r.stalled[0].stalled_for_s == pytest.approx(10.0)
    assert r.live and r.ready and not r.healthy
    # when the offset moves: no longer stalled, and the clock starts again from that sample
    consumer.set(0, 101, 105, unfinished=4)
    assert health.stalled() == ()
    clock.now += 9.0
    assert health.stalled() == ()
    clock.now += 1.0
    assert [s.partition for s in health.stalled()] == [0]


def test_an_idle_partition_is_never_stalled(setup: tuple[FakeConsumer, Clock, Health]) -> None:
    consumer, clock, health = setup
    consumer.set(0, 100, 100)  # lag 0
    consumer.set(1, None, 500)  # nothing stored yet and nothing received: the lag is not known
    consumer.set(2, None, None)  # end offset not known yet
    clock.now += 3600
    assert health.stalled() == ()


def test_before_the_first_store_unfinished_messages_that_never_finish_are_a_stall(
    setup: tuple[FakeConsumer, Clock, Health],
) -> None:
    consumer, clock, health = setup
    consumer.set(0, None, 500, unfinished=3)
    health.check()
    clock.now += 10.0
    (s,) = health.stalled()
    assert s.partition == 0 and s.lag is None and s.unfinished == 3


def test_a_revoked_partition_is_forgotten(setup: tuple[FakeConsumer, Clock, Health]) -> None:
    consumer, clock, health = setup
    consumer.set(0, 100, 105, unfinished=5)
    health.check()
    clock.now += 8.0
    # when the partition is revoked and later assigned again at the same offset
    del consumer.statuses[("t", 0)]
    health.check()
    consumer.set(0, 100, 105, unfinished=5)
    assert health.stalled() == ()
    clock.now += 5.0
    # then its stall clock started again at the reassignment (13 s after it was first seen)
    assert health.stalled() == ()
    clock.now += 5.0
    assert [s.partition for s in health.stalled()] == [0]


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError):
        Health(FakeConsumer(), stall_after_s=0)
    with pytest.raises(ValueError):
        Health(FakeConsumer(), live_within_s=-1)


def get(url: str) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_http_endpoints(setup: tuple[FakeConsumer, Clock, Health]) -> None:
    consumer, clock, health = setup
    port = health.serve(0)
    try:
        base = f"http://127.0.0.1:{port}"
        # given a consumer that has not polled: every probe fails, with the report as JSON
        code, body = get(base + "/livez")
        assert code == 503 and body["live"] is False
        assert get(base + "/readyz")[0] == 503 and get(base + "/healthz")[0] == 503
        # when it polls with a partition assigned: all pass
        consumer.polled_at_s = clock.now
        consumer.set(0, 100, 105, unfinished=5)
        assert [get(base + p)[0] for p in ("/livez", "/readyz", "/healthz")] == [200, 200, 200]
        # when the partition stalls: /healthz fails and names it, /livez and /readyz still pass
        clock.now += 4.0
        consumer.polled_at_s = clock.now
        clock.now += 1.0
        code, body = get(base + "/healthz")
        assert code == 200
        clock.now += 10.0
        consumer.polled_at_s = clock.now
        code, body = get(base + "/healthz")
        assert code == 503 and body["healthy"] is False
        assert body["stalled"] == [
            {
                "topic": "t",
                "partition": 0,
                "stored_offset": 100,
                "lag": 5,
                "unfinished": 5,
                "oldest_unfinished_age_s": 0.0,
                "stalled_for_s": 15.0,
            }
        ]
        assert get(base + "/livez")[0] == 200 and get(base + "/readyz/")[0] == 200
        assert get(base + "/nope")[0] == 404
        with pytest.raises(RuntimeError):
            health.serve(0)
    finally:
        health.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/livez", timeout=2)
