"""A consumer process for the tests of bounded stops: runs until SIGTERM, logs what it did.

    python -m tests.integration.procs.stop_consumer BOOTSTRAP TOPIC GROUP LOGFILE
        [--redis URL --namespace NS] [--shutdown-s S] [--sleep S] [--concurrency N] [--protocol P]
        [--hold-key KEY]

``--hold-key``: the handler of a message with that key never returns (it holds its partition's
first unfinished offset, as a hot key's slow message does).

Logs, unbuffered (O_APPEND), one line per event: ``R pid`` once ``run()`` started, ``E pid partition
offset`` for each handler end, ``X pid monotonic_ns exit-detail`` when ``run()`` returned (what it
raised, or ``ok``). The process exits 0 when ``run()`` returned normally.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from keyedconsumer import KeyedConsumer, Message, RedisSequencer


def main() -> int:
    ap = argparse.ArgumentParser()
    for name in ("bootstrap", "topic", "group", "logfile"):
        ap.add_argument(name)
    ap.add_argument("--redis", default="")
    ap.add_argument("--namespace", default="")
    ap.add_argument("--shutdown-s", type=float, default=3.0)
    ap.add_argument("--sleep", type=float, default=0.005)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--protocol", default="classic")
    ap.add_argument("--hold-key", default=None)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    fd = os.open(a.logfile, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    pid = os.getpid()

    hold = a.hold_key.encode() if a.hold_key is not None else None

    def handle(msg: Message) -> None:
        if hold is not None and msg.key == hold:
            time.sleep(3600)
        time.sleep(a.sleep)
        os.write(fd, f"E {pid} {msg.partition} {msg.offset}\n".encode())

    config: dict[str, str | int] = {
        "session.timeout.ms": 6000,
        "heartbeat.interval.ms": 500,
        "auto.commit.interval.ms": 500,
    }
    if a.protocol == "consumer":
        config = {"group.protocol": "consumer", "auto.commit.interval.ms": 500}
    seq = RedisSequencer(a.redis, a.namespace, lease_ttl_s=3.0) if a.redis else None
    c = KeyedConsumer(
        name=a.group,
        handler=handle,
        brokers=[a.bootstrap],
        topics=[a.topic],
        concurrency=a.concurrency,
        shutdown_timeout_s=a.shutdown_s,
        revoke_timeout_s=2.0,
        sequencer=seq,
        config=config,
    )
    os.write(fd, f"R {pid}\n".encode())
    detail, rc = "ok", 0
    try:
        c.run()
    except Exception as exc:
        detail, rc = type(exc).__name__, 3
    os.write(fd, f"X {pid} {time.monotonic_ns()} {detail}\n".encode())
    return rc


if __name__ == "__main__":
    sys.exit(main())
