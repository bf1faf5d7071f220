"""The benchmark suite: every contender, in one run, on the same topic data; reports ratios.

    scripts/bench [--size full|ci] [--only 1,2,3,4,5] [--repeats N] [--contenders PATTERNS] [--brokers HOST:PORT]

Creates its own topics (unique names) on the broker, produces each workload's input ONCE, then runs
every selected contender on that data, each in its own subprocess with a fresh consumer group,
``--repeats`` times (3 at full size, 1 at ci size), round-robin: raw, keyedconsumer..., peers, then
raw, keyedconsumer..., peers again, so that a change of the machine's load hits every contender alike.
Each ratio (to raw, Redis to in-memory, keyedconsumer to a peer) is computed within one repeat; the
report gives the median over the repeats and the spread (min-max) of msg/s and of every ratio.

  raw                    plain confluent-kafka loop: consume(num_messages=500), store_offsets per
                         message, enable.auto.offset.store=false, auto commit; keyedconsumer's fetch
                         settings (common.FETCH_SETTINGS, read from its config at run time)
  keyedconsumer          ordering key|partition|none x concurrency 1,16,64,256 x sync|async handlers
                         (async: event_loop="uvloop"; mode async-asyncio: event_loop="asyncio")
  keyedconsumer-redis    keyedconsumer with the Redis sequencer (per-key leases in Redis)
  parallel-consumer      Confluent Parallel Consumer (Java, bench/parallel-consumer, built by scripts/bench)
  pyrallel-consumer      from bench/.venv-peers (async execution mode; see bench/README.md)
  faststream             from bench/.venv-peers (aiokafka subscriber, partition order)
  faststream-unordered   faststream's concurrent subscriber (max_workers, no order)

Workloads (full size; `ci` is a ~1 min smoke version on tiny data):
  1 overhead  10,000,000 x 100 B, 8 partitions, 10,000 keys, no-op handler; every run ends 12 s after
              its first message (none consumes the topic by then)
  2 io        600,000 x 100 B, 1 partition, 10,000 keys, handler waits 5 ms; each run handles the
              prefix whose ideal time is 10 s (capped at 15 s)
  3 skew      50,000 messages like workload 2 with 20% of the messages on 5 hot keys
  4 memory    1,000,000 x 1 KB backlog, 1 partition, 10,000 keys + one blocked key (1% of the
              messages) whose handler blocks until the consumer stalls; max_in_flight=10,000;
              RSS sampled every second
  5 flights   examples/flights.py on the first 30,000 flights: concurrency=1 on a 5,000-message
              sample (ideal: the handler alone, back to back) and concurrency=64

--noise runs every repeat twice, a quiet pass and a noisy one (a busy-loop process, one core, runs
beside the noisy pass), and reports both. Each run records the 1-minute load average before and after.

Writes <out>/results.json, <out>/results.md and <out>/throughput.png (default out: bench/results).
Contender ids look like ``keyedconsumer/key/c16/sync``; --contenders takes comma-separated
fnmatch patterns over them (``raw,keyedconsumer/key/*``); a bare name matches all its runs.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import fnmatch
import itertools
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from array import array
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from common import make_value  # noqa: E402
from goals import (  # noqa: E402  (fmt, spread_of: also used by bench/scaling.py as run.fmt, run.spread_of)
    ASYNCIO,
    CONCURRENCIES,
    MODES,
    fmt,
    goals,
    other_checks,
)
from machine_load import BusyLoop, cool_down, cores_busy, load_record, loadavg  # noqa: E402  (loadavg: run.loadavg elsewhere)
from report import NOTES, print_goals, write_markdown  # noqa: E402

PEERS_PY = HERE / ".venv-peers" / "bin" / "python"
PC_DIR = HERE / "parallel-consumer"  # the Java contender; scripts/bench builds it into target/
ORDERINGS = ("key", "partition", "none")
#: keyedconsumer's async handlers run on uvloop (mode "async", the consumer's ``event_loop="uvloop"``)
#: or on asyncio's default loop (mode ASYNCIO, "async-asyncio": ``event_loop="asyncio"``)
EVENT_LOOPS = {"async": "uvloop", ASYNCIO: "asyncio"}

# ----------------------------------------------------------------------------------- workloads

SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "full": {
        # W1: every run is time-boxed: it ends 12 s after its first message, and no contender can
        # consume 10M records by then (raw would need 833k msg/s; it makes 380-700k here), so raw,
        # the denominator of every W1 ratio, runs as long as the others (bench/README.md, "Sizing")
        "w1": dict(
            title="overhead",
            messages=10_000_000,
            size=100,
            partitions=8,
            keys=10_000,
            sleep_ms=0,
            lat_every=16,
            max_seconds=12.0,
        ),
        # W2: each run handles the prefix whose ideal time is io_budget_s (10 s): c256 at 5 ms is
        # 51,200 msg/s ideal, so 512,000 messages; runs far below the ideal stop at 15 s
        "w2": dict(
            title="I/O-bound",
            messages=600_000,
            size=100,
            partitions=1,
            keys=10_000,
            sleep_ms=5,
            max_seconds=15.0,
        ),
        # W3: the 5 hot keys make the ideal time of 50,000 messages 10 s (longest key chain)
        "w3": dict(
            title="skewed keys",
            messages=50_000,
            size=100,
            partitions=1,
            keys=10_000,
            sleep_ms=5,
            hot_keys=5,
            hot_share=0.20,
            max_seconds=30.0,
        ),
        "w4": dict(
            title="memory",
            messages=1_000_000,
            size=1024,
            partitions=1,
            keys=10_000,
            sleep_ms=0,
            block_share=0.01,
            max_in_flight=10_000,
            stall_s=3.0,
            lat_every=4,
            max_seconds=120.0,
            peer_max_seconds=30.0,
        ),
        # W5: examples/flights.py (its own topic); the c1 sample of 5,000 takes ~10.5 s at ~470 msg/s
        "w5": dict(
            title="flights demo",
            demo=True,
            messages=30_000,
            sample=5_000,
            size=0,
            partitions=8,
            keys=0,
            sleep_ms=2,
        ),
    },
    "ci": {
        "w1": dict(title="overhead", messages=20_000, size=100, partitions=8, keys=1_000, sleep_ms=0),
        "w2": dict(title="I/O-bound", messages=2_000, size=100, partitions=1, keys=1_000, sleep_ms=5),
        "w3": dict(
            title="skewed keys",
            messages=2_000,
            size=100,
            partitions=1,
            keys=1_000,
            sleep_ms=5,
            hot_keys=5,
            hot_share=0.20,
        ),
        "w4": dict(
            title="memory",
            messages=20_000,
            size=1024,
            partitions=1,
            keys=1_000,
            sleep_ms=0,
            block_share=0.01,
            max_in_flight=1_000,
            stall_s=1.0,
            max_seconds=8.0,
        ),
        "w5": dict(
            title="flights demo",
            demo=True,
            messages=2_000,
            sample=300,
            size=0,
            partitions=8,
            keys=0,
            sleep_ms=2,
        ),
    },
}
REPEATS = {"full": 3, "ci": 1}
# per run: a run ends when its target is handled or max_seconds after its first message
RUN_LIMITS = {
    "full": dict(max_seconds=60.0, io_budget_s=10.0, io_min_target=2_000),
    "ci": dict(max_seconds=4.0, io_budget_s=1.5, io_min_target=150),
}
BLOCK_KEY = "k-blocked"
#: --noise: after a noisy pass, wait up to this long for other work to fall below
#: machine_load.BUSY_CORES (machine_load.cool_down)
COOL_DOWN_S = {"full": 60.0, "ci": 0.0}


def kc(ordering: str, c: int, mode: str) -> dict[str, Any]:
    return dict(contender="keyedconsumer", ordering=ordering, concurrency=c, mode=mode)


def kcr(c: int, mode: str) -> dict[str, Any]:
    """keyedconsumer with the Redis sequencer (goal: >= 0.7x the in-memory sequencer on W2)."""
    return dict(contender="keyedconsumer-redis", ordering="key", concurrency=c, mode=mode)


def pc(ordering: str, c: int, mode: str = "sync") -> dict[str, Any]:
    """Confluent Parallel Consumer (Java): handlers on its maxConcurrency worker threads; the mode is
    its commit mode (sync: PERIODIC_CONSUMER_SYNC, async: PERIODIC_CONSUMER_ASYNCHRONOUS)."""
    return dict(
        contender="parallel-consumer", ordering=ordering, concurrency=c, mode=mode, peer=True, java=True
    )


def peer(name: str, ordering: str, c: int, mode: str) -> dict[str, Any]:
    return dict(contender=name, ordering=ordering, concurrency=c, mode=mode, peer=True)


RAW = dict(contender="raw", ordering="partition", concurrency=1, mode="sync")


def matrix(size: str, wl: str, full_matrix: bool = False) -> list[dict[str, Any]]:
    """The contenders of one workload, raw first (each repeat runs them in this order).

    Trimmed unless ``full_matrix`` (every run is repeated, so each one costs 3 x 12-25 s):
    workload 1: ordering key at every concurrency x sync/async, partition and none at 16 sync;
    workloads 2 and 3: key at every concurrency x sync/async, partition at 16 sync (one partition:
    every concurrency is bound to 200 msg/s), none at 64 sync and 256 async, and the peers without
    their concurrency-1 runs (bound by the handler like everyone's). Confluent Parallel Consumer runs
    at every concurrency keyedconsumer runs on workloads 1 and 2 (a goal compares them at each);
    workload 2 also runs key c256 async on asyncio's default loop (``async-asyncio``) next to uvloop.
    ``full_matrix`` runs every ordering x concurrency x mode and every peer run.
    """
    all_kc = [kc(o, c, m) for o in ORDERINGS for c in CONCURRENCIES for m in MODES] + [
        kc("key", 256, ASYNCIO)
    ]
    key_kc = [kc("key", c, m) for c in CONCURRENCIES for m in MODES]
    redis = [kcr(c, m) for c in CONCURRENCIES[1:] for m in MODES]
    pcs = [pc("key", c) for c in CONCURRENCIES]
    if size == "ci":
        return {
            # every goal's runs, once, on tiny data (the goals table is exercised, no speed is asserted)
            "w1": [
                RAW,
                kc("key", 1, "sync"),
                kc("key", 16, "sync"),
                kc("key", 16, "async"),
                kc("key", 64, "sync"),
                kc("key", 256, "async"),
                kc("partition", 16, "sync"),
                kc("none", 16, "async"),
                pc("key", 16),
                peer("pyrallel-consumer", "key", 16, "async"),
                peer("faststream", "partition", 1, "async"),
            ],
            "w2": [
                RAW,
                kc("key", 64, "sync"),
                kc("key", 64, "async"),
                kc("key", 256, "sync"),
                kc("key", 256, "async"),
                kc("key", 256, ASYNCIO),
                kcr(64, "sync"),
                pc("key", 64),
                peer("pyrallel-consumer", "key", 64, "async"),
            ],
            "w3": [RAW, kc("key", 16, "sync")],
            "w4": [RAW, kc("key", 16, "sync")],
            "w5": [kc("key", 1, "sync"), kc("key", 64, "sync")],
        }[wl]
    if wl == "w1":
        w1_kc = all_kc if full_matrix else [*key_kc, kc("partition", 16, "sync"), kc("none", 16, "sync")]
        return [
            RAW,
            *w1_kc,
            *pcs,
            peer("pyrallel-consumer", "key", 16, "async"),
            peer("faststream", "partition", 1, "async"),
            peer("faststream", "partition", 8, "async"),
            peer("faststream-unordered", "none", 16, "async"),
        ]
    if wl in ("w2", "w3"):
        if full_matrix:
            return [
                RAW,
                *all_kc,
                *redis,
                *pcs,
                *[peer("pyrallel-consumer", "key", c, "async") for c in CONCURRENCIES],
                peer("faststream", "partition", 1, "sync"),
                peer("faststream", "partition", 1, "async"),
                *[peer("faststream-unordered", "none", c, "async") for c in (16, 64, 256)],
            ]
        return [
            RAW,
            *key_kc,
            *([kc("key", 256, ASYNCIO)] if wl == "w2" else []),
            kc("partition", 16, "sync"),
            kc("none", 64, "sync"),
            kc("none", 256, "async"),
            *(redis if wl == "w2" else [kcr(64, "sync"), kcr(256, "async")]),
            *pcs,
            *[peer("pyrallel-consumer", "key", c, "async") for c in CONCURRENCIES[1:]],
            peer("faststream", "partition", 1, "async"),
            *[peer("faststream-unordered", "none", c, "async") for c in (64, 256)],
        ]
    if wl == "w5":
        return [kc("key", 1, "sync"), kc("key", 64, "sync")]
    return [
        RAW,
        kc("key", 16, "sync"),
        kc("key", 16, "async"),
        kc("key", 256, "async"),
        peer("pyrallel-consumer", "key", 16, "async"),
        peer("faststream", "partition", 1, "async"),
    ]


def parse_id(text: str) -> dict[str, Any] | None:
    """An explicit run id (no wildcard) outside the size's matrix, e.g. keyedconsumer/key/c1/sync."""
    if any(ch in text for ch in "*?["):
        return None
    if text == "raw":
        return dict(RAW)
    parts = text.split("/")
    if len(parts) != 4 or not parts[2].startswith("c") or not parts[2][1:].isdigit():
        return None
    name, ordering, c, mode = parts[0], parts[1], int(parts[2][1:]), parts[3]
    if ordering not in ORDERINGS or mode not in (
        *MODES,
        *([ASYNCIO] if name.startswith("keyedconsumer") else []),
    ):
        return None
    if name == "keyedconsumer":
        return kc(ordering, c, mode)
    if name == "keyedconsumer-redis":
        return kcr(c, mode)
    if name == "parallel-consumer":
        return pc(ordering, c, mode)
    if name in ("pyrallel-consumer", "faststream", "faststream-unordered"):
        return peer(name, ordering, c, mode)
    return None


def run_id(r: dict[str, Any]) -> str:
    if r["contender"] == "raw":
        return "raw"
    return f"{r['contender']}/{r['ordering']}/c{r['concurrency']}/{r['mode']}"


# ------------------------------------------------------------------------------------- helpers


def log(*a: Any) -> None:
    print(time.strftime("%H:%M:%S"), *a, file=sys.stderr, flush=True)


def machine_info(peers_py: Path | None) -> dict[str, Any]:
    import confluent_kafka

    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gb = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gb = round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    commit = ""
    try:
        commit = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--", "keyedconsumer"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        if dirty:
            commit += " (keyedconsumer/ modified)"
    except (OSError, subprocess.SubprocessError):
        pass
    info: dict[str, Any] = {
        "nproc": os.cpu_count(),
        "memory_gb": mem_gb,
        "cpu": cpu,
        "os": platform.platform(),
        "python": platform.python_version(),
        "confluent_kafka": getattr(confluent_kafka, "__version__", None) or str(confluent_kafka.version()),
        "librdkafka": confluent_kafka.libversion()[0],
        "keyedconsumer_commit": commit,
        "loadavg_start": loadavg(),
    }
    why, pcv = pc_status()
    if why is None:
        info["parallel_consumer"] = pcv
        try:
            out = subprocess.run(
                [java_bin() or "java", "-version"], capture_output=True, text=True, timeout=60
            )
            info["java"] = (out.stderr.strip().splitlines() or [""])[0]
        except (OSError, subprocess.SubprocessError):
            pass
    if peers_py is not None:
        code = (
            "import json,platform,importlib.metadata as m\n"
            "v={'python':platform.python_version()}\n"
            "for p in ('pyrallel-consumer','faststream','aiokafka','confluent-kafka','matplotlib'):\n"
            "    try: v[p]=m.version(p)\n"
            "    except Exception: pass\n"
            "print(json.dumps(v))"
        )
        try:
            out = subprocess.run([str(peers_py), "-c", code], capture_output=True, text=True, timeout=60)
            info["peers_venv"] = json.loads(out.stdout)
        except (OSError, subprocess.SubprocessError, ValueError) as exc:
            info["peers_venv"] = {"error": str(exc)}
    return info


def peers_status(peers_py: Path) -> dict[str, str | None]:
    """{peer: None if usable else the reason}."""
    names = {
        "pyrallel-consumer": "pyrallel_consumer",
        "faststream": "faststream.kafka",
        "faststream-unordered": "faststream.kafka",
    }
    out: dict[str, str | None] = {"parallel-consumer": pc_status()[0]}
    if not peers_py.exists():
        why = f"no peers venv at {peers_py.parent.parent} (scripts/bench creates it)"
        return {**out, **{n: why for n in names}}
    for name, mod in names.items():
        note = peers_py.parent.parent / f"UNAVAILABLE-{name.split('-unordered')[0]}"
        if note.exists():
            out[name] = note.read_text().strip()
            continue
        r = subprocess.run(
            [str(peers_py), "-c", f"import {mod}"], capture_output=True, text=True, timeout=120
        )
        out[name] = (
            None if r.returncode == 0 else f"import {mod} failed: {r.stderr.strip().splitlines()[-1:]}"
        )
    return out


def pc_status() -> tuple[str | None, str | None]:
    """(None if the Java contender is built else why not, the parallel-consumer-core version).

    scripts/bench builds it (bench/parallel-consumer/build): target/pc-bench.jar, target/lib/ and
    target/BUILT (``<stamp> <version>``); a failed build leaves target/UNAVAILABLE with the reason."""
    target = PC_DIR / "target"
    if (target / "UNAVAILABLE").exists() and not (target / "BUILT").exists():
        return (target / "UNAVAILABLE").read_text().strip() or "build failed", None
    if not (target / "BUILT").exists() or not (target / "pc-bench.jar").exists():
        return f"not built ({PC_DIR.relative_to(ROOT)}/build, which scripts/bench runs)", None
    java = java_bin()
    if java is None:
        return "no java on PATH or in JAVA_HOME", None
    parts = (target / "BUILT").read_text().split()
    return None, parts[1] if len(parts) > 1 else None


def java_bin() -> str | None:
    home = os.environ.get("JAVA_HOME")
    if home and Path(home, "bin", "java").exists():
        return str(Path(home, "bin", "java"))
    return shutil.which("java")


# ------------------------------------------------------------------------------------ producing


def create_topic(brokers: str, name: str, partitions: int, replication_factor: int = 1) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": brokers})
    topic = NewTopic(name, num_partitions=partitions, replication_factor=replication_factor)
    admin.create_topics([topic])[name].result(timeout=60)


def delete_topics(brokers: str, names: list[str]) -> None:
    from confluent_kafka.admin import AdminClient

    if not names:
        return
    admin = AdminClient({"bootstrap.servers": brokers})
    for name, fut in admin.delete_topics(names, operation_timeout=30).items():
        try:
            fut.result(timeout=60)
        except Exception as exc:  # noqa: BLE001
            log(f"could not delete topic {name}: {exc}")


def keys_for(w: dict[str, Any], rng: random.Random) -> array[int]:
    """Key id per message: uniform over `keys`, with the hot and blocked keys of workloads 3 and 4.
    Id -1 is the blocked key. An ``array('i')``: 4 bytes a message (W1's 10M ids in 40 MB, where a
    list of ints would hold 360 MB in the orchestrator for the whole run)."""
    n, nkeys = w["messages"], w["keys"]
    hot, hot_share = w.get("hot_keys", 0), w.get("hot_share", 0.0)
    block_share = w.get("block_share", 0.0)
    out = array("i")
    for _ in range(n):
        r = rng.random()
        if r < block_share:
            out.append(-1)
        elif r < block_share + hot_share:
            out.append(rng.randrange(hot))
        else:
            out.append(rng.randrange(hot, nkeys))
    return out


def produce(brokers: str, topic: str, w: dict[str, Any], key_ids: Sequence[int]) -> dict[str, Any]:
    from confluent_kafka import Producer

    p = Producer(
        {
            "bootstrap.servers": brokers,
            "acks": "all",
            "enable.idempotence": True,  # keeps each partition in produce order across retries
            "linger.ms": 20,
            "batch.size": 1_000_000,
            "queue.buffering.max.messages": 500_000,
            "queue.buffering.max.kbytes": 512 * 1024,
            "compression.type": "none",
        }
    )
    errors = []

    def cb(err, _msg):  # type: ignore[no-untyped-def]
        if err is not None:
            errors.append(str(err))

    size = w["size"]
    seq: dict[int, int] = {}
    t0 = time.perf_counter()
    ts0 = None
    now_ms = lambda: int(time.time() * 1000)  # noqa: E731
    produce_ = p.produce
    for i, kid in enumerate(key_ids):
        s = seq.get(kid, -1) + 1
        seq[kid] = s
        ts = now_ms()
        if ts0 is None:
            ts0 = ts
        key = BLOCK_KEY.encode() if kid < 0 else b"k%05d" % kid
        while True:
            try:
                produce_(topic, key=key, value=make_value(s, ts, size), timestamp=ts, on_delivery=cb)
                break
            except BufferError:
                p.poll(0.05)
        if i & 1023 == 0:
            p.poll(0)
    left = p.flush(300)
    if left or errors:
        raise RuntimeError(f"produce to {topic}: {left} not delivered, errors: {errors[:3]}")
    return {
        "produce_s": round(time.perf_counter() - t0, 1),
        "produce_t0_ms": ts0,
        "per_key_max": max(seq.values()) + 1 if seq else 0,
    }


def end_offsets(brokers: str, topic: str, partitions: int) -> int:
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": brokers, "group.id": f"bench-probe-{uuid.uuid4().hex[:8]}"})
    try:
        return sum(
            c.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1] for p in range(partitions)
        )
    finally:
        c.close()


# ----------------------------------------------------------------------------------------- ideal


def ideal(
    w: dict[str, Any], key_ids: Sequence[int], r: dict[str, Any], target: int, max_in_flight: int
) -> dict[str, Any] | None:
    """Ideal msg/s of an I/O-bound run handling the first ``target`` messages of the partition.

    ``min(concurrency, active keys) / sleep`` where the usable concurrency depends on the ordering
    (key: min(c, distinct keys among the first max_in_flight messages); partition: min(c, partitions);
    none: c; raw: 1), bounded below by the longest chain of one key (ordering key) that must run one
    after another: ideal time = max(target * sleep / usable, max messages of one key * sleep).
    """
    s = w["sleep_ms"] / 1000.0
    if not s:
        return None
    prefix = key_ids[:target]
    window = len(set(key_ids[:max_in_flight]))
    c, ordering = r["concurrency"], r["ordering"]
    if r["contender"] == "raw":
        usable = 1
    elif ordering == "key":
        usable = min(c, window)
    elif ordering == "partition":
        usable = min(c, w["partitions"])
    else:
        usable = c
    t_par = target * s / usable
    counts: dict[int, int] = {}
    for k in prefix:
        counts[k] = counts.get(k, 0) + 1
    chain = max(counts.values()) * s if (ordering == "key" and r["contender"] != "raw") else 0.0
    t = max(t_par, chain)
    return {
        "ideal_msg_per_s": round(target / t, 1),
        "usable_concurrency": usable,
        "active_keys": window,
        "bound": "longest key chain" if chain > t_par else "concurrency",
    }


# ------------------------------------------------------------------------------------ running


def run_one(
    args: argparse.Namespace,
    wl: str,
    w: dict[str, Any],
    meta: dict[str, Any],
    r: dict[str, Any],
    key_ids: Sequence[int],
    peers_py: Path,
    repeat: int = 0,
    noise: bool = False,
) -> dict[str, Any]:
    limits = RUN_LIMITS[args.size]
    target = w["messages"]
    if w["sleep_ms"]:
        # every I/O-bound run handles the prefix whose ideal time is the budget (10 s at full size):
        # concurrency 1 handles 2,000 messages, c256 with ordering key 512,000
        probe = ideal(w, key_ids, r, target, w.get("max_in_flight", 10_000))
        assert probe is not None
        budget = args.io_budget_s if args.io_budget_s else limits["io_budget_s"]
        if target / probe["ideal_msg_per_s"] > budget:
            target = min(target, max(limits["io_min_target"], int(probe["ideal_msg_per_s"] * budget)))
    max_in_flight = w.get("max_in_flight", 10_000)
    spec = {
        **{k: r[k] for k in ("contender", "ordering", "concurrency", "mode")},
        "brokers": args.brokers,
        "topic": meta["topic"],
        "group": f"{meta['topic']}-{run_id(r).replace('/', '-')}-{uuid.uuid4().hex[:6]}",
        "target": target,
        "partitions": w["partitions"],
        "sleep_ms": w["sleep_ms"],
        "max_seconds": args.max_seconds or w.get("max_seconds") or limits["max_seconds"],
        "startup_s": 60.0,
        "max_in_flight": max_in_flight,
        "produce_t0_ms": meta["produce_t0_ms"],
        "sample_s": 1.0,
        "lat_every": w.get("lat_every", 1),
        "redis_url": args.redis_url,
    }
    if r["contender"].startswith("keyedconsumer") and r["mode"] in EVENT_LOOPS:
        spec["event_loop"] = EVENT_LOOPS[r["mode"]]
    if r.get("peer") and w.get("peer_max_seconds") and not args.max_seconds:
        spec["max_seconds"] = w["peer_max_seconds"]  # W4: the peers cannot finish 1M in 120 s anyway
    if w.get("block_share"):
        spec.update(block_key=BLOCK_KEY, block_count=meta["block_count"], stall_s=w["stall_s"])
    if r.get("java"):
        target_dir = PC_DIR / "target"
        version = pc_status()[1] or ""
        cmd = [
            java_bin() or "java",
            "-Dorg.slf4j.simpleLogger.defaultLogLevel=warn",
            f"-Dpc.version={version}",
            "-cp",
            f"{target_dir / 'pc-bench.jar'}:{target_dir / 'lib'}/*",
            "bench.PcContender",
            json.dumps(spec),
        ]
    else:
        py = peers_py if r.get("peer") else Path(sys.executable)
        cmd = [str(py), str(HERE / "contender.py"), json.dumps(spec)]
    prof_out = None
    if (
        args.profile
        and not r.get("java")
        and any(fnmatch.fnmatchcase(run_id(r), p) for p in args.profile.split(","))
        and wl in args.profile_workloads
        and repeat == 0
        and not noise  # the quiet pass of the first repeat only
    ):
        pyspy = args.py_spy or str(PEERS_PY.parent / "py-spy")
        pyspy = str(Path(pyspy).resolve()) if "/" in pyspy else (shutil.which(pyspy) or pyspy)
        prof_out = args.out / f"profile-{wl}-{run_id(r).replace('/', '-')}.raw.txt"
        # --gil: only the thread holding the GIL is sampled, i.e. where the Python-side CPU goes
        cmd = [
            pyspy,
            "record",
            "--format",
            "raw",
            "--rate",
            "250",
            "--gil",
            "--nonblocking",
            "-o",
            str(prof_out),
            "--",
            *cmd,
        ]
    cwd = args.out / "tmp"
    cwd.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)
    if args.engine and not r.get("peer") and not r.get("java"):
        env["PYTHONPATH"] = str(args.engine)  # raw and keyedconsumer import that checkout's package
    load0, others = loadavg(), cores_busy()
    t0 = time.perf_counter()
    timeout = spec["max_seconds"] + spec["startup_s"] + 90 + (w.get("stall_s", 0) * 4)
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stderr = (
            exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        ) + f"\n(killed after {timeout:.0f} s)"
        rc = -9
    wall = time.perf_counter() - t0
    res: dict[str, Any] = {
        "id": run_id(r),
        **{k: r[k] for k in ("contender", "ordering", "concurrency", "mode")},
        "peer": bool(r.get("peer")),
        "repeat": repeat,
        "wall_s": round(wall, 1),
        **load_record(load0, noise, others),
    }
    line = next((ln for ln in reversed(stdout.splitlines()) if ln.startswith("BENCH_RESULT ")), None)
    if line is None:
        res["error"] = f"exit {rc}, no result; stderr tail: {stderr.strip()[-1500:]}"
        return res
    res.update(json.loads(line[len("BENCH_RESULT ") :]))
    if res.get("error"):
        res["error"] += f"; stderr tail: {stderr.strip()[-800:]}"
    if rc != 0 and not res.get("error"):
        res["error"] = f"exit {rc}: {stderr.strip()[-800:]}"
    if prof_out is not None:
        res["profile"] = summarize_profile(prof_out)
    if w["sleep_ms"]:
        res["ideal"] = ideal(w, key_ids, r, res["target"], max_in_flight)
    return res


def summarize_profile(raw: Path, top: int = 25) -> str | None:
    """py-spy raw (collapsed) stacks -> <name>.top.txt: top functions by self and inclusive samples,
    and top source lines by self samples."""
    import re

    if not raw.exists():
        return None
    self_f: dict[str, int] = {}
    total_f: dict[str, int] = {}
    self_l: dict[str, int] = {}
    n = 0
    for line in raw.read_text().splitlines():
        stack, _, cnt = line.rpartition(" ")
        if not stack or not cnt.isdigit():
            continue
        c = int(cnt)
        n += c
        frames = [f for f in stack.split(";") if not f.startswith(("process ", "thread "))]
        if not frames:
            continue
        funcs = [re.sub(r":\d+\)$", ")", f) for f in frames]
        self_l[frames[-1]] = self_l.get(frames[-1], 0) + c
        self_f[funcs[-1]] = self_f.get(funcs[-1], 0) + c
        for f in set(funcs):
            total_f[f] = total_f.get(f, 0) + c
    if not n:
        return None
    out = raw.with_name(raw.name.replace(".raw.txt", ".top.txt"))

    def block(title: str, d: dict[str, int]) -> list[str]:
        return ["", title] + [
            f"{100 * c / n:6.1f}%  {f}" for f, c in sorted(d.items(), key=lambda x: -x[1])[:top]
        ]

    lines = [f"py-spy --gil samples: {n} (the thread holding the GIL at each sample)"]
    lines += block("functions by self time:", self_f)
    lines += block("functions by inclusive time:", total_f)
    lines += block("lines by self time:", self_l)
    out.write_text("\n".join(lines) + "\n")
    return str(out)


# ------------------------------------------------------------------------------------ reporting

#: per-repeat figures that are aggregated as median and spread (min-max) over the repeats
SPREAD_KEYS = ("msg_per_s", "ratio_to_raw", "efficiency", "ratio_to_in_memory", "speed_up")


def finish_workload(wl: str, data: dict[str, Any]) -> None:
    """Per repeat and pass (quiet, or noisy with ``--noise``): ratios against the runs of the same
    repeat and pass; then one aggregated run per id (in the order first run) with the median and
    min-max of each figure: ``data["runs"]`` for the quiet pass, ``data["noisy_runs"]`` for the noisy one."""
    reps: list[dict[str, Any]] = data.setdefault("repeat_runs", [])
    if not reps and data.get("runs"):  # a results.json written before repeats: one run each
        reps.extend(dict(x, repeat=0) for x in data["runs"])
    by_rep: dict[tuple[int, bool], dict[str, dict[str, Any]]] = {}
    for x in reps:
        by_rep.setdefault((x.get("repeat", 0), bool(x.get("noise"))), {})[x["id"]] = x
    for runs in by_rep.values():
        raw = (runs.get("raw") or {}).get("msg_per_s")
        c1 = (runs.get("keyedconsumer/key/c1/sync") or {}).get("msg_per_s")
        for x in runs.values():
            for k in SPREAD_KEYS[1:]:
                x.pop(k, None)
            v = x.get("msg_per_s")
            if not v:
                continue
            if raw and not w_is_demo(wl):
                x["ratio_to_raw"] = round(v / raw, 3)
            if x.get("ideal"):
                x["efficiency"] = round(v / x["ideal"]["ideal_msg_per_s"], 3)
            if x["contender"] == "keyedconsumer-redis":
                base = (runs.get(x["id"].replace("keyedconsumer-redis/", "keyedconsumer/")) or {}).get(
                    "msg_per_s"
                )
                if base:
                    x["ratio_to_in_memory"] = round(v / base, 3)
            if w_is_demo(wl) and x["concurrency"] > 1 and c1:
                x["speed_up"] = round(v / c1, 2)
            if wl == "w4" and x.get("rss_samples"):
                x["rss_growth"] = rss_growth(x["rss_samples"], data["messages"], data["size"])
    for key, noise in (("runs", False), ("noisy_runs", True)):
        groups: dict[str, list[dict[str, Any]]] = {}
        for x in reps:
            if bool(x.get("noise")) == noise:
                groups.setdefault(x["id"], []).append(x)
        data[key] = [aggregate(xs) for xs in groups.values()]
    if not data["noisy_runs"]:
        del data["noisy_runs"]


def w_is_demo(wl: str) -> bool:
    return wl == "w5"


def aggregate(xs: list[dict[str, Any]]) -> dict[str, Any]:
    """One contender's repeats -> the median (``msg_per_s``, ``ratio_to_raw``, ...) and spread
    (``msg_per_s_min`` / ``_max`` ...) of each figure; the other fields (handled, latency, RSS samples,
    settings) are those of the repeat with the median msg/s; order violations are summed and peak RSS
    is the highest of all repeats; ``load_1min`` lists each repeat's 1-minute load average before and
    after its run, ``busy_repeats`` the repeats whose load before exceeded the cores."""
    ok = sorted((x for x in xs if x.get("msg_per_s")), key=lambda x: x["msg_per_s"])
    rep = ok[(len(ok) - 1) // 2] if ok else xs[0]
    skip = ("repeat", "busy", "loadavg_before", "loadavg_after", *SPREAD_KEYS)
    agg = {k: v for k, v in rep.items() if k not in skip}
    agg["repeats"] = len(xs)
    agg["median_repeat"] = rep.get("repeat")
    for k in SPREAD_KEYS:
        vals = [x[k] for x in xs if x.get(k) is not None]
        if vals:
            nd = 1 if k == "msg_per_s" else 3
            agg[k] = round(statistics.median(vals), nd)
            agg[k + "_min"], agg[k + "_max"] = min(vals), max(vals)
    agg["load_1min"] = [
        [(x.get("loadavg_before") or [None])[0], (x.get("loadavg_after") or [None])[0]] for x in xs
    ]
    agg["busy_repeats"] = [x.get("repeat", 0) for x in xs if x.get("busy")]
    viol = [x["order_violations"] for x in xs if x.get("order_violations") is not None]
    agg["order_violations"] = sum(viol) if viol else None
    rss = [x["peak_rss_mb"] for x in xs if x.get("peak_rss_mb") is not None]
    agg["peak_rss_mb"] = max(rss) if rss else None
    agg["complete"] = all(x.get("complete") for x in xs)
    agg["wall_s"] = round(sum(x.get("wall_s") or 0 for x in xs), 1)
    errors = [f"repeat {x.get('repeat', 0) + 1}: {x['error']}" for x in xs if x.get("error")]
    agg["error"] = "; ".join(errors) or None
    growth = [x["rss_growth"]["mb_per_100k_messages"] for x in xs if x.get("rss_growth")]
    if growth:
        agg["rss_growth_max_mb_per_100k"] = max(growth)
    net = [
        x["rss_growth"]["net_mb_per_100k_messages"]
        for x in xs
        if x.get("rss_growth") and "net_mb_per_100k_messages" in x["rss_growth"]
    ]
    if net and len(net) == len(growth):
        agg["rss_net_growth_max_mb_per_100k"] = max(net)
    return agg


def rss_growth(samples: list[list[float]], n: int, value_bytes: int) -> dict[str, Any] | None:
    """RSS when 25% and 90% of the backlog had been handled, and the slope between (MB per 100k).

    With a blocked key (W4) the engine holds that key's messages, by design, up to
    ``max_in_flight``: RSS grows with them until the bound. Where the contender reports its
    messages in flight (sample column 4), ``net_mb_per_100k_messages`` is the slope after taking
    off the held messages' values (``value_bytes`` each, a lower bound of what a held message
    costs: its ``Message`` and engine objects are left in, so the net slope over-counts growth).
    """

    def at(frac: float) -> list[float] | None:
        return next((s for s in samples if s[2] >= frac * n), None)

    a, b = at(0.25), at(0.90)
    if a is None or b is None or b[2] == a[2]:
        return None
    per_100k = (b[2] - a[2]) / 100_000
    out: dict[str, Any] = {
        "rss_mb_at_25pct": a[1],
        "rss_mb_at_90pct": b[1],
        "mb_per_100k_messages": round((b[1] - a[1]) / per_100k, 2),
    }
    if len(a) > 3 and a[3] >= 0 and b[3] >= 0:
        held_mb = (b[3] - a[3]) * value_bytes / 1e6
        out.update(
            {
                "held_at_25pct": a[3],
                "held_at_90pct": b[3],
                "net_mb_per_100k_messages": round((b[1] - a[1] - held_mb) / per_100k, 2),
            }
        )
    return out


def run_flights(
    args: argparse.Namespace, w: dict[str, Any], repeat: int, topic: str, noise: bool = False
) -> list[dict[str, Any]]:
    """Workload 5: examples/flights.py (its own topic) -> a concurrency=1 and a concurrency=64 run."""
    tmp = args.out / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    out_json = tmp / f"{topic}.json"
    out_json.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "flights.py"),
        "--brokers",
        args.brokers,
        "--limit",
        str(w["messages"]),
        "--sample",
        str(w["sample"]),
        "--concurrency",
        "64",
        "--topic",
        topic,
        "--json-out",
        str(out_json),
        "--no-progress",
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)
    load0, others = loadavg(), cores_busy()
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired:
        rc, stdout, stderr = -9, "", "(killed after 900 s)"
    wall = round(time.perf_counter() - t0, 1)
    base = dict(
        contender="keyedconsumer",
        ordering="key",
        mode="sync",
        peer=False,
        repeat=repeat,
        wall_s=wall,
        **load_record(load0, noise, others),
    )
    if not out_json.exists():
        err = f"exit {rc}, no result; output tail: {(stdout + stderr).strip()[-1500:]}"
        return [
            {**base, "id": f"keyedconsumer/key/c{c}/sync", "concurrency": c, "error": err} for c in (1, 64)
        ]
    d = json.loads(out_json.read_text())
    out = []
    for part, c in (("baseline", 1), ("main", 64)):
        x = d[part]
        rec: dict[str, Any] = {
            **base,
            "id": f"keyedconsumer/key/c{c}/sync",
            "concurrency": c,
            "handled": x["messages"],
            "target": x["messages"],
            "complete": x["distinct"] >= x["messages"],
            "seconds": x["seconds"],
            "msg_per_s": x["msg_per_s"],
            "startup_s": x["startup_s"],
            "lat_p50_ms": None,
            "lat_p99_ms": None,
            "aligned_p50_ms": None,
            "aligned_p99_ms": None,
            "order_violations": x["violations"] + x["overlaps"],
            "peak_rss_mb": d.get("vm_hwm_mb"),
            "rss_samples": [],
            "settings": {
                "demo": "examples/flights.py",
                "topic": topic,
                "handler": "json.loads + time.sleep(0.002) + per-aircraft state",
                "handler_ms_mean": x["handler_ms_mean"],
                "startup_s": x["startup_s"],
                "stop_s": x["stop_s"],
                "overlaps": x["overlaps"],
            },
            "error": None if rc == 0 else f"exit {rc} (a check failed): {stdout.strip()[-600:]}",
        }
        if c == 1:
            rec["ideal"] = {
                "ideal_msg_per_s": x["ideal_msg_per_s"],
                "bound": f"the handler alone, back to back: {x['handler_alone_ms']:.2f} ms a message",
            }
            rec["settings"]["handler_alone_ms"] = x["handler_alone_ms"]
        else:
            rec["lag0"] = x.get("lag0")
        out.append(rec)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=("full", "ci"), default="full")
    ap.add_argument(
        "--only", default="1,2,3,4,5", help="workloads, e.g. 2,3 (or w2,w3); 5 is the flights demo"
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="runs of every contender, round-robin (default: 3 at full size, 1 at ci size)",
    )
    ap.add_argument(
        "--contenders",
        default="*",
        help="comma-separated fnmatch patterns over run ids; prefix wN: to apply to one workload only "
        "(e.g. 'w1:raw,w1:keyedconsumer/key/c16/sync,w2:*'); an explicit id outside the matrix is added",
    )
    ap.add_argument("--brokers", default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092"))
    ap.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--peers-python", type=Path, default=PEERS_PY)
    ap.add_argument("--no-peers", action="store_true", help="run only raw and keyedconsumer")
    ap.add_argument("--max-seconds", type=float, default=None, help="cap of one run after its first message")
    ap.add_argument("--io-budget-s", type=float, default=None, help="W2/W3: seconds of ideal time per run")
    ap.add_argument("--keep-topics", action="store_true")
    ap.add_argument(
        "--noise",
        action="store_true",
        help="run every repeat twice: a quiet pass, then a noisy one with a busy-loop process (one core) "
        "beside it; both are reported, and the goal 'a busy machine' compares them",
    )
    ap.add_argument(
        "--full-matrix",
        action="store_true",
        help="every ordering x concurrency x mode and every peer run (default: trimmed, see matrix())",
    )
    ap.add_argument(
        "--profile", default="", help="run ids (fnmatch) to record with py-spy (first repeat only)"
    )
    ap.add_argument("--profile-workloads", default="w1")
    ap.add_argument("--py-spy", default=None)
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument(
        "--engine",
        type=Path,
        default=None,
        help="a checkout (or a build of one) whose keyedconsumer package raw and keyedconsumer import "
        "(first on PYTHONPATH): before/after figures of an engine change in one run of this bench",
    )
    ap.add_argument("--seed", type=int, default=20261130)
    ap.add_argument(
        "--merge",
        action="store_true",
        help="replace only the workloads run now in an existing <out>/results.json (each workload "
        "records its own date, command and engine commit)",
    )
    ap.add_argument(
        "--rerender",
        action="store_true",
        help="only rewrite results.md, the goals and throughput.png from <out>/results.json",
    )
    args = ap.parse_args()
    if args.engine is not None:
        # a commit id or a typo is not a checkout: PYTHONPATH would then silently fall back to the
        # venv's editable install of the working tree, and "before" would measure "after"
        args.engine = args.engine.resolve()
        if not (args.engine / "keyedconsumer" / "__init__.py").is_file():
            ap.error(
                f"--engine {args.engine}: no keyedconsumer/__init__.py there (a checkout or a git archive of one)"
            )
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    repeats = args.repeats if args.repeats is not None else REPEATS[args.size]
    if repeats < 1:
        ap.error("--repeats must be >= 1")
    if args.rerender:
        jp = args.out / "results.json"
        results = json.loads(jp.read_text())
        results["notes"] = NOTES
        for wl, data in results["workloads"].items():
            finish_workload(wl, data)
        set_goals(results)
        jp.write_text(json.dumps(results, indent=1))
        write_markdown(results, args.out / "results.md")
        if not args.no_plot:
            plot(args, jp)
        return 0
    wanted = [("w" + s.strip().lstrip("wW")) for s in args.only.split(",") if s.strip()]
    unknown = [wl for wl in wanted if wl not in SIZES[args.size]]
    if unknown:
        ap.error(f"--only: no workload {', '.join(unknown)} (there are {', '.join(SIZES[args.size])})")
    all_pats = [p.strip() for p in args.contenders.split(",") if p.strip()]

    def pats_for(wl: str) -> list[str]:
        """Patterns for one workload: ``w2:keyedconsumer/*`` applies to w2 only, a bare one to all."""
        out = []
        for p in all_pats:
            head, sep, tail = p.partition(":")
            if not sep:
                out.append(p)
            elif "w" + head.lstrip("wW") == wl:
                out.append(tail)
        return out

    started = dt.datetime.now(dt.timezone.utc)
    t_start = time.perf_counter()
    use_peers = not args.no_peers
    pstat = peers_status(args.peers_python) if use_peers else {}
    results: dict[str, Any] = {
        "schema": 2,
        "size": args.size,
        "repeats": repeats,
        "started": started.strftime("%Y-%m-%d %H:%M"),
        "command": " ".join(["scripts/bench", *sys.argv[1:]]),
        "brokers": args.brokers,
        "machine": machine_info(args.peers_python if use_peers and args.peers_python.exists() else None),
        "workloads": {},
        "skipped": [],
        "notes": NOTES,
        "noise": {"enabled": args.noise, "passes": [], "cool_down_limit_s": COOL_DOWN_S[args.size]},
    }
    passes = (False, True) if args.noise else (False,)

    @contextlib.contextmanager
    def noise_pass(noise: bool, wl: str, rep: int) -> Iterator[None]:
        """The noisy pass of one repeat: the busy loop runs beside it; after it, the load cools down."""
        if not noise:
            yield
            return
        log(f"{wl} r{rep + 1}/{repeats}: noisy pass, a busy-loop process beside it")
        with BusyLoop() as busy:
            yield
        rec = {"workload": wl, "repeat": rep, **busy.record, **cool_down(COOL_DOWN_S[args.size])}
        results["noise"]["passes"].append(rec)
        log(
            f"{wl} r{rep + 1}/{repeats}: busy loop stopped ({rec.get('cores_used')} cores used), "
            f"cooled down {rec['cool_down_s']} s to {rec['other_cores']} other cores busy, load {rec['loadavg'][:1]}"
        )

    json_path, md_path = args.out / "results.json", args.out / "results.md"
    run_tag = uuid.uuid4().hex[:8]
    topics: list[str] = []
    failed = False

    def save() -> None:
        results["wall_s"] = round(time.perf_counter() - t_start, 1)
        if not args.merge:
            json_path.write_text(json.dumps(results, indent=1))

    def report(wl: str, data: dict[str, Any], res: dict[str, Any], rep: int) -> None:
        nonlocal failed
        data["repeat_runs"].append(res)
        finish_workload(wl, data)
        status = res.get("error") or ""
        extra = ""
        if res.get("ratio_to_in_memory") is not None:
            extra = f"  x{fmt(res['ratio_to_in_memory'], 2)} in-memory"
        if res.get("speed_up") is not None:
            extra = f"  speed-up x{fmt(res['speed_up'], 1)}"
        load = [(res.get(k) or [None])[0] for k in ("loadavg_before", "loadavg_after")]
        tag = " noisy" if res.get("noise") else (" BUSY" if res.get("busy") else "")
        log(
            f"{wl} r{rep + 1}/{repeats}{tag} {res['id']:40s} {fmt(res.get('msg_per_s')):>10} msg/s  "
            f"x{fmt(res.get('ratio_to_raw'), 2)} raw  eff {fmt(res.get('efficiency'), 2)}{extra}  "
            f"rss {fmt(res.get('peak_rss_mb'))} MB  viol {res.get('order_violations')}  "
            f"load {fmt(load[0], 1)}→{fmt(load[1], 1)}  ({res.get('wall_s')} s) {status[:300]}"
        )
        if res.get("error"):
            failed = True
        if (
            res["contender"] in ("keyedconsumer", "keyedconsumer-redis")
            and res["ordering"] in ("key", "partition")
            and res.get("order_violations")
        ):
            failed = True

    try:
        for wl in wanted:
            w = SIZES[args.size][wl]
            pats = pats_for(wl)

            def selected(rid: str, pats: list[str] = pats) -> bool:
                return any(fnmatch.fnmatchcase(rid, p) or rid.split("/")[0] == p for p in pats)

            runs = [r for r in matrix(args.size, wl, args.full_matrix) if selected(run_id(r))]
            if w.get("demo"):
                if not runs:
                    continue
                data = {
                    **w,
                    "runs": [],
                    "repeat_runs": [],
                    "notes": [
                        "examples/flights.py in a subprocess per repeat (its own topic); seconds from the first handler "
                        "start to the end of the handler that completed the last message: the group join before and "
                        "stop() after are reported apart (notes), not counted"
                    ],
                    "run": {
                        "started": results["started"],
                        "command": results["command"],
                        "repeats": repeats,
                        "keyedconsumer_commit": results["machine"].get("keyedconsumer_commit"),
                    },
                }
                results["workloads"][wl] = data
                t_wl = time.perf_counter()
                for rep, noise in itertools.product(range(repeats), passes):
                    topic = f"bench-{run_tag}-{wl}-r{rep}" + ("-noisy" if noise else "")
                    topics.append(topic)
                    log(
                        f"{wl}: examples/flights.py --limit {w['messages']:,} --sample {w['sample']:,} "
                        f"(repeat {rep + 1}/{repeats}{', noisy' if noise else ''})"
                    )
                    with noise_pass(noise, wl, rep):
                        for res in run_flights(args, w, rep, topic, noise):
                            report(wl, data, res, rep)
                    data["run"]["wall_s"] = round(time.perf_counter() - t_wl, 1)
                    save()
                continue
            known = {run_id(r) for r in runs}
            runs += [r for p in pats if (r := parse_id(p)) is not None and run_id(r) not in known]
            todo = []
            for r in runs:
                if r.get("peer"):
                    why = "--no-peers" if not use_peers else pstat.get(r["contender"])
                    if why:
                        results["skipped"].append({"id": f"{wl}:{run_id(r)}", "reason": why})
                        continue
                todo.append(r)
            if not todo:
                continue
            topic = f"bench-{run_tag}-{wl}"
            create_topic(args.brokers, topic, w["partitions"])
            topics.append(topic)
            key_ids = keys_for(w, random.Random(f"{args.seed}-{wl}"))
            log(f"{wl}: producing {w['messages']:,} x {w['size']} B to {topic}")
            meta = produce(args.brokers, topic, w, key_ids)
            meta["topic"] = topic
            meta["block_count"] = sum(1 for k in key_ids if k < 0)
            n = end_offsets(args.brokers, topic, w["partitions"])
            if n != w["messages"]:
                raise RuntimeError(f"{topic} holds {n} records, expected {w['messages']}")
            data = {
                **w,
                **meta,
                "runs": [],
                "repeat_runs": [],
                "notes": [],
                "run": {
                    "started": results["started"],
                    "command": results["command"],
                    "repeats": repeats,
                    "keyedconsumer_commit": results["machine"].get("keyedconsumer_commit"),
                },
            }
            t_wl = time.perf_counter()
            if w.get("hot_keys"):
                data["notes"].append(
                    f"{w['hot_keys']} hot keys carry {w['hot_share']:.0%} of the messages "
                    f"(the longest key has {meta['per_key_max']:,} messages)"
                )
            if w.get("block_share"):
                data["notes"].append(
                    f"key {BLOCK_KEY!r} ({meta['block_count']:,} messages, {w['block_share']:.0%}) blocks until the "
                    f"handled count has not moved for {w['stall_s']:g} s (or all other messages are handled); "
                    f"max_in_flight={w['max_in_flight']:,} (pyrallel-consumer: queue_max_messages)"
                )
            log(f"{wl}: produced in {meta['produce_s']} s; {len(todo)} runs x {repeats} repeat(s)")
            results["workloads"][wl] = data
            # round-robin: every contender once per repeat and pass, raw first
            for rep, noise in itertools.product(range(repeats), passes):
                with noise_pass(noise, wl, rep):
                    for r in todo:
                        res = run_one(args, wl, w, meta, r, key_ids, args.peers_python, rep, noise)
                        report(wl, data, res, rep)
                        data["run"]["wall_s"] = round(time.perf_counter() - t_wl, 1)
                        save()
    finally:
        if not args.keep_topics:
            delete_topics(args.brokers, topics)
    results["machine"]["loadavg_end"] = loadavg()
    results["wall_s"] = round(time.perf_counter() - t_start, 1)
    if args.merge and json_path.exists():
        old = json.loads(json_path.read_text())
        old["workloads"].update(results["workloads"])
        old["skipped"] = [
            x for x in old.get("skipped", []) if x["id"].split(":")[0] not in results["workloads"]
        ]
        old["skipped"] += [x for x in results["skipped"] if x["id"].split(":")[0] in results["workloads"]]
        old["workloads"] = dict(sorted(old["workloads"].items()))
        noise = old.setdefault("noise", {"enabled": False, "passes": []})
        noise["passes"] = [
            x for x in noise.get("passes", []) if x["workload"] not in results["workloads"]
        ] + results["noise"]["passes"]
        noise["enabled"] = bool(noise["passes"]) or args.noise
        noise["cool_down_limit_s"] = results["noise"]["cool_down_limit_s"]
        old["notes"] = NOTES
        for wl, data in old["workloads"].items():
            finish_workload(wl, data)
        results = old
    set_goals(results)
    json_path.write_text(json.dumps(results, indent=1))
    write_markdown(results, md_path)
    print_goals(results)
    log(f"wrote {json_path} and {md_path} ({results['wall_s'] / 60:.1f} min)")
    if not args.no_plot:
        plot(args, json_path)
    return 1 if failed else 0


def set_goals(results: dict[str, Any]) -> None:
    """results["goals"] (the quiet pass's, with "a busy machine"), results["goals_noisy"] (--noise) and
    results["other_checks"]."""
    results["goals"], noisy = goals(results)
    results.pop("goals_noisy", None)
    if noisy is not None:
        results["goals_noisy"] = noisy
    results["other_checks"] = other_checks(results)


def plot(args: argparse.Namespace, json_path: Path) -> None:
    png = json_path.with_name("throughput.png")
    for py in (args.peers_python, Path(sys.executable)):
        if not py.exists():
            continue
        r = subprocess.run(
            [str(py), str(HERE / "plot.py"), str(json_path), str(png)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if r.returncode == 0:
            log(f"wrote {png}")
            return
        if "No module named 'matplotlib'" not in r.stderr:
            log(f"plot failed with {py}: {r.stderr.strip()[-500:]}")
            return
    log("no plot: matplotlib is in bench/.venv-peers only (scripts/bench creates it)")


if __name__ == "__main__":
    sys.exit(main())
