"""A consumer process for crash tests: logs each handler start and end, unbuffered (O_APPEND).

    python -m tests.integration.procs.logging_consumer BOOTSTRAP TOPIC GROUP LOGFILE [CONCURRENCY]

Each line: ``S|E pid partition offset key monotonic_ns``. Runs until SIGTERM/SIGINT or killed.
"""

from __future__ import annotations

import os
import sys
import time

from keyedconsumer import KeyedConsumer, Message


def main() -> None:
    bootstrap, topic, group, logfile = sys.argv[1:5]
    concurrency = int(sys.argv[5]) if len(sys.argv) > 5 else 8
    fd = os.open(logfile, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    pid = os.getpid()

    def write(kind: str, msg: Message) -> None:
        key = (msg.key or b"-").decode()
        os.write(fd, f"{kind} {pid} {msg.partition} {msg.offset} {key} {time.monotonic_ns()}\n".encode())

    def handle(msg: Message) -> None:
        write("S", msg)
        time.sleep(0.003)
        write("E", msg)

    KeyedConsumer(
        name=group,
        handler=handle,
        brokers=[bootstrap],
        topics=[topic],
        concurrency=concurrency,
        config={"session.timeout.ms": 6000, "heartbeat.interval.ms": 1000},
    ).run()


if __name__ == "__main__":
    main()
