"""Helpers for integration tests on the real broker (tests only: they may import confluent_kafka)."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition


def produce(
    bootstrap: str, topic: str, records: Iterable[tuple[bytes | None, bytes | None, int | None]]
) -> list[tuple[int, int]]:
    """Produce ``(key, value, partition)`` records with acks=all; return their (partition, offset)."""
    p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True, "linger.ms": 5})
    acked: list[tuple[int, int]] = []

    def cb(err, msg):  # type: ignore[no-untyped-def]
        assert err is None, err
        acked.append((msg.partition(), msg.offset()))

    for key, value, partition in records:
        kwargs = {} if partition is None else {"partition": partition}
        while True:
            try:
                p.produce(topic, value=value, key=key, on_delivery=cb, **kwargs)
                break
            except BufferError:
                p.poll(0.1)
        p.poll(0)
    assert p.flush(60) == 0
    return acked


def end_offsets(bootstrap: str, topic: str, partitions: int) -> dict[int, int]:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"probe-{uuid.uuid4().hex}"})
    try:
        return {
            p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in range(partitions)
        }
    finally:
        c.close()


# the errors librdkafka returns while the group coordinator loads or moves (the KafkaError of
# Consumer.committed() does not carry retriable(): the codes are named)
_COORDINATOR_NOT_READY = frozenset(
    {
        KafkaError.NOT_COORDINATOR,
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        KafkaError.COORDINATOR_NOT_AVAILABLE,
    }
)


def committed(
    bootstrap: str, group: str, topic: str, partitions: int, timeout_s: float = 30.0
) -> dict[int, int | None]:
    """The group's committed offsets (``None``: nothing committed).

    An error saying the group coordinator is not ready (loading or moved, e.g. just after a broker was
    resumed: NOT_COORDINATOR, COORDINATOR_LOAD_IN_PROGRESS) is asked again until ``timeout_s``;
    any other error is raised. The answer itself is never retried into a different one.
    """
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                res = c.committed([TopicPartition(topic, p) for p in range(partitions)], timeout=10)
                return {tp.partition: (tp.offset if tp.offset >= 0 else None) for tp in res}
            except KafkaException as exc:
                if exc.args[0].code() not in _COORDINATOR_NOT_READY or time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)
    finally:
        c.close()


def log_lines(path: Path) -> list[str]:
    """The complete lines of a log another process may be appending to; ``[]`` if it is missing.

    A reader can see a line half written (the kernel copies an append page by page, so a line
    across a page boundary shows its first part first): a last line without its newline is left
    out, to be read whole next time. (A writer killed mid-line leaves a fragment that the next
    process appending to the same log continues: one garbled line, which the parsers of these
    logs would reject. It needs a SIGKILL inside a write across a page boundary.)
    """
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return text.split("\n")[:-1]


def wait_until(pred, timeout_s: float, interval_s: float = 0.05) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval_s)
    return bool(pred())


def read_all(bootstrap: str, topic: str, expect: int, timeout_s: float = 30.0) -> list:  # type: ignore[type-arg]
    """Read ``topic`` from the beginning until ``expect`` records arrived or ``timeout_s`` passed."""
    c = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"reader-{uuid.uuid4().hex}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    c.subscribe([topic])
    out = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < expect and time.monotonic() < deadline:
            for m in c.consume(100, 0.5):
                if m.error() is None:
                    out.append(m)
        # a short extra read shows there is nothing more
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            out.extend(m for m in c.consume(100, 0.2) if m.error() is None)
    finally:
        c.close()
    return out


class CommittedReader:
    """A ``read_committed`` reader of a topic from its beginning, read in a thread of its own."""

    def __init__(self, bootstrap: str, topic: str, partitions: int) -> None:
        self.values: list[tuple[bytes, bytes]] = []  # (key, value) in each partition's order
        self._c = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"reader-{uuid.uuid4().hex[:8]}",
                "isolation.level": "read_committed",
                "enable.auto.commit": False,
            }
        )
        self._c.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            got = [(m.key(), m.value()) for m in self._c.consume(200, 0.2) if m.error() is None]
            with self._lock:
                self.values.extend(got)

    def snapshot(self) -> list[tuple[bytes, bytes]]:
        with self._lock:
            return list(self.values)

    def close(self) -> list[tuple[bytes, bytes]]:
        self._stop.set()
        self._t.join(10)
        self._c.close()
        return self.snapshot()


def read_committed_all(
    bootstrap: str, topic: str, partitions: int, timeout_s: float = 60.0
) -> list[tuple[bytes, bytes]]:
    """Everything a ``read_committed`` reader sees of ``topic``: ``(key, value)`` in each partition's
    order, read until every partition's position reached its high watermark (no transaction is open
    any more: the last stable offset caught up), or ``timeout_s`` passed (then an AssertionError)."""
    c = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"reader-{uuid.uuid4().hex[:8]}",
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
        }
    )
    tps = [TopicPartition(topic, p, 0) for p in range(partitions)]
    c.assign(tps)
    out: list[tuple[bytes, bytes]] = []
    deadline = time.monotonic() + timeout_s
    try:
        highs: dict[int, int] = {}
        while len(highs) < partitions:  # a broker back from a stall may have no leader for a moment
            p = len(highs)
            try:
                highs[p] = c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
            except KafkaException as exc:
                assert time.monotonic() < deadline, f"no high watermark of partition {p}: {exc}"
                time.sleep(0.2)
        while True:
            out.extend((m.key(), m.value()) for m in c.consume(500, 0.2) if m.error() is None)
            positions = {
                tp.partition: tp.offset for tp in c.position([TopicPartition(topic, p) for p in highs])
            }
            if all(high == 0 or positions[p] >= high for p, high in highs.items()):
                return out
            assert time.monotonic() < deadline, f"read_committed reader stuck at {positions} of {highs}"
    finally:
        c.close()


def once_in_key_order(seen: list[tuple[bytes, bytes]], inputs: list[bytes]) -> list[str]:
    """What is wrong with ``seen`` (``(key, b"key:seq")`` results of ``inputs``, as read): results
    missing, duplicated, unknown, or out of their key's input order. Empty when each input's result
    is there exactly once and each key's results are in input order."""
    counts = Counter(v for _, v in seen)
    problems = []
    missing = [v for v in inputs if v not in counts]
    if missing:
        problems.append(f"{len(missing)} results missing, e.g. {missing[:5]}")
    twice = [v for v, n in counts.items() if n > 1]
    if twice:
        problems.append(f"{len(twice)} results more than once, e.g. {twice[:5]}")
    unknown = set(counts) - set(inputs)
    if unknown:
        problems.append(f"{len(unknown)} unknown results, e.g. {sorted(unknown)[:5]}")
    firsts: dict[bytes, list[int]] = {}  # per key, the seq of each first occurrence, in read order
    met: set[bytes] = set()
    for key, v in seen:
        if v not in met:
            met.add(v)
            firsts.setdefault(key, []).append(int(v.split(b":")[1]))
    for key, seqs in firsts.items():
        if seqs != sorted(seqs):
            problems.append(f"key {key!r} out of input order: {seqs[:30]}")
    return problems
