"""A consumer process that parks failing keys in Redis, for the recovery tests.

    python -m tests.integration.procs.park_consumer BOOTSTRAP TOPIC GROUP LOGFILE REDIS_URL NAMESPACE
        [--fail-value V --fail-times N [--fail-once-file F]] [--slow-key K --slow-s S]
        [--retry-delay S] [--seen-retention S] [--session-ms MS] [--commit-ms MS]

A message whose value is ``V`` fails its first ``N`` attempts (with ``--fail-once-file``: only while
file ``F`` does not exist; the first failure creates it, so a copy of the message parked twice fails
once in all). Messages of key ``K`` take ``S``
seconds, so a test can kill the process while it drains that key. Logs, unbuffered (O_APPEND), one line per event:
``S|E|F pid partition offset key value attempt token monotonic_ns`` (F: the attempt failed).
"""

from __future__ import annotations

import argparse
import os
import time

from keyedconsumer.middleware import Retry

from keyedconsumer import KeyedConsumer, Message, RedisSequencer


def main() -> None:
    ap = argparse.ArgumentParser()
    for name in ("bootstrap", "topic", "group", "logfile", "redis_url", "namespace"):
        ap.add_argument(name)
    ap.add_argument("--fail-value", default="")
    ap.add_argument("--fail-times", type=int, default=0)
    ap.add_argument("--slow-key", default="")
    ap.add_argument("--slow-s", type=float, default=0.0)
    ap.add_argument("--ttl", type=float, default=2.0)
    ap.add_argument("--fail-once-file", default="")
    ap.add_argument("--retry-delay", type=float, default=0.5)
    ap.add_argument("--seen-retention", type=float, default=7 * 24 * 3600.0)
    ap.add_argument("--session-ms", type=int, default=10000)
    ap.add_argument("--commit-ms", type=int, default=5000)
    a = ap.parse_args()
    fd = os.open(a.logfile, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    pid = os.getpid()

    def log(kind: str, msg: Message) -> None:
        line = (
            f"{kind} {pid} {msg.partition} {msg.offset} {(msg.key or b'-').decode()} {(msg.value or b'-').decode()} "
            f"{msg.attempt} {msg.fencing_token} {time.monotonic_ns()}\n"
        )
        os.write(fd, line.encode())

    def handle(msg: Message) -> None:
        log("S", msg)
        if a.slow_key and msg.key == a.slow_key.encode():
            time.sleep(a.slow_s)
        if a.fail_value and msg.value == a.fail_value.encode() and msg.attempt <= a.fail_times:
            if not a.fail_once_file or not os.path.exists(a.fail_once_file):
                if a.fail_once_file:
                    open(a.fail_once_file, "w").close()
                log("F", msg)
                raise ConnectionError(f"attempt {msg.attempt} fails")
        log("E", msg)

    seq = RedisSequencer(a.redis_url, a.namespace, lease_ttl_s=a.ttl, seen_retention_s=a.seen_retention)
    KeyedConsumer(
        name=a.group,
        handler=handle,
        brokers=[a.bootstrap],
        topics=[a.topic],
        concurrency=8,
        sequencer=seq,
        middlewares=[
            Retry(max_attempts=None, initial_delay_s=a.retry_delay, multiplier=1.0, jitter=0, park=True)
        ],
        config={
            "session.timeout.ms": a.session_ms,
            "heartbeat.interval.ms": 1000,
            "auto.commit.interval.ms": a.commit_ms,
        },
    ).run()


if __name__ == "__main__":
    main()
