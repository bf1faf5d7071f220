"""A consumer process that produces one result record per input, for the exactly-once fault tests.

    python -m tests.integration.procs.eos_consumer BOOTSTRAP GROUP IN OUT MODE TXN_ID MARKER DIR
        [--protocol classic|consumer] [--shutdown-s S] [--transaction-timeout-s S]
        [--sleep S] [--config NAME=VALUE ...] [--log-file FILE]

``MODE`` ``tx``: ``transactional=True`` with ``transactional_id=TXN_ID``; ``plain``: at-least-once
``msg.produce``. Each input ``key:seq`` writes ``key:seq`` to ``OUT`` under the same key. The input
whose value is ``MARKER`` is the kill point: the first time its handler returned (without
``transactional``, its record is acknowledged by then), an outer middleware writes
``DIR/marker-PID`` and blocks, so the message never counts done and its offset is never committed
past it; the test SIGKILLs this process then. Later runs of the marker (after the restart) do not
block; an empty ``MARKER`` has none. ``--config`` adds librdkafka properties; ``--log-file`` takes the
log at INFO (else warnings go to stderr). Prints ``started`` once
built; SIGTERM stops it gracefully. When ``run()`` returned, ``DIR/exit-PID`` holds ``ok`` or the
name and message of what it raised (exit status 3).
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from keyedconsumer import KeyedConsumer, Message

ROOT = Path(__file__).resolve().parents[3]


def spawn(*args: str) -> subprocess.Popen[bytes]:
    """Start this consumer as a process (the arguments as on its command line; stdout discarded)."""
    return subprocess.Popen(
        [sys.executable, "-m", "tests.integration.procs.eos_consumer", *args],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    for name in ("bootstrap", "group", "in_topic", "out_topic", "mode", "txn_id", "marker", "folder"):
        ap.add_argument(name)
    ap.add_argument("--protocol", default="classic")
    ap.add_argument("--shutdown-s", type=float, default=30.0)
    ap.add_argument("--transaction-timeout-s", type=float, default=10.0)
    ap.add_argument("--sleep", type=float, default=0.002)
    ap.add_argument("--config", action="append", default=[])
    ap.add_argument("--log-file", default=None)
    a = ap.parse_args()
    logging.basicConfig(
        level=logging.INFO if a.log_file else logging.WARNING,
        filename=a.log_file,
        format="%(asctime)s %(process)d %(levelname)s %(name)s %(message)s",
    )
    hold = threading.Event()
    folder = Path(a.folder)
    done_once = folder / "marker-done"

    def handle(msg: Message) -> None:
        time.sleep(a.sleep)  # a little work, so a kill lands mid-run
        msg.produce(a.out_topic, msg.key, msg.value)

    def kill_point(inner: Callable[[Message], Any]) -> Callable[[Message], Any]:
        def outer(msg: Message) -> Any:
            result = inner(msg)
            if a.marker and msg.value == a.marker.encode() and not done_once.exists():
                done_once.write_text(str(os.getpid()))
                (folder / f"marker-{os.getpid()}").write_text("returned")
                hold.wait()  # never set: the SIGKILL ends it
            return result

        return outer

    config: dict[str, Any] = {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500}
    if a.protocol == "consumer":  # KIP-848: the broker sets the session timeout and heartbeats
        config = {"group.protocol": "consumer"}
    config.update(dict(item.split("=", 1) for item in a.config))
    options: dict[str, Any] = (
        {
            "transactional": True,
            "transactional_id": a.txn_id,
            "transaction_timeout_s": a.transaction_timeout_s,
        }
        if a.mode == "tx"
        else {}
    )
    consumer = KeyedConsumer(
        name=a.group,
        handler=handle,
        middlewares=[kill_point],
        brokers=[a.bootstrap],
        topics=[a.in_topic],
        concurrency=4,
        shutdown_timeout_s=a.shutdown_s,
        config=config,
        **options,
    )
    print("started", flush=True)
    detail, rc = "ok", 0
    try:
        consumer.run()
    except Exception as exc:
        detail, rc = f"{type(exc).__name__}: {exc}", 3
    (folder / f"exit-{os.getpid()}").write_text(detail)
    return rc


if __name__ == "__main__":
    sys.exit(main())
