"""Retry, dead letters and typed payloads against the real broker."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from confluent_kafka.admin import AdminClient, NewTopic
from keyedconsumer.middleware import DeadLetter, DeadLetterError, Retry, Typed
from pydantic import BaseModel

from keyedconsumer import KeyedConsumer, Message, MessageError

from .kafkautil import committed, end_offsets, produce, read_all, wait_until

pytestmark = [pytest.mark.kafka]


def run_until(consumer: KeyedConsumer, pred, timeout_s: float) -> None:  # type: ignore[no-untyped-def]
    def watch() -> None:
        wait_until(pred, timeout_s)
        consumer.stop()

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    consumer.run()


@pytest.mark.timeout(120)
def test_poison_message_is_retried_then_dead_lettered_while_other_keys_flow(
    kafka_bootstrap: str, new_topic
) -> None:  # type: ignore[no-untyped-def]
    # given one poison message (key "poison") early in partition 0, followed by later messages of
    # that key, among 10,000 messages of other keys on 2 partitions
    topic = new_topic(2)
    records: list[tuple[bytes, bytes, int]] = []
    for i in range(10_000):
        records.append((f"k{i % 500}".encode(), str(i).encode(), i % 2))
        if i in (10, 2000, 4000):
            records.append((b"poison", f"p{i}".encode(), 0))
    produce(kafka_bootstrap, topic, records)
    lock = threading.Lock()
    attempts: dict[int, list[float]] = {}
    completed_at: dict[tuple[int, int], float] = {}
    poison_order: list[bytes] = []
    first_poison_offset: list[int] = []

    def handle(msg: Message) -> None:
        now = time.monotonic()
        if msg.key == b"poison":
            with lock:
                attempts.setdefault(msg.offset, []).append(now)
                if msg.value == b"p10":
                    first_poison_offset[:] = [msg.offset]
                    raise RuntimeError("poison pill")
                poison_order.append(msg.value or b"")
        time.sleep(0.0002)
        with lock:
            completed_at[(msg.partition, msg.offset)] = time.monotonic()

    group = f"poison-{uuid.uuid4().hex[:8]}"
    dlq = f"{topic}.dlq"
    consumer = KeyedConsumer(
        name=group,
        handler=handle,
        brokers=[kafka_bootstrap],
        topics=[topic],
        concurrency=16,
        middlewares=[
            DeadLetter(brokers=[kafka_bootstrap]),
            # a back-off long enough (attempts at 0, 2 and 6 s) for the other keys of partition 0
            # to flow on a slow machine before the last attempt, while a partition held behind the
            # poison message would still end none of them before it
            Retry(max_attempts=3, initial_delay_s=2.0, multiplier=2, jitter=0.0),
        ],
    )
    total = len(records)
    run_until(consumer, lambda: len(completed_at) >= total - 1, 90)

    # then exactly max_attempts attempts were made, spaced by the back-off
    poison = first_poison_offset[0]
    times = attempts[poison]
    assert len(times) == 3
    assert times[1] - times[0] >= 1.99 and times[2] - times[1] >= 3.99
    # and one dead-letter record arrived, unchanged, with all the failure headers
    dead = read_all(kafka_bootstrap, dlq, 1)
    assert len(dead) == 1
    d = dead[0]
    assert d.key() == b"poison" and d.value() == b"p10"
    h = dict(d.headers())
    assert h["kafka_dlt-original-topic"] == topic.encode()
    assert (
        h["kafka_dlt-original-partition"] == b"0" and h["kafka_dlt-original-offset"] == str(poison).encode()
    )
    assert h["kafka_dlt-original-consumer-group"] == group.encode()
    assert h["kafka_dlt-attempts"] == b"3" and h["kafka_dlt-exception-fqcn"] == b"builtins.RuntimeError"
    assert (
        b"poison pill" in h["kafka_dlt-exception-message"]
        and b"Traceback" in h["kafka_dlt-exception-stacktrace"]
    )
    assert int(h["kafka_dlt-failed-at"]) > 0 and "kafka_dlt-original-timestamp" in h
    # and the offset moved past the poison message: everything is committed
    assert committed(kafka_bootstrap, group, topic, 2) == end_offsets(kafka_bootstrap, topic, 2)
    # and other keys were not held back by the retries: most of partition 0's later messages
    # finished before the poison message's last attempt
    later = [t for (p, o), t in completed_at.items() if p == 0 and o > poison]
    assert sum(1 for t in later if t < times[-1]) > 0.8 * len(later)
    # and the poison key's later messages still ran, in order, after it
    assert poison_order == [b"p2000", b"p4000"]


@pytest.mark.timeout(90)
def test_failed_dead_letter_publish_commits_nothing_past_the_message(kafka_bootstrap: str, new_topic) -> None:  # type: ignore[no-untyped-def]
    # given a dead-letter topic that cannot take the record (its max.message.bytes is tiny)
    topic = new_topic(1)
    dlq = f"{topic}.dlq"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(dlq, 1, 1, config={"max.message.bytes": "64"})])[dlq].result(30)
    produce(kafka_bootstrap, topic, [(b"a", b"ok-0", 0), (b"bad", b"x" * 200, 0), (b"b", b"ok-2", 0)])
    group = f"dlqfail-{uuid.uuid4().hex[:8]}"

    def handle(msg: Message) -> None:
        if msg.key == b"bad":
            raise ValueError("cannot handle")

    consumer = KeyedConsumer(
        name=group,
        handler=handle,
        brokers=[kafka_bootstrap],
        topics=[topic],
        middlewares=[DeadLetter(brokers=[kafka_bootstrap], timeout_s=10)],
    )
    # when the dead-letter publish fails, the consumer reports the error and stops
    with pytest.raises(MessageError) as info:
        consumer.run()
    assert isinstance(info.value.cause, DeadLetterError) and info.value.offset == 1
    assert "dead-letter publish" in str(info.value)
    # then nothing was committed past the message
    assert committed(kafka_bootstrap, group, topic, 1) == {0: 1}


@pytest.mark.timeout(90)
def test_re_dead_lettering_does_not_grow_the_headers(kafka_bootstrap: str, new_topic) -> None:  # type: ignore[no-untyped-def]
    # given a record that fails, is dead-lettered, re-consumed from the dead-letter topic, fails again...
    topic = new_topic(1)
    produce(kafka_bootstrap, topic, [(b"k", b"v", 0)])
    dlq = f"{topic}.dlq"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(dlq, 1, 1)])[dlq].result(30)
    rounds = 6

    def always_fail(msg: Message) -> None:
        raise RuntimeError(f"round {msg.offset}")

    # the same dead-letter topic consumed and written: each failure makes the next record
    consumer = KeyedConsumer(
        name=f"c4-{uuid.uuid4().hex[:8]}",
        handler=always_fail,
        brokers=[kafka_bootstrap],
        topics=[topic, dlq],
        middlewares=[DeadLetter(brokers=[kafka_bootstrap], topic=dlq)],
    )
    run_until(consumer, lambda: end_offsets(kafka_bootstrap, dlq, 1)[0] >= rounds, 60)
    dead = read_all(kafka_bootstrap, dlq, rounds)
    assert len(dead) >= rounds
    sizes = [len(m.headers()) for m in dead]
    # then the number of headers is stable after the first dead-lettering, and no header repeats
    assert len(set(sizes)) == 1
    for m in dead:
        names = [k for k, _ in m.headers()]
        assert len(names) == len(set(names))
    assert dict(dead[-1].headers())["kafka_dlt-original-topic"] == dlq.encode()


class Payment(BaseModel):
    account: str
    cents: int


@pytest.mark.timeout(90)
def test_typed_payloads_good_reach_the_handler_bad_are_dead_lettered(kafka_bootstrap: str, new_topic) -> None:  # type: ignore[no-untyped-def]
    topic = new_topic(1)
    recs = [
        (b"a", b'{"account": "a", "cents": 100}', 0),
        (b"b", b"\xff\xfe\x00 not json", 0),
        (b"c", b'{"account": "c", "cents": "lots"}', 0),
        (b"\xff", b'{"account": "d", "cents": 5}', 0),  # a key that is not UTF-8
        (b"e", None, 0),  # a tombstone
    ]
    produce(kafka_bootstrap, topic, recs)
    got: list[tuple[bytes | None, object]] = []
    calls: list[int] = []

    def handle(msg: Message) -> None:
        calls.append(msg.offset)
        got.append((msg.key, msg.payload))

    consumer = KeyedConsumer(
        name=f"typed-{uuid.uuid4().hex[:8]}",
        handler=handle,
        brokers=[kafka_bootstrap],
        topics=[topic],
        middlewares=[DeadLetter(brokers=[kafka_bootstrap]), Retry(), Typed(Payment)],
    )
    run_until(consumer, lambda: len(got) >= 3, 60)
    assert got == [
        (b"a", Payment(account="a", cents=100)),
        (b"\xff", Payment(account="d", cents=5)),
        (b"e", None),
    ]
    dead = read_all(kafka_bootstrap, f"{topic}.dlq", 2)
    assert [m.key() for m in dead] == [b"b", b"c"]
    for m in dead:
        h = dict(m.headers())
        assert h["kafka_dlt-attempts"] == b"1"  # never retried
        assert h["kafka_dlt-exception-fqcn"].endswith(b"DecodeError")
        assert b"loc" in h["kafka_dlt-validation-errors"]


@pytest.mark.timeout(60)
def test_undecodable_without_dead_letter_stops_naming_the_message(kafka_bootstrap: str, new_topic) -> None:  # type: ignore[no-untyped-def]
    topic = new_topic(1)
    produce(kafka_bootstrap, topic, [(b"a", b"not json", 0)])
    consumer = KeyedConsumer(
        name=f"typed-stop-{uuid.uuid4().hex[:8]}",
        handler=lambda m: None,
        brokers=[kafka_bootstrap],
        topics=[topic],
        middlewares=[Retry(), Typed(Payment)],
    )
    with pytest.raises(MessageError) as info:
        consumer.run()
    assert (info.value.topic, info.value.partition, info.value.offset) == (topic, 0, 0)
    assert "cannot decode" in str(info.value)


@pytest.mark.timeout(60)
def test_retry_waiting_messages_are_held_once_and_memory_stays_bounded_case_c2(
    kafka_bootstrap: str, new_topic
) -> None:  # type: ignore[no-untyped-def]
    # given 200 messages over 5 partitions that always fail, a 1 s retry delay, unlimited retries
    topic = new_topic(5)
    produce(kafka_bootstrap, topic, [(f"k{i}".encode(), b"x", i % 5) for i in range(200)])
    max_in_flight = 100
    consumer = KeyedConsumer(
        name=f"c2-{uuid.uuid4().hex[:8]}",
        handler=lambda m: (_ for _ in ()).throw(RuntimeError("down")),
        brokers=[kafka_bootstrap],
        topics=[topic],
        concurrency=8,
        max_in_flight=max_in_flight,
        middlewares=[Retry(max_attempts=None, initial_delay_s=1.0, multiplier=1.0, jitter=0.0)],
    )
    samples: list[tuple[int, int]] = []
    full_at: list[float] = []  # when the consumer first held max_in_flight messages
    stopped_at: list[float] = []

    def watch() -> None:
        # when it runs for 4.5 s from the moment it holds max_in_flight messages (the group join
        # and the first fetches, however slow, are not part of the window; 30 s at most)
        end = time.monotonic() + 30
        while time.monotonic() < end:
            run = consumer._run  # internal, read only (None until run() built it)
            if run is not None:
                samples.append((consumer.in_flight, len(run.engine.queue.delayed())))
                if not full_at and consumer.in_flight >= max_in_flight:
                    full_at.append(time.monotonic())
                    end = full_at[0] + 4.5
            time.sleep(0.05)
        stopped_at.append(time.monotonic())
        consumer.stop()

    t = threading.Thread(target=watch)
    t.start()
    consumer.run()
    returned_at = time.monotonic()
    t.join()
    assert full_at, f"never held {max_in_flight} messages: {samples[-5:]}"
    # then the buffer stayed bounded, each waiting message was held once, fetching paused, and the
    # stop did not wait for the back-off
    assert max(s[0] for s in samples) <= max_in_flight
    assert max(s[1] for s in samples) <= max_in_flight
    assert consumer.peak_in_flight <= max_in_flight
    assert (
        consumer._run is not None and consumer._run.engine.retries >= 2 * max_in_flight
    )  # every held message was retried several times
    assert returned_at - stopped_at[0] < 5.5


@pytest.mark.timeout(60)
def test_metrics_count_outcomes_and_serve_partition_gauges(kafka_bootstrap: str, new_topic) -> None:  # type: ignore[no-untyped-def]
    import socket
    import urllib.request

    from keyedconsumer.middleware import Metrics

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    topic = new_topic(2)
    produce(kafka_bootstrap, topic, [(f"k{i}".encode(), b"v", i % 2) for i in range(100)])
    metrics = Metrics(http_port=port)
    seen: list[int] = []

    def handle(msg: Message) -> None:
        seen.append(msg.offset)
        if msg.key == b"k7":
            msg.ack_skip()

    consumer = metrics.bind(
        KeyedConsumer(
            name=f"m-{uuid.uuid4().hex[:8]}",
            handler=handle,
            brokers=[kafka_bootstrap],
            topics=[topic],
            concurrency=4,
            middlewares=[metrics],
        )
    )
    scraped: list[str] = []

    def scrape_when_done() -> bool:
        if len(seen) < 100:
            return False
        time.sleep(1.2)  # the end offsets are refreshed about once a second
        scraped.append(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode())
        return True

    run_until(consumer, scrape_when_done, 40)
    text = scraped[0]
    assert (
        f'messaging_client_consumed_messages_total{{messaging_consumer_group_name="{consumer.config.group}",messaging_destination_name="{topic}",outcome="SUCCESS"}} 99.0'
        in text
    )
    assert 'outcome="SKIP"} 1.0' in text
    assert "messaging_process_duration_seconds_bucket" in text
    assert (
        f'keyedconsumer_partition_lag{{messaging_consumer_group_name="{consumer.config.group}",messaging_destination_name="{topic}",messaging_destination_partition_id="0"}} 0.0'
        in text
    )
    assert "keyedconsumer_oldest_unfinished_age_seconds" in text
