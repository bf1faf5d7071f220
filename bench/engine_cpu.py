"""The engine's own CPU per message, without Kafka: W1's shape (8 partitions, 10,000 keys, 100 B,
no-op handler) through admit -> take -> run -> settle -> finish, in one thread: the owner's steps
(admit, take, finish) and a worker's (the runner over a chunk), without the hand-overs between them.

    .venv/bin/python bench/engine_cpu.py [--messages 200000] [--calls]

Prints microseconds of process CPU per message (median of 5 runs) and, with ``--calls``, Python
function calls per message (cProfile). ``KC_SRC=/path/to/checkout`` measures another checkout's
engine (before/after figures in bench/README.md). The poll thread's ``Message`` construction and
librdkafka are not included: this is the part of a message's cost that is the engine's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.environ.get("KC_SRC") or os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from keyedconsumer.engine.engine import Engine  # noqa: E402
from keyedconsumer.engine.handler import Contract  # noqa: E402
from keyedconsumer.engine.runner import Runner  # noqa: E402
from keyedconsumer.engine.settle import Settler  # noqa: E402
from keyedconsumer.engine.workers import Slot  # noqa: E402
from keyedconsumer.message import Message  # noqa: E402

PARTITIONS, KEYS, BATCH, ROUND = 8, 10_000, 500, 20_000


def run(n: int) -> float:
    """CPU seconds per message of one pass over ``n`` messages (built 20,000 at a time, untimed,
    as the poll thread would hand them over; the engine's work on them is timed)."""
    d = Engine("key")
    d.assign([("t", p) for p in range(PARTITIONS)])
    settle = Settler(d, None, print, Contract())
    slot = Slot()

    def handler(msg: Message) -> None:
        pass

    runner = Runner(handler, settle, d.may_start)
    cpu = 0.0
    for base in range(0, n, ROUND):
        msgs = [
            Message("t", i % PARTITIONS, i // PARTITIONS, b"k%d" % (i % KEYS), b"x" * 90)
            for i in range(base, min(n, base + ROUND))
        ]
        t0 = time.process_time()
        for i in range(0, len(msgs), BATCH):
            d.admit(msgs[i : i + BATCH])
            while d.queue:
                units = d.take(2)
                for unit in units:
                    results, elapsed = runner.run(slot, unit)
                    d.finish(results, elapsed or 1e-6)
        cpu += time.process_time() - t0
        del msgs
    if d.in_flight:
        raise SystemExit(f"{d.in_flight} messages not finished")
    return cpu / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=200_000)
    ap.add_argument("--calls", action="store_true", help="also count Python calls per message (cProfile)")
    args = ap.parse_args()
    runs = [run(args.messages) * 1e6 for _ in range(5)]
    print(
        f"engine CPU per message: median {statistics.median(runs):.2f} us (min {min(runs):.2f}, max {max(runs):.2f}; 5 runs)"
    )
    if args.calls:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        run(20_000)
        prof.disable()
        calls = sum(v[1] for v in pstats.Stats(prof).stats.values())  # type: ignore[attr-defined]
        print(f"Python calls per message: {calls / 20_000:.1f}")


if __name__ == "__main__":
    main()
