"""What producing results costs, and what exactly-once costs on top: msg/s of the same workload with
a handler that produces nothing, one that produces one record per message at-least-once
(``msg.produce``: the message counts done once the broker acknowledged it), and the same with
``transactional=True`` (the records and offsets committed in one transaction every
``transaction_interval_s``).

    .venv/bin/python bench/eos_cost.py --brokers 127.0.0.1:9092 [--size ci|full] [--repeats 3] [--out bench/results]

One input topic (8 partitions, N messages over 1,000 keys, 100-byte values) is produced once; each
contender runs on it with a fresh consumer group in this process (``KeyedConsumer``, concurrency
16, a plain handler), repeats interleaved (none, plain, tx-0.1s, tx-1s, then again), so a change of
the machine's load hits them alike. msg/s runs from the first handler start to the moment the N-th
result is readable by a ``read_committed`` reader (running meanwhile, in this process); for
``none``, to the N-th message handled. The group join and the stop are not counted. The ratios
(tx / plain, plain / none) are computed within a repeat, then the median is reported. Each run's
output is checked: the reader must have seen N records (each producing contender writes N).

Writes ``<out>/eos_cost.json`` and ``<out>/eos_cost.md`` with the machine's load average.
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

from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import ratio_rows, write_report  # noqa: E402
from keyedconsumer import KeyedConsumer, Message  # noqa: E402

SIZES = {"ci": 2000, "full": 50_000}
CONTENDERS: dict[str, dict[str, Any]] = {
    "none": {},
    "plain": {},
    "tx-0.1s": {"transactional": True, "transaction_interval_s": 0.1},
    "tx-1s": {"transactional": True, "transaction_interval_s": 1.0},
}


def _produce_input(brokers: str, topic: str, n: int) -> None:
    p = Producer({"bootstrap.servers": brokers, "acks": "all", "enable.idempotence": True, "linger.ms": 20})
    for i in range(n):
        p.produce(topic, key=f"k{i % 1000}".encode(), value=b"%08d" % i + b"x" * 92)
        if i % 10_000 == 0:
            p.poll(0)
    p.flush(60)


class _Reader:
    """Counts the ``read_committed`` records of ``topic`` in a thread; notes when ``expect`` were seen."""

    def __init__(self, brokers: str, topic: str, partitions: int, expect: int) -> None:
        self.count = 0
        self.reached_at = 0.0
        self._expect = expect
        self._stop = threading.Event()
        self._c = Consumer(
            {
                "bootstrap.servers": brokers,
                "group.id": f"eos-bench-reader-{uuid.uuid4().hex[:8]}",
                "isolation.level": "read_committed",
                "enable.auto.commit": False,
            }
        )
        self._c.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            self.count += sum(1 for m in self._c.consume(1000, 0.1) if m.error() is None)
            if self.count >= self._expect and not self.reached_at:
                self.reached_at = time.perf_counter()

    def close(self, linger_s: float = 1.0) -> int:
        time.sleep(linger_s)  # anything more (a duplicate) would show
        self._stop.set()
        self._t.join(10)
        self._c.close()
        return self.count


def _run(brokers: str, src: str, out: str, n: int, name: str) -> dict[str, Any]:
    reader = _Reader(brokers, out, 4, n) if name != "none" else None
    handled = [0]
    first = [0.0]
    last = [0.0]
    lock = threading.Lock()
    produces = name != "none"

    def handle(msg: Message) -> None:
        if produces:
            msg.produce(out, msg.key, msg.value)
        with lock:
            if not first[0]:
                first[0] = time.perf_counter()
            handled[0] += 1
            if handled[0] == n:
                last[0] = time.perf_counter()

    consumer = KeyedConsumer(
        name=f"eos-bench-{name}-{uuid.uuid4().hex[:8]}",
        handler=handle,
        brokers=[brokers],
        topics=[src],
        concurrency=16,
        **CONTENDERS[name],
    )
    t = threading.Thread(target=consumer.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 600
    while (
        time.monotonic() < deadline
        and t.is_alive()
        and (handled[0] < n if reader is None else not reader.reached_at)
    ):
        time.sleep(0.005)
    end = last[0] if reader is None else reader.reached_at
    consumer.stop()
    t.join(60)
    seconds = (end or time.perf_counter()) - first[0]
    return {
        "contender": name,
        "handled": handled[0],
        "seconds": round(seconds, 3),
        "msg_per_s": round(n / seconds, 1) if seconds > 0 and end else 0.0,
        "records_read_committed": reader.close() if reader is not None else 0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--brokers", default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092"))
    ap.add_argument("--size", choices=sorted(SIZES), default="full")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)
    n = SIZES[args.size]
    repeats = args.repeats or (1 if args.size == "ci" else 3)
    admin = AdminClient({"bootstrap.servers": args.brokers})
    src = f"bench-eos-{uuid.uuid4().hex[:8]}"
    admin.create_topics([NewTopic(src, 8, 1)])[src].result(30)
    _produce_input(args.brokers, src, n)
    load_before = os.getloadavg()
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    runs: list[dict[str, Any]] = []
    topics = [src]
    try:
        for rep in range(repeats):
            for name in CONTENDERS:
                out = f"{src}-out-{name.replace('.', '')}-{rep}"
                admin.create_topics([NewTopic(out, 4, 1)])[out].result(30)
                topics.append(out)
                r = _run(args.brokers, src, out, n, name)
                r["repeat"] = rep
                runs.append(r)
                print(json.dumps(r), flush=True)
    finally:
        for fut in admin.delete_topics(topics).values():
            try:
                fut.result(30)
            except Exception:
                pass
    load_after = os.getloadavg()
    by = {(r["repeat"], r["contender"]): r["msg_per_s"] for r in runs}

    def ratio(a: str, b: str) -> list[float]:
        return [round(by[(i, a)] / by[(i, b)], 3) for i in range(repeats) if by.get((i, b))]

    ratios = {
        "plain/none": ratio("plain", "none"),
        "tx-0.1s/plain": ratio("tx-0.1s", "plain"),
        "tx-1s/plain": ratio("tx-1s", "plain"),
        "tx-0.1s/none": ratio("tx-0.1s", "none"),
    }
    result = {
        "size": args.size,
        "messages": n,
        "repeats": repeats,
        "started": started,
        "nproc": os.cpu_count(),
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in load_after],
        "runs": runs,
        "ratios": ratios,
        "median_ratios": {k: statistics.median(v) for k, v in ratios.items() if v},
        "median_msg_per_s": {
            c: statistics.median([r["msg_per_s"] for r in runs if r["contender"] == c]) for c in CONTENDERS
        },
    }
    ok = all(r["handled"] >= n for r in runs) and all(
        r["records_read_committed"] >= n for r in runs if r["contender"] != "none"
    )
    result["ok"] = ok
    lines = [
        "# Producing results: at-least-once vs exactly-once (`bench/eos_cost.py`)",
        "",
        f"{started}, {n} messages over 1,000 keys, 8 partitions, concurrency 16, one 100-byte record produced "
        f"per message, {repeats} repeat(s) interleaved; {os.cpu_count()} cores, load average "
        f"{result['load_before']} before, {result['load_after']} after.",
        "",
        "| contender | median msg/s |",
        "| --- | --- |",
        *[f"| {c} | {v:,.0f} |" for c, v in result["median_msg_per_s"].items()],
        "",
        *ratio_rows(ratios, result["median_ratios"]),
        "",
        "msg/s: from the first handler start to the N-th result readable by a `read_committed` reader "
        "(`none`: to the N-th message handled). "
        "`none`: the handler produces nothing. `plain`: `msg.produce`, the message counts done once its "
        "record is acknowledged (acks=all, idempotent, `linger.ms` 5). `tx-*`: `transactional=True` with "
        "`transaction_interval_s` 0.1 / 1.0: records and offsets committed in one transaction per interval.",
        "",
    ]
    write_report(Path(args.out), "eos_cost", result, lines)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
