"""The partition keyedconsumer computes for a key (``keyedconsumer.kafka.partitioners``, which the
dead-letter replay uses to say where each record goes before it sends it) is the partition
librdkafka's producer gives it, for every key partitioner librdkafka has, on the real broker."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from confluent_kafka import Producer

from keyedconsumer.kafka.partitioners import PARTITIONERS, murmur2, partition_for

pytestmark = [pytest.mark.kafka]


def test_murmur2_is_the_java_clients() -> None:
    # the Java client's own test vectors (org.apache.kafka.common.utils.UtilsTest#testMurmur2)
    vectors = {
        b"21": -973932308,
        b"foobar": -790332482,
        b"a-little-bit-long-string": -985981536,
        b"a-little-bit-longer-string": -1486304829,
        b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
        b"abc": 479470107,
    }
    assert {k: murmur2(k) for k in vectors} == vectors


@pytest.mark.timeout(120)
@pytest.mark.parametrize("partitioner", sorted(PARTITIONERS))
def test_each_partitioner_gives_a_key_the_partition_librdkafka_gives_it(
    partitioner: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    # given topics of 1, 3, 7 and 13 partitions, and 300 keys: text, binary, long, one byte, empty
    rng = random.Random(partitioner)
    keys = [f"cust-{i}".encode() for i in range(100)]
    keys += [rng.randbytes(rng.randint(1, 64)) for _ in range(190)]
    keys += [bytes([i]) for i in range(9)] + [b""]
    for count in (1, 3, 7, 13):
        topic = new_topic(count, prefix=f"part-{partitioner}")
        delivered: dict[bytes, int] = {}
        producer = Producer({"bootstrap.servers": kafka_bootstrap, "partitioner": partitioner})

        def on_delivery(err: object, msg: object, into: dict[bytes, int] = delivered) -> None:
            assert err is None, err
            into[msg.key()] = msg.partition()  # type: ignore[attr-defined]

        # when librdkafka's producer sends each key without a partition (its partitioner picks)
        for key in keys:
            producer.produce(topic, key=key, value=b"v", on_delivery=on_delivery)
            producer.poll(0)
        assert producer.flush(30) == 0
        # then each key landed where partition_for says (an empty key under consistent_random has no
        # partition of its own: librdkafka spreads it)
        expected = {k: partition_for(partitioner, k, count) for k in keys}
        spread = {k for k, p in expected.items() if p is None}
        assert spread == ({b""} if partitioner == "consistent_random" else set())
        got = {k: p for k, p in delivered.items() if k not in spread}
        assert got == {k: p for k, p in expected.items() if k not in spread}, (partitioner, count)


def test_a_null_key_has_a_partition_only_under_the_hashing_partitioners() -> None:
    for name in PARTITIONERS:
        hashed = partition_for(name, None, 5)
        assert (hashed is None) == name.endswith("_random"), name
        if hashed is not None:  # hashed as an empty key, as librdkafka does
            assert hashed == partition_for(name, b"", 5)
    with pytest.raises(ValueError, match="unknown partitioner"):
        partition_for("random", b"k", 3)
