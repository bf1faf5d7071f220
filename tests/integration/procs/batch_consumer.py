"""A batch consumer process for the batch fault tests: runs until SIGTERM, logs what it did.

    python -m tests.integration.procs.batch_consumer BOOTSTRAP TOPIC GROUP LOGFILE POISON [--stall]

The batch handler fails the message whose value is ``POISON`` by name (``BatchFailed``), under
``Retry(max_attempts=2)`` and ``DeadLetter``. With ``--stall``, a batch holding the poison's first
attempt writes ``S pid`` and sleeps 60 s (the test SIGKILLs it then). Logs, unbuffered, one line per
event: ``R pid`` once ``run()`` starts, ``E pid partition offset`` for each message that ended done
(success), ``F pid partition offset attempt`` for each failed attempt.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from keyedconsumer.middleware import DeadLetter, Retry

from keyedconsumer import BatchFailed, KeyedConsumer, Message


def main() -> int:
    ap = argparse.ArgumentParser()
    for name in ("bootstrap", "topic", "group", "logfile", "poison"):
        ap.add_argument(name)
    ap.add_argument("--stall", action="store_true")
    a = ap.parse_args()
    fd = os.open(a.logfile, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    pid = os.getpid()
    poison = a.poison.encode()

    def handle(msgs: list[Message]) -> None:
        bad = {m for m in msgs if m.value == poison}
        if a.stall and any(m.attempt == 1 for m in bad):
            os.write(fd, f"S {pid}\n".encode())
            time.sleep(60)
        time.sleep(0.01)
        lines = [
            f"F {pid} {m.partition} {m.offset} {m.attempt}\n"
            if m in bad
            else f"E {pid} {m.partition} {m.offset}\n"
            for m in msgs
        ]
        os.write(fd, "".join(lines).encode())
        if bad:
            raise BatchFailed({m: RuntimeError("poison pill") for m in bad})

    c = KeyedConsumer(
        name=a.group,
        batch_handler=handle,
        brokers=[a.bootstrap],
        topics=[a.topic],
        concurrency=2,
        handler_batch_size=20,
        config={"auto.commit.interval.ms": 200},
        middlewares=[
            DeadLetter(brokers=[a.bootstrap]),
            Retry(max_attempts=2, initial_delay_s=0.05, jitter=0.0),
        ],
    )
    os.write(fd, f"R {pid}\n".encode())
    c.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
