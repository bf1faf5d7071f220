"""CPU and context switches a message of one keyedconsumer instance, for an A/B of two engines.

    .venv/bin/python bench/wakeups.py [--engine PATH ...] [--concurrency 16] [--mode sync|async]
                                      [--sleep-ms 5] [--messages 20000] [--keys 5000] [--gaps]

Produces ``--messages`` records of 100 B over ``--keys`` keys to a new 8-partition topic on
``--brokers`` (default 127.0.0.1:9092), then for each ``--engine`` (a checkout holding
``keyedconsumer/__init__.py``; default: this one; e.g. a ``git worktree`` of an older commit) runs
one instance in a subprocess: a handler that sleeps ``--sleep-ms`` milliseconds (0: a no-op), a
fresh consumer group, until 80 % of the records are handled. Between 20 % and 80 % it measures the
process's CPU time (user + system, ``os.times``) and the context switches of all its threads
(``/proc/<pid>/task/*/status``, voluntary and involuntary), and prints one JSON line per engine:
msg/s, CPU seconds per 1,000 messages, context switches a message, and those of the owner thread
and of the worker threads apart.

With ``--gaps`` each handler run in that window is timed, and per worker (thread, or task in async
mode) the gap between the end of one run and the start of its next: ``handler_ms`` (p50, p90, p99,
mean; for a sleeping handler its sleep plus the wait for the GIL after it) and ``gap_ms`` (the
worker waiting for its next message: for the owner to hand one over, or for the GIL). Adds two
clock reads a message.

Used for the engine v2 wake-up fix (bench/README.md, "Engine v2 ..."): a 5 ms handler costs one
context switch a message for its sleep; what the engine adds beyond that is its hand-over.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CHILD = r"""
import asyncio, glob, json, os, sys, threading, time
engine, brokers, topic, target, conc, mode, sleep_ms, gaps = sys.argv[1:9]
sys.path.insert(0, engine)
import keyedconsumer
from keyedconsumer import KeyedConsumer
assert keyedconsumer.__file__.startswith(engine), keyedconsumer.__file__
target, conc, sleep_s = int(target), int(conc), float(sleep_ms) / 1000

def switches():
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {"owner": 0, "workers": 0, "other": 0}
    for d in glob.glob(f"/proc/{os.getpid()}/task/*"):
        tid = int(d.rsplit("/", 1)[1])
        try:
            n = sum(int(l.split()[1]) for l in open(d + "/status") if "ctxt_switches:" in l)
        except FileNotFoundError:
            continue
        name = names.get(tid, "")
        kind = "owner" if tid == os.getpid() else "workers" if name.startswith("keyedconsumer-") else "other"
        out[kind] += n
    return out

def snap():
    t = os.times()
    return t.user + t.system, switches(), time.perf_counter()

count, lock, marks = 0, threading.Lock(), {}
w0, w1 = target // 4, target
spans = {}  # --gaps: per worker (thread, or task), (start, end) of each handler run in the window

def bump():
    global count
    with lock:
        count += 1
        c = count
    if c in (w0, w1):
        marks[c] = snap()
    if c == w1:
        kc.stop()

def span(who, t0):
    if w0 in marks and w1 not in marks:
        spans.setdefault(who, []).append((t0, time.perf_counter()))

if mode == "sync":
    def handler(msg):
        t0 = time.perf_counter()
        if sleep_s:
            time.sleep(sleep_s)
        if gaps == "1":
            span(threading.get_ident(), t0)
        bump()
else:
    async def handler(msg):
        t0 = time.perf_counter()
        if sleep_s:
            await asyncio.sleep(sleep_s)
        if gaps == "1":
            span(id(asyncio.current_task()), t0)
        bump()

def stats(xs):
    xs = sorted(xs)
    if not xs:
        return None
    q = lambda p: round(xs[min(len(xs) - 1, int(len(xs) * p))] * 1000, 3)
    return {"p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "mean": round(sum(xs) / len(xs) * 1000, 3)}

kc = KeyedConsumer(handler=handler, name="wakeups-" + os.urandom(4).hex(), brokers=[brokers],
                   topics=[topic], concurrency=conc)
kc.run()
(c0, s0, t0), (c1, s1, t1) = marks[w0], marks[w1]
n = w1 - w0
print(json.dumps({
    "engine": engine, "concurrency": conc, "mode": mode, "sleep_ms": float(sleep_ms),
    "msgs_per_s": round(n / (t1 - t0)),
    "cpu_s_per_1000": round((c1 - c0) / n * 1000, 4),
    "switches_per_msg": round((sum(s1.values()) - sum(s0.values())) / n, 2),
    "by_thread": {k: round((s1[k] - s0[k]) / n, 2) for k in s0},
    "load_1min": os.getloadavg()[0],
    **({"handler_ms": stats([b - a for r in spans.values() for a, b in r]),
        "gap_ms": stats([c - b for r in spans.values() for (a, b), (c, d) in zip(r, r[1:])])}
       if gaps == "1" else {}),
}))
"""


def produce(brokers: str, topic: str, n: int, keys: int) -> None:
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": brokers})
    for fut in admin.create_topics([NewTopic(topic, num_partitions=8, replication_factor=1)]).values():
        fut.result(30)
    p = Producer({"bootstrap.servers": brokers, "linger.ms": 20, "queue.buffering.max.messages": 1_000_000})
    value = b"v" * 100
    for i in range(n):
        p.produce(topic, key=b"k%d" % (i % keys), value=value)
        if i % 10_000 == 0:
            p.poll(0)
    p.flush(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", action="append", help="a checkout to import keyedconsumer from (repeatable)")
    ap.add_argument("--brokers", default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092"))
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--mode", choices=("sync", "async"), default="sync")
    ap.add_argument("--sleep-ms", type=float, default=5.0)
    ap.add_argument("--messages", type=int, default=20_000)
    ap.add_argument("--keys", type=int, default=5_000)
    ap.add_argument(
        "--gaps",
        action="store_true",
        help="also time each handler run and the gap between two runs of one worker (thread or task)",
    )
    args = ap.parse_args()
    engines = [os.path.abspath(e) for e in (args.engine or [ROOT])]
    for e in engines:
        if not os.path.exists(os.path.join(e, "keyedconsumer", "__init__.py")):
            raise SystemExit(f"wakeups: {e} holds no keyedconsumer/__init__.py")
    topic = "wakeups-" + uuid.uuid4().hex[:8]
    produce(args.brokers, topic, args.messages, args.keys)
    target = args.messages * 4 // 5
    for e in engines:
        cmd = [sys.executable, "-c", CHILD, e, args.brokers, topic, str(target), str(args.concurrency)]
        cmd += [args.mode, str(args.sleep_ms), "1" if args.gaps else "0"]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600).stdout
        print(out.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
