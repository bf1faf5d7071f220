"""A Schema Registry outage is not a poison message (issue 25, item 17): against the real broker
and a registry process of the test's own (scripts/registry's binary, franz-go's srfake, on a port
of its own), stopped (SIGKILL: connections refused) or stalled (SIGSTOP: connections accepted,
never answered) while Avro records wait to be decoded.

While the registry is out, no record is dead-lettered or handed to the handler: each waits (its
key holds, its partition's offset stays), health is not ready and names the registry, and at most
one request to it is in flight at a time, each bounded by the client's request timeout. Once it is
back, every record is handled, in key order, nothing dead-lettered, and the offsets committed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from keyedconsumer.middleware import DeadLetter, Retry, Typed
from keyedconsumer.middleware.decoders import Field
from keyedconsumer.middleware.schema_registry import Avro
from pydantic import BaseModel

from keyedconsumer import KeyedConsumer, Message
from keyedconsumer.health import Health

from ..faults.services import stable_free_port
from .kafkautil import committed, end_offsets, produce, wait_until

pytestmark = [pytest.mark.kafka]

ROOT = Path(__file__).resolve().parents[2]

ORDER_AVSC = json.dumps(
    {
        "type": "record",
        "name": "Order",
        "namespace": "kc.outage",
        "fields": [{"name": "id", "type": "string"}, {"name": "seq", "type": "int"}],
    }
)


class Order(BaseModel):
    id: str
    seq: int


class OwnRegistry:
    """A schema registry process of this test, on a port of its own: killed, restarted, paused."""

    def __init__(self, binary: Path, port: int, log: Path) -> None:
        self.binary, self.port, self.log = binary, port, log
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [str(self.binary), "-listen", f"127.0.0.1:{self.port}"], stdout=out, stderr=out
            )
        assert wait_until(self.answers, 30, 0.1), f"the registry did not answer on {self.url}"

    def answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/subjects", timeout=1) as resp:
                return isinstance(json.load(resp), list)
        except OSError:
            return False

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def pause(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def own_registry(tmp_path: Path) -> Iterator[OwnRegistry]:
    subprocess.run(
        [str(ROOT / "scripts" / "registry"), "build"], check=True, capture_output=True, timeout=300
    )
    cache = Path(os.environ.get("KC_CACHE_DIR", ROOT / ".run" / "cache"))
    registry = OwnRegistry(
        cache / "schema-registry" / "schema-registry", stable_free_port(), tmp_path / "registry.log"
    )
    registry.start()
    try:
        yield registry
    finally:
        registry.close()


class TimedDecoder:
    """A decoder around another that records the (start, end) of each of its calls (monotonic s)."""

    def __init__(self, inner: Avro[Order]) -> None:
        self.inner = inner
        self.name = inner.name
        self.calls: list[tuple[float, float]] = []
        self._lock = threading.Lock()

    def decode(self, data: bytes, *, msg: Message, field: Field) -> Order:
        t0 = time.monotonic()
        try:
            return self.inner.decode(data, msg=msg, field=field)
        finally:
            with self._lock:
                self.calls.append((t0, time.monotonic()))

    def unavailable(self) -> list[str]:
        return self.inner.unavailable()


def _records(
    registry: OwnRegistry, topic: str
) -> tuple[int, list[tuple[bytes | None, bytes | None, int | None]]]:
    """The writer schema's id and 40 Avro orders over 8 keys and 2 partitions (seq counts per key)."""
    client = SchemaRegistryClient({"url": registry.url})
    schema_id = client.register_schema(f"{topic}-value", Schema(ORDER_AVSC, "AVRO"))
    ser = AvroSerializer(
        client, ORDER_AVSC, conf={"auto.register.schemas": False, "use.latest.version": True}
    )
    ctx = SerializationContext(topic, MessageField.VALUE)
    seqs: dict[str, int] = {}
    out: list[tuple[bytes | None, bytes | None, int | None]] = []
    for i in range(40):
        key = f"k{i % 8}"
        seqs[key] = seqs.get(key, -1) + 1
        out.append((key.encode(), ser({"id": f"o{i}", "seq": seqs[key]}, ctx), i % 2))
    return schema_id, out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fault", ["killed", "stalled"])
def test_a_registry_outage_dead_letters_nothing_records_wait_and_health_is_not_ready(
    kafka_bootstrap: str, new_topic: Callable[..., str], start: Any, own_registry: OwnRegistry, fault: str
) -> None:
    # given 40 Avro orders written with a registry of the test's own, and that registry out (killed:
    # refused; stalled: SIGSTOP, requests accepted and never answered) before any is decoded
    topic = new_topic(2)
    schema_id, records = _records(own_registry, topic)
    produce(kafka_bootstrap, topic, records)
    own_registry.kill() if fault == "killed" else own_registry.pause()
    # and a consumer that dead-letters after two quick attempts, decoding with a fresh client (its
    # cache empty) whose requests time out after 1 s
    seen: list[Order] = []
    seen_lock = threading.Lock()

    def handle(msg: Message[Order]) -> None:
        with seen_lock:
            seen.append(msg.payload)

    decoder = TimedDecoder(Avro({"url": own_registry.url, "timeout": 1}, model=Order))
    typed = Typed(decoder)
    dlq = new_topic(1)
    dead_letter = DeadLetter(topic=dlq)
    group = f"sr-out-{uuid.uuid4().hex[:8]}"
    consumer = KeyedConsumer(
        name=group,
        handler=handle,
        brokers=[kafka_bootstrap],
        topics=[topic],
        concurrency=8,
        middlewares=[dead_letter, Retry(max_attempts=2, initial_delay_s=0.01, jitter=0), typed],
    )
    health = Health(consumer, dependencies=[typed])
    running = start(consumer)
    # when it runs for 6 s of outage (past the point where two attempts a message would have
    # dead-lettered every record many times over)
    assert wait_until(lambda: health.check().live and len(decoder.calls) >= 8, 60), len(decoder.calls)
    out_at = time.monotonic()
    reports = []
    while time.monotonic() - out_at < 6:
        reports.append(health.check())
        time.sleep(0.25)
    # then nothing reached the handler or the dead-letter topic, and health said not ready, naming
    # the registry, from the first failed request on
    assert seen == [] and dead_letter.published == 0
    assert all(r.live and not r.ready for r in reports), [r.to_dict() for r in reports if r.ready]
    assert all(any(own_registry.url in u for u in r.unavailable) for r in reports), reports[-1].to_dict()
    # and the requests were bounded: no decode took much longer than the request timeout, and once
    # the first request had failed, the ones that waited on the network (longer than 0.5 s) never
    # overlapped: one request at a time (before, at most one per worker had left)
    slow = sorted((a, b) for a, b in decoder.calls if b - a > 0.5)
    assert max(b - a for a, b in decoder.calls) < 3.0, max(b - a for a, b in decoder.calls)
    if fault == "stalled":
        assert slow, "a stalled registry's request should have waited for its timeout"
        first_failed = min(b for _, b in slow)
        later = [c for c in slow if c[0] >= first_failed]
        assert len(later) >= 2 and all(p[1] <= n[0] for p, n in zip(later, later[1:], strict=False)), later
    # when the registry is back (restarted with the same schema, or resumed)
    if fault == "killed":
        own_registry.start()
        again = SchemaRegistryClient({"url": own_registry.url}).register_schema(
            f"{topic}-value", Schema(ORDER_AVSC, "AVRO")
        )
        assert again == schema_id  # srfake numbers schemas from 1 again
    else:
        own_registry.resume()
    # then every order is handled, each key's in order, none dead-lettered, all committed, ready again
    assert wait_until(lambda: len(seen) >= 40, 60), len(seen)
    assert wait_until(lambda: health.check().ready, 30), health.check().to_dict()
    assert running.stop(30) and running.error is None, running.error
    assert sorted(o.id for o in seen) == sorted(f"o{i}" for i in range(40))
    last: dict[int, int] = {}
    for o in seen:
        key = int(o.id[1:]) % 8
        assert o.seq == last.get(key, -1) + 1, (o, last)
        last[key] = o.seq
    assert dead_letter.published == 0
    assert end_offsets(kafka_bootstrap, dlq, 1) == {0: 0}
    assert committed(kafka_bootstrap, group, topic, 2) == end_offsets(kafka_bootstrap, topic, 2)
