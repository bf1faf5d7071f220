"""A consumer process whose revoke is under way at a moment the test can see, for the bounded-stop
test of a stop during a revoke.

    python -m tests.integration.procs.revoke_consumer BOOTSTRAP TOPIC GROUP LOGFILE [--shutdown-s S]

Runs every message at once (concurrency 8). A partition's offset 0 ends 0.5 s after the engine's
``on_revoke`` started (so the revoke has a new offset to commit); every other message runs 10 s.
Logs, unbuffered (O_APPEND): ``S pid partition offset`` at each handler start, ``V pid`` when
``on_revoke`` starts (seen through a wrapping client: the real one, plus that line), ``X pid
monotonic_ns detail`` when ``run()`` returned. Stops gracefully on SIGTERM; exits 0 when ``run()``
returned normally.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from typing import Any

from keyedconsumer import KeyedConsumer, Message
from keyedconsumer.kafka.client import connect


def main() -> int:
    ap = argparse.ArgumentParser()
    for name in ("bootstrap", "topic", "group", "logfile"):
        ap.add_argument(name)
    ap.add_argument("--shutdown-s", type=float, default=3.0)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    fd = os.open(a.logfile, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    pid = os.getpid()
    revoking = threading.Event()

    class RevokeSeen:
        """The real client; says when the engine's ``on_revoke`` starts."""

        def __init__(self, inner: Any) -> None:
            self._inner = inner

        def subscribe(self, topics: Any, listener: Any) -> None:
            class Listener:
                def on_assign(self, partitions: Any) -> None:
                    listener.on_assign(partitions)

                def on_lost(self, partitions: Any) -> None:
                    listener.on_lost(partitions)

                def on_revoke(self, partitions: Any) -> None:
                    if not revoking.is_set():
                        revoking.set()
                        os.write(fd, f"V {pid}\n".encode())
                    listener.on_revoke(partitions)

            self._inner.subscribe(topics, Listener())

        def __getattr__(self, name: str) -> Any:
            return getattr(self._inner, name)

    def handle(msg: Message) -> None:
        os.write(fd, f"S {pid} {msg.partition} {msg.offset}\n".encode())
        if msg.offset == 0:
            revoking.wait(60)
            time.sleep(0.5)
            return
        time.sleep(10.0)

    c = KeyedConsumer(
        name=a.group,
        handler=handle,
        brokers=[a.bootstrap],
        topics=[a.topic],
        concurrency=8,
        shutdown_timeout_s=a.shutdown_s,
        revoke_timeout_s=3.0,
        client_factory=lambda conf, on_error: RevokeSeen(connect(conf, on_error)),
        config={"session.timeout.ms": 6000, "heartbeat.interval.ms": 500, "auto.commit.interval.ms": 500},
    )
    detail, rc = "ok", 0
    try:
        c.run()
    except Exception as exc:
        detail, rc = type(exc).__name__, 3
    os.write(fd, f"X {pid} {time.monotonic_ns()} {detail}\n".encode())
    return rc


if __name__ == "__main__":
    sys.exit(main())
