"""How little a keyed engine can cost per message in pure Python: a lower bound to set beside
``bench/engine_cpu.py`` (issue 24's W1 goals need the engine's share near 0.8 µs a message).

    .venv/bin/python bench/lean_engine.py [--messages 200000]

The same shape and the same steps as ``bench/engine_cpu.py`` (8 partitions, 10,000 keys, poll
batches of 500, chunks of 2, a no-op handler, one thread), done by the least code that still keeps
the guarantees: a key's messages one at a time in offset order (a lane per (partition, key), its
head ready only when the one before finished) and each partition's offset to store only up to its
first unfinished message. It has none of the rest (retries, parking, time limits, batches,
conflation, flow control, revoke, status, a sequencer's seam), so it is a floor, not a design:
what the engine's bookkeeping costs beyond it is what a leaner engine could save at most.

Prints, in one process and alternating, the median CPU µs a message of this lean pass and of
``bench/engine_cpu.run`` (5 runs each), and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import deque

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import engine_cpu  # noqa: E402  (beside this script: a script's folder is on sys.path)

from keyedconsumer.message import Message  # noqa: E402

PARTITIONS, KEYS, BATCH, ROUND = engine_cpu.PARTITIONS, engine_cpu.KEYS, engine_cpu.BATCH, engine_cpu.ROUND


class LeanEngine:
    """Lanes, a ready queue and each partition's offsets, nothing else (one thread)."""

    def __init__(self, partitions: int) -> None:
        self.lanes: dict[tuple[int, bytes | None], deque[Message]] = {}
        self.ready: deque[Message] = deque()
        self.order = [deque[int]() for _ in range(partitions)]  # offsets admitted, not yet stored past
        self.done: list[set[int]] = [set() for _ in range(partitions)]  # finished, behind an unfinished one
        self.store_at = [0] * partitions  # the offset to store: the first unfinished (or the next)

    def admit(self, msgs: list[Message]) -> None:
        lanes, ready, order = self.lanes, self.ready, self.order
        for m in msgs:
            lid = (m.partition, m.key)
            order[m.partition].append(m.offset)
            lane = lanes.get(lid)
            if lane is None:
                lanes[lid] = deque()
                ready.append(m)
            else:
                lane.append(m)

    def take(self, n: int) -> list[Message]:
        ready = self.ready
        return [ready.popleft() for _ in range(min(n, len(ready)))]

    def finish(self, m: Message) -> None:
        lid = (m.partition, m.key)
        lane = self.lanes[lid]
        if lane:
            self.ready.append(lane.popleft())
        else:
            del self.lanes[lid]
        p = m.partition
        order = self.order[p]
        if order[0] == m.offset:
            last = order.popleft()
            done = self.done[p]
            while order and order[0] in done:
                last = order.popleft()
                done.remove(last)
            self.store_at[p] = order[0] if order else last + 1
        else:
            self.done[p].add(m.offset)


def run(n: int) -> float:
    """CPU seconds per message of one lean pass over ``n`` messages (built untimed, as in
    ``engine_cpu.run``)."""
    e = LeanEngine(PARTITIONS)

    def handler(msg: Message) -> None:
        pass

    cpu = 0.0
    top = [0] * PARTITIONS  # each partition's last offset + 1: where its stored offset must end
    for base in range(0, n, ROUND):
        msgs = [
            Message("t", i % PARTITIONS, i // PARTITIONS, b"k%d" % (i % KEYS), b"x" * 90)
            for i in range(base, min(n, base + ROUND))
        ]
        for m in msgs[-PARTITIONS:]:
            top[m.partition] = max(top[m.partition], m.offset + 1)
        t0 = time.process_time()
        for i in range(0, len(msgs), BATCH):
            e.admit(msgs[i : i + BATCH])
            while e.ready:
                for m in e.take(2):
                    handler(m)
                    e.finish(m)
        cpu += time.process_time() - t0
        del msgs
    if e.lanes or any(e.order) or e.store_at != top:
        raise SystemExit("the lean pass left messages unfinished")
    return cpu / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=200_000)
    args = ap.parse_args()
    lean, engine = [], []
    for _ in range(5):
        lean.append(run(args.messages) * 1e6)
        engine.append(engine_cpu.run(args.messages) * 1e6)
    lm, em = statistics.median(lean), statistics.median(engine)
    print(f"lean pass CPU per message: median {lm:.2f} us (min {min(lean):.2f}, max {max(lean):.2f}; 5 runs)")
    print(
        f"engine CPU per message: median {em:.2f} us (min {min(engine):.2f}, max {max(engine):.2f}; 5 runs)"
    )
    print(f"engine / lean: {em / lm:.2f}x")


if __name__ == "__main__":
    main()
