"""Shared by the orchestrator (bench/run.py, project venv) and the contenders (bench/contender.py,
project venv or bench/.venv-peers). Standard library only.

Record layout (every workload):
    key   = b"k%05d" % key_id
    value = b"%010d %013d " % (per-key sequence number, produce timestamp ms) + padding
The record's Kafka timestamp is set to the same produce timestamp (CreateTime), so a contender that
does not expose the record timestamp (pyrallel-consumer's WorkItem) reads the same number from the
value.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from array import array
from pathlib import Path
from typing import Any

HEADER = 25  # b"%010d %013d "

#: librdkafka fetch settings that the raw contender takes from keyedconsumer (bench/README.md,
#: "Fetch settings"): they bound how much librdkafka prefetches (bytes, and messages per partition)
#: and how soon it fetches again when its queue is full, which caps a 1 KB backlog's throughput
#: (workload 4). bench/contender.py reads their
#: values at run time from ``ConsumerConfig(...).librdkafka()``, built with the options the
#: keyedconsumer runs get; a property keyedconsumer does not set keeps librdkafka's default for both.
FETCH_SETTINGS = ("queued.max.messages.kbytes", "queued.min.messages", "fetch.queue.backoff.ms")


def make_value(seq: int, ts_ms: int, size: int) -> bytes:
    head = b"%010d %013d " % (seq, ts_ms)
    return head + b"x" * max(0, size - len(head))


def value_ts(value: bytes) -> int:
    return int(value[11:24])


def percentile(sorted_vals: list[float], q: float) -> float | None:
    if not sorted_vals:
        return None
    i = min(len(sorted_vals) - 1, max(0, int(round(q * (len(sorted_vals) - 1)))))
    return sorted_vals[i]


# --------------------------------------------------------------------------------------- memory

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                    out.extend(int(x) for x in f.read().split())
            except OSError:
                pass
    except OSError:
        pass
    return out


def tree_rss_bytes(pid: int) -> int:
    """RSS of a process and all its descendants (pyrallel's process mode, faststream threads)."""
    total, stack, seen = 0, [pid], set()
    while stack:
        p = stack.pop()
        if p in seen:
            continue
        seen.add(p)
        total += _rss_bytes(p)
        stack.extend(_children(p))
    return total


def vm_hwm_bytes(pid: int | str = "self") -> int:
    """The kernel's peak RSS (VmHWM) of one process."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# ------------------------------------------------------------------------------------- recorder


class Recorder:
    """Counts handled messages, checks per-key order, records latency.

    ``begin(key, value, ts_ms)`` at handler start, ``end(key)`` at handler end: closures over local
    state (about 0.7 us a message here), thread-safe enough under the GIL without a lock (C-level
    ``next()`` on ``itertools.count``, ``dict`` and ``array`` item sets), so the same few hundred
    nanoseconds are added to every contender's handler. Latency is recorded for one message in
    ``lat_every``.
    """

    def __init__(self, target: int, lat_every: int = 1) -> None:
        self.target = target
        self.lat_every = lat_every
        self.last: dict[bytes, int] = {}
        # preallocated, so the harness's own memory does not grow during a run (workload 4)
        self.lat = array("d", bytes(8 * (target // lat_every + 1024)))
        self._lat_i = itertools.count()
        self._count = itertools.count(1)
        self._viol = itertools.count()
        # the violations where the sequence number went back or repeated (a redelivery or a reorder),
        # as opposed to a gap (which is also what a key that moved here from another instance shows)
        self._back = itertools.count()
        self.t_first: float | None = None
        self.t_last: float | None = None
        # set when a run is stopped by its time cap: the handled count and the time at the cap (so a
        # capped run's msg/s does not include the contender's stop)
        self.t_cap: float | None = None
        self.handled_at_cap: int | None = None
        self.wall_first: float | None = None
        self.done = threading.Event()
        self.begin, self.end = self._make()

    def _make(self):  # type: ignore[no-untyped-def]
        rec = self
        last, get = self.last, self.last.get
        lat, lat_i, viol, back, count = self.lat, self._lat_i, self._viol, self._back, self._count
        every, target = self.lat_every, self.target
        wall, perf = time.time, time.perf_counter
        done = self.done

        def begin(key: bytes, value: bytes, ts_ms: int) -> None:
            if rec.t_first is None:
                rec.t_first = perf()
                rec.wall_first = wall()
            seq = int(value[:10])
            prev = get(key, -1)
            if prev + 1 != seq:
                next(viol)
                if seq <= prev:
                    next(back)
            last[key] = seq
            i = next(lat_i)
            if not i % every:
                try:
                    lat[i // every] = wall() * 1000.0 - ts_ms
                except IndexError:  # more starts than the target (a run that goes on while it stops)
                    pass

        def end(key: bytes) -> None:
            if next(count) == target:
                rec.t_last = perf()
                done.set()

        return begin, end

    @property
    def handled(self) -> int:
        return _peek(self._count) - 1

    def latencies(self) -> list[float]:
        n = (_peek(self._lat_i) + self.lat_every - 1) // self.lat_every
        return sorted(self.lat[: min(len(self.lat), n)])

    @property
    def violations(self) -> int:
        return _peek(self._viol)

    @property
    def backward(self) -> int:
        """Violations where a key's sequence number repeated or went back (not a gap)."""
        return _peek(self._back)


def _peek(counter: itertools.count[int]) -> int:
    # repr is "count(N)": the next value, i.e. how many times next() was called
    return int(repr(counter)[6:-1])


class Sampler(threading.Thread):
    """Every ``interval_s``: RSS of this process and its descendants, the handled count and, if the
    contender tells (:attr:`held`), how many messages it holds in flight."""

    def __init__(self, rec: Recorder, interval_s: float = 1.0, on_sample=None) -> None:  # type: ignore[no-untyped-def]
        super().__init__(name="bench-sampler", daemon=True)
        self.rec = rec
        self.interval_s = interval_s
        # (seconds since start, RSS MB, handled, messages in flight or -1 when not known)
        self.samples: list[tuple[float, float, int, int]] = []
        #: the contender's count of messages it holds (admitted, not finished), if it tells
        self.held: Any = None
        self.stop_event = threading.Event()
        self.on_sample = on_sample
        self.t0 = time.perf_counter()

    def sample(self) -> None:
        rss = tree_rss_bytes(os.getpid()) / 1e6
        held = self.held() if self.held is not None else -1
        self.samples.append((round(time.perf_counter() - self.t0, 2), round(rss, 1), self.rec.handled, held))
        if self.on_sample is not None:
            self.on_sample(self.samples)

    def run(self) -> None:
        self.sample()
        while not self.stop_event.wait(self.interval_s):
            self.sample()

    def stop(self) -> None:
        self.stop_event.set()
        self.sample()


def ratio_rows(ratios: dict[str, list[float]], medians: dict[str, float]) -> list[str]:
    """Markdown rows of ratios taken within a repeat: ``{name: [ratio per repeat]}`` with their
    ``{name: median}``."""
    return [
        "| ratio (same repeat) | median | each repeat |",
        "| --- | --- | --- |",
        *[
            f"| {k} | {medians.get(k, 0):.2f} | {', '.join(f'{x:.2f}' for x in v)} |"
            for k, v in ratios.items()
        ],
    ]


def write_report(out_dir: Path, stem: str, result: dict[str, Any], lines: list[str]) -> None:
    """Write ``<out_dir>/<stem>.json`` (``result``) and ``<out_dir>/<stem>.md`` (``lines``), and print
    the lines."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out_dir / f"{stem}.md").write_text("\n".join(lines))
    print("\n".join(lines))
