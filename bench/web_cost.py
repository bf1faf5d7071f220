"""What an open dashboard page costs a running consumer (issue 18).

One topic is produced once; then, round-robin over ``--repeats`` rounds, a consumer (``KeyedConsumer``,
in-memory sequencer, a trivial handler) reads it all with a fresh group under three conditions:

- ``none``: no dashboard;
- ``page@5s``: ``keyedconsumer web`` (default refresh 5 s, Redis keys view on) running, with a
  headless Chromium showing the group's page (it polls its fragment every 5 s);
- ``page@1s``: the same with ``--refresh 1`` (the worst case: samples and polls every second).

The dashboard, the browser and the consumer share this machine, so the figure includes their CPU
(on a 2-core machine, the larger part of the cost); the brokers see the dashboard's admin
requests. Throughput is messages / (last message - first message). Reported: msg/s per run, the CPU
the dashboard process and the browser (chromedriver's process tree) used per second of the run (in
cores: 0.05 is 5% of one core), and per condition the median over rounds of (condition / ``none``
of the same round).

    flock -x -w 900 /tmp/kc-quiet.lock .venv/bin/python bench/web_cost.py --messages 600000 --repeats 3
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

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from keyedconsumer import KeyedConsumer, Message  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from common import _children  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")
from tests.e2e.conftest import CHROMEDRIVER, CHROMIUM, Dashboard  # noqa: E402


def produce(bootstrap: str, topic: str, n: int, keys: int) -> None:
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "batch.num.messages": 10000, "acks": 1})
    value = b"x" * 100
    for i in range(n):
        while True:
            try:
                p.produce(topic, key=f"k{i % keys}".encode(), value=value)
                break
            except BufferError:
                p.poll(0.05)
    p.flush(60)


def consume(bootstrap: str, topic: str, group: str, n: int, timeout_s: float = 300.0) -> float:
    """msg/s of one full read of ``topic`` by a new group."""
    lock = threading.Lock()
    seen = [0]
    first: list[float] = []
    last = [0.0]
    done = threading.Event()

    def handle(msg: Message) -> None:
        now = time.monotonic()
        with lock:
            if not first:
                first.append(now)
            seen[0] += 1
            last[0] = now
            if seen[0] >= n:
                done.set()

    consumer = KeyedConsumer(name=group, handler=handle, brokers=[bootstrap], topics=[topic], concurrency=16)
    t = threading.Thread(target=consumer.run, daemon=True)
    t.start()
    ok = done.wait(timeout_s)
    consumer.stop()
    t.join(60)
    if not ok:
        raise RuntimeError(f"only {seen[0]} of {n} messages in {timeout_s} s")
    return n / max(1e-6, last[0] - first[0])


def _tree(pid: int) -> list[int]:
    out, stack = [], [pid]
    while stack:
        p = stack.pop()
        out.append(p)
        stack.extend(_children(p))
    return out


def tree_cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of processes and all their descendants (living ones)."""
    total = 0.0
    for pid in {p for root in pids for p in _tree(root)}:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / TICKS
        except (OSError, IndexError, ValueError):
            pass
    return total


def browser() -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1280,900",
    ):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--brokers", default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092"))
    ap.add_argument("--redis", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--messages", type=int, default=600_000)
    ap.add_argument("--partitions", type=int, default=6)
    ap.add_argument("--keys", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "web_cost.json"))
    args = ap.parse_args()

    topic = f"webcost-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": args.brokers})
    admin.create_topics([NewTopic(topic, args.partitions, 1)])[topic].result(30)
    started = time.time()
    load_before = Path("/proc/loadavg").read_text().strip()
    produce(args.brokers, topic, args.messages, args.keys)
    runs: list[dict[str, Any]] = []
    driver = browser()
    tmp = Path("/tmp") / f"kc-web-cost-{os.getpid()}"
    tmp.mkdir(exist_ok=True)
    try:
        for rnd in range(args.repeats):
            for cond in ("none", "page@5s", "page@1s"):
                group = f"webcost-{uuid.uuid4().hex[:8]}"
                dash = None
                if cond != "none":
                    refresh = cond.split("@")[1].rstrip("s")
                    dash = Dashboard(
                        [
                            "--brokers",
                            args.brokers,
                            "--group",
                            group,
                            "--redis",
                            args.redis,
                            "--refresh",
                            refresh,
                        ],
                        {},
                        tmp / f"{group}.log",
                    )
                    driver.get(f"{dash.url}/groups/{group}")
                watched = [driver.service.process.pid] + ([dash.proc.pid] if dash is not None else [])
                cpu0, t0 = tree_cpu_s(watched), time.monotonic()
                try:
                    rate = consume(args.brokers, topic, group, args.messages)
                    cpu = (tree_cpu_s(watched) - cpu0) / (time.monotonic() - t0)
                finally:
                    if dash is not None:
                        driver.get("about:blank")
                        dash.stop()
                load = Path("/proc/loadavg").read_text().split()[0]
                runs.append(
                    {
                        "round": rnd,
                        "condition": cond,
                        "msg_per_s": round(rate),
                        "load1": float(load),
                        "dashboard_and_browser_cores": round(cpu, 4),
                    }
                )
                print(
                    f"round {rnd} {cond:8s} {rate:10.0f} msg/s  dashboard+browser {cpu * 100:5.1f}% of a core  load1 {load}",
                    flush=True,
                )
    finally:
        driver.quit()
        admin.delete_topics([topic])
    ratios: dict[str, list[float]] = {}
    for rnd in range(args.repeats):
        base = next(r["msg_per_s"] for r in runs if r["round"] == rnd and r["condition"] == "none")
        for r in runs:
            if r["round"] == rnd and r["condition"] != "none":
                ratios.setdefault(r["condition"], []).append(r["msg_per_s"] / base)
    summary: dict[str, Any] = {
        c: {
            "median_ratio": round(statistics.median(v), 3),
            "min": round(min(v), 3),
            "max": round(max(v), 3),
            "median_dashboard_and_browser_cores": statistics.median(
                r["dashboard_and_browser_cores"] for r in runs if r["condition"] == c
            ),
        }
        for c, v in ratios.items()
    }
    result = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "messages": args.messages,
        "partitions": args.partitions,
        "keys": args.keys,
        "repeats": args.repeats,
        "nproc": os.cpu_count(),
        "loadavg_before": load_before,
        "loadavg_after": Path("/proc/loadavg").read_text().strip(),
        "runs": runs,
        "ratio_to_none": summary,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
