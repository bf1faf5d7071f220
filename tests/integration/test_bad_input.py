"""Bad input (issue 6) on the real broker and a real Redis: each input ends in exactly one of a clear
error naming the field or the message (topic, partition, offset), a dead-letter record, or processing.
Nothing is silently dropped, and no secret reaches a log line, an error or a ``repr``.

Inputs already covered by other tests are not repeated here:

=====================================================  ==============================================================
input                                                  test (outcome asserted)
=====================================================  ==============================================================
undecodable value, no dead letter                      ``test_middleware_kafka.py::test_undecodable_without_dead_letter_stops_naming_the_message``
undecodable / schema-violating value, non-UTF-8 key,   ``test_middleware_kafka.py::test_typed_payloads_good_reach_the_handler_bad_are_dead_lettered``
tombstone, with Typed + DeadLetter
null key vs empty key are different lanes              ``test_ordering.py::test_null_and_empty_keys_are_different_lanes``
a handler that hangs (stop bounded by                  ``test_adversarial.py::test_stop_returns_in_bounded_time_with_many_hung_handlers``
shutdown_timeout_s, offset not committed past it)      (sync, async), ``::test_run_async_returns_in_bounded_time_with_a_hung_async_handler``
a handler that always raises, no error_handler         ``test_cases.py::test_c7_failed_message_holds_offset_and_is_redelivered``
a handler that always raises, Retry + DeadLetter       ``test_middleware_kafka.py::test_poison_message_is_retried_then_dead_lettered_while_other_keys_flow``
SystemExit / KeyboardInterrupt / GeneratorExit,        ``test_adversarial.py::test_base_exception_from_a_handler_fails_its_message``
no error_handler (sync, async)
CancelledError raised by an async handler              ``test_adversarial.py::test_async_handler_raising_cancelled_error_fails_its_message``,
                                                       ``::test_async_handler_raising_cancelled_error_goes_to_error_handler``
wrong broker address 127.0.0.1:1                       ``test_adversarial.py::test_wrong_broker_address_raises_within_startup_timeout``
=====================================================  ==============================================================

Pure configuration inputs are in ``tests/unit/test_bad_config.py``.

**Attempt header.** No code parses an attempt header: ``Message.attempt`` starts at 1 for every
record read from Kafka and only the engine raises it (before each ``RetryLater`` re-run); the
dead-letter middleware *writes* ``kafka_dlt-attempts`` and replaces an existing one. So a record that
carries a malformed ``kafka_dlt-attempts`` (e.g. re-consumed from a dead-letter topic) or any other
``attempt`` header is processed with attempts counted from 1, the headers reach the handler untouched,
and a dead-lettered copy carries the real count.

**5 MB messages.** What the user must set: the topic's ``max.message.bytes`` (the broker default is
1 MiB; this test broker allows 10 MiB) and the producer's ``message.max.bytes`` (librdkafka default
1,000,000; also ``DeadLetter(producer_config=...)`` to dead-letter one). On the consumer nothing:
``fetch.max.bytes`` and ``max.partition.fetch.bytes`` are soft limits (the first record is always
returned) and ``max_in_flight_bytes`` below the message size only pauses fetching. A consumer
``receive.message.max.bytes`` below the response size stalls the partition with a recurring client
error naming that property; the message is never skipped.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import json
import logging
import os
import socket
import struct
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic
from keyedconsumer.middleware import DeadLetter, DeadLetterError, DecodeError, Logging, Recover, Retry, Typed
from pydantic import BaseModel, ValidationError

from keyedconsumer import (
    ConsumerConfig,
    KafkaClientError,
    KeyedConsumer,
    KeyedConsumerError,
    Message,
    MessageError,
    RedisSequencer,
)
from keyedconsumer.consumer import SHUTDOWN_MARGIN_S

from .kafkautil import committed, produce, read_all, wait_until

pytestmark = [pytest.mark.kafka]

SECRET = "Hunter2-s3cret-9f1c"
MIB = 1024 * 1024


def gid(prefix: str) -> str:
    return f"bad-{prefix}-{uuid.uuid4().hex[:8]}"


def consumer(bootstrap: str, topic: str, group: str, handler: Any, **kw: Any) -> KeyedConsumer:
    return KeyedConsumer(name=group, handler=handler, brokers=[bootstrap], topics=[topic], **kw)


def create_topic(bootstrap: str, name: str, config: dict[str, str] | None = None) -> str:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(name, 1, 1, config=config or {})])[name].result(30)
    return name


Headers = list[tuple[str, bytes | None]]


def produce_with_headers(
    bootstrap: str, topic: str, records: list[tuple[bytes | None, bytes | None, Headers]], **conf: Any
) -> list[int]:
    """Produce ``(key, value, headers)`` to partition 0 in order; return their offsets."""
    p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True, **conf})
    offsets: list[int] = []

    def cb(err, msg):  # type: ignore[no-untyped-def]
        assert err is None, err
        offsets.append(msg.offset())

    for key, value, headers in records:
        p.produce(topic, key=key, value=value, headers=headers or None, partition=0, on_delivery=cb)
        p.poll(0)
    assert p.flush(60) == 0
    return offsets


class Payment(BaseModel):
    account: str
    cents: int


# ------------------------------------------------------------------------------------------------
# A raw Kafka producer: confluent-kafka cannot write a header *name* that is not UTF-8 (it sends
# str(bytes) instead), so one record is written with the Produce API (v3, record batch v2) by hand.
# ------------------------------------------------------------------------------------------------


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC32C = _crc32c_table()


def _crc32c(data: bytes) -> int:
    c = 0xFFFFFFFF
    for b in data:
        c = _CRC32C[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def _varint(n: int) -> bytes:
    z = (n << 1) ^ (n >> 63)
    out = bytearray()
    while True:
        b = z & 0x7F
        z >>= 7
        if not z:
            out.append(b)
            return bytes(out)
        out.append(b | 0x80)


def _vbytes(b: bytes | None) -> bytes:
    return _varint(-1) if b is None else _varint(len(b)) + b


def _recv(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("broker closed the connection")
        buf += chunk
    return buf


def produce_raw(
    bootstrap: str, topic: str, key: bytes, value: bytes, headers: list[tuple[bytes, bytes]]
) -> int:
    """Write one record with raw header-name bytes to partition 0 (acks=all); return its offset."""
    ts = int(time.time() * 1000)
    body = b"\x00" + _varint(0) + _varint(0) + _vbytes(key) + _vbytes(value) + _varint(len(headers))
    for hk, hv in headers:
        body += _vbytes(hk) + _vbytes(hv)
    after_crc = struct.pack(">hiqqqhii", 0, 0, ts, ts, -1, -1, -1, 1) + _varint(len(body)) + body
    inner = struct.pack(">ibI", 0, 2, _crc32c(after_crc)) + after_crc
    batch = struct.pack(">qi", 0, len(inner)) + inner
    t = topic.encode()
    req = struct.pack(">hhih", 0, 3, 1, 3) + b"raw" + struct.pack(">hhi", -1, -1, 30000)
    req += struct.pack(">ih", 1, len(t)) + t + struct.pack(">iii", 1, 0, len(batch)) + batch
    host, port = bootstrap.split(",")[0].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(struct.pack(">i", len(req)) + req)
        resp = _recv(s, struct.unpack(">i", _recv(s, 4))[0])
    at = 8 + 2 + struct.unpack(">h", resp[8:10])[0] + 4  # correlation id, topics[1], name, partitions[1]
    _partition, error, offset = struct.unpack(">ihq", resp[at : at + 14])
    assert error == 0, f"produce error code {error}"
    return int(offset)


# ------------------------------------------------------------------------------------------------
# keys, values, headers
# ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(40)
def test_odd_keys_and_values_reach_the_handler_as_the_exact_bytes(
    kafka_bootstrap: str, new_topic, start, caplog
) -> None:  # type: ignore[no-untyped-def]
    # given a null key, an empty key, a key that is not UTF-8, tombstones and an empty value
    caplog.set_level(logging.INFO, logger="keyedconsumer.messages")
    topic = new_topic(1)
    records: list[tuple[bytes | None, bytes | None]] = [
        (None, b"null-key"),
        (b"", b"empty-key"),
        (b"\xff\xfe\x00k", b"non-utf8-key"),
        (b"t", None),
        (b"e", b""),
        (None, None),
        (b"", None),
    ]
    produce(kafka_bootstrap, topic, [(k, v, 0) for k, v in records])
    group = gid("keys")
    seen: dict[int, tuple[bytes | None, bytes | None]] = {}

    def handle(msg: Message) -> None:
        seen[msg.offset] = (msg.key, msg.value)

    r = start(consumer(kafka_bootstrap, topic, group, handle, concurrency=4, middlewares=[Logging()]))
    ok = wait_until(lambda: len(seen) == len(records), 15)
    assert r.stop() and r.error is None, r.error
    # then each was processed with its key and value unchanged: None is not b"", bytes stay bytes
    assert ok, f"processed only {sorted(seen)}"
    assert seen == dict(enumerate(records))
    assert committed(kafka_bootstrap, group, topic, 1) == {0: len(records)}
    # and the Logging middleware logged the non-UTF-8 key escaped, without failing the message
    logged = {
        rec.keyedconsumer["offset"]: rec.keyedconsumer
        for rec in caplog.records
        if hasattr(rec, "keyedconsumer")
    }
    assert logged[2]["key"] == "\\xff\\xfe\x00k" and logged[2]["outcome"] == "SUCCESS"
    assert logged[0]["key"] is None and logged[1]["key"] == ""


@pytest.mark.timeout(60)
def test_bad_payloads_are_dead_lettered_unchanged_naming_the_field(
    kafka_bootstrap: str, new_topic, start
) -> None:  # type: ignore[no-untyped-def]
    # given valid payloads around an undecodable one and three schema violations, with a header each
    topic = new_topic(1)
    dlq = create_topic(kafka_bootstrap, f"{topic}.dlq")
    good = b'{"account": "a", "cents": 1}'
    bad = {  # key: (value, loc of the first validation error, its type)
        b"undecodable": (b"\xff\xfe\x00 not json", [], "json_invalid"),
        b"missing": (b'{"account": "a"}', ["cents"], "missing"),
        b"wrong-type": (b'{"account": "a", "cents": "lots"}', ["cents"], "int_parsing"),
        b"not-object": (b"[1, 2]", [], "model_type"),
    }
    records: list[tuple[bytes | None, bytes | None, Headers]] = [(b"good", good, [("trace", b"t0")])]
    records += [(k, v, [("trace", k)]) for k, (v, _, _) in bad.items()]
    records += [(b"good", good, [("trace", b"t5")])]
    produce_with_headers(kafka_bootstrap, topic, records)
    group = gid("typed-dlq")
    calls: list[tuple[int, Any]] = []
    dl = DeadLetter(brokers=[kafka_bootstrap], timeout_s=20)

    def handle(msg: Message) -> None:
        calls.append((msg.offset, msg.payload))

    mws = [dl, Retry(max_attempts=3, initial_delay_s=0.01, jitter=0.0), Typed(Payment)]
    r = start(consumer(kafka_bootstrap, topic, group, handle, middlewares=mws))
    ok = wait_until(lambda: len(calls) == 2 and dl.published == len(bad), 30)
    assert r.stop() and r.error is None, r.error
    assert ok, (calls, dl.published)
    # then the handler saw only the valid ones, decoded
    assert calls == [(0, Payment(account="a", cents=1)), (5, Payment(account="a", cents=1))]
    # and each bad one is on the dead-letter topic unchanged, named, with its validation errors
    dead = read_all(kafka_bootstrap, dlq, len(bad))
    assert [m.key() for m in dead] == list(bad)
    for offset, m in enumerate(dead, start=1):
        value, loc, typ = bad[m.key()]
        h = m.headers()
        assert m.value() == value and h[0] == ("trace", m.key())
        hd = dict(h)
        assert (
            hd["kafka_dlt-original-topic"],
            hd["kafka_dlt-original-partition"],
            hd["kafka_dlt-original-offset"],
        ) == (topic.encode(), b"0", str(offset).encode())
        assert hd["kafka_dlt-original-consumer-group"] == group.encode()
        assert hd["kafka_dlt-attempts"] == b"1"  # a decode error is never retried
        assert hd["kafka_dlt-exception-fqcn"].endswith(b".DecodeError")
        assert f"offset={offset}".encode() in hd["kafka_dlt-exception-message"]
        errors = json.loads(hd["kafka_dlt-validation-errors"])
        assert (errors[0]["loc"], errors[0]["type"]) == (loc, typ)
        if loc:  # the field is named in the message too
            assert f"{loc[0]}: ".encode() in hd["kafka_dlt-exception-message"]
    # and the offset moved past all of them
    assert committed(kafka_bootstrap, group, topic, 1) == {0: len(records)}


@pytest.mark.timeout(40)
def test_schema_violation_without_dead_letter_stops_naming_the_message_and_the_field(
    kafka_bootstrap: str, new_topic, start
) -> None:  # type: ignore[no-untyped-def]
    topic = new_topic(1)
    produce(
        kafka_bootstrap,
        topic,
        [
            (b"a", b'{"account": "a", "cents": 1}', 0),
            (b"b", b'{"account": "b", "cents": "lots"}', 0),
            (b"c", b'{"account": "c", "cents": 3}', 0),
        ],
    )
    group = gid("typed-stop")
    calls: list[int] = []
    mws = [Retry(max_attempts=3, initial_delay_s=0.01), Typed(Payment)]
    r = start(consumer(kafka_bootstrap, topic, group, lambda m: calls.append(m.offset), middlewares=mws))
    assert r.join(20), "the consumer neither stopped nor went on"
    # then run() raised MessageError naming the message, and the field that was wrong
    err = r.error
    assert isinstance(err, MessageError) and (err.topic, err.partition, err.offset) == (topic, 0, 1), err
    assert isinstance(err.cause, DecodeError) and err.cause.validation_errors[0]["loc"] == ["cents"]
    assert f"topic={topic} partition=0 offset=1" in str(err) and "cents: " in str(err), str(err)
    assert "lots" not in str(err)  # the input itself is left out
    assert calls == [0]
    assert committed(kafka_bootstrap, group, topic, 1) == {0: 1}


@pytest.mark.timeout(40)
def test_odd_headers_and_keys_reach_handler_and_dead_letter_unchanged(
    kafka_bootstrap: str, new_topic, start
) -> None:  # type: ignore[no-untyped-def]
    # given headers whose values are not UTF-8 or null, duplicated names, an empty and a non-ASCII
    # name; one record is processed, three fail: a non-UTF-8 key, an empty key and a null key
    topic = new_topic(1)
    dlq = create_topic(kafka_bootstrap, f"{topic}.dlq")
    headers: Headers = [
        ("dup", b"1"),
        ("bin", b"\xff\xfe\x00"),
        ("dup", b"2"),
        ("none", None),
        ("", b"empty-name"),
        ("\u00fcn\u00efc\u00f6de", b"\x80"),
    ]
    failing: list[bytes | None] = [b"\xfe\xff", b"", None]
    produce_with_headers(
        kafka_bootstrap, topic, [(b"ok", b"v", headers)] + [(k, b"v", headers) for k in failing]
    )
    group = gid("headers")
    seen: dict[int, tuple[Headers, bytes | None]] = {}
    dl = DeadLetter(brokers=[kafka_bootstrap], timeout_s=20)

    def handle(msg: Message) -> None:
        seen[msg.offset] = (list(msg.headers), msg.header("dup"))
        if msg.key != b"ok":
            raise ValueError("cannot handle")

    r = start(consumer(kafka_bootstrap, topic, group, handle, middlewares=[dl]))
    ok = wait_until(lambda: len(seen) == 4 and dl.published == 3, 20)
    assert r.stop() and r.error is None, r.error
    assert ok, (seen, dl.published)
    # then the handler saw every header, in order, duplicates kept; header() is the last of a name
    assert seen == {o: (headers, b"2") for o in range(4)}
    # and the dead-letter records keep the key bytes (b"" is not None) and the headers unchanged,
    # before the failure headers
    dead = read_all(kafka_bootstrap, dlq, 3)
    assert [m.key() for m in dead] == failing
    for m in dead:
        assert m.headers()[: len(headers)] == headers
        assert all(k.startswith("kafka_dlt-") for k, _ in m.headers()[len(headers) :])
    assert committed(kafka_bootstrap, group, topic, 1) == {0: 4}


@pytest.mark.timeout(40)
def test_header_name_not_utf8_is_processed_or_stops_naming_the_message(
    kafka_bootstrap: str, new_topic, start
) -> None:  # type: ignore[no-untyped-def]
    # given offset 1 with a header whose *name* is not UTF-8, between two plain records
    topic = new_topic(1)
    produce(kafka_bootstrap, topic, [(b"a", b"0", 0)])
    assert produce_raw(kafka_bootstrap, topic, b"k", b"v", [(b"\xff\xfename", b"x"), (b"ok", b"y")]) == 1
    produce(kafka_bootstrap, topic, [(b"a", b"2", 0)])
    group = gid("header-name")
    seen: dict[int, Headers] = {}
    r = start(consumer(kafka_bootstrap, topic, group, lambda m: seen.__setitem__(m.offset, list(m.headers))))
    ended = wait_until(lambda: len(seen) == 3 or not r.thread.is_alive(), 15)
    assert ended
    if 1 in seen:  # processed: the header is there (its name decoded somehow), the other one intact
        assert r.stop() and r.error is None, r.error
        assert ("ok", b"y") in seen[1] and len(seen[1]) == 2
        assert committed(kafka_bootstrap, group, topic, 1) == {0: 3}
    else:  # or a clear error naming the message, and it is not skipped
        assert isinstance(r.error, KeyedConsumerError), repr(r.error)
        assert (
            f"topic={topic}" in str(r.error) and "partition=0" in str(r.error) and "offset=1" in str(r.error)
        )
        assert committed(kafka_bootstrap, group, topic, 1) == {0: 1}


@pytest.mark.timeout(40)
def test_malformed_attempt_headers_are_not_parsed_attempts_count_from_1(
    kafka_bootstrap: str, new_topic, start
) -> None:  # type: ignore[no-untyped-def]
    # given records carrying a malformed kafka_dlt-attempts header (as a re-consumed dead letter
    # would) and a generic "attempt" header: abc, -1, 2**63; "ok-*" fails once, "dead-*" always
    topic = new_topic(1)
    dlq = create_topic(kafka_bootstrap, f"{topic}.dlq")
    bad_values = [b"abc", b"-1", str(2**63).encode()]
    records: list[tuple[bytes | None, bytes | None, Headers]] = []
    for i, bad in enumerate(bad_values):
        hs: Headers = [("kafka_dlt-attempts", bad), ("attempt", bad)]
        records += [(f"ok-{i}".encode(), b"v", hs), (f"dead-{i}".encode(), b"v", hs)]
    produce_with_headers(kafka_bootstrap, topic, records)
    group = gid("attempts")
    lock = threading.Lock()
    runs: dict[bytes | None, list[tuple[int, Headers]]] = {}
    dl = DeadLetter(brokers=[kafka_bootstrap], timeout_s=20)

    def handle(msg: Message) -> None:
        with lock:
            runs.setdefault(msg.key, []).append((msg.attempt, list(msg.headers)))
        if (msg.key or b"").startswith(b"dead") or msg.attempt == 1:
            raise RuntimeError("failing")

    mws = [dl, Retry(max_attempts=2, initial_delay_s=0.01, jitter=0.0)]
    r = start(consumer(kafka_bootstrap, topic, group, handle, concurrency=3, middlewares=mws))
    ok = wait_until(lambda: dl.published == 3 and sum(len(v) for v in runs.values()) == 12, 20)
    assert r.stop() and r.error is None, r.error
    assert ok, runs
    # then every record ran as attempt 1, then 2, with its headers untouched
    for key, _value, hs in records:
        assert runs[key] == [(1, hs), (2, hs)], (key, runs[key])
    # and each dead-lettered copy carries the real count, once, and the other header unchanged
    dead = read_all(kafka_bootstrap, dlq, 3)
    assert sorted(m.key() for m in dead) == [b"dead-0", b"dead-1", b"dead-2"]
    for m in dead:
        bad = bad_values[int(m.key()[-1:])]
        names = [k for k, _ in m.headers()]
        assert names.count("kafka_dlt-attempts") == 1 and dict(m.headers())["kafka_dlt-attempts"] == b"2"
        assert ("attempt", bad) in m.headers()
    assert committed(kafka_bootstrap, group, topic, 1) == {0: len(records)}


# ------------------------------------------------------------------------------------------------
# a 5 MB message
# ------------------------------------------------------------------------------------------------

BIG = os.urandom(5 * MIB)
BIG_SHA = hashlib.sha256(BIG).hexdigest()
#: What the user must set to write a 5 MB record: the topic's max.message.bytes and the producer's
#: message.max.bytes (librdkafka's default is 1,000,000: produce() fails with MSG_SIZE_TOO_LARGE).
BIG_TOPIC = {"max.message.bytes": str(6 * MIB)}
BIG_PRODUCER = {"message.max.bytes": 6 * MIB}


def big_topic(kafka_bootstrap: str) -> str:
    return create_topic(kafka_bootstrap, f"big-{uuid.uuid4().hex[:10]}", BIG_TOPIC)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "config,max_in_flight_bytes",
    [({}, 64 * MIB), ({"fetch.max.bytes": MIB, "max.partition.fetch.bytes": MIB}, MIB)],
    ids=["consumer-defaults", "fetch-limits-and-in-flight-bytes-1MiB"],
)
def test_5mb_message_is_processed(
    kafka_bootstrap: str, start, config: dict[str, int], max_in_flight_bytes: int
) -> None:  # type: ignore[no-untyped-def]
    topic = big_topic(kafka_bootstrap)
    produce_with_headers(
        kafka_bootstrap,
        topic,
        [(b"k", b"small-0", []), (b"big", BIG, []), (b"k", b"small-2", [])],
        **BIG_PRODUCER,
    )
    group = gid("big")
    seen: dict[int, tuple[bytes | None, str]] = {}

    def handle(msg: Message) -> None:
        seen[msg.offset] = (msg.key, hashlib.sha256(msg.value or b"").hexdigest())

    r = start(
        consumer(
            kafka_bootstrap, topic, group, handle, config=config, max_in_flight_bytes=max_in_flight_bytes
        )
    )
    ok = wait_until(lambda: len(seen) == 3, 30)
    assert r.stop() and r.error is None, r.error
    assert ok, sorted(seen)
    assert seen[1] == (b"big", BIG_SHA)  # whole, unchanged
    assert committed(kafka_bootstrap, group, topic, 1) == {0: 3}


@pytest.mark.timeout(60)
def test_5mb_message_above_receive_message_max_bytes_is_never_skipped(kafka_bootstrap: str, start) -> None:  # type: ignore[no-untyped-def]
    # given a consumer whose receive.message.max.bytes (2 MB) is below the fetch response size
    topic = big_topic(kafka_bootstrap)
    produce_with_headers(kafka_bootstrap, topic, [(b"k", b"small-0", [])])
    group = gid("big-recv")
    seen: list[int] = []
    errors: list[BaseException] = []
    c = consumer(
        kafka_bootstrap,
        topic,
        group,
        lambda m: seen.append(m.offset),
        config={"receive.message.max.bytes": 2_000_000, "fetch.max.bytes": 1_000_000},
        error_handler=lambda e, m: errors.append(e),
    )
    r = start(c)
    assert wait_until(lambda: seen == [0] and c.partition_status()[0].stored_offset == 1, 20)
    # when the 5 MB message and one more arrive
    produce_with_headers(kafka_bootstrap, topic, [(b"big", BIG, []), (b"k", b"small-2", [])], **BIG_PRODUCER)

    def named() -> bool:
        return any(isinstance(e, KafkaClientError) and "receive.message.max.bytes" in str(e) for e in errors)

    # then a client error names the property to raise, and neither message is skipped
    assert wait_until(named, 20), [str(e) for e in errors]
    assert r.stop() and r.error is None, r.error
    assert seen == [0]
    assert committed(kafka_bootstrap, group, topic, 1) == {0: 1}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "producer_config", [BIG_PRODUCER, {}], ids=["dead-letter-producer-raised", "dead-letter-producer-default"]
)
def test_5mb_failed_message_is_dead_lettered_whole_or_stops_naming_it(
    kafka_bootstrap: str, start, producer_config: dict[str, int]
) -> None:  # type: ignore[no-untyped-def]
    topic = big_topic(kafka_bootstrap)
    dlq = create_topic(kafka_bootstrap, f"{topic}.dlq", BIG_TOPIC)
    produce_with_headers(
        kafka_bootstrap,
        topic,
        [(b"k", b"small-0", []), (b"big", BIG, []), (b"k", b"small-2", [])],
        **BIG_PRODUCER,
    )
    group = gid("big-dlq")
    seen: list[int] = []
    dl = DeadLetter(brokers=[kafka_bootstrap], producer_config=producer_config, timeout_s=20)

    def handle(msg: Message) -> None:
        seen.append(msg.offset)
        if msg.key == b"big":
            raise ValueError("too big to handle")

    r = start(consumer(kafka_bootstrap, topic, group, handle, middlewares=[dl]))
    if producer_config:
        # then, with the producer's message.max.bytes raised, the whole record is dead-lettered
        ok = wait_until(lambda: sorted(seen) == [0, 1, 2] and dl.published == 1, 30)
        assert r.stop() and r.error is None, r.error
        assert ok, (seen, dl.published)
        (dead,) = read_all(kafka_bootstrap, dlq, 1)
        assert dead.key() == b"big" and hashlib.sha256(dead.value()).hexdigest() == BIG_SHA
        assert committed(kafka_bootstrap, group, topic, 1) == {0: 3}
    else:
        # then, with librdkafka's default (1,000,000), the publish fails and the consumer stops
        # naming the message; its offset is not committed
        assert r.join(30), "the consumer neither stopped nor went on"
        err = r.error
        assert isinstance(err, MessageError) and (err.topic, err.partition, err.offset) == (topic, 0, 1), err
        assert isinstance(err.cause, DeadLetterError) and "MSG_SIZE_TOO_LARGE" in str(err.cause)
        assert dl.published == 0
        assert committed(kafka_bootstrap, group, topic, 1) == {0: 1}


# ------------------------------------------------------------------------------------------------
# handlers that hang, always raise, or raise BaseException subclasses
# ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(40)
def test_hung_handler_does_not_delay_an_error_stop_beyond_shutdown_timeout(
    kafka_bootstrap: str, new_topic, start
) -> None:  # type: ignore[no-untyped-def]
    # given key h whose handler hangs at offset 0, and key f failing at offset 1 (no error_handler)
    topic = new_topic(1)
    produce(kafka_bootstrap, topic, [(b"h", b"x", 0), (b"f", b"x", 0), (b"g", b"x", 0)])
    group = gid("hung-fail")
    release = threading.Event()
    hung = threading.Event()
    failed_at: list[float] = []

    def handle(msg: Message) -> None:
        if msg.key == b"h":
            hung.set()
            release.wait(60)
        elif msg.key == b"f":
            assert hung.wait(10)
            failed_at.append(time.monotonic())
            raise RuntimeError("f fails")

    r = start(consumer(kafka_bootstrap, topic, group, handle, concurrency=2, shutdown_timeout_s=1.0))
    try:
        # then run() raises about shutdown_timeout_s after the failure, not when h returns
        assert r.join(15), "stop on the failure waited for the hung handler"
        assert failed_at and r.ended_at is not None and r.ended_at - failed_at[0] < 1.0 + 3.0
        err = r.error
        assert isinstance(err, MessageError) and (err.topic, err.partition, err.offset) == (topic, 0, 1), err
        # and nothing is committed past the hung message
        assert committed(kafka_bootstrap, group, topic, 1) == {0: 0}
    finally:
        release.set()


@pytest.mark.timeout(40)
def test_always_raising_handler_with_retry_stops_after_max_attempts_naming_the_message(
    kafka_bootstrap: str, new_topic, start
) -> None:  # type: ignore[no-untyped-def]
    topic = new_topic(1)
    produce(kafka_bootstrap, topic, [(b"a", str(i).encode(), 0) for i in range(3)])
    group = gid("always-stop")
    attempts: list[tuple[int, int]] = []

    def handle(msg: Message) -> None:
        attempts.append((msg.offset, msg.attempt))
        raise ValueError(f"broken {msg.offset}")

    mws = [Retry(max_attempts=3, initial_delay_s=0.05, jitter=0.0)]
    r = start(consumer(kafka_bootstrap, topic, group, handle, middlewares=mws))
    assert r.join(15), "the consumer neither stopped nor went on"
    # then offset 0 ran exactly 3 times, the key's next message never, and run() names offset 0
    assert attempts == [(0, 1), (0, 2), (0, 3)]
    err = r.error
    assert isinstance(err, MessageError) and (err.topic, err.partition, err.offset) == (topic, 0, 0), err
    assert isinstance(err.cause, ValueError) and "broken 0" in str(err)
    assert committed(kafka_bootstrap, group, topic, 1)[0] in (None, 0)


@pytest.mark.timeout(40)
def test_always_raising_handler_with_error_handler_reports_every_message_once(
    kafka_bootstrap: str, new_topic, start
) -> None:  # type: ignore[no-untyped-def]
    topic = new_topic(1)
    produce(kafka_bootstrap, topic, [(b"a", b"0", 0), (b"a", b"1", 0), (b"b", b"2", 0), (None, b"3", 0)])
    group = gid("always-eh")
    lock = threading.Lock()
    attempts: list[tuple[int, int]] = []
    reported: list[tuple[int, str]] = []

    def handle(msg: Message) -> None:
        with lock:
            attempts.append((msg.offset, msg.attempt))
        raise ValueError(f"broken {msg.offset}")

    def error_handler(err: BaseException, msg: Message | None) -> None:
        assert msg is not None
        with lock:
            reported.append((msg.offset, str(err)))

    mws = [Retry(max_attempts=2, initial_delay_s=0.01, jitter=0.0)]
    r = start(
        consumer(
            kafka_bootstrap, topic, group, handle, concurrency=2, middlewares=mws, error_handler=error_handler
        )
    )
    ok = wait_until(lambda: len(reported) == 4, 15)
    assert r.stop() and r.error is None, r.error
    assert ok, reported
    # then each message ran twice and was reported once, with its own error; all are done
    assert sorted(attempts) == [(o, a) for o in range(4) for a in (1, 2)]
    assert sorted(reported) == [(o, f"broken {o}") for o in range(4)]
    assert committed(kafka_bootstrap, group, topic, 1) == {0: 4}


class CustomBaseError(BaseException):
    """A BaseException subclass that is not an Exception."""


@pytest.mark.timeout(40)
@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_custom_base_exception_passes_middleware_and_stops_naming_the_message(
    kafka_bootstrap: str, new_topic, start, is_async: bool
) -> None:  # type: ignore[no-untyped-def]
    # given the full middleware stack, and a handler raising a custom BaseException at offset 1
    topic = new_topic(1)
    produce(kafka_bootstrap, topic, [(b"k", str(i).encode(), 0) for i in range(3)])
    group = gid("custom-base")
    attempts: list[tuple[int, int]] = []
    dl = DeadLetter(brokers=[kafka_bootstrap], timeout_s=20)

    def body(msg: Message) -> None:
        attempts.append((msg.offset, msg.attempt))
        if msg.offset == 1:
            raise CustomBaseError("not an Exception")

    if is_async:

        async def handle(msg: Message) -> None:
            await asyncio.sleep(0)
            body(msg)
    else:

        def handle(msg: Message) -> None:  # type: ignore[misc]
            body(msg)

    mws = [Recover(), Logging(), dl, Retry(max_attempts=3, initial_delay_s=0.01)]
    r = start(consumer(kafka_bootstrap, topic, group, handle, middlewares=mws))
    # then no middleware swallows, retries or dead-letters it: run() raises naming offset 1
    assert r.join(15), "the consumer neither stopped nor went on"
    err = r.error
    assert isinstance(err, MessageError) and (err.topic, err.partition, err.offset) == (topic, 0, 1), err
    assert isinstance(err.cause, CustomBaseError) and "CustomBaseError" in str(err)
    assert attempts == [(0, 1), (1, 1)] and dl.published == 0
    # and the message is not lost: the committed offset stays at it
    assert committed(kafka_bootstrap, group, topic, 1) == {0: 1}


@pytest.mark.timeout(40)
@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_base_exceptions_with_error_handler_do_not_kill_the_only_worker(
    kafka_bootstrap: str, new_topic, start, is_async: bool
) -> None:  # type: ignore[no-untyped-def]
    # given one worker (concurrency 1), one key, and BaseExceptions raised at odd offsets
    raises: dict[int, type[BaseException]] = {
        1: KeyboardInterrupt,
        3: SystemExit,
        5: GeneratorExit,
        7: CustomBaseError,
    }
    if is_async:
        raises[9] = asyncio.CancelledError
    n = 11
    topic = new_topic(1)
    produce(kafka_bootstrap, topic, [(b"k", str(i).encode(), 0) for i in range(n)])
    group = gid("base-eh")
    seen: list[int] = []
    reported: list[tuple[int, type[BaseException]]] = []

    def body(msg: Message) -> None:
        seen.append(msg.offset)
        exc = raises.get(msg.offset)
        if exc is not None:
            raise exc()

    if is_async:

        async def handle(msg: Message) -> None:
            await asyncio.sleep(0)
            body(msg)
    else:

        def handle(msg: Message) -> None:  # type: ignore[misc]
            body(msg)

    def error_handler(err: BaseException, msg: Message | None) -> None:
        assert msg is not None
        reported.append((msg.offset, type(err)))

    r = start(consumer(kafka_bootstrap, topic, group, handle, error_handler=error_handler))
    ok = wait_until(lambda: len(seen) == n, 15)
    assert r.stop() and r.error is None, r.error
    # then the worker survived every one: all messages ran in order, each BaseException was reported
    assert ok, f"ran {seen}: a BaseException killed the worker"
    assert seen == list(range(n))
    assert reported == sorted(raises.items())
    assert committed(kafka_bootstrap, group, topic, 1) == {0: n}


@pytest.mark.timeout(60)
def test_sync_handler_returning_a_coroutine_stops_naming_the_message(
    kafka_bootstrap: str, new_topic, start
) -> None:  # type: ignore[no-untyped-def]
    # given one message, a plain handler that forgets to await an async def function, DeadLetter +
    # Retry around it, and an error_handler that would mark any failure handled
    import warnings

    topic = new_topic(1)
    produce(kafka_bootstrap, topic, [(b"k", b"v", 0)])
    group = gid("not-awaited")
    ran: list[int] = []
    reported: list[BaseException] = []
    dl = DeadLetter(brokers=[kafka_bootstrap], timeout_s=20)

    async def handle_async(msg: Message) -> None:
        ran.append(msg.offset)

    def error_handler(err: BaseException, msg: Message | None) -> None:
        reported.append(err)

    c = consumer(
        kafka_bootstrap,
        topic,
        group,
        lambda m: handle_async(m),
        error_handler=error_handler,
        middlewares=[dl, Retry(max_attempts=3, initial_delay_s=0.01)],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = start(c)
        # then the consumer stops by itself, and run() raises the contract error naming the message
        assert r.join(30), "the consumer did not stop: the returned coroutine counted as a success"
        gc.collect()
    err = r.error
    assert isinstance(err, KeyedConsumerError) and type(err).__name__ == "HandlerContractError", repr(err)
    assert (err.topic, err.partition, err.offset) == (topic, 0, 0)  # type: ignore[attr-defined]
    assert f"topic={topic} partition=0 offset=0" in str(err) and "async def" in str(err)
    # and the body never ran, nothing was retried, reported or dead-lettered, nothing committed past it
    assert ran == [] and reported == [] and dl.published == 0
    assert committed(kafka_bootstrap, group, topic, 1)[0] in (None, 0)
    assert not [w for w in caught if "never awaited" in str(w.message)]


# ------------------------------------------------------------------------------------------------
# a wrong broker address at run time; secrets
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def fake_broker() -> Iterator[Any]:
    """``fake_broker(reply) -> "127.0.0.1:port"``: a TCP server that accepts and then either never
    answers (``reply=None``) or answers every read with ``reply`` (a service that is not Kafka)."""
    servers: list[socket.socket] = []
    stop = threading.Event()

    def make(reply: bytes | None) -> str:
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(16)
        srv.settimeout(0.2)
        servers.append(srv)
        conns: list[socket.socket] = []

        def serve() -> None:
            while not stop.is_set():
                try:
                    conn, _ = srv.accept()
                    conns.append(conn)
                    conn.settimeout(0.2)
                except OSError:
                    pass
                for conn in list(conns):
                    try:
                        if conn.recv(65536) and reply is not None:
                            conn.sendall(reply)
                    except OSError:
                        pass
            for conn in conns:
                conn.close()

        threading.Thread(target=serve, daemon=True).start()
        return f"127.0.0.1:{srv.getsockname()[1]}"

    yield make
    stop.set()
    time.sleep(0.3)
    for srv in servers:
        srv.close()


@pytest.mark.timeout(40)
@pytest.mark.parametrize("kind", ["unresolvable-host", "silent-listener", "not-kafka"])
def test_wrong_broker_address_raises_naming_brokers_within_startup_timeout(fake_broker, kind: str) -> None:  # type: ignore[no-untyped-def]
    address = {
        "unresolvable-host": lambda: "no-such-host.invalid:9092",
        "silent-listener": lambda: fake_broker(None),  # accepts, never answers: must not hang
        "not-kafka": lambda: fake_broker(b"-ERR unknown command\r\n" * 4),  # e.g. Redis on the Kafka port
    }[kind]()
    c = KeyedConsumer(
        name=gid("wrong-broker"),
        handler=lambda m: None,
        brokers=[address],
        topics=["t"],
        startup_timeout_s=2.0,
    )
    t0 = time.monotonic()
    with pytest.raises(KafkaClientError) as info:
        c.run()
    took = time.monotonic() - t0
    # within the documented bound (startup_timeout_s, then a shutdown bounded by SHUTDOWN_MARGIN_S:
    # the client's close alone may take CLOSE_TIMEOUT_S); a tighter figure is speed, not a promise
    # (a CI run took 6.3 s on a loaded machine)
    assert took < 2.0 + SHUTDOWN_MARGIN_S, f"run() took {took:.1f} s to give up"
    assert "brokers" in str(info.value)


@pytest.mark.timeout(30)
def test_topic_regex_librdkafka_refuses_is_a_clear_error(kafka_bootstrap: str) -> None:
    # given a regex Python compiles (so the config accepts it) but librdkafka's regex engine does not
    regex = "^(?:orders|payments)"
    with pytest.raises((ValidationError, KeyedConsumerError)) as info:
        KeyedConsumer(
            name=gid("regex"),
            handler=lambda m: None,
            brokers=[kafka_bootstrap],
            topics=[regex],
            startup_timeout_s=5.0,
        ).run()
    assert "topics" in str(info.value) or regex in str(info.value)


@pytest.mark.timeout(40)
def test_sasl_password_in_no_log_line_error_or_repr(kafka_bootstrap: str, caplog, capfd) -> None:  # type: ignore[no-untyped-def]
    # given SASL credentials against the PLAINTEXT broker (authentication fails), librdkafka's own
    # debug output on stderr, every logger at DEBUG, and a DeadLetter producer with the same secret
    caplog.set_level(logging.DEBUG)
    sasl = {
        "security.protocol": "SASL_PLAINTEXT",
        "sasl.mechanism": "PLAIN",
        "sasl.username": "alice",
        "sasl.password": SECRET,
    }
    dl = DeadLetter(brokers=[kafka_bootstrap], producer_config={**sasl, "debug": "conf,security"})
    c = KeyedConsumer(
        name=gid("sasl"),
        handler=lambda m: None,
        brokers=[kafka_bootstrap],
        topics=["t"],
        startup_timeout_s=2.0,
        config={**sasl, "debug": "conf,security,broker"},
        middlewares=[dl],
    )
    with pytest.raises(KafkaClientError) as info:
        c.run()
    texts = {
        "consumer repr": repr(c),
        "config repr": repr(c.config),
        "config str": str(c.config),
        "error": str(info.value),
        "error repr": repr(info.value),
    }
    del info, c, dl  # destroy the clients now, so their last debug lines are captured too
    gc.collect()
    out, err = capfd.readouterr()
    texts.update(
        {"log": caplog.text, "log args": repr([r.args for r in caplog.records]), "stdout": out, "stderr": err}
    )
    # (the captures are live: librdkafka listed its configuration on stderr, and the client's
    # authentication errors were logged)
    assert "sasl.password" in err
    assert any("AUTHENTICATION" in r.getMessage() for r in caplog.records), caplog.text[-2000:]
    leaked = [name for name, text in texts.items() if SECRET in text]
    assert leaked == []


# ------------------------------------------------------------------------------------------------
# Redis down at start
# ------------------------------------------------------------------------------------------------


def free_port() -> int:
    # below the ephemeral range: a port from bind(0) can be taken by an outgoing connection
    # before the server (re)starts on it
    from tests.faults.services import stable_free_port

    return stable_free_port()


@pytest.mark.redis
@pytest.mark.timeout(60)
def test_redis_down_at_start_waits_then_processes_everything(
    kafka_bootstrap: str, new_topic, start, tmp_path: Path, caplog
) -> None:  # type: ignore[no-untyped-def]
    # given a Redis sequencer whose (password-protected) Redis is not running yet
    caplog.set_level(logging.DEBUG)
    port = free_port()
    topic = new_topic(1)
    keys = [None, b"", b"\xff\xfe", b"k"]
    records = [(keys[i % 4], str(i).encode(), 0) for i in range(12)]
    produce(kafka_bootstrap, topic, records)
    group = gid("redis-down")
    lock = threading.Lock()
    seen: list[tuple[bytes | None, int]] = []

    def handle(msg: Message) -> None:
        with lock:
            seen.append((msg.key, msg.offset))

    url = f"redis://:{SECRET}@127.0.0.1:{port}/0"
    seq = RedisSequencer(url, f"bad{uuid.uuid4().hex[:8]}", lease_ttl_s=2.0, socket_timeout_s=0.5)
    c = consumer(kafka_bootstrap, topic, group, handle, concurrency=4, sequencer=seq)
    r = start(c)
    redis_proc: subprocess.Popen[bytes] | None = None
    try:

        def waiting() -> int:
            return sum(
                1
                for rec in caplog.records
                if rec.name == "keyedconsumer.redis" and "unavailable" in rec.getMessage()
            )

        # then it waits: every message received, Redis retried with back-off, nothing run or committed
        assert wait_until(lambda: c.in_flight == len(records) and waiting() >= 4, 20), (
            c.in_flight,
            waiting(),
        )
        assert r.thread.is_alive() and r.error is None
        assert seen == []
        assert committed(kafka_bootstrap, group, topic, 1)[0] in (None, 0)
        # when Redis comes up
        redis_proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--dir",
                str(tmp_path),
                "--requirepass",
                SECRET,
                "--save",
                "",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        # then everything runs, each key in offset order
        assert wait_until(lambda: len(seen) == len(records), 20), seen
        assert r.stop() and r.error is None, r.error
    finally:
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(10)
    for key in keys:
        offsets = [o for k, o in seen if k == key]
        assert offsets == [i for i in range(12) if keys[i % 4] == key]
    assert committed(kafka_bootstrap, group, topic, 1) == {0: len(records)}
    # and the Redis password is in no log line, and not in the sequencer's repr
    assert SECRET not in caplog.text and SECRET not in repr([rec.args for rec in caplog.records])
    assert SECRET not in repr(seq) and SECRET not in repr(c.config)


@pytest.mark.timeout(60)
def test_an_option_given_next_to_settings_is_used_not_dropped(kafka_bootstrap: str, new_topic, start) -> None:  # type: ignore[no-untyped-def]
    # given settings of concurrency 1, and four messages of four keys whose handlers each wait until
    # all four run at once
    topic = new_topic(1)
    produce(kafka_bootstrap, topic, [(f"k{i}".encode(), b"v", 0) for i in range(4)])
    group = gid("settings-and-option")
    together = threading.Barrier(4, timeout=20)
    broken: list[int] = []

    def handle(msg: Message) -> None:
        try:
            together.wait()
        except threading.BrokenBarrierError:
            broken.append(msg.offset)

    cfg = ConsumerConfig(name=group, brokers=[kafka_bootstrap], topics=[topic], concurrency=1)
    # when the consumer is given the settings and concurrency=4 next to them
    c = KeyedConsumer(settings=cfg, handler=handle, concurrency=4)
    r = start(c)
    # then its four workers run the four messages at once (with concurrency 1 the first would wait
    # for the other three until the barrier broke)
    assert wait_until(lambda: committed(kafka_bootstrap, group, topic, 1) == {0: 4}, 40)
    assert r.stop() and r.error is None, r.error
    assert broken == [] and c.config.concurrency == 4
