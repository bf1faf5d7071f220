"""The harness's producer: an idempotent ``acks=all`` producer that logs every acknowledged record.

    python -m tests.faults.producer RUN_DIR backlog|steady

``backlog`` produces the first ``backlog_share`` of the plan as fast as it can and exits when every
record is acknowledged; ``steady`` produces the rest evenly over ``steady_s`` (from ``run.json``).
Each acknowledgement is appended (``O_APPEND``, unbuffered) to ``acks-<phase>.log`` as
``partition offset key seq id flag ack_ns``; a record the producer gave up on goes to
``nacks-<phase>.log``. Keys map to partitions by the default partitioner, so each key lives on one
partition and its sequence numbers follow its offsets.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path

from confluent_kafka import KafkaError, Producer

from .common import SIZES, encode_value, load_json, plan


def main() -> int:
    run_dir, phase = Path(sys.argv[1]), sys.argv[2]
    cfg = load_json(run_dir / "run.json")
    size = SIZES[cfg["size"]]
    msgs = plan(size, cfg["seed"], cfg.get("hold_index"))
    split = cfg["backlog"]
    todo = msgs[:split] if phase == "backlog" else msgs[split:]
    first = 0 if phase == "backlog" else split
    ack_fd = os.open(run_dir / f"acks-{phase}.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    nack_fd = os.open(run_dir / f"nacks-{phase}.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    p = Producer(
        {
            "bootstrap.servers": cfg["bootstrap"],
            "acks": "all",
            "enable.idempotence": True,
            "linger.ms": 5,
            "message.timeout.ms": 600_000,  # outlives a broker restart
            "log_level": 3,
        }
    )
    failed = 0

    def on_delivery(i: int, err: KafkaError | None, m) -> None:  # type: ignore[no-untyped-def]
        nonlocal failed
        pl = msgs[i]
        if err is None:
            line = f"{m.partition()} {m.offset()} {pl.key} {pl.seq} {pl.id} {pl.flag or '-'} {time.monotonic_ns()}\n"
            os.write(ack_fd, line.encode())
        else:
            failed += 1
            os.write(nack_fd, f"{pl.key} {pl.seq} {pl.id} {err.name()}\n".encode())

    steady_s = float(cfg["steady_s"])
    t0 = time.monotonic()
    for n, pl in enumerate(todo):
        i = first + n
        if phase == "steady":
            due = t0 + steady_s * n / max(1, len(todo))
            while True:
                left = due - time.monotonic()
                if left <= 0:
                    break
                p.poll(min(left, 0.05))
        while True:
            try:
                p.produce(
                    cfg["topic"],
                    key=pl.key.encode(),
                    value=encode_value(pl, size.value_bytes),
                    on_delivery=functools.partial(on_delivery, i),
                )
                break
            except BufferError:
                p.poll(0.1)
        p.poll(0)
    left = p.flush(900)
    print(
        f"producer {phase}: {len(todo)} records, {failed} failed, {left} unflushed, "
        f"{time.monotonic() - t0:.1f} s",
        file=sys.stderr,
    )
    return 0 if failed == 0 and left == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
