"""The partition a producer gives a record key: librdkafka's key partitioners (its ``partitioner``
property), computed here so that a tool can say where a record will go before it sends it.

Each is the function librdkafka runs (``rdkafka_msg.c``), checked against librdkafka itself in
``tests/integration/test_partitioners.py``:

- ``murmur2`` / ``murmur2_random``: the Java producer's hash (``Utils.murmur2`` of the key bytes,
  ``& 0x7fffffff``, modulo the partition count); ``murmur2_random`` is the Java producer's default
  partitioner.
- ``consistent`` / ``consistent_random``: CRC-32 of the key modulo the partition count;
  ``consistent_random`` is librdkafka's default (and so of confluent-kafka's Python, Go and .NET
  producers, and of :class:`~keyedconsumer.Publisher`).
- ``fnv1a`` / ``fnv1a_random``: 32-bit FNV-1a of the key, made positive, modulo the partition count
  (Sarama's default).

A ``*_random`` partitioner gives a null key (``consistent_random``: also an empty key) no partition of
its own: librdkafka spreads such records (sticky partitioning), so :func:`partition_for` returns
``None``. The others hash a null key as an empty one.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

__all__ = ["PARTITIONERS", "DEFAULT_PARTITIONER", "murmur2", "fnv1a", "partition_for"]

_MASK = 0xFFFFFFFF


def murmur2(data: bytes) -> int:
    """The Java client's ``org.apache.kafka.common.utils.Utils.murmur2`` of ``data``, as a signed
    32-bit int (seed ``0x9747b28c``)."""
    m, length = 0x5BD1E995, len(data)
    h = (0x9747B28C ^ length) & _MASK
    full = length - length % 4
    for i in range(0, full, 4):
        k = int.from_bytes(data[i : i + 4], "little")
        k = (k * m) & _MASK
        k ^= k >> 24
        k = (k * m) & _MASK
        h = ((h * m) & _MASK) ^ k
    rest = length % 4
    if rest == 3:
        h ^= data[full + 2] << 16
    if rest >= 2:
        h ^= data[full + 1] << 8
    if rest >= 1:
        h ^= data[full]
        h = (h * m) & _MASK
    h ^= h >> 13
    h = (h * m) & _MASK
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


def fnv1a(data: bytes) -> int:
    """librdkafka's ``rd_fnv1a`` of ``data``: 32-bit FNV-1a taken as a signed int and made positive
    (as Sarama's default ``NewHashPartitioner`` does), returned unsigned."""
    h = 0x811C9DC5
    for byte in data:
        h = ((h ^ byte) * 0x01000193) & _MASK
    signed = h - (1 << 32) if h & 0x80000000 else h
    return abs(signed) & _MASK


def _murmur2(key: bytes, count: int) -> int:
    return (murmur2(key) & 0x7FFFFFFF) % count


def _crc32(key: bytes, count: int) -> int:
    return zlib.crc32(key) % count


def _fnv1a(key: bytes, count: int) -> int:
    return fnv1a(key) % count


#: librdkafka's key partitioners: ``name -> (hash of a key to a partition, a null key has no partition
#: of its own, an empty key has none either)``.
PARTITIONERS: dict[str, tuple[Callable[[bytes, int], int], bool, bool]] = {
    "murmur2_random": (_murmur2, True, False),
    "murmur2": (_murmur2, False, False),
    "consistent_random": (_crc32, True, True),
    "consistent": (_crc32, False, False),
    "fnv1a_random": (_fnv1a, True, False),
    "fnv1a": (_fnv1a, False, False),
}
#: The Java producer's default partitioner, and Kafka's reference client's.
DEFAULT_PARTITIONER = "murmur2_random"


def partition_for(partitioner: str, key: bytes | None, count: int) -> int | None:
    """The partition librdkafka's ``partitioner`` gives ``key`` in a topic of ``count`` partitions.

    Returns
    -------
    A partition in ``range(count)``, or ``None`` where the partitioner gives the key no partition of
    its own (a null key under a ``*_random`` partitioner, an empty key under ``consistent_random``).

    Raises
    ------
    ValueError
        ``partitioner`` is not one of :data:`PARTITIONERS`, or ``count < 1``.
    """
    if partitioner not in PARTITIONERS:
        raise ValueError(f"unknown partitioner {partitioner!r}: one of {', '.join(PARTITIONERS)}")
    if count < 1:
        raise ValueError(f"a topic has at least one partition, not {count}")
    hash_of, null_spread, empty_spread = PARTITIONERS[partitioner]
    if (key is None and null_spread) or (key == b"" and empty_spread):
        return None
    return hash_of(key or b"", count)
