"""Waiting for a service is not a failure (issue 25, item 17): the availability gate's state
machine on a fake clock, Retry not counting waits, and health not ready while a dependency is
awaited. The real registry outage (killed, stalled) is tests/integration/test_registry_outage.py.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from keyedconsumer.middleware import Retry, Typed
from keyedconsumer.middleware.schema_registry import Avro, registry_client
from keyedconsumer.middleware.unavailable import Availability, Unavailable, failed_attempts, wait_on

from keyedconsumer import Message, RetryLater
from keyedconsumer.health import Health

from .test_health import Clock, FakeConsumer

pytestmark = pytest.mark.timeout(30)


def other_thread(fn: Any) -> Any:
    box: list[Any] = []
    t = threading.Thread(target=lambda: box.append(fn()))
    t.start()
    t.join(10)
    return box[0]


def test_the_gate_lets_one_probe_through_spaced_by_a_doubling_back_off() -> None:
    clock = Clock()
    gate = Availability("svc", first_probe_s=0.5, max_probe_s=2.0, clock=clock)
    # given a service that answers: every request goes, nothing is unavailable
    assert gate.admit() is None and other_thread(gate.admit) is None and gate.unavailable() is None
    # when a request fails: down, the next probe in 0.5 s; callers meanwhile wait without asking
    assert gate.failed("ConnectError: refused") == 0.5
    assert gate.admit() == pytest.approx(0.5)
    reason = gate.unavailable()
    assert reason is not None and reason.startswith("svc: unavailable for 0.0 s") and "refused" in reason
    # when the probe time comes, one caller probes (its own retries go too) and the others wait
    clock.now += 0.5
    assert gate.admit() is None and gate.admit() is None
    assert other_thread(gate.admit) == 0.5
    # when the probe fails, the back-off doubles, and is capped at max_probe_s
    assert gate.failed("again") == 1.0
    clock.now += 1.0
    assert gate.admit() is None and gate.failed("again") == 2.0
    clock.now += 2.0
    assert gate.admit() is None and gate.failed("again") == 2.0
    # a failure of a request that left before the service went down changes no back-off
    assert other_thread(lambda: gate.failed("late")) == pytest.approx(2.0)
    # when the probe is answered: up again, every request goes
    clock.now += 2.0
    assert gate.admit() is None
    gate.answered()
    assert other_thread(gate.admit) is None and gate.unavailable() is None


def test_a_probe_that_ends_without_news_frees_the_next_probe() -> None:
    clock = Clock()
    gate = Availability("svc", clock=clock)
    gate.failed("refused")
    clock.now += 0.5
    assert gate.admit() is None  # this thread probes
    gate.release()  # ... and its decode ended without an answer or a failure (it raised otherwise)
    assert other_thread(gate.admit) is None  # another may probe at once


def test_nothing_is_unavailable_once_no_caller_waited_for_twice_the_longest_back_off() -> None:
    clock = Clock()
    gate = Availability("svc", first_probe_s=0.5, max_probe_s=5.0, clock=clock)
    gate.failed("refused")
    clock.now += 9.9
    assert gate.unavailable() is not None
    gate.admit()  # a waiting message asks again: still awaited
    clock.now += 10.0
    assert gate.unavailable() is not None
    clock.now += 0.1  # nothing asked for 10.1 s: nothing waits for it
    assert gate.unavailable() is None


def test_bad_gate_bounds_are_refused() -> None:
    for first, most in ((0, 1), (2, 1), (1, float("inf"))):
        with pytest.raises(ValueError):
            Availability("svc", first_probe_s=first, max_probe_s=most)


def failing(msg: Message) -> None:
    raise ValueError("boom")


def test_retry_counts_failed_attempts_not_the_ones_that_waited_for_a_service() -> None:
    # given a message whose first 5 attempts waited for a service (noted by wait_on)
    m = Message("t", 0, 7)
    for attempt in range(1, 6):
        m.attempt = attempt
        assert isinstance(wait_on(m, 0.5, "svc down"), RetryLater)
    # when its 6th attempt fails, then it is its first failed attempt: Retry asks for another
    m.attempt = 6
    assert failed_attempts(m) == 1
    retry = Retry(max_attempts=2, jitter=0.0, initial_delay_s=1.0)
    with pytest.raises(RetryLater) as info:
        retry(failing)(m)
    assert info.value.delay_s == 1.0
    # and its 7th failure is its second: Retry gives up
    m.attempt = 7
    with pytest.raises(ValueError):
        retry(failing)(m)


def test_a_wait_passes_retry_untouched() -> None:
    def waits(msg: Message) -> None:
        raise wait_on(msg, 0.25, "svc down")

    with pytest.raises(Unavailable) as info:
        Retry(max_attempts=1)(waits)(Message("t", 0, 1))
    assert info.value.delay_s == 0.25


def test_a_registry_nobody_listens_on_makes_records_wait_and_asks_it_once_per_back_off() -> None:
    # given a well-framed Avro record and a registry nobody listens on
    avro = Avro("http://127.0.0.1:1")
    typed = Typed(avro)
    m = Message("orders", 0, 42, key=b"k", value=b"\x00\x00\x00\x00\x07\x04o1")
    # when it is decoded: it waits (not a DecodeError), the wait noted, the registry named
    with pytest.raises(Unavailable) as info:
        typed.decode(m)
    assert info.value.delay_s == 0.5 and "ConnectError" in str(info.value)
    assert failed_attempts(m) == 1 and m.state
    assert typed.unavailable() and "schema registry http://127.0.0.1:1" in typed.unavailable()[0]
    # and a second record right after waits without a request (the gate refuses it before the wire)
    with pytest.raises(Unavailable) as again:
        typed.decode(Message("orders", 0, 43, value=m.value))
    assert type(again.value.__cause__).__name__ == "_Refused"
    # and a second decoder of the same client shares the gate
    assert Avro(avro.client).availability is avro.availability


def test_a_client_built_here_has_a_request_timeout_and_no_sleeping_retries_of_its_own() -> None:
    client = registry_client("http://127.0.0.1:1")
    assert client.config()["timeout"] == 5.0 and client.config()["max.retries"] == 0
    mine = registry_client({"url": "http://127.0.0.1:1", "timeout": 30, "max.retries": 2})
    assert mine.config()["timeout"] == 30 and mine.config()["max.retries"] == 2


class Awaited:
    def __init__(self) -> None:
        self.reasons: list[str] = []

    def unavailable(self) -> list[str]:
        return list(self.reasons)


def test_health_is_not_ready_while_a_dependency_is_awaited() -> None:
    consumer, clock, dep = FakeConsumer(), Clock(), Awaited()
    health = Health(consumer, clock=clock, dependencies=[dep])
    consumer.polled_at_s = clock.now
    consumer.set(0, None, None)
    assert health.check().ready
    dep.reasons = ["schema registry http://r:8081: unavailable for 3.0 s (refused)"]
    report = health.check()
    assert report.live and not report.ready and report.unavailable == tuple(dep.reasons)
    assert report.to_dict()["unavailable"] == dep.reasons
    dep.reasons = []
    assert health.check().ready
