"""Where the GIL went in a py-spy profile of a keyedconsumer run, by part of the engine.

Reads the raw (collapsed) stacks that ``scripts/bench --profile`` writes
(``profile-<workload>-<run id>.raw.txt``, or gzipped as ``.raw.txt.gz``, recorded with ``py-spy record --gil``: at each sample, the
stack of the thread holding the GIL) and prints one markdown row per file: the share of samples in
each part, by the first rule below that matches a sample's stack.

    .venv/bin/python bench/profile_shares.py bench/results/profiles-2026-12-06/*.raw.txt.gz

Parts (rules in this order):

- ``handler``: the bench's handler and its order recorder (``contender.py``'s handler frames);
- ``poll``: ``consume()`` and building each ``Message`` (``poll_batch``);
- ``admit``: admission (offset tracking, lanes, ready queue);
- ``redis``: the Redis sequencer's own code and redis-py (owner and renewer);
- ``commit``: storing and committing offsets (``engine/commits.py``);
- ``owner``: the rest of the owner thread (hand-out, take, finish, mailbox, timers);
- ``workers``: the rest of the worker threads or coroutines (runner, slot, settle, the event loop);
- ``other``: anything else (imports at start-up, the garbage collector's frames if any).

The garbage collector has no frame of its own: py-spy charges a collection to the Python line that
allocated the object which set it off (``Message.__init__``, ``Message._bind`` and ``Delivery``
are the usual ones), so it is spread over ``poll`` and ``admit``.
"""

from __future__ import annotations

import gzip
import sys
from pathlib import Path

#: (part, substrings of a stack that put a sample in it), first match wins; ``other`` otherwise.
RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("handler", ("run_keyedconsumer.<locals>.handler", "make_handlers.<locals>")),
    ("poll", ("poll_batch",)),
    ("admit", ("Admission.admit", "Engine.admit")),
    ("redis", ("keyedconsumer/sequencing/", "redis/")),
    ("commit", ("engine/commits.py",)),
    ("owner", ("Run._loop", "Run.serve")),
    ("workers", ("Thread._bootstrap", "AsyncWorkers", "asyncio/")),
)
PARTS = (*(part for part, _ in RULES), "other")


def part_of(stack: str) -> str:
    """The part of one collapsed stack (frames joined by ``;``), by :data:`RULES`."""
    for part, marks in RULES:
        if any(m in stack for m in marks):
            return part
    return "other"


def shares(raw: Path) -> tuple[int, dict[str, float]]:
    """Samples in ``raw`` and the share (0-1) of each part."""
    counts = dict.fromkeys(PARTS, 0)
    n = 0
    text = gzip.decompress(raw.read_bytes()).decode() if raw.suffix == ".gz" else raw.read_text()
    for line in text.splitlines():
        stack, _, cnt = line.rpartition(" ")
        if not stack or not cnt.isdigit():
            continue
        c = int(cnt)
        n += c
        counts[part_of(stack)] += c
    return n, {p: (counts[p] / n if n else 0.0) for p in PARTS}


def main(paths: list[str]) -> None:
    print("| run | samples | " + " | ".join(PARTS) + " |")
    print("| --- | ---: | " + " | ".join("---:" for _ in PARTS) + " |")
    for p in paths:
        path = Path(p)
        name = path.name.removeprefix("profile-").removesuffix(".gz").removesuffix(".raw.txt")
        n, s = shares(path)
        print(f"| {name} | {n} | " + " | ".join(f"{100 * s[x]:.0f}%" for x in PARTS) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
