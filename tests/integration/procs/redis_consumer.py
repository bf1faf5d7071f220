"""A consumer process with the Redis sequencer, for multi-instance tests.

    python -m tests.integration.procs.redis_consumer BOOTSTRAP TOPIC GROUP LOGFILE REDIS_URL NAMESPACE
        [--ttl S] [--renew-s S] [--sleep S] [--slow-key KEY --slow-s S] [--concurrency N]
        [--session-ms MS] [--log PATH]

``--renew-s``: the sequencer's ``renew_interval_s`` (default a quarter of ``--ttl``).

Logs, unbuffered (O_APPEND), one line per event:
``S|E pid partition offset key token monotonic_ns`` for handler start/end and
``W pid partition offset key token ok|refused monotonic_ns`` for the fenced write each handler makes
to an external store (a Redis hash per key that accepts a write only with a token at least as high
as the highest it has seen: how a handler guards its own writes with ``msg.fencing_token``).
"""

from __future__ import annotations

import argparse
import logging
import os
import time

from keyedconsumer import KeyedConsumer, Message, RedisSequencer
from keyedconsumer.sequencing.store import connect

FENCED_WRITE = """
local top = tonumber(redis.call('HGET', KEYS[1], 'token') or '0')
if tonumber(ARGV[1]) < top then return 0 end
redis.call('HSET', KEYS[1], 'token', ARGV[1], 'value', ARGV[2])
return 1
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    for name in ("bootstrap", "topic", "group", "logfile", "redis_url", "namespace"):
        ap.add_argument(name)
    ap.add_argument("--ttl", type=float, default=2.0)
    ap.add_argument("--renew-s", type=float, default=None)
    ap.add_argument("--sleep", type=float, default=0.002)
    ap.add_argument("--slow-key", default="")
    ap.add_argument("--slow-s", type=float, default=0.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--session-ms", type=int, default=45000)
    ap.add_argument("--log", default="", help="the package's log lines (INFO and up) go to this file")
    a = ap.parse_args()
    if a.log:
        logging.basicConfig(
            filename=a.log, level=logging.INFO, format="%(created).6f %(levelname)s %(message)s"
        )
    fd = os.open(a.logfile, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    pid = os.getpid()
    store = connect(a.redis_url, 5.0)
    fenced = store.register_script(FENCED_WRITE)

    def log(kind: str, msg: Message, extra: str = "") -> None:
        key = (msg.key or b"-").decode()
        line = f"{kind} {pid} {msg.partition} {msg.offset} {key} {msg.fencing_token} {extra}{time.monotonic_ns()}\n"
        os.write(fd, line.encode())

    def handle(msg: Message) -> None:
        log("S", msg)
        slow = a.slow_key and msg.key == a.slow_key.encode()
        time.sleep(a.slow_s if slow else a.sleep)
        ok = fenced(
            keys=[f"ext:{a.namespace}:{(msg.key or b'-').decode()}"], args=[msg.fencing_token, msg.offset]
        )
        log("W", msg, "ok " if ok else "refused ")
        log("E", msg)

    seq = RedisSequencer(a.redis_url, a.namespace, lease_ttl_s=a.ttl, renew_interval_s=a.renew_s)
    KeyedConsumer(
        name=a.group,
        handler=handle,
        brokers=[a.bootstrap],
        topics=[a.topic],
        concurrency=a.concurrency,
        sequencer=seq,
        config={
            "session.timeout.ms": a.session_ms,
            "heartbeat.interval.ms": 1000,
            "auto.commit.interval.ms": 500,
        },
    ).run()


if __name__ == "__main__":
    main()
