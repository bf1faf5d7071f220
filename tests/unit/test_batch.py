"""Batch handlers on the in-memory broker: a batch holds at most one message per key, keys stay in
order and never run twice at once (inside a batch or across batches), each message of a batch ends
on its own (one failure is retried and dead-lettered alone), and offsets never pass an unfinished
message."""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict

import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from keyedconsumer.middleware import DeadLetter, Logging, Retry, Typed

from keyedconsumer import (
    BatchFailed,
    HandlerContractError,
    HandlerTimeoutError,
    KeyedApp,
    KeyedConsumer,
    Message,
    RetryLater,
    Status,
)
from keyedconsumer.testing import InMemoryBroker

pytestmark = [pytest.mark.timeout(30)]


class Order(pydantic.BaseModel):
    id: int


class Recorder:
    """What a batch handler saw: its batches, and any key run by two batches at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.batches: list[list[tuple[bytes | None, int, int]]] = []  # [(key, partition, offset)]
        self.running: set[tuple[int, bytes | None]] = set()
        self.overlaps: list[bytes | None] = []

    def enter(self, msgs: list[Message]) -> None:
        with self.lock:
            self.batches.append([(m.key, m.partition, m.offset) for m in msgs])
            for m in msgs:
                lane = (m.partition, m.key)
                if lane in self.running:
                    self.overlaps.append(m.key)
                self.running.add(lane)

    def leave(self, msgs: list[Message]) -> None:
        with self.lock:
            for m in msgs:
                self.running.discard((m.partition, m.key))

    def runs_per_key(self) -> dict[tuple[int, bytes | None], list[int]]:
        out: dict[tuple[int, bytes | None], list[int]] = defaultdict(list)
        for batch in self.batches:
            for key, p, off in batch:
                out[(p, key)].append(off)
        return out


def produce_keys(
    broker: InMemoryBroker, topic: str, keys: int, per_key: int
) -> dict[tuple[int, bytes], list[int]]:
    """``per_key`` messages of each of ``keys`` keys, interleaved; their offsets per (partition, key)."""
    expected: dict[tuple[int, bytes], list[int]] = defaultdict(list)
    for i in range(per_key):
        for k in range(keys):
            rec = broker.produce(topic, f"{i}", key=f"k{k}")
            assert rec.key is not None
            expected[(rec.partition, rec.key)].append(rec.offset)
    return expected


@pytest.mark.parametrize("concurrency", [1, 4])
def test_a_batch_holds_one_message_per_key_and_keys_run_in_order_never_at_once(concurrency: int) -> None:
    # given 12 keys of 15 messages each on 3 partitions, and a batch handler that sleeps a little
    broker = InMemoryBroker()
    broker.create_topic("events", partitions=3)
    expected = produce_keys(broker, "events", keys=12, per_key=15)
    rec = Recorder()

    def handle(msgs: list[Message]) -> None:
        rec.enter(msgs)
        threading.Event().wait(0.001)
        rec.leave(msgs)

    consumer = broker.consumer(
        name="batch-order",
        batch_handler=handle,
        topics=["events"],
        concurrency=concurrency,
        handler_batch_size=5,
    )
    # when it runs until everything is committed
    with broker.run(consumer) as run:
        run.until_idle(timeout_s=20)
    # then no batch held two messages of one key, nor more than handler_batch_size
    for batch in rec.batches:
        lanes = [(p, key) for key, p, _ in batch]
        assert len(lanes) == len(set(lanes)), batch
        assert 1 <= len(batch) <= 5
    # and no key ran in two batches at once, each message ran once, in offset order per key
    assert rec.overlaps == []
    assert rec.runs_per_key() == expected
    ends = {("events", p): n for (_, p), n in broker.end_offsets("events").items()}
    assert broker.committed("batch-order") == ends


def test_a_batch_takes_every_ready_key_oldest_first() -> None:
    # given five keys with one message each on one partition, produced before the consumer starts
    broker = InMemoryBroker()
    broker.create_topic("events", partitions=1)
    for k in range(5):
        broker.produce("events", "v", key=f"k{k}")
    rec = Recorder()

    def handle(msgs: list[Message]) -> None:
        rec.enter(msgs)
        rec.leave(msgs)

    consumer = broker.consumer(
        name="batch-first", batch_handler=handle, topics=["events"], handler_batch_size=100
    )
    with broker.run(consumer) as run:
        run.until_idle(timeout_s=10)
    # then the one poll's five ready heads were one batch, in offset order
    assert rec.batches == [[(f"k{k}".encode(), 0, k) for k in range(5)]]


def test_ordering_partition_batches_one_message_per_partition() -> None:
    broker = InMemoryBroker()
    broker.create_topic("events", partitions=2)
    produce_keys(broker, "events", keys=6, per_key=4)
    rec = Recorder()

    def handle(msgs: list[Message]) -> None:
        rec.enter(msgs)
        rec.leave(msgs)

    consumer = broker.consumer(
        name="batch-part", batch_handler=handle, topics=["events"], ordering="partition", concurrency=2
    )
    with broker.run(consumer) as run:
        run.until_idle(timeout_s=10)
    for batch in rec.batches:
        parts = [p for _, p, _ in batch]
        assert len(parts) == len(set(parts)), batch
    offsets: dict[int, list[int]] = defaultdict(list)
    for batch in rec.batches:
        for _, p, off in batch:
            offsets[p].append(off)
    assert all(offs == sorted(offs) and len(offs) == len(set(offs)) for offs in offsets.values())


def test_one_failed_message_is_retried_and_dead_lettered_alone_the_others_done() -> None:
    # given a key "bad" whose first message always fails, and good keys, behind Retry and DeadLetter
    broker = InMemoryBroker()
    broker.create_topic("payments", partitions=1)
    for i in range(3):
        for key in ("good-a", "bad", "good-b"):
            broker.produce("payments", f"{key}-{i}", key=key)
    runs: list[tuple[bytes | None, bytes | None, int]] = []  # (key, value, attempt)
    batches: list[list[bytes | None]] = []

    def handle(msgs: list[Message]) -> None:
        batches.append([m.value for m in msgs])
        runs.extend((m.key, m.value, m.attempt) for m in msgs)
        failed = {m: ValueError("declined") for m in msgs if m.value == b"bad-0"}
        if failed:
            raise BatchFailed(failed)

    consumer = broker.consumer(
        name="batch-dlt",
        batch_handler=handle,
        topics=["payments"],
        middlewares=[
            DeadLetter(publisher=broker.publisher()),
            Retry(max_attempts=3, initial_delay_s=10, multiplier=1, jitter=0),
        ],
    )
    with broker.run(consumer) as run:
        run.until_idle(timeout_s=20)
    # then bad-0 ran three times and was dead-lettered once; nothing else failed or ran twice
    assert [(v, a) for k, v, a in runs if v == b"bad-0"] == [(b"bad-0", 1), (b"bad-0", 2), (b"bad-0", 3)]
    (dead,) = broker.records("payments.dlq")
    assert (dead.key, dead.value, dead.header("kafka_dlt-attempts")) == (b"bad", b"bad-0", b"3")
    others = [v for _, v, _ in runs if v != b"bad-0"]
    assert sorted(others) == sorted(
        f"{k}-{i}".encode() for k in ("good-a", "bad", "good-b") for i in range(3) if (k, i) != ("bad", 0)
    )
    # and the key "bad" waited: its later messages ran only after bad-0's last attempt
    order = [v for _, v, _ in runs]
    last_bad0 = max(i for i, v in enumerate(order) if v == b"bad-0")
    assert all(order.index(v) > last_bad0 for v in (b"bad-1", b"bad-2"))
    # and the good keys did not wait for it: they finished while bad-0 was being retried
    first_bad0_retry = [i for i, v in enumerate(order) if v == b"bad-0"][1]
    assert order.index(b"good-a-2") < first_bad0_retry and order.index(b"good-b-2") < first_bad0_retry
    assert broker.committed("batch-dlt") == {("payments", 0): 9}


def test_a_raised_exception_fails_the_messages_not_acknowledged_before_it() -> None:
    # given a handler that acknowledges the first message of its batch, then raises
    broker = InMemoryBroker()
    broker.create_topic("events", partitions=1)
    for k in range(4):
        broker.produce("events", "v", key=f"k{k}")
    failed: list[tuple[int, str]] = []
    statuses: dict[int, Status] = {}

    def handle(msgs: list[Message]) -> None:
        msgs[0].ack_success()
        msgs[1].ack_skip()
        for m in msgs:
            statuses[m.offset] = m.status
        raise RuntimeError("downstream down")

    def on_error(error: BaseException, msg: Message | None) -> None:
        assert msg is not None
        failed.append((msg.offset, str(error)))

    consumer = broker.consumer(
        name="batch-ack", batch_handler=handle, topics=["events"], error_handler=on_error
    )
    with broker.run(consumer) as run:
        run.until_idle(timeout_s=10)
    # then only the two not acknowledged went to error_handler (handled: done); all committed
    assert sorted(failed) == [(2, "downstream down"), (3, "downstream down")]
    assert statuses[0] is Status.SUCCESS and statuses[1] is Status.SKIP
    assert broker.committed("batch-ack") == {("events", 0): 4}


def test_retry_later_for_the_whole_batch_retries_each_message_not_acknowledged() -> None:
    broker = InMemoryBroker()
    broker.create_topic("events", partitions=1)
    for k in range(3):
        broker.produce("events", "v", key=f"k{k}")
    runs: list[tuple[int, int]] = []

    def handle(msgs: list[Message]) -> None:
        runs.extend((m.offset, m.attempt) for m in msgs)
        if msgs[0].attempt == 1:
            msgs[0].ack_success()  # this one is done even though the batch asks for a retry
            raise RetryLater(30.0)

    consumer = broker.consumer(name="batch-retry-all", batch_handler=handle, topics=["events"])
    with broker.run(consumer) as run:
        run.until_idle(timeout_s=10)
    assert sorted(runs) == [(0, 1), (1, 1), (1, 2), (2, 1), (2, 2)]


def test_one_exception_for_a_batch_dead_letters_each_message_with_the_same_trace() -> None:
    # given a batch of five messages that fails with one exception, behind DeadLetter
    broker = InMemoryBroker()
    broker.create_topic("events", partitions=1)
    for k in range(5):
        broker.produce("events", "v", key=f"k{k}")

    def handle(msgs: list[Message]) -> None:
        raise ValueError("the whole batch")

    consumer = broker.consumer(
        name="batch-trace",
        batch_handler=handle,
        topics=["events"],
        middlewares=[DeadLetter(publisher=broker.publisher())],
    )
    with broker.run(consumer) as run:
        run.until_idle(timeout_s=10)
    # then each was dead-lettered, and the trace did not grow from one message to the next
    dead = broker.records("events.dlq")
    assert sorted(d.header("kafka_dlt-original-offset") for d in dead) == [str(i).encode() for i in range(5)]
    assert {d.header("kafka_dlt-exception-message") for d in dead} == {b"the whole batch"}
    traces = {d.header("kafka_dlt-exception-stacktrace") for d in dead}
    assert len(traces) == 1, traces


def test_an_unhandled_failure_stops_the_consumer_and_commits_nothing_past_it() -> None:
    broker = InMemoryBroker()
    broker.create_topic("events", partitions=1)
    for k in range(4):
        broker.produce("events", "v", key=f"k{k}")

    def handle(msgs: list[Message]) -> None:
        raise BatchFailed({m: ValueError("bad") for m in msgs if m.offset == 2})

    consumer = broker.consumer(name="batch-halt", batch_handler=handle, topics=["events"])
    with pytest.raises(Exception) as info, broker.run(consumer) as run:
        run.until_idle(timeout_s=10)
    assert "bad" in str(info.value)
    assert broker.committed("batch-halt").get(("events", 0), 0) <= 2


def test_async_batch_handler_retries_one_message_with_retry_later() -> None:
    # given an async batch handler that asks to retry one message once, and skips another
    broker = InMemoryBroker()
    broker.create_topic("events", partitions=2)
    produce_keys(broker, "events", keys=4, per_key=3)
    rec = Recorder()
    attempts: dict[tuple[int, int], list[int]] = defaultdict(list)

    async def handle(msgs: list[Message]) -> None:
        rec.enter(msgs)
        await asyncio.sleep(0.001)
        rec.leave(msgs)
        errors: dict[Message, BaseException] = {}
        for m in msgs:
            attempts[(m.partition, m.offset)].append(m.attempt)
            if m.offset == 1 and m.attempt == 1:
                errors[m] = RetryLater(5.0)
        if errors:
            raise BatchFailed(errors)

    consumer = broker.consumer(name="batch-async", batch_handler=handle, topics=["events"], concurrency=3)
    with broker.run(consumer) as run:
        run.until_idle(timeout_s=20)
    assert rec.overlaps == []
    with_offset_1 = [p for p, end in broker.end_offsets("events").items() if end >= 2]
    assert with_offset_1
    assert {k: v for k, v in attempts.items() if k[1] == 1} == {(p, 1): [1, 2] for _, p in with_offset_1}
    assert all(v == [1] for k, v in attempts.items() if k[1] != 1)
    assert all(offs == sorted(offs) for offs in rec.runs_per_key().values())


def test_handler_timeout_fails_every_message_of_the_batch() -> None:
    broker = InMemoryBroker()
    broker.create_topic("events", partitions=1)
    for k in range(3):
        broker.produce("events", "v", key=f"k{k}")
    failed: list[tuple[int, type[BaseException]]] = []
    calls = 0

    async def handle(msgs: list[Message]) -> None:
        nonlocal calls
        calls += 1
        await asyncio.sleep(30)

    def on_error(error: BaseException, msg: Message | None) -> None:
        assert msg is not None
        failed.append((msg.offset, type(error)))

    consumer = broker.consumer(
        name="batch-timeout",
        batch_handler=handle,
        topics=["events"],
        error_handler=on_error,
        handler_timeout_s=0.05,
    )
    with broker.run(consumer) as run:
        run.until_idle(timeout_s=10)
    assert calls == 1
    assert sorted(failed) == [(0, HandlerTimeoutError), (1, HandlerTimeoutError), (2, HandlerTimeoutError)]
    assert consumer.handler_timeouts == 1


def test_a_plain_batch_handler_returning_an_awaitable_stops_the_consumer() -> None:
    broker = InMemoryBroker()
    broker.create_topic("events", partitions=1)
    broker.produce("events", "v", key="k")

    async def really(msgs: list[Message]) -> None:
        return None

    consumer = broker.consumer(
        name="batch-contract", batch_handler=lambda msgs: really(msgs), topics=["events"]
    )
    with pytest.raises(HandlerContractError), broker.run(consumer) as run:
        run.until_idle(timeout_s=10)
    assert broker.committed("batch-contract").get(("events", 0), 0) == 0


def test_conflation_leaves_only_the_newest_waiting_message_per_key() -> None:
    # given a key whose first message blocks its batch while four more of it wait
    broker = InMemoryBroker()
    broker.create_topic("events", partitions=1)
    entered, release = threading.Event(), threading.Event()
    seen: list[bytes | None] = []

    def handle(msgs: list[Message]) -> None:
        seen.extend(m.value for m in msgs)
        if any(m.value == b"0" for m in msgs):
            entered.set()
            assert release.wait(10)

    consumer = broker.consumer(name="batch-conflate", batch_handler=handle, topics=["events"], conflate=True)
    with broker.run(consumer) as run:
        broker.produce("events", "0", key="k")
        run.wait_for(entered.is_set)
        for i in range(1, 5):
            broker.produce("events", str(i), key="k")
        run.wait_for(lambda: consumer.conflated == 3)
        release.set()
        run.until_idle(timeout_s=10)
    assert seen == [b"0", b"4"]


def test_app_batch_handler_route() -> None:
    broker = InMemoryBroker()
    broker.create_topic("events", partitions=1)
    for k in range(3):
        broker.produce("events", "v", key=f"k{k}")
    app = KeyedApp()
    sizes: list[int] = []

    @app.batch_handler("events", handler_batch_size=2)
    def handle(msgs: list[Message]) -> None:
        sizes.append(len(msgs))

    with broker.run_app(app) as run:
        run.until_idle(timeout_s=10)
    assert sum(sizes) == 3 and max(sizes) <= 2


@pytest.mark.parametrize("is_async", [False, True], ids=["threads", "asyncio"])
def test_linger_waits_for_a_fuller_batch(is_async: bool) -> None:
    # given a consumer that lingers up to 20 s for batches of 3, and one message admitted
    broker = InMemoryBroker()
    broker.create_topic("events", partitions=1)
    batches: list[list[int]] = []

    def handle(msgs: list[Message]) -> None:
        batches.append([m.offset for m in msgs])

    async def ahandle(msgs: list[Message]) -> None:
        handle(msgs)

    consumer = broker.consumer(
        name=f"batch-linger-{is_async}",
        batch_handler=ahandle if is_async else handle,
        topics=["events"],
        handler_batch_size=3,
        handler_batch_linger_s=20,
    )
    with broker.run(consumer) as run:
        broker.produce("events", "0", key="k0")
        run.wait_for(lambda: consumer.in_flight == 1, what="the first message admitted")
        # when two more messages of other keys arrive while it lingers
        broker.produce("events", "1", key="k1")
        broker.produce("events", "2", key="k2")
        run.until_idle(timeout_s=15)
    # then the three ran as one batch
    assert batches == [[0, 1, 2]]


def test_rebalances_mid_run_keep_key_order_and_never_commit_backwards() -> None:
    # given two batch consumers of one group on four partitions, handling messages slowly
    broker = InMemoryBroker()
    broker.create_topic("events", partitions=4)
    keys = [f"key-{i}".encode() for i in range(12)]
    lock = threading.Lock()
    log: list[tuple[bytes, int]] = []
    running: set[bytes] = set()
    overlaps: list[bytes] = []

    def handle(msgs: list[Message]) -> None:
        with lock:
            for m in msgs:
                assert m.key is not None
                if m.key in running:
                    overlaps.append(m.key)
                running.add(m.key)
        threading.Event().wait(0.002)
        with lock:
            for m in msgs:
                assert m.key is not None
                running.discard(m.key)
                log.append((m.key, int(m.value or b"0")))

    c1, c2 = (
        broker.consumer(
            name=name,
            group_id="grp",
            batch_handler=handle,
            topics=["events"],
            concurrency=2,
            handler_batch_size=4,
        )
        for name in ("c1", "c2")
    )
    with broker.run(c1, c2) as run:
        run.wait_for(
            lambda: sorted(map(len, broker.assignments("grp").values())) == [2, 2], what="a 2/2 assignment"
        )
        # when messages arrive and the group rebalances twice while they run
        for seq in range(10):
            for key in keys:
                broker.produce("events", str(seq), key=key)
            if seq in (3, 6):
                broker.rebalance("grp")
        run.until_idle(timeout_s=20)
    # then no key ran in two batches at once, none skipped ahead, every message ran
    assert overlaps == []
    by_key: dict[bytes, list[int]] = defaultdict(list)
    for key, seq in log:
        assert seq <= max(by_key[key], default=-1) + 1, f"{key!r} ran {seq} after {by_key[key]}"
        by_key[key].append(seq)
    assert {k: sorted(set(v)) for k, v in by_key.items()} == {k: list(range(10)) for k in keys}
    # and each partition's commits never moved back and ended at its end offset
    seen: dict[tuple[str, int], list[int]] = defaultdict(list)
    for c in broker.commits("grp"):
        tp = (c.topic, c.partition)
        assert not seen[tp] or c.offset >= seen[tp][-1], (tp, seen[tp], c.offset)
        seen[tp].append(c.offset)
    assert {tp: offs[-1] for tp, offs in seen.items()} == broker.end_offsets("events")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    keys=st.lists(st.integers(0, 5), min_size=1, max_size=40),
    retry_every=st.integers(2, 7),
    size=st.integers(1, 6),
    concurrency=st.integers(1, 3),
    partitions=st.integers(1, 3),
)
def test_property_order_per_key_and_each_failure_retried_alone(
    keys: list[int], retry_every: int, size: int, concurrency: int, partitions: int
) -> None:
    # given messages of random keys; every retry_every-th one asks to be retried once
    broker = InMemoryBroker()
    broker.create_topic("events", partitions=partitions)
    expected: dict[tuple[int, bytes | None], list[int]] = defaultdict(list)
    for i, k in enumerate(keys):
        r = broker.produce("events", str(i), key=f"k{k}")
        expected[(r.partition, r.key)].append(r.offset)
    rec = Recorder()
    done: dict[tuple[int, bytes | None], list[int]] = defaultdict(list)
    runs: dict[tuple[int, int], int] = defaultdict(int)

    def handle(msgs: list[Message]) -> None:
        rec.enter(msgs)
        errors: dict[Message, BaseException] = {}
        for m in msgs:
            runs[(m.partition, m.offset)] += 1
            if int(m.value or b"0") % retry_every == 0 and m.attempt == 1:
                errors[m] = RetryLater(1.0)
            else:
                done[(m.partition, m.key)].append(m.offset)
        rec.leave(msgs)
        if errors:
            raise BatchFailed(errors)

    consumer = broker.consumer(
        name="batch-prop",
        batch_handler=handle,
        topics=["events"],
        handler_batch_size=size,
        concurrency=concurrency,
    )
    with broker.run(consumer) as run:
        run.until_idle(timeout_s=20)
    # then each key's messages were done once each, in offset order, never two at once
    assert done == expected
    assert rec.overlaps == []
    assert all(len(b) <= size and len({(p, k) for k, p, _ in b}) == len(b) for b in rec.batches)
    # and only the messages that asked for it ran twice
    retried = {(p, o) for (p, o), n in runs.items() if n == 2}
    assert all(n in (1, 2) for n in runs.values())
    assert len(retried) == sum(1 for i in range(len(keys)) if i % retry_every == 0)


# -- refused at construction -------------------------------------------------------------------------


def test_middlewares_that_act_around_a_run_are_refused_for_a_batch_handler() -> None:
    with pytest.raises(TypeError, match=r"middlewares\[1\] \(Logging\) cannot wrap a batch handler"):
        KeyedConsumer(
            name="x", topics=["t"], batch_handler=lambda msgs: None, middlewares=[Retry(), Logging()]
        )
    app = KeyedApp()
    with pytest.raises(TypeError, match=r"\(Typed\) cannot wrap a batch handler"):
        app.batch_handler("t", middlewares=[Typed(Order)])


def test_exactly_one_of_handler_and_batch_handler() -> None:
    with pytest.raises(TypeError, match="one of handler="):
        KeyedConsumer(name="x", topics=["t"])
    with pytest.raises(TypeError, match="one of handler="):
        KeyedConsumer(name="x", topics=["t"], handler=lambda m: None, batch_handler=lambda msgs: None)
    with pytest.raises(TypeError, match="batch_handler must be callable"):
        KeyedConsumer(name="x", topics=["t"], batch_handler=42)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("handler_batch_size", 0),
        ("handler_batch_size", True),
        ("handler_batch_size", "many"),
        ("handler_batch_linger_s", -1),
        ("handler_batch_linger_s", True),
        ("handler_batch_linger_s", 61),
    ],
)
def test_bad_batch_options_name_the_field(field: str, value: object) -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        KeyedConsumer(name="x", topics=["t"], batch_handler=lambda msgs: None, **{field: value})
    assert [e["loc"] for e in info.value.errors()] == [(field,)]


def test_batch_failed_takes_a_mapping_of_messages_to_exceptions() -> None:
    m = Message("t", 0, 0, b"k", b"v")
    err = ValueError("x")
    assert BatchFailed({m: err}).errors == {m: err}
    with pytest.raises(TypeError, match="mapping"):
        BatchFailed([m])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="mapping"):
        BatchFailed({0: ValueError("x")})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="mapping"):
        BatchFailed({m: "oops"})  # type: ignore[dict-item]
