"""What the audit trail and conflation cost (issue "Exactly-once results, conflation and an audit
trail"): msg/s of the same topic data, in one run, against a raw confluent-kafka loop.

    .venv/bin/python bench/features_cost.py --brokers 127.0.0.1:9092 [--size ci|full] [--repeats 3] [--out bench/results]

Two workloads, each on a topic produced once (8 partitions, 100-byte values):

- **audit**: N messages over 1,000 keys, a handler that does nothing (the worst case for a
  per-message overhead). Contenders: ``raw`` (one confluent-kafka ``Consumer``, ``consume`` in
  batches of 500, the handler called on each message, offsets stored and auto-committed: the
  floor of a Python loop), ``kc`` (``KeyedConsumer``, concurrency 16) and ``kc+audit`` (the same
  with ``Audit`` writing one record per message to an audit topic, default batching, and
  ``flush()`` before the clock stops, so every record is acknowledged).
- **conflation**: N/5 messages over 20 keys (a price feed), a handler that takes 1 ms (a
  downstream write). Contenders: ``kc`` and ``kc+conflate`` (``conflate=True``): msg/s counts
  offsets done (handled or conflated), and the handler calls are reported.

msg/s runs from the first handler start to the N-th message done. The group join and the stop are
not counted. Repeats are interleaved (raw, kc, kc+audit, then again) so that the machine's load
hits them alike; ratios are taken within a repeat and their median reported. Writes
``<out>/features_cost.json`` and ``<out>/features_cost.md`` with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient, NewTopic

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from keyedconsumer.middleware import Audit  # noqa: E402

from bench.common import ratio_rows, write_report  # noqa: E402
from keyedconsumer import KeyedConsumer, Message  # noqa: E402

SIZES = {"ci": 4000, "full": 100_000}
AUDIT_CONTENDERS = ("raw", "kc", "kc+audit")
CONFLATION_CONTENDERS = ("kc", "kc+conflate")


def _produce(brokers: str, topic: str, n: int, keys: int) -> None:
    p = Producer({"bootstrap.servers": brokers, "acks": "all", "enable.idempotence": True, "linger.ms": 20})
    for i in range(n):
        p.produce(topic, key=f"k{i % keys}".encode(), value=b"%08d" % i + b"x" * 92)
        if i % 10_000 == 0:
            p.poll(0)
    p.flush(60)


class _Clock:
    """First start and the moment the ``n``-th message was done (handled or conflated)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.done = 0
        self.calls = 0
        self.first = 0.0
        self.last = 0.0
        self._lock = threading.Lock()

    def start(self) -> None:
        if not self.first:
            with self._lock:
                self.first = self.first or time.perf_counter()

    def add(self, k: int = 1, call: bool = True) -> None:
        with self._lock:
            self.done += k
            self.calls += k if call else 0
            if self.done >= self.n and not self.last:
                self.last = time.perf_counter()

    def result(self) -> dict[str, Any]:
        seconds = (self.last or time.perf_counter()) - self.first
        return {
            "done": self.done,
            "handler_calls": self.calls,
            "seconds": round(seconds, 3),
            "msg_per_s": round(self.n / seconds, 1) if self.last and seconds > 0 else 0.0,
        }


def _run_raw(brokers: str, topic: str, n: int) -> dict[str, Any]:
    clock = _Clock(n)
    c = Consumer(
        {
            "bootstrap.servers": brokers,
            "group.id": f"feat-raw-{uuid.uuid4().hex[:8]}",
            "auto.offset.reset": "earliest",
            "enable.auto.offset.store": False,
            "enable.auto.commit": True,
            "fetch.wait.max.ms": 50,
        }
    )
    c.subscribe([topic])
    deadline = time.monotonic() + 600
    while clock.done < n and time.monotonic() < deadline:
        for m in c.consume(500, 0.2):
            if m.error() is None:
                clock.start()
                clock.add()  # the handler: nothing
                c.store_offsets(m)
    c.close()
    return clock.result()


def _run_kc(brokers: str, topic: str, n: int, name: str, audit_topic: str | None) -> dict[str, Any]:
    clock = _Clock(n)
    conflate = name == "kc+conflate"
    slow = audit_topic is None  # the conflation workload's handler takes 1 ms
    audit = Audit(topic=audit_topic, brokers=[brokers]) if name == "kc+audit" and audit_topic else None

    def handle(msg: Message) -> None:
        clock.start()
        if slow:
            time.sleep(0.001)
        clock.add()

    def conflated(msg: Message) -> None:
        clock.add(call=False)

    consumer = KeyedConsumer(
        name=f"feat-{name}-{uuid.uuid4().hex[:8]}",
        handler=handle,
        brokers=[brokers],
        topics=[topic],
        concurrency=16,
        middlewares=[audit] if audit else [],
        conflate=conflate,
        on_conflated=conflated if conflate else None,
    )
    t = threading.Thread(target=consumer.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 600
    while clock.done < n and t.is_alive() and time.monotonic() < deadline:
        time.sleep(0.005)
    if audit is not None:  # every record acknowledged before the clock stops
        audit.flush(60)
        clock.last = time.perf_counter() if clock.last else 0.0
    consumer.stop()
    t.join(60)
    out = clock.result()
    if audit is not None:
        out["audit_failed"] = audit.failed
        audit.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--brokers", default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092"))
    ap.add_argument("--size", choices=sorted(SIZES), default="full")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)
    n = SIZES[args.size]
    nc = n // 5
    repeats = args.repeats or (1 if args.size == "ci" else 3)
    admin = AdminClient({"bootstrap.servers": args.brokers})
    base = f"bench-feat-{uuid.uuid4().hex[:8]}"
    src, hot = f"{base}-audit", f"{base}-hot"
    for f in admin.create_topics([NewTopic(src, 8, 1), NewTopic(hot, 8, 1)]).values():
        f.result(30)
    _produce(args.brokers, src, n, 1000)
    _produce(args.brokers, hot, nc, 20)
    load_before = os.getloadavg()
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    runs: list[dict[str, Any]] = []
    topics = [src, hot]
    try:
        for rep in range(repeats):
            for name in AUDIT_CONTENDERS:
                audit_topic = f"{base}-trail-{rep}"
                if name == "kc+audit":
                    admin.create_topics([NewTopic(audit_topic, 4, 1)])[audit_topic].result(30)
                    topics.append(audit_topic)
                r = (
                    _run_raw(args.brokers, src, n)
                    if name == "raw"
                    else _run_kc(args.brokers, src, n, name, audit_topic)
                )
                r.update(workload="audit", contender=name, repeat=rep)
                runs.append(r)
                print(json.dumps(r), flush=True)
            for name in CONFLATION_CONTENDERS:
                r = _run_kc(args.brokers, hot, nc, name, None)
                r.update(workload="conflation", contender=name, repeat=rep)
                runs.append(r)
                print(json.dumps(r), flush=True)
    finally:
        for fut in admin.delete_topics(topics).values():
            try:
                fut.result(30)
            except Exception:  # cleanup only
                pass
    load_after = os.getloadavg()
    by = {(r["workload"], r["repeat"], r["contender"]): r["msg_per_s"] for r in runs}

    def ratio(w: str, a: str, b: str) -> list[float]:
        return [round(by[(w, i, a)] / by[(w, i, b)], 3) for i in range(repeats) if by.get((w, i, b))]

    ratios = {
        "audit: kc/raw": ratio("audit", "kc", "raw"),
        "audit: kc+audit/raw": ratio("audit", "kc+audit", "raw"),
        "audit: kc+audit/kc": ratio("audit", "kc+audit", "kc"),
        "conflation: kc+conflate/kc": ratio("conflation", "kc+conflate", "kc"),
    }
    med = {
        f"{w}: {c}": statistics.median(
            [r["msg_per_s"] for r in runs if r["workload"] == w and r["contender"] == c]
        )
        for w, cs in (("audit", AUDIT_CONTENDERS), ("conflation", CONFLATION_CONTENDERS))
        for c in cs
    }
    calls = {
        c: statistics.median(
            [r["handler_calls"] for r in runs if r["workload"] == "conflation" and r["contender"] == c]
        )
        for c in CONFLATION_CONTENDERS
    }
    ok = all(r["done"] >= (n if r["workload"] == "audit" else nc) for r in runs) and all(
        r.get("audit_failed", 0) == 0 for r in runs
    )
    result = {
        "size": args.size,
        "messages": n,
        "conflation_messages": nc,
        "repeats": repeats,
        "started": started,
        "nproc": os.cpu_count(),
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in load_after],
        "runs": runs,
        "ratios": ratios,
        "median_ratios": {k: statistics.median(v) for k, v in ratios.items() if v},
        "median_msg_per_s": med,
        "conflation_handler_calls": calls,
        "ok": ok,
    }
    lines = [
        "# The audit trail and conflation: their cost (`bench/features_cost.py`)",
        "",
        f"{started}; audit workload {n:,} messages over 1,000 keys, handler does nothing; conflation workload "
        f"{nc:,} messages over 20 keys, handler 1 ms; 8 partitions, concurrency 16, {repeats} repeat(s) "
        f"interleaved; {os.cpu_count()} cores, load average {result['load_before']} before, "
        f"{result['load_after']} after.",
        "",
        "| workload: contender | median msg/s |",
        "| --- | --- |",
        *[f"| {k} | {v:,.0f} |" for k, v in med.items()],
        "",
        *ratio_rows(ratios, result["median_ratios"]),
        "",
        f"Handler calls on the conflation workload (median): kc {calls['kc']:,.0f}, kc+conflate "
        f"{calls['kc+conflate']:,.0f} of {nc:,} messages.",
        "",
        "msg/s: from the first handler start to the N-th message done (handled or conflated); kc+audit "
        "until every audit record was acknowledged too. raw: one confluent-kafka Consumer, consume(500), "
        "offsets stored and auto-committed, no ordering or concurrency.",
        "",
    ]
    write_report(Path(args.out), "features_cost", result, lines)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
