"""What the harness's programs share: run sizes, the seeded message plan, file names, record formats.

Every record is one line of space-separated fields; times are ``time.monotonic_ns()`` (Linux
``CLOCK_MONOTONIC``, one clock for every process of the machine, so records of different processes
compare directly).

=========================  =========================================================================
file (in the run dir)      lines
=========================  =========================================================================
``run.json``               the run's parameters (size, seed, bug, topic, group, ports, schedule)
``acks-*.log``             ``partition offset key seq id flag ack_ns`` per acknowledged record
``events/<pid>.log``       consumer records (below), one file per consumer process
``faults.log``             ``ns kind pid detail`` per fault and per process start/exit
``commits.log``            ``sent_ns recv_ns p:offset,... p=metadata;...`` committed offsets and their commit
                           metadata, or ``-`` (or ``... ERR text``)
``resources.log``          ``ns rss pid:kib,...`` and ``ns redis used_memory_bytes``
``dlq.log``                ``orig_partition orig_offset key attempts`` per dead-letter record
``final.json``             end offsets, final commits, Redis keys left, drain time, exits
=========================  =========================================================================

Consumer records (``events/<pid>.log``)::

    S pid part off key seq token attempt ns                  a handler run starts
    E pid part off key seq token attempt ns ok|refused w_ns ver   it ends; its fenced write's
                                                             outcome and the record's version
    X pid part off key seq token attempt ns ErrorClass       it ends by raising
    D pid part off key seq token attempt ns                  the message was dead-lettered
    K pid part off key seq token attempt ns                  parked in Redis (--park): its offset
                                                             counts done before it runs
    A pid ns p,p,...                                         the process's assignment changed
    P pid ns start|exit detail                               the process started / run() returned
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

#: Message flags (the value's ``f``): raise on the first attempt; run longer than the lease TTL; held
#: on its first run (the one message a targeted control run lands its fault on).
ONCE, OVERRUN, HOLD = "once", "overrun", "hold"


@dataclasses.dataclass(frozen=True)
class Size:
    """One run size. Times in seconds."""

    name: str
    partitions: int
    keys: int
    messages: int
    fault_window_s: float  # faults happen during this window, then the run drains
    consumer_fault_every_s: tuple[float, float]  # a consumer SIGKILL/SIGTERM/SIGSTOP every U(a, b)
    drain_timeout_s: float
    hot_keys: int = 5
    hot_share: float = 0.20
    poison_keys: int = 3
    backlog_share: float = 0.60
    fail_once_share: float = 0.01
    overrun_share: float = 0.001
    handler_s: float = 0.003
    value_bytes: int = 256
    restart_after_s: tuple[float, float] = (1.0, 5.0)
    stop_s: tuple[float, float] = (7.0, 9.0)  # SIGSTOP length: above the session timeout
    redis_down_s: float = 2.0
    kafka_down_s: float = 2.0
    lease_ttl_s: float = 3.0
    session_timeout_ms: int = 6000
    auto_commit_interval_ms: int = 200
    concurrency: int = 16
    max_in_flight: int = 5000
    consumers: int = 3
    cut_s: tuple[float, float] = (14.0, 16.0)  # a host cut off (cluster runs): above TTL and session timeout


SIZES = {
    "full": Size(
        "full",
        partitions=12,
        keys=2000,
        messages=150_000,
        fault_window_s=210.0,
        consumer_fault_every_s=(15.0, 25.0),
        drain_timeout_s=240.0,
    ),
    "ci": Size(
        "ci",
        partitions=12,
        keys=300,
        messages=15_000,
        fault_window_s=75.0,
        consumer_fault_every_s=(9.0, 12.0),
        drain_timeout_s=120.0,
    ),
    # the cluster run (--cluster): 3 brokers, a Redis Cluster, consumers on hosts; a longer window,
    # for the host cut and the failovers. 3 JVMs and 7 Redis servers share the 2 cores with the
    # consumers: a 6 s session timeout let the group coordinator drop members that no fault touched
    # (under a load of 30-40), so 10 s, and the pauses and cuts stay longer than that
    "cluster-full": Size(
        "cluster-full",
        partitions=12,
        keys=2000,
        messages=150_000,
        fault_window_s=240.0,
        consumer_fault_every_s=(15.0, 25.0),
        drain_timeout_s=300.0,
        session_timeout_ms=10_000,
        stop_s=(11.0, 13.0),
        cut_s=(16.0, 18.0),
    ),
    "cluster-ci": Size(
        "cluster-ci",
        partitions=12,
        keys=300,
        messages=15_000,
        fault_window_s=90.0,
        consumer_fault_every_s=(10.0, 14.0),
        drain_timeout_s=150.0,
        session_timeout_ms=10_000,
        stop_s=(11.0, 13.0),
        cut_s=(16.0, 18.0),
    ),
}


@dataclasses.dataclass(frozen=True)
class Planned:
    key: str
    seq: int
    id: str
    flag: str


def key_names(size: Size) -> tuple[list[str], list[str], list[str]]:
    """``(all keys, hot keys, poison keys)``; poison keys are never hot."""
    keys = [f"k{i:04d}" for i in range(size.keys)]
    return keys, keys[: size.hot_keys], keys[size.hot_keys : size.hot_keys + size.poison_keys]


def plan(size: Size, seed: int, hold_index: int | None = None) -> list[Planned]:
    """The messages of a run, in production order (the same for every program given the seed);
    message ``hold_index`` (if given) is flagged ``hold``, on a key that is neither hot nor poison."""
    rng = random.Random(f"plan-{seed}")
    keys, hot, _poison = key_names(size)
    cold = keys[size.hot_keys :]
    seqs: dict[str, int] = {}
    out = []
    for i in range(size.messages):
        key = rng.choice(hot) if rng.random() < size.hot_share else rng.choice(cold)
        seq = seqs[key] = seqs.get(key, 0) + 1
        r = rng.random()
        flag = (
            OVERRUN
            if r < size.overrun_share
            else ONCE
            if r < size.overrun_share + size.fail_once_share
            else ""
        )
        out.append(Planned(key, seq, f"{seed}-{i}", flag))
    if hold_index is not None:
        i = next(j for j in range(hold_index, len(out)) if out[j].key in cold[size.poison_keys :])
        out[i] = dataclasses.replace(out[i], flag=HOLD)
    return out


def encode_value(p: Planned, value_bytes: int) -> bytes:
    body = {"k": p.key, "s": p.seq, "id": p.id, "f": p.flag}
    raw = json.dumps(body, separators=(",", ":"))
    pad = max(0, value_bytes - len(raw) - 8)
    body["pad"] = "x" * pad
    return json.dumps(body, separators=(",", ":")).encode()


def load_json(path: Path) -> Any:
    return json.loads(path.read_text())
