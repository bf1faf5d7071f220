"""The benchmark suite: every contender, in one run, on the same topic data; reports ratios.

    scripts/bench [--size full|ci] [--only 1,2,3,4] [--contenders PATTERNS] [--brokers HOST:PORT]

Creates its own topics (unique names) on the broker, produces each workload's input ONCE, then runs
every selected contender on that data, each in its own subprocess with a fresh consumer group:

  raw                    plain confluent-kafka loop: consume(num_messages=500), store_offsets per
                         message, enable.auto.offset.store=false, auto commit
  keyedconsumer          ordering key|partition|none x concurrency 1,16,64,256 x sync|async handlers
  pyrallel-consumer      from bench/.venv-peers (async execution mode; see bench/README.md)
  faststream             from bench/.venv-peers (aiokafka subscriber, partition order)
  faststream-unordered   faststream's concurrent subscriber (max_workers, no order)

Workloads (full size; `ci` is a ~30 s smoke version on tiny data):
  1 overhead  1,000,000 x 100 B, 8 partitions, 10,000 keys, no-op handler
  2 io        50,000 x 100 B, 1 partition, 10,000 keys, handler waits 5 ms
  3 skew      workload 2 with 20% of the messages on 5 hot keys
  4 memory    1,000,000 x 1 KB backlog, 1 partition, 10,000 keys + one blocked key (1% of the
              messages) whose handler blocks until the consumer stalls; max_in_flight=10,000;
              RSS sampled every second

Writes <out>/results.json, <out>/results.md and <out>/throughput.png (default out: bench/results).
Contender ids look like ``keyedconsumer/key/c16/sync``; --contenders takes comma-separated
fnmatch patterns over them (``raw,keyedconsumer/key/*``); a bare name matches all its runs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import fnmatch
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from common import make_value  # noqa: E402

PEERS_PY = HERE / ".venv-peers" / "bin" / "python"
CONCURRENCIES = (1, 16, 64, 256)
ORDERINGS = ("key", "partition", "none")
MODES = ("sync", "async")

# ----------------------------------------------------------------------------------- workloads

SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "full": {
        "w1": dict(title="overhead", messages=1_000_000, size=100, partitions=8, keys=10_000, sleep_ms=0,
                   lat_every=4),
        "w2": dict(title="I/O-bound", messages=50_000, size=100, partitions=1, keys=10_000, sleep_ms=5),
        "w3": dict(title="skewed keys", messages=50_000, size=100, partitions=1, keys=10_000, sleep_ms=5,
                   hot_keys=5, hot_share=0.20),
        "w4": dict(title="memory", messages=1_000_000, size=1024, partitions=1, keys=10_000, sleep_ms=0,
                   block_share=0.01, max_in_flight=10_000, stall_s=3.0, lat_every=4, max_seconds=120.0,
                   peer_max_seconds=60.0),
    },
    "ci": {
        "w1": dict(title="overhead", messages=20_000, size=100, partitions=8, keys=1_000, sleep_ms=0),
        "w2": dict(title="I/O-bound", messages=2_000, size=100, partitions=1, keys=1_000, sleep_ms=5),
        "w3": dict(title="skewed keys", messages=2_000, size=100, partitions=1, keys=1_000, sleep_ms=5,
                   hot_keys=5, hot_share=0.20),
        "w4": dict(title="memory", messages=20_000, size=1024, partitions=1, keys=1_000, sleep_ms=0,
                   block_share=0.01, max_in_flight=1_000, stall_s=1.0, max_seconds=8.0),
    },
}
# per run: a run ends when its target is handled or max_seconds after its first message
RUN_LIMITS = {
    "full": dict(max_seconds=60.0, io_budget_s=10.0, io_min_target=1_000),
    "ci": dict(max_seconds=4.0, io_budget_s=1.5, io_min_target=150),
}
BLOCK_KEY = "k-blocked"


def kc(ordering: str, c: int, mode: str) -> dict[str, Any]:
    return dict(contender="keyedconsumer", ordering=ordering, concurrency=c, mode=mode)


def kcr(c: int, mode: str) -> dict[str, Any]:
    """keyedconsumer with the Redis sequencer (issue 5: >= 0.5x the in-memory sequencer on W2)."""
    return dict(contender="keyedconsumer-redis", ordering="key", concurrency=c, mode=mode)


def peer(name: str, ordering: str, c: int, mode: str) -> dict[str, Any]:
    return dict(contender=name, ordering=ordering, concurrency=c, mode=mode, peer=True)


RAW = dict(contender="raw", ordering="partition", concurrency=1, mode="sync")


def matrix(size: str, wl: str, full_matrix: bool = False) -> list[dict[str, Any]]:
    """The contenders of one workload, raw first.

    Workload 1 (1,000,000 messages, ~15-20 s per keyedconsumer run) is trimmed unless
    ``full_matrix``: ordering key at every concurrency, partition and none at concurrency 16.
    """
    all_kc = [kc(o, c, m) for o in ORDERINGS for c in CONCURRENCIES for m in MODES]
    w1_kc = all_kc if full_matrix else [
        *[kc("key", c, m) for c in CONCURRENCIES for m in MODES],
        *[kc(o, 16, m) for o in ("partition", "none") for m in MODES],
    ]
    if size == "ci":
        return {
            "w1": [RAW, kc("key", 16, "sync"), kc("key", 64, "async"), kc("partition", 16, "sync"),
                   kc("none", 16, "async"), peer("pyrallel-consumer", "key", 16, "async"),
                   peer("faststream", "partition", 1, "async")],
            "w2": [RAW, kc("key", 16, "sync"), kc("key", 64, "async"), kcr(64, "async"),
                   peer("pyrallel-consumer", "key", 16, "async")],
            "w3": [RAW, kc("key", 16, "sync")],
            "w4": [RAW, kc("key", 16, "sync")],
        }[wl]
    if wl == "w1":
        return [RAW, *w1_kc,
                peer("pyrallel-consumer", "key", 16, "async"),
                peer("faststream", "partition", 1, "async"),
                peer("faststream", "partition", 8, "async"),
                peer("faststream-unordered", "none", 16, "async")]
    if wl in ("w2", "w3"):
        return [RAW, *all_kc, *[kcr(c, m) for c in (16, 64) for m in MODES], kcr(256, "async"),
                *[peer("pyrallel-consumer", "key", c, "async") for c in CONCURRENCIES],
                peer("faststream", "partition", 1, "sync"),
                peer("faststream", "partition", 1, "async"),
                *[peer("faststream-unordered", "none", c, "async") for c in (16, 64, 256)]]
    return [RAW, kc("key", 16, "sync"), kc("key", 16, "async"), kc("key", 256, "async"),
            peer("pyrallel-consumer", "key", 16, "async"),
            peer("faststream", "partition", 1, "async")]


def parse_id(text: str) -> dict[str, Any] | None:
    """An explicit run id (no wildcard) outside the size's matrix, e.g. keyedconsumer/key/c1/sync."""
    if any(ch in text for ch in "*?["):
        return None
    if text == "raw":
        return dict(RAW)
    parts = text.split("/")
    if len(parts) != 4 or not parts[2].startswith("c") or not parts[2][1:].isdigit() or parts[3] not in MODES:
        return None
    name, ordering, c, mode = parts[0], parts[1], int(parts[2][1:]), parts[3]
    if ordering not in ORDERINGS:
        return None
    if name == "keyedconsumer":
        return kc(ordering, c, mode)
    if name == "keyedconsumer-redis":
        return kcr(c, mode)
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


def loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


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
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "keyedconsumer"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
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
    if peers_py is not None:
        code = ("import json,platform,importlib.metadata as m\n"
                "v={'python':platform.python_version()}\n"
                "for p in ('pyrallel-consumer','faststream','aiokafka','confluent-kafka','matplotlib'):\n"
                "    try: v[p]=m.version(p)\n"
                "    except Exception: pass\n"
                "print(json.dumps(v))")
        try:
            out = subprocess.run([str(peers_py), "-c", code], capture_output=True, text=True, timeout=60)
            info["peers_venv"] = json.loads(out.stdout)
        except (OSError, subprocess.SubprocessError, ValueError) as exc:
            info["peers_venv"] = {"error": str(exc)}
    return info


def peers_status(peers_py: Path) -> dict[str, str | None]:
    """{peer: None if usable else the reason}."""
    names = {"pyrallel-consumer": "pyrallel_consumer", "faststream": "faststream.kafka",
             "faststream-unordered": "faststream.kafka"}
    if not peers_py.exists():
        why = f"no peers venv at {peers_py.parent.parent} (scripts/bench creates it)"
        return {n: why for n in names}
    out: dict[str, str | None] = {}
    for name, mod in names.items():
        note = peers_py.parent.parent / f"UNAVAILABLE-{name.split('-unordered')[0]}"
        if note.exists():
            out[name] = note.read_text().strip()
            continue
        r = subprocess.run([str(peers_py), "-c", f"import {mod}"], capture_output=True, text=True, timeout=120)
        out[name] = None if r.returncode == 0 else f"import {mod} failed: {r.stderr.strip().splitlines()[-1:]}"
    return out


# ------------------------------------------------------------------------------------ producing


def create_topic(brokers: str, name: str, partitions: int) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": brokers})
    admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)])[name].result(timeout=60)


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


def keys_for(w: dict[str, Any], rng: random.Random) -> list[int]:
    """Key id per message: uniform over `keys`, with the hot and blocked keys of workloads 3 and 4.
    Id -1 is the blocked key."""
    n, nkeys = w["messages"], w["keys"]
    hot, hot_share = w.get("hot_keys", 0), w.get("hot_share", 0.0)
    block_share = w.get("block_share", 0.0)
    out = []
    for _ in range(n):
        r = rng.random()
        if r < block_share:
            out.append(-1)
        elif r < block_share + hot_share:
            out.append(rng.randrange(hot))
        else:
            out.append(rng.randrange(hot, nkeys))
    return out


def produce(brokers: str, topic: str, w: dict[str, Any], key_ids: list[int]) -> dict[str, Any]:
    from confluent_kafka import Producer

    p = Producer({
        "bootstrap.servers": brokers,
        "acks": "all",
        "enable.idempotence": True,  # keeps each partition in produce order across retries
        "linger.ms": 20,
        "batch.size": 1_000_000,
        "queue.buffering.max.messages": 500_000,
        "queue.buffering.max.kbytes": 512 * 1024,
        "compression.type": "none",
    })
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
    return {"produce_s": round(time.perf_counter() - t0, 1), "produce_t0_ms": ts0,
            "per_key_max": max(seq.values()) + 1 if seq else 0}


def end_offsets(brokers: str, topic: str, partitions: int) -> int:
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": brokers, "group.id": f"bench-probe-{uuid.uuid4().hex[:8]}"})
    try:
        return sum(c.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1] for p in range(partitions))
    finally:
        c.close()


# ----------------------------------------------------------------------------------------- ideal


def ideal(w: dict[str, Any], key_ids: list[int], r: dict[str, Any], target: int, max_in_flight: int) -> dict[str, Any] | None:
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
    return {"ideal_msg_per_s": round(target / t, 1), "usable_concurrency": usable, "active_keys": window,
            "bound": "longest key chain" if chain > t_par else "concurrency"}


# ------------------------------------------------------------------------------------ running


def run_one(args: argparse.Namespace, wl: str, w: dict[str, Any], meta: dict[str, Any], r: dict[str, Any],
            key_ids: list[int], peers_py: Path) -> dict[str, Any]:
    limits = RUN_LIMITS[args.size]
    target = w["messages"]
    if w["sleep_ms"]:
        # slow-by-design runs (concurrency 1, partition order on one partition) measure a prefix
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
    if r.get("peer") and w.get("peer_max_seconds") and not args.max_seconds:
        spec["max_seconds"] = w["peer_max_seconds"]  # W4: the peers cannot finish 1M in 120 s anyway
    if w.get("block_share"):
        spec.update(block_key=BLOCK_KEY, block_count=meta["block_count"], stall_s=w["stall_s"])
    py = peers_py if r.get("peer") else Path(sys.executable)
    cmd = [str(py), str(HERE / "contender.py"), json.dumps(spec)]
    prof_out = None
    if args.profile and any(fnmatch.fnmatchcase(run_id(r), p) for p in args.profile.split(",")) and wl in args.profile_workloads:
        pyspy = args.py_spy or str(PEERS_PY.parent / "py-spy")
        pyspy = str(Path(pyspy).resolve()) if "/" in pyspy else (shutil.which(pyspy) or pyspy)
        prof_out = args.out / f"profile-{wl}-{run_id(r).replace('/', '-')}.raw.txt"
        # --gil: only the thread holding the GIL is sampled, i.e. where the Python-side CPU goes
        cmd = [pyspy, "record", "--format", "raw", "--rate", "250", "--gil", "--nonblocking", "-o", str(prof_out),
               "--", *cmd]
    cwd = args.out / "tmp"
    cwd.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)
    load0 = loadavg()
    t0 = time.perf_counter()
    timeout = spec["max_seconds"] + spec["startup_s"] + 90 + (w.get("stall_s", 0) * 4)
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stderr = (exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")) + f"\n(killed after {timeout:.0f} s)"
        rc = -9
    wall = time.perf_counter() - t0
    res: dict[str, Any] = {"id": run_id(r), **{k: r[k] for k in ("contender", "ordering", "concurrency", "mode")},
                           "peer": bool(r.get("peer")), "wall_s": round(wall, 1), "loadavg_before": load0}
    line = next((ln for ln in reversed(stdout.splitlines()) if ln.startswith("BENCH_RESULT ")), None)
    if line is None:
        res["error"] = f"exit {rc}, no result; stderr tail: {stderr.strip()[-1500:]}"
        return res
    res.update(json.loads(line[len("BENCH_RESULT "):]))
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
        return ["", title] + [f"{100 * c / n:6.1f}%  {f}" for f, c in sorted(d.items(), key=lambda x: -x[1])[:top]]

    lines = [f"py-spy --gil samples: {n} (the thread holding the GIL at each sample)"]
    lines += block("functions by self time:", self_f)
    lines += block("functions by inclusive time:", total_f)
    lines += block("lines by self time:", self_l)
    out.write_text("\n".join(lines) + "\n")
    return str(out)


# ------------------------------------------------------------------------------------ reporting


def finish_workload(wl: str, data: dict[str, Any]) -> None:
    runs = data["runs"]
    raw = next((x for x in runs if x["id"] == "raw" and x.get("msg_per_s")), None)
    for x in runs:
        if raw and x.get("msg_per_s"):
            x["ratio_to_raw"] = round(x["msg_per_s"] / raw["msg_per_s"], 3)
        if x.get("ideal") and x.get("msg_per_s"):
            x["efficiency"] = round(x["msg_per_s"] / x["ideal"]["ideal_msg_per_s"], 3)
        if wl == "w4" and x.get("rss_samples"):
            x["rss_growth"] = rss_growth(x["rss_samples"], data["messages"])


def rss_growth(samples: list[list[float]], n: int) -> dict[str, Any] | None:
    """RSS when 25% and 90% of the backlog had been handled, and the slope between (MB per 100k)."""
    def at(frac: float) -> list[float] | None:
        return next((s for s in samples if s[2] >= frac * n), None)

    a, b = at(0.25), at(0.90)
    if a is None or b is None or b[2] == a[2]:
        return None
    return {"rss_mb_at_25pct": a[1], "rss_mb_at_90pct": b[1],
            "mb_per_100k_messages": round((b[1] - a[1]) / ((b[2] - a[2]) / 100_000), 2)}


def find(runs: list[dict[str, Any]], rid: str) -> dict[str, Any] | None:
    return next((x for x in runs if x["id"] == rid), None)


def goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    wls = results["workloads"]
    if "w1" in wls:
        x = find(wls["w1"]["runs"], "keyedconsumer/key/c16/sync")
        v = x.get("ratio_to_raw") if x else None
        out.append({"goal": "W1 overhead: keyedconsumer key c16 (sync) >= 0.5x raw", "value": v,
                    "met": None if v is None else v >= 0.5})
        xa = find(wls["w1"]["runs"], "keyedconsumer/key/c16/async")
        if xa and xa.get("ratio_to_raw") is not None:
            out.append({"goal": "W1 overhead: keyedconsumer key c16 (async) >= 0.5x raw", "value": xa["ratio_to_raw"],
                        "met": xa["ratio_to_raw"] >= 0.5})
    if "w2" in wls:
        for rid in ("keyedconsumer/key/c64/sync", "keyedconsumer/key/c256/async"):
            x = find(wls["w2"]["runs"], rid)
            v = x.get("efficiency") if x else None
            out.append({"goal": f"W2 I/O: {rid} >= 0.9 of ideal", "value": v, "met": None if v is None else v >= 0.9})
        for c in CONCURRENCIES[1:]:  # at concurrency 1 both are bound by the 5 ms handler (200 msg/s)
            p = find(wls["w2"]["runs"], f"pyrallel-consumer/key/c{c}/async")
            if not p or not p.get("msg_per_s"):
                continue
            for mode in MODES:
                x = find(wls["w2"]["runs"], f"keyedconsumer/key/c{c}/{mode}")
                if x and x.get("msg_per_s"):
                    v = round(x["msg_per_s"] / p["msg_per_s"], 2)
                    out.append({"goal": f"W2 peers: keyedconsumer key c{c} {mode} >= 2x pyrallel-consumer key_hash c{c}",
                                "value": v, "met": v >= 2.0 and x.get("order_violations") == 0})
    if "w2" in wls:
        for rid in ("keyedconsumer-redis/key/c64/sync", "keyedconsumer-redis/key/c64/async", "keyedconsumer-redis/key/c256/async",
                    "keyedconsumer-redis/key/c16/sync"):
            x = find(wls["w2"]["runs"], rid)
            base = find(wls["w2"]["runs"], rid.replace("keyedconsumer-redis", "keyedconsumer"))
            if x and base and x.get("msg_per_s") and base.get("msg_per_s"):
                v = round(x["msg_per_s"] / base["msg_per_s"], 2)
                out.append({"goal": f"W2 Redis: {rid} >= 0.5x the in-memory sequencer", "value": v,
                            "met": v >= 0.5 and x.get("order_violations") == 0})
    if "w4" in wls:
        for x in wls["w4"]["runs"]:
            if x["contender"] == "keyedconsumer" and x.get("peak_rss_mb") is not None:
                out.append({"goal": f"W4 memory: {x['id']} peak RSS < 300 MB", "value": x["peak_rss_mb"],
                            "met": x["peak_rss_mb"] < 300})
                g = x.get("rss_growth")
                if g:
                    raw = find(wls["w4"]["runs"], "raw")
                    rg = (raw or {}).get("rss_growth") or {}
                    ref = f"; raw: {rg['mb_per_100k_messages']}" if rg else ""
                    out.append({"goal": f"W4 memory: {x['id']} RSS does not grow with the backlog "
                                        f"(MB per 100k messages handled, 25%→90% of the backlog: "
                                        f"{g['rss_mb_at_25pct']}→{g['rss_mb_at_90pct']} MB{ref}; < 2 counts as flat)",
                                "value": g["mb_per_100k_messages"], "met": g["mb_per_100k_messages"] < 2})
    return out


def fmt(v: Any, nd: int = 0) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:,.{nd}f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def write_markdown(results: dict[str, Any], path: Path) -> None:
    m = results["machine"]
    L = [f"# keyedconsumer benchmark ({results['size']} size)", ""]
    L.append(f"- date: {results['started']} UTC, wall time {results['wall_s'] / 60:.1f} min")
    L.append(f"- machine: {m['nproc']} CPUs ({m['cpu']}), {m['memory_gb']} GB RAM, {m['os']}; "
             f"load average at start {m.get('loadavg_start')}, at end {m.get('loadavg_end')}")
    L.append(f"- python {m['python']}, confluent-kafka {m['confluent_kafka']}, librdkafka {m['librdkafka']}; "
             f"keyedconsumer {m.get('keyedconsumer_commit')}")
    pv = m.get("peers_venv")
    if pv:
        L.append("- peers venv: " + ", ".join(f"{k} {v}" for k, v in pv.items()))
    L.append(f"- broker: {results['brokers']}; command: `{results['command']}`")
    L.append("")
    if results.get("goals"):
        L += ["## Goals (ratios from this run)", "", "| goal | measured | met |", "| --- | ---: | :---: |"]
        for g in results["goals"]:
            met = "–" if g["met"] is None else ("yes" if g["met"] else "**no**")
            L.append(f"| {g['goal']} | {fmt(g['value'], 2)} | {met} |")
        L.append("")
    for wl, data in results["workloads"].items():
        L.append(f"## {wl.upper()} {data['title']}: {data['messages']:,} x {data['size']} B, "
                 f"{data['partitions']} partition(s), {data['keys']:,} keys"
                 + (f", handler waits {data['sleep_ms']} ms" if data["sleep_ms"] else ", no-op handler"))
        L.append("")
        run = data.get("run") or {}
        if run and (run.get("started") != results["started"] or run.get("command") != results["command"]):
            L += [f"- run separately: {run.get('started')} UTC, {fmt(run.get('wall_s'), 0)} s, `{run.get('command')}`, "
                  f"keyedconsumer {run.get('keyedconsumer_commit')}", ""]
        if data.get("notes"):
            L += [f"- {n}" for n in data["notes"]] + [""]
        L.append("| contender | workload | ordering | concurrency | sync/async | handled | msg/s | ratio to raw "
                 "| efficiency vs ideal | p50/p99 latency ms (produce→start) | p50/p99 ms backlog-aligned "
                 "| peak RSS MB | order violations | notes |")
        L.append("| --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
        for x in data["runs"]:
            notes = []
            if x.get("error"):
                notes.append("ERROR: " + x["error"].splitlines()[0][:120])
            elif not x.get("complete"):
                notes.append(f"capped at {x.get('seconds')} s")
            if x.get("target") and x["target"] < data["messages"]:
                notes.append(f"prefix of {x['target']:,}")
            if x.get("ideal"):
                notes.append(f"ideal {x['ideal']['ideal_msg_per_s']:,.0f}/s ({x['ideal']['bound']})")
            if x.get("block"):
                notes.append(f"block released after {x['block'].get('released_after_s')} s "
                             f"at {x['block'].get('handled_at_release'):,} handled, "
                             f"RSS then {x['block'].get('rss_mb_at_release')} MB")
            if x.get("rss_growth"):
                notes.append(f"RSS 25%→90% of backlog: {x['rss_growth']['rss_mb_at_25pct']}→"
                             f"{x['rss_growth']['rss_mb_at_90pct']} MB")
            if x.get("peak_in_flight") is not None:
                notes.append(f"peak in-flight {x['peak_in_flight']:,}")
            acq = (x.get("settings") or {}).get("lease_acquire_calls")
            if acq is not None and x.get("handled"):
                notes.append(f"Redis lease acquires {acq:,} ({acq / x['handled']:.2f} per message)")
            lat = (f"{fmt(x.get('lat_p50_ms'))} / {fmt(x.get('lat_p99_ms'))}" if x.get("lat_p50_ms") is not None else "–")
            alat = (f"{fmt(x.get('aligned_p50_ms'))} / {fmt(x.get('aligned_p99_ms'))}"
                    if x.get("aligned_p50_ms") is not None else "–")
            L.append(f"| {x['contender']} | {wl.upper()} | {x['ordering']} | {x['concurrency']} | {x['mode']} "
                     f"| {fmt(x.get('handled'))} | {fmt(x.get('msg_per_s'))} | {fmt(x.get('ratio_to_raw'), 2)} "
                     f"| {fmt(x.get('efficiency'), 2)} | {lat} | {alat} | {fmt(x.get('peak_rss_mb'))} "
                     f"| {fmt(x.get('order_violations'))} | {'; '.join(notes)} |")
        L.append("")
    if results.get("skipped"):
        L += ["## Not run", ""] + [f"- {s['id']}: {s['reason']}" for s in results["skipped"]] + [""]
    L += ["## How to read this", ""] + [f"- {n}" for n in results["notes"]] + [""]
    path.write_text("\n".join(L))


NOTES = [
    "Every contender runs in its own process, one after another, on the same topic data, each with a fresh "
    "consumer group; ratios compare runs of this one invocation, absolute numbers depend on the (shared, noisy) machine.",
    "msg/s: handled messages / seconds from the first handler start to the end of the last handled message. "
    "A run that is not done after its cap (max_seconds after its first message) reports what it handled so far (\"capped\").",
    "I/O-bound runs whose ideal would take longer than the budget (concurrency 1, partition order on one partition) "
    "measure a prefix of the topic (\"prefix of N\") and are compared with the ideal of that prefix.",
    "efficiency = msg/s / ideal; ideal = usable concurrency / handler wait, where usable concurrency is "
    "min(concurrency, distinct keys among the first max_in_flight messages) for ordering=key, "
    "min(concurrency, partitions) for ordering=partition (and for raw: 1), concurrency for ordering=none; "
    "bounded by the longest chain of one key for ordering=key (workload 3's hot keys).",
    "latency (produce→start) = handler start - the record's produce timestamp (Kafka CreateTime, set by the "
    "producer; pyrallel-consumer does not expose it, so it is read from the value, where the producer wrote the same number). "
    "The input is produced once before all runs, so it mostly measures how long the backlog waited; "
    "backlog-aligned latency subtracts (first handler start - first produce time), i.e. it is the latency of a replay of the "
    "topic at its produce rate started when the run started (clamped at 0): comparable across contenders.",
    "peak RSS: the highest RSS of the contender process and its children, sampled every second (the harness's own "
    "per-message latency array, 8 bytes a message, is included for every contender).",
    "order violations: a message whose per-key sequence number is not the previous one + 1 (reordering, duplicate "
    "or gap); must be 0 for ordering key and partition. ordering=none and faststream-unordered promise no order.",
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=("full", "ci"), default="full")
    ap.add_argument("--only", default="1,2,3,4", help="workloads, e.g. 2,3 (or w2,w3)")
    ap.add_argument("--contenders", default="*",
                    help="comma-separated fnmatch patterns over run ids; prefix wN: to apply to one workload only "
                         "(e.g. 'w1:raw,w1:keyedconsumer/key/c16/sync,w2:*'); an explicit id outside the matrix is added")
    ap.add_argument("--brokers", default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092"))
    ap.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--peers-python", type=Path, default=PEERS_PY)
    ap.add_argument("--no-peers", action="store_true", help="run only raw and keyedconsumer")
    ap.add_argument("--max-seconds", type=float, default=None, help="cap of one run after its first message")
    ap.add_argument("--io-budget-s", type=float, default=None, help="W2/W3: seconds of ideal time per run")
    ap.add_argument("--keep-topics", action="store_true")
    ap.add_argument("--full-matrix", action="store_true",
                    help="workload 1 with every ordering x concurrency x mode (default: trimmed, see matrix())")
    ap.add_argument("--profile", default="", help="run ids (fnmatch) to record with py-spy")
    ap.add_argument("--profile-workloads", default="w1")
    ap.add_argument("--py-spy", default=None)
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--seed", type=int, default=20261130)
    ap.add_argument("--merge", action="store_true",
                    help="replace only the workloads run now in an existing <out>/results.json (each workload "
                         "records its own date, command and engine commit)")
    ap.add_argument("--rerender", action="store_true",
                    help="only rewrite results.md, the goals and throughput.png from <out>/results.json")
    args = ap.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.rerender:
        jp = args.out / "results.json"
        results = json.loads(jp.read_text())
        results["notes"] = NOTES
        for wl, data in results["workloads"].items():
            finish_workload(wl, data)
        results["goals"] = goals(results)
        jp.write_text(json.dumps(results, indent=1))
        write_markdown(results, args.out / "results.md")
        if not args.no_plot:
            plot(args, jp)
        return 0
    wanted = [("w" + s.strip().lstrip("wW")) for s in args.only.split(",") if s.strip()]
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
        "schema": 1,
        "size": args.size,
        "started": started.strftime("%Y-%m-%d %H:%M"),
        "command": " ".join(["scripts/bench", *sys.argv[1:]]),
        "brokers": args.brokers,
        "machine": machine_info(args.peers_python if use_peers and args.peers_python.exists() else None),
        "workloads": {},
        "skipped": [],
        "notes": NOTES,
    }
    json_path, md_path = args.out / "results.json", args.out / "results.md"
    run_tag = uuid.uuid4().hex[:8]
    topics: list[str] = []
    failed = False
    try:
        for wl in wanted:
            w = SIZES[args.size][wl]
            pats = pats_for(wl)

            def selected(rid: str, pats: list[str] = pats) -> bool:
                return any(fnmatch.fnmatchcase(rid, p) or rid.split("/")[0] == p for p in pats)

            runs = [r for r in matrix(args.size, wl, args.full_matrix) if selected(run_id(r))]
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
            data = {**w, **meta, "runs": [], "notes": [],
                    "run": {"started": results["started"], "command": results["command"],
                            "keyedconsumer_commit": results["machine"].get("keyedconsumer_commit")}}
            t_wl = time.perf_counter()
            if w.get("hot_keys"):
                data["notes"].append(f"{w['hot_keys']} hot keys carry {w['hot_share']:.0%} of the messages "
                                     f"(the longest key has {meta['per_key_max']:,} messages)")
            if w.get("block_share"):
                data["notes"].append(
                    f"key {BLOCK_KEY!r} ({meta['block_count']:,} messages, {w['block_share']:.0%}) blocks until the "
                    f"handled count has not moved for {w['stall_s']:g} s (or all other messages are handled); "
                    f"max_in_flight={w['max_in_flight']:,} (pyrallel-consumer: queue_max_messages)")
            log(f"{wl}: produced in {meta['produce_s']} s; {len(todo)} runs")
            results["workloads"][wl] = data
            for r in todo:
                res = run_one(args, wl, w, meta, r, key_ids, args.peers_python)
                data["runs"].append(res)
                finish_workload(wl, data)
                status = res.get("error") or ""
                log(f"{wl} {res['id']:40s} {fmt(res.get('msg_per_s')):>10} msg/s  "
                    f"x{fmt(res.get('ratio_to_raw'), 2)} raw  eff {fmt(res.get('efficiency'), 2)}  "
                    f"rss {fmt(res.get('peak_rss_mb'))} MB  viol {res.get('order_violations')}  "
                    f"({res['wall_s']} s) {status[:300]}")
                if res.get("error"):
                    failed = True
                if res["contender"] in ("keyedconsumer", "keyedconsumer-redis") and res["ordering"] in ("key", "partition") and res.get("order_violations"):
                    failed = True
                results["wall_s"] = round(time.perf_counter() - t_start, 1)
                data["run"]["wall_s"] = round(time.perf_counter() - t_wl, 1)
                if not args.merge:
                    json_path.write_text(json.dumps(results, indent=1))
    finally:
        if not args.keep_topics:
            delete_topics(args.brokers, topics)
    results["machine"]["loadavg_end"] = loadavg()
    results["wall_s"] = round(time.perf_counter() - t_start, 1)
    if args.merge and json_path.exists():
        old = json.loads(json_path.read_text())
        old["workloads"].update(results["workloads"])
        old["skipped"] = [x for x in old.get("skipped", []) if x["id"].split(":")[0] not in results["workloads"]]
        old["skipped"] += [x for x in results["skipped"] if x["id"].split(":")[0] in results["workloads"]]
        old["workloads"] = dict(sorted(old["workloads"].items()))
        old["notes"] = NOTES
        results = old
    results["goals"] = goals(results)
    json_path.write_text(json.dumps(results, indent=1))
    write_markdown(results, md_path)
    log(f"wrote {json_path} and {md_path} ({results['wall_s'] / 60:.1f} min)")
    if not args.no_plot:
        plot(args, json_path)
    return 1 if failed else 0


def plot(args: argparse.Namespace, json_path: Path) -> None:
    png = json_path.with_name("throughput.png")
    for py in (args.peers_python, Path(sys.executable)):
        if not py.exists():
            continue
        r = subprocess.run([str(py), str(HERE / "plot.py"), str(json_path), str(png)], capture_output=True,
                           text=True, timeout=300)
        if r.returncode == 0:
            log(f"wrote {png}")
            return
        if "No module named 'matplotlib'" not in r.stderr:
            log(f"plot failed with {py}: {r.stderr.strip()[-500:]}")
            return
    log("no plot: matplotlib is in bench/.venv-peers only (scripts/bench creates it)")


if __name__ == "__main__":
    sys.exit(main())
