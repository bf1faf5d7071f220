"""A consumer process with the Redis sequencer whose wall clock is wrong, for the one-clock tests.

    python -m tests.integration.procs.skewed_consumer SKEW_S BOOTSTRAP TOPIC GROUP LOGFILE STATUSFILE REDIS_URL NAMESPACE
        [--no-scheduler] [--ttl S]

``time.time`` and ``time.time_ns`` are shifted by ``SKEW_S`` seconds (e.g. ``+20`` or ``-60``)
before ``keyedconsumer`` is imported, so every wall-clock read of this process is off by that much,
as on a machine whose clock is wrong (libfaketime cannot be used here). librdkafka (C) and
``time.monotonic`` are not shifted.

Logs, unbuffered (O_APPEND), one line per handler start:
``S pid key value attempt redis_ms monotonic_ns``, ``redis_ms`` being the Redis server's ``TIME``
(ms since the epoch) read first thing in the handler. Writes ``STATUSFILE`` (JSON: ``pid``,
``instance``, ``scheduler``, ``gone``, ``misfires``, ``moved``) every 0.1 s and once more after
the consumer stopped (SIGTERM: a graceful stop).
"""

from __future__ import annotations

import sys
import time

SKEW_S = float(sys.argv[1])
_real_time, _real_time_ns = time.time, time.time_ns
time.time = lambda: _real_time() + SKEW_S
time.time_ns = lambda: _real_time_ns() + int(SKEW_S * 1e9)

import argparse  # noqa: E402  (after the clock is shifted)
import json  # noqa: E402
import os  # noqa: E402
import threading  # noqa: E402

from keyedconsumer import KeyedConsumer, Message, RedisSequencer  # noqa: E402
from keyedconsumer.sequencing.store import connect  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    for name in ("skew_s", "bootstrap", "topic", "group", "logfile", "statusfile", "redis_url", "namespace"):
        ap.add_argument(name)
    ap.add_argument("--no-scheduler", action="store_true")
    ap.add_argument("--ttl", type=float, default=2.0)
    a = ap.parse_args()
    fd = os.open(a.logfile, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    pid = os.getpid()
    r = connect(a.redis_url, 5.0)

    def handle(msg: Message) -> None:
        sec, usec = r.time()
        redis_ms = sec * 1000 + usec / 1000
        key, value = (msg.key or b"-").decode(), (msg.value or b"-").decode()
        os.write(fd, f"S {pid} {key} {value} {msg.attempt} {redis_ms:.3f} {time.monotonic_ns()}\n".encode())

    seq = RedisSequencer(a.redis_url, a.namespace, lease_ttl_s=a.ttl, scheduler=not a.no_scheduler)

    def status() -> None:
        p = seq.parker
        doc = {
            "pid": pid,
            "instance": seq.instance_id,
            "scheduler": seq.is_scheduler,
            "gone": list(seq.gone_instances),
            "misfires": p.misfires if p is not None else 0,
            "moved": p.moved if p is not None else 0,
        }
        tmp = f"{a.statusfile}.{pid}.tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, a.statusfile)

    stop = threading.Event()

    def report() -> None:
        while not stop.wait(0.1):
            status()

    reporter = threading.Thread(target=report, daemon=True)
    reporter.start()
    KeyedConsumer(
        name=a.group,
        handler=handle,
        brokers=[a.bootstrap],
        topics=[a.topic],
        concurrency=4,
        sequencer=seq,
        config={"session.timeout.ms": 10000, "heartbeat.interval.ms": 1000},
    ).run()
    stop.set()
    reporter.join(5)
    status()


if __name__ == "__main__":
    main()
