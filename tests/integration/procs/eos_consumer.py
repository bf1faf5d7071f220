"""A consumer process that produces one result record per input, for the exactly-once fault tests.

    python -m tests.integration.procs.eos_consumer BOOTSTRAP GROUP IN OUT MODE TXN_ID MARKER DIR

``MODE`` ``tx``: ``transactional=True`` with ``transactional_id=TXN_ID``; ``plain``: at-least-once
``msg.produce``. Each input ``key:seq`` writes ``key:seq`` to ``OUT`` under the same key. The input
whose value is ``MARKER`` is the kill point: the first time its handler returned (without
``transactional``, its record is acknowledged by then), an outer middleware writes
``DIR/marker-PID`` and blocks, so the message never counts done and its offset is never committed
past it; the test SIGKILLs this process then. Later runs of the marker (after the restart) do not
block. Prints ``started`` once subscribed; SIGTERM stops it gracefully.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from keyedconsumer import KeyedConsumer, Message


def main() -> int:
    bootstrap, group, in_topic, out_topic, mode, txn_id, marker, folder = sys.argv[1:9]
    hold = threading.Event()
    done_once = Path(folder) / "marker-done"

    def handle(msg: Message) -> None:
        time.sleep(0.002)  # a little work, so a kill lands mid-run
        msg.produce(out_topic, msg.key, msg.value)

    def kill_point(inner: Callable[[Message], Any]) -> Callable[[Message], Any]:
        def outer(msg: Message) -> Any:
            result = inner(msg)
            if msg.value == marker.encode() and not done_once.exists():
                done_once.write_text(str(os.getpid()))
                (Path(folder) / f"marker-{os.getpid()}").write_text("returned")
                hold.wait()  # never set: the SIGKILL ends it
            return result

        return outer

    options: dict[str, Any] = {"transactional": True, "transactional_id": txn_id} if mode == "tx" else {}
    consumer = KeyedConsumer(
        name=group,
        handler=handle,
        middlewares=[kill_point],
        brokers=[bootstrap],
        topics=[in_topic],
        concurrency=4,
        config={"session.timeout.ms": 6000, "heartbeat.interval.ms": 500},
        **options,
    )
    print("started", flush=True)
    consumer.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
