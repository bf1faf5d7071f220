"""One owner of SIGINT and SIGTERM (issue 12, section 8): every running consumer of the process is
stopped by one signal, and the handlers it replaced come back. The real-broker side, two consumers
in one subprocess, is ``tests/integration/test_signals.py``."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from keyedconsumer import KeyedConsumer
from keyedconsumer.testing import InMemoryBroker

pytestmark = [pytest.mark.timeout(30)]


class Stub:
    def __init__(self) -> None:
        self.stops = 0

    def stop(self) -> None:
        self.stops += 1


@pytest.fixture
def previous() -> Iterator[list[int]]:
    """A SIGTERM handler of the test's own, recording the signals it gets; the original comes back."""
    assert threading.current_thread() is threading.main_thread()
    got: list[int] = []
    original = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    yield got
    signal.signal(signal.SIGTERM, original)


def in_thread(fn: Any, *args: Any) -> None:
    t = threading.Thread(target=fn, args=args)
    t.start()
    t.join(5)
    assert not t.is_alive()


def test_one_signal_stops_every_registered_consumer_then_the_previous_handler_comes_back(
    previous: list[int],
) -> None:
    from keyedconsumer import signals

    mine = signal.getsignal(signal.SIGTERM)
    main, other = Stub(), Stub()
    # given one consumer registered from the main thread and one from another thread
    signals.register(main)
    in_thread(signals.register, other)
    assert signal.getsignal(signal.SIGTERM) is not mine
    # when SIGTERM comes, then both are stopped, and the replaced handler is not called
    signal.raise_signal(signal.SIGTERM)
    assert (main.stops, other.stops, previous) == (1, 1, [])
    # when both ended, then the previous handler is back, and gets the next signal
    in_thread(signals.unregister, other)
    signals.unregister(main)
    assert signal.getsignal(signal.SIGTERM) is mine
    signal.raise_signal(signal.SIGTERM)
    assert previous == [signal.SIGTERM] and (main.stops, other.stops) == (1, 1)


def test_consumers_of_other_threads_alone_install_nothing(previous: list[int]) -> None:
    from keyedconsumer import signals

    mine = signal.getsignal(signal.SIGTERM)
    other = Stub()
    in_thread(signals.register, other)
    assert signal.getsignal(signal.SIGTERM) is mine  # only the main thread may install a handler
    signal.raise_signal(signal.SIGTERM)
    assert previous == [signal.SIGTERM] and other.stops == 0
    in_thread(signals.unregister, other)


def test_the_last_consumer_ending_in_another_thread_hands_the_next_signal_on(previous: list[int]) -> None:
    from keyedconsumer import signals

    mine = signal.getsignal(signal.SIGTERM)
    main, other = Stub(), Stub()
    signals.register(main)
    in_thread(signals.register, other)
    # given the main thread's consumer ended first: the handler stays for the other one
    signals.unregister(main)
    assert signal.getsignal(signal.SIGTERM) is not mine
    signal.raise_signal(signal.SIGTERM)
    assert (main.stops, other.stops, previous) == (0, 1, [])
    # when the last one ends in its thread (which may not touch handlers), and a signal comes
    in_thread(signals.unregister, other)
    signal.raise_signal(signal.SIGTERM)
    # then the signal reaches the previous handler, which is back
    assert previous == [signal.SIGTERM] and other.stops == 1
    assert signal.getsignal(signal.SIGTERM) is mine


def test_sigterm_stops_a_consumer_run_in_the_main_thread_and_one_run_in_another() -> None:
    # given two consumers of two groups on the in-memory broker, one run() in this (main) thread
    broker = InMemoryBroker()
    for topic in ("a", "b"):
        broker.create_topic(topic, partitions=2)
        for i in range(20):
            broker.produce(topic, str(i), key=f"k{i % 3}")
    seen: list[str] = []
    lock = threading.Lock()

    def handler(msg: Any) -> None:
        with lock:
            seen.append(msg.topic)

    c1: KeyedConsumer = broker.consumer(name="ga", topics=["a"], handler=handler, poll_timeout_s=0.05)
    c2: KeyedConsumer = broker.consumer(name="gb", topics=["b"], handler=handler, poll_timeout_s=0.05)
    before = signal.getsignal(signal.SIGTERM)
    second = threading.Thread(target=c2.run, daemon=True)
    second.start()

    def signal_when_both_committed() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if all(set(broker.lag(g, t).values()) == {0} for g, t in (("ga", "a"), ("gb", "b"))):
                break
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=signal_when_both_committed, daemon=True).start()
    # when SIGTERM comes, then run() returns here, and the other thread's consumer stops too
    c1.run()
    second.join(15)
    stopped = not second.is_alive()
    if not stopped:
        c2.stop()
        second.join(15)
    assert stopped, "SIGTERM stopped only the consumer of the main thread"
    # the previous handler is back once the main thread registers or unregisters again (when the
    # other thread's consumer ended last, it could not put it back itself)
    from keyedconsumer import signals

    stub = Stub()
    signals.register(stub)
    signals.unregister(stub)
    assert signal.getsignal(signal.SIGTERM) is before and signals.registered() == []
    assert sorted(seen) == ["a"] * 20 + ["b"] * 20
    assert set(broker.lag("ga", "a").values()) == {0} and set(broker.lag("gb", "b").values()) == {0}


def test_a_guard_holds_the_signals_before_the_first_consumer_and_after_the_last(previous: list[int]) -> None:
    from keyedconsumer import signals

    mine = signal.getsignal(signal.SIGTERM)
    first, second = Stub(), Stub()
    with signals.guard():
        # given no consumer registered yet: a signal is remembered, not passed to the previous handler
        assert signal.getsignal(signal.SIGTERM) is not mine
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGINT)  # a second one, of the other kind: nothing more
        assert previous == []
        # when consumers register later in the block, then each stops at once (stop() before run())
        signals.register(first)
        assert first.stops == 1
        signals.unregister(first)
        # after the last one ended, the handler stays: another signal changes nothing
        assert signal.getsignal(signal.SIGTERM) is not mine
        signal.raise_signal(signal.SIGTERM)
        signals.register(second)
        assert second.stops == 1 and previous == []
        signals.unregister(second)
    # when the block ends, the previous handlers are back and nothing is remembered any more
    assert signal.getsignal(signal.SIGTERM) is mine
    signal.raise_signal(signal.SIGTERM)
    assert previous == [signal.SIGTERM]
    signals.register(first)
    assert first.stops == 1
    signals.unregister(first)


def test_a_guard_as_a_decorator_nests_and_in_another_thread_does_nothing(previous: list[int]) -> None:
    from keyedconsumer import signals

    mine = signal.getsignal(signal.SIGTERM)

    @signals.guard()
    def outer() -> None:
        with signals.guard():
            pass
        assert signal.getsignal(signal.SIGTERM) is not mine  # still held by the outer block

    outer()
    assert signal.getsignal(signal.SIGTERM) is mine

    def elsewhere() -> None:
        with signals.guard():
            assert signal.getsignal(signal.SIGTERM) is mine

    in_thread(elsewhere)
