"""What the Redis sequencer costs Redis: commands and round trips per message, Redis CPU per 1,000
messages, and memory per held key, per fencing counter and per parked or scheduled message.

    .venv/bin/python bench/redis_cost.py --brokers 127.0.0.1:9092 \\
        [--redis redis://127.0.0.1:6379/0] [--redis-cluster redis+cluster://127.0.0.1:17000,...] \\
        [--messages 20000] [--smoke] [--out bench/results]

Each target (a single Redis, a Redis Cluster, or both) gets the same workloads, one KeyedConsumer
(``RedisSequencer``, concurrency 64, a no-op sync handler) in this process, on a topic of its own:

  reuse    N messages over 1,000 keys (a key comes back while its lease is held or lingers)
  distinct N messages over 1,000,000 keys (almost every message is a key not seen before: the
           worst case, one acquire and one release per message)
  park     N messages over 5,000 keys; 1 % of the messages fail once with
           ``RetryLater(0.2, park=True)`` (their key is parked and drained), plus N / 100 messages
           scheduled 1 s ahead (``RedisSequencer.schedule``)
  idle     the consumer on an empty topic for ``--idle-s`` seconds: the per-instance background
           (check-ins, scheduler election, the scheduler's polls), as commands per second

For each: server side, ``INFO commandstats`` and ``INFO cpu`` (``used_cpu_user + used_cpu_sys``)
of every node before and after, summed over masters (replicas apart); client side, every command
redis-py sends and every send (a round trip: one single command, or one pipeline to one node),
counted in redis-py's connection class. Server counts include the commands run inside Lua scripts
(``GET``, ``SET``... under ``EVALSHA``); client counts are the top-level commands only.

Memory (``INFO memory`` used_memory deltas summed over masters, and ``MEMORY USAGE`` of sample keys),
with the sequencer's own scripts through its ``LeaseStore``: 10,000 leases held; what they leave
after release (the fencing counters of the hash slots they fell in, at most 16,384 per namespace:
``bench/redis_memory.py`` follows them over 10,000,000 keys); 10,000 parked 100-byte messages over
1,000 keys; 2,000 scheduled messages.

Timings (CPU) are only meaningful on a quiet machine: run it under ``flock -x /tmp/kc-quiet.lock``.
Writes ``<out>/redis_cost.json`` and ``<out>/redis_cost.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
#: the keyedconsumer measured: this checkout, or KC_SRC (e.g. a `git archive <commit> keyedconsumer` tree)
KC_SRC = os.environ.get("KC_SRC") or str(ROOT)
sys.path.insert(0, KC_SRC)

import redis  # noqa: E402
import run as suite  # noqa: E402  (bench/run.py: topics, produce, log)
from redis.connection import Connection  # noqa: E402

from keyedconsumer import KeyedConsumer, Message, RedisSequencer, RetryLater  # noqa: E402
from keyedconsumer.sequencing import keys as kkeys  # noqa: E402
from keyedconsumer.sequencing.parking import encode_entry, new_schedule_id  # noqa: E402
from keyedconsumer.sequencing.store import LeaseStore, connect  # noqa: E402

# ------------------------------------------------------------------------ client-side counting


class ClientCounter:
    """Counts the commands redis-py packs and the sends it makes (round trips), process-wide."""

    def __init__(self) -> None:
        self.commands: Counter[str] = Counter()
        self.sends = 0
        self.on = False
        self._lock = threading.Lock()

    def install(self) -> None:
        """Wrap redis-py's ``Connection`` (where its MRO defines them): ``send_command`` (one
        command), ``pack_commands`` (a pipeline's commands), ``send_packed_command`` (one send)."""
        counter = self

        def owner(name: str) -> Any:
            return next(c for c in Connection.__mro__ if name in c.__dict__)

        send_one, pack_many, send = (
            owner("send_command").send_command,
            owner("pack_commands").pack_commands,
            owner("send_packed_command").send_packed_command,
        )

        def send_command(conn: Any, *args: Any, **kwargs: Any) -> Any:
            if counter.on:
                counter._count([args])
            return send_one(conn, *args, **kwargs)

        def pack_commands(conn: Any, commands: Any) -> Any:
            commands = list(commands)
            if counter.on:
                counter._count(commands)
            return pack_many(conn, commands)

        def send_packed_command(conn: Any, command: Any, check_health: bool = True) -> Any:
            if counter.on:
                with counter._lock:
                    counter.sends += 1
            return send(conn, command, check_health)

        owner("send_command").send_command = send_command
        owner("pack_commands").pack_commands = pack_commands
        owner("send_packed_command").send_packed_command = send_packed_command

    def _count(self, commands: list[Any]) -> None:
        with self._lock:
            for cmd in commands:
                name = cmd[0].decode() if isinstance(cmd[0], bytes) else str(cmd[0])
                self.commands[name.upper()] += 1

    def start(self) -> None:
        with self._lock:
            self.commands.clear()
            self.sends = 0
            self.on = True

    def stop(self) -> dict[str, Any]:
        with self._lock:
            self.on = False
            return {"commands": dict(self.commands), "sends": self.sends}


CLIENT = ClientCounter()


def route_scripts_client_side(on: bool) -> None:
    """redis-py 8's cluster pipeline has no routing policy for ``EVALSHA`` and asks the server for
    each command's keys (``COMMAND GETKEYS``, one more round trip per script call); a single
    command's path reads them from the arguments. ``on``: give ``EVAL``/``EVALSHA`` the keyed policy,
    so the pipeline routes them from their arguments too (the fix measured as ``cluster-fix``)."""
    from redis.commands.policies import (  # type: ignore[attr-defined]
        STATIC_POLICIES,
        CommandPolicies,
        RequestPolicy,
        ResponsePolicy,
    )

    core = STATIC_POLICIES.setdefault("core", {})
    for name in ("eval", "evalsha"):
        if on:
            core[name] = CommandPolicies(
                request_policy=RequestPolicy.DEFAULT_KEYED, response_policy=ResponsePolicy.DEFAULT_KEYED
            )
        else:
            core.pop(name, None)


# ------------------------------------------------------------------------ server-side counting


class Nodes:
    """Every Redis node of a target (one, or each node of a cluster), read with plain clients."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.cluster = url.startswith(("redis+cluster", "rediss+cluster"))
        if self.cluster:
            rc = connect(url, 5.0)
            addrs = [(n.host, n.port) for n in rc.get_nodes()]
            rc.close()
        else:
            c = redis.Redis.from_url(url)
            kw = c.connection_pool.connection_kwargs
            addrs = [(kw.get("host", "127.0.0.1"), int(kw.get("port", 6379)))]
            c.close()
        self.clients = {f"{h}:{p}": redis.Redis(host=h, port=p, socket_timeout=5) for h, p in sorted(addrs)}

    def snapshot(self) -> dict[str, dict[str, Any]]:
        out = {}
        for name, c in self.clients.items():
            stats = c.info("commandstats")
            cpu = c.info("cpu")
            mem = c.info("memory")
            role = c.info("replication")["role"]
            out[name] = {
                "role": role,
                "calls": {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()},
                "cpu_s": float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]),
                "used_memory": int(mem["used_memory"]),
            }
        return out

    def pids(self) -> list[int]:
        return [int(c.info("server")["process_id"]) for c in self.clients.values()]

    def close(self) -> None:
        for c in self.clients.values():
            c.close()


def diff(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per role: calls by command, CPU seconds and used_memory change, summed over the nodes."""
    out: dict[str, Any] = {}
    for name, a in after.items():
        b = before[name]
        role = a["role"] if a["role"] == b["role"] else "changed"
        r = out.setdefault(role, {"nodes": 0, "calls": Counter(), "cpu_s": 0.0, "used_memory": 0})
        r["nodes"] += 1
        for cmd, n in a["calls"].items():
            d = n - b["calls"].get(cmd, 0)
            if d:
                r["calls"][cmd] += d
        r["cpu_s"] += a["cpu_s"] - b["cpu_s"]
        r["used_memory"] += a["used_memory"] - b["used_memory"]
    for r in out.values():
        r["calls"] = dict(r["calls"].most_common())
        r["cpu_s"] = round(r["cpu_s"], 4)
    return out


def without_probe(calls: dict[str, int], nodes: int) -> dict[str, int]:
    """Take off the probe's own INFO calls (4 per node per snapshot: the after snapshot's are not
    counted by Redis yet when it answers, the before snapshot's are)."""
    out = dict(calls)
    if "info" in out:
        out["info"] -= 4 * nodes
        if out["info"] <= 0:
            del out["info"]
    return out


# ------------------------------------------------------------------------------- workloads

WORKLOADS: dict[str, dict[str, Any]] = {
    "reuse": dict(keys=1_000, park_share=0.0, scheduled_share=0.0),
    "distinct": dict(keys=1_000_000, park_share=0.0, scheduled_share=0.0),
    "park": dict(keys=5_000, park_share=0.01, scheduled_share=0.01),
}


def run_consumer(
    brokers: str,
    url: str,
    topic: str,
    target: int,
    park_share: float,
    scheduled: int,
    cap_s: float,
    idle_s: float | None = None,
) -> dict[str, Any]:
    """One KeyedConsumer with a RedisSequencer until ``target`` messages are handled (or, with
    ``idle_s``, for that long after its partitions are assigned); the Redis counters around it."""
    group = f"rc-{uuid.uuid4().hex[:8]}"
    seq = RedisSequencer(url, group)
    handled = [0]
    done = threading.Event()
    lock = threading.Lock()
    every = round(1 / park_share) if park_share else 0  # which messages fail once: by (offset, partition)

    def handle(msg: Message) -> None:
        if (
            every
            and msg.partition >= 0
            and msg.attempt == 1
            and (msg.offset * 31 + msg.partition) % every == 0
        ):
            raise RetryLater(0.2, park=True)
        with lock:
            handled[0] += 1
            if handled[0] >= target:
                done.set()

    nodes = Nodes(url)
    if scheduled:
        for i in range(scheduled):
            seq.schedule(topic, b"s%05d" % i, b"x" * 100, delay_s=1.0)
    consumer = KeyedConsumer(
        name=group,
        handler=handle,
        brokers=[brokers],
        topics=[topic],
        concurrency=64,
        sequencer=seq,
        config={"group.protocol": "classic"},
    )
    th = threading.Thread(target=consumer.run, name="rc-consumer", daemon=True)
    if idle_s is not None:  # the steady background: counted from 1 s after the assignment
        th.start()
        deadline = time.monotonic() + 60
        while not consumer.assignment and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)
    before = nodes.snapshot()
    CLIENT.start()
    t0 = time.perf_counter()
    if idle_s is not None:
        time.sleep(idle_s)
    else:
        th.start()
        if not done.wait(cap_s):
            suite.log(f"{topic}: only {handled[0]:,} of {target:,} handled after {cap_s:.0f} s")
    t_handled = time.perf_counter() - t0
    if idle_s is not None:
        seconds = t_handled
        client = CLIENT.stop()
        after = nodes.snapshot()
        consumer.stop()
        th.join(60)
    else:
        consumer.stop()
        th.join(60)
        seconds = time.perf_counter() - t0
        client = CLIENT.stop()
        after = nodes.snapshot()
    d = diff(before, after)
    for r in d.values():
        r["calls"] = without_probe(r["calls"], r["nodes"])
    nodes.close()
    return {
        "group": group,
        "handled": handled[0],
        "seconds": round(seconds, 2),
        "handled_s": round(t_handled, 2),
        "acquire_calls": seq.acquire_calls,
        "client": client,
        "server": d,
    }


def per_message(res: dict[str, Any], n: int) -> dict[str, Any]:
    """The run's counts per message (and CPU per 1,000 messages)."""
    srv = res["server"]
    m = srv.get("master", {"calls": {}, "cpu_s": 0.0})
    rep = srv.get("slave", {"calls": {}, "cpu_s": 0.0})
    cli = res["client"]
    return {
        "client_commands_per_msg": {
            k: round(v / n, 3) for k, v in sorted(cli["commands"].items(), key=lambda kv: -kv[1])
        },
        "client_commands_total_per_msg": round(sum(cli["commands"].values()) / n, 3),
        "round_trips_per_msg": round(cli["sends"] / n, 3),
        "server_calls_per_msg": {k: round(v / n, 3) for k, v in m["calls"].items()},
        "server_calls_total_per_msg": round(sum(m["calls"].values()) / n, 3),
        "acquires_per_msg": round(res["acquire_calls"] / n, 3),
        "cpu_ms_per_1000_msgs_masters": round(m["cpu_s"] * 1e6 / n, 2),
        "cpu_ms_per_1000_msgs_replicas": round(rep["cpu_s"] * 1e6 / n, 2) if "slave" in srv else None,
    }


# ---------------------------------------------------------------------------------- memory


def memory(url: str, n_leases: int, n_parked: int, parked_keys: int, n_scheduled: int) -> dict[str, Any]:
    """used_memory deltas (masters) and MEMORY USAGE samples of what the sequencer's scripts create."""
    ns = f"mem{uuid.uuid4().hex[:8]}"
    nodes = Nodes(url)
    store = LeaseStore(url, ns, 5.0)
    r = store._r  # the store's own client (a cluster client routes MEMORY USAGE by key)

    def used() -> int:
        snap = nodes.snapshot()
        return sum(s["used_memory"] for s in snap.values() if s["role"] == "master")

    def sample(names: list[str]) -> float:
        vals = [int(r.memory_usage(k) or 0) for k in names]
        return round(sum(vals) / len(vals), 1) if vals else 0.0

    out: dict[str, Any] = {"namespace": ns}
    lids = [kkeys.lease_id(b"k%07d" % i, "t", 0) for i in range(n_leases)]
    owner = uuid.uuid4().hex
    m0 = used()
    for i in range(0, n_leases, 500):
        store.acquire([(lid, owner) for lid in lids[i : i + 500]], 10_000)
    m1 = used()
    out["lease_held_bytes_per_key"] = round((m1 - m0) / n_leases, 1)
    out["memory_usage_lease_key"] = sample([kkeys.lease(ns, lid) for lid in lids[:200]])
    out["memory_usage_fence_key"] = sample([kkeys.fence(ns, lid) for lid in lids[:200]])
    if hasattr(kkeys, "slot_fence"):  # a tree measured with KC_SRC may predate the slot counters
        out["memory_usage_slot_counter"] = sample(sorted({kkeys.slot_fence(ns, lid) for lid in lids[:200]}))
    for i in range(0, n_leases, 500):
        store.release([(lid, owner) for lid in lids[i : i + 500]])
    m2 = used()
    # what stays: the counters of the hash slots the keys fell in (at most 16,384, bench/redis_memory.py)
    out["after_release_bytes_per_key"] = round((m2 - m0) / n_leases, 1)
    if hasattr(kkeys, "slot_of"):
        out["slot_counters"] = len({kkeys.slot_of(lid) for lid in lids})

    # parked messages: 100-byte values, keys of 6 bytes, as the parker encodes them
    plids = [kkeys.lease_id(b"p%05d" % i, "t", 0) for i in range(parked_keys)]
    store.acquire([(lid, owner) for lid in plids], 60_000)
    per_key = n_parked // parked_keys
    m3 = used()
    field = f"{b'bench'.hex()}.0"
    for j in range(0, parked_keys, 100):
        batches = []
        for k, lid in enumerate(plids[j : j + 100]):
            key = b"p%05d" % (j + k)
            entries = [
                (
                    field,
                    (j + k) * per_key + o,
                    encode_entry(Message("bench", 0, (j + k) * per_key + o, key, b"x" * 100, None, 0), 0),
                )
                for o in range(per_key)
            ]
            batches.append((lid, owner, entries, None))
        store.park(batches, 7 * 24 * 3600 * 1000, 10_000, 64 << 20)
    m4 = used()
    out["parked_bytes_per_message"] = round((m4 - m3) / (per_key * parked_keys), 1)
    out["parked_entry_bytes"] = len(encode_entry(Message("bench", 0, 1, b"p00001", b"x" * 100, None, 0), 0))
    out["memory_usage_park_list"] = sample([kkeys.park(ns, lid) for lid in plids[:50]])
    out["memory_usage_seen_hash"] = sample([kkeys.seen(ns, lid) for lid in plids[:50]])
    out["memory_usage_pbytes"] = sample([kkeys.pbytes(ns, lid) for lid in plids[:50]])
    out["parked_per_key"] = per_key
    store.release([(lid, owner) for lid in plids])

    m5 = used()
    for i in range(n_scheduled):
        sid = new_schedule_id()
        store.schedule(
            sid,
            int(time.time() * 1000) + 3_600_000,
            encode_entry(Message("bench", -1, -1, b"s%05d" % i, b"x" * 100, None, 0), 0, sid),
        )
    m6 = used()
    out["scheduled_bytes_per_message"] = round((m6 - m5) / n_scheduled, 1)

    # clean up the namespace (SCAN every master)
    for c in nodes.clients.values():
        if c.info("replication")["role"] != "master":
            continue
        names = list(c.scan_iter(match=f"kc:{ns}:*", count=1000))
        for i in range(0, len(names), 500):
            for name in names[i : i + 500]:
                c.delete(name)  # one by one: a cluster node refuses a multi-key DEL across slots
    store.close()
    nodes.close()
    out.update(leases=n_leases, parked=per_key * parked_keys, parked_keys=parked_keys, scheduled=n_scheduled)
    return out


# ------------------------------------------------------------------------------------- main


def load_scripts(url: str) -> None:
    """Load the sequencer's scripts first (on every master), so no window counts the ``NOSCRIPT``
    answers and re-sent pipelines of a Redis that never saw them (a fresh one, or a promoted replica)."""
    store = LeaseStore(url, "warmup", 5.0)
    for script in vars(store).values():
        if hasattr(script, "sha") and hasattr(script, "script"):
            store._r.script_load(script.script)
    store.close()


def fsync_probe(directory: str, n: int = 300) -> dict[str, float]:
    """Latency of ``fsync`` after a 100 B append in ``directory`` (what ``appendfsync always`` waits
    for once per event-loop iteration), in ms."""
    path = os.path.join(directory, f"kc-fsync-probe-{uuid.uuid4().hex[:8]}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    ts = []
    try:
        for _ in range(n):
            os.write(fd, b"x" * 100)
            t = time.perf_counter()
            os.fsync(fd)
            ts.append((time.perf_counter() - t) * 1000)
    finally:
        os.close(fd)
        os.unlink(path)
    ts.sort()
    return {
        "p50_ms": round(ts[n // 2], 3),
        "p90_ms": round(ts[n * 9 // 10], 3),
        "p99_ms": round(ts[n * 99 // 100], 3),
        "mean_ms": round(sum(ts) / n, 3),
    }


def capacity(url: str, requests: int) -> list[dict[str, Any]]:
    """One Redis's throughput and CPU per call of the sequencer's acquire script on fresh keys
    (one key per call: ``INFO replication``, ``TIME``, ``LLEN``, ``GET`` x2, ``HMGET``, ``HSET``,
    ``SET PX`` x2: the costliest lease call; the consumer sends up to 256 keys per call, which
    shares the first two) and of its release script,
    driven by ``redis-benchmark`` (random keys; ``clients`` connections, ``pipeline`` calls in flight
    on each), as many instances' pipelined calls would drive it."""
    from keyedconsumer.sequencing import scripts

    nodes = Nodes(url)
    ((name, c),) = nodes.clients.items()
    host, port = name.rsplit(":", 1)
    out = []
    acquire_args = [
        "0",
        "10000",
        "10000",
        "0",
        "kc:cap:{k.__rand_int__}:lease",
        "kc:cap:{k.__rand_int__}:fence",
    ]
    acquire_args += ["kc:cap:{k.__rand_int__}:park", "kc:cap:{_f__rand_int__}:fence", "owner"]
    release_args = ["2", "kc:cap:{k.__rand_int__}:lease", "kc:cap:{k.__rand_int__}:fence", "owner"]
    for label, script, args in (
        ("acquire (fresh key)", scripts.ACQUIRE, acquire_args),
        ("release (not ours)", scripts.RELEASE, release_args),
    ):
        sha = c.script_load(script)
        for clients, pipeline in ((100, 1), (100, 16)):
            before = nodes.snapshot()[name]
            t0 = time.perf_counter()
            proc = subprocess.run(
                [
                    "redis-benchmark",
                    "-h",
                    host,
                    "-p",
                    port,
                    "-n",
                    str(requests),
                    "-c",
                    str(clients),
                    "-P",
                    str(pipeline),
                    "-r",
                    "100000000",
                    "--csv",
                    "EVALSHA",
                    sha,
                    *args,
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            wall = time.perf_counter() - t0
            after = nodes.snapshot()[name]
            row = proc.stdout.strip().splitlines()[-1].split('","')
            calls = after["calls"].get("evalsha", 0) - before["calls"].get("evalsha", 0)
            cpu = after["cpu_s"] - before["cpu_s"]
            out.append(
                {
                    "script": label,
                    "clients": clients,
                    "pipeline": pipeline,
                    "requests": requests,
                    "rps": float(row[1]),
                    "p50_ms": float(row[4]),
                    "p99_ms": float(row[6]),
                    "wall_s": round(wall, 2),
                    "evalsha_calls": calls,
                    "cpu_us_per_call": round(cpu * 1e6 / max(1, calls), 2),
                    "cpu_busy_share": round(cpu / wall, 2),
                }
            )
            suite.log(f"capacity: {out[-1]}")
    names = list(c.scan_iter(match="kc:cap:*", count=5000))
    for i in range(0, len(names), 1000):
        c.unlink(*names[i : i + 1000])  # one Redis: any keys in one call
    nodes.close()
    return out


def measure_target(args: argparse.Namespace, label: str, url: str) -> dict[str, Any]:
    n = args.messages
    out: dict[str, Any] = {"url": url, "workloads": {}}
    nodes = Nodes(url)
    out["nodes"] = {name: s["role"] for name, s in nodes.snapshot().items()}
    out["redis_version"] = next(iter(nodes.clients.values())).info("server")["redis_version"]
    nodes.close()
    load_scripts(url)
    for wl in args.workloads:
        w = WORKLOADS[wl]
        topic = f"rc-{uuid.uuid4().hex[:8]}-{wl}"
        suite.create_topic(args.brokers, topic, args.partitions)
        key_ids = suite.keys_for({"messages": n, "keys": w["keys"]}, random.Random(11))
        suite.produce(args.brokers, topic, {"size": 100}, key_ids)
        scheduled = int(n * w["scheduled_share"])
        suite.log(
            f"{label}/{wl}: {n:,} messages over {len(set(key_ids)):,} keys, {args.partitions} partitions, "
            f"{scheduled} scheduled"
        )
        res = run_consumer(args.brokers, url, topic, n + scheduled, w["park_share"], scheduled, args.cap_s)
        res.update(
            messages=n,
            distinct_keys=len(set(key_ids)),
            scheduled=scheduled,
            per=per_message(res, n + scheduled),
        )
        out["workloads"][wl] = res
        suite.log(f"{label}/{wl}: {json.dumps(res['per'])}")
        suite.delete_topics(args.brokers, [topic])
    if args.idle_s:
        topic = f"rc-{uuid.uuid4().hex[:8]}-idle"
        suite.create_topic(args.brokers, topic, args.partitions)
        res = run_consumer(args.brokers, url, topic, 1, 0.0, 0, args.cap_s, idle_s=args.idle_s)
        m = res["server"].get("master", {"calls": {}, "cpu_s": 0.0})
        res["per_s"] = {
            "client_commands_per_s": {
                k: round(v / res["seconds"], 2) for k, v in res["client"]["commands"].items()
            },
            "round_trips_per_s": round(res["client"]["sends"] / res["seconds"], 2),
            "server_calls_per_s": round(sum(m["calls"].values()) / res["seconds"], 2),
            "cpu_ms_per_s_masters": round(m["cpu_s"] * 1000 / res["seconds"], 3),
        }
        out["idle"] = res
        suite.log(f"{label}/idle: {json.dumps(res['per_s'])}")
        suite.delete_topics(args.brokers, [topic])
    out["memory"] = memory(url, args.mem_leases, args.mem_parked, args.mem_parked_keys, args.mem_scheduled)
    suite.log(f"{label}/memory: {json.dumps(out['memory'])}")
    return out


def fmt_calls(d: dict[str, float], top: int = 8) -> str:
    items = list(d.items())[:top]
    return ", ".join(f"{k} {v:g}" for k, v in items) or "-"


def write_markdown(results: dict[str, Any], path: Path) -> None:
    lines = [
        "# Redis cost of the Redis sequencer",
        "",
        f"`bench/redis_cost.py`, {results['date']} (last run), "
        f"{results['messages']:,} messages of 100 B per workload, {results['partitions']} partitions, one "
        f"KeyedConsumer (concurrency 64, no-op handler, lease_ttl_s 10, lease_linger_s 1). Load average at the "
        f"start {results['loadavg_before']}, at the end {results['loadavg_after']}"
        f"{'; under the exclusive quiet lock' if results.get('quiet_lock') else ''}. Command: `{results['command']}`.",
        "",
        "Server counts (`INFO commandstats`, masters) include the commands run inside the Lua scripts; client "
        "counts are the top-level commands redis-py sent; a round trip is one send (one command, or one pipeline "
        "to one node). Windows include the consumer's start (durability check, script loads) and stop "
        "(lease release), not the produce; the scripts were loaded before (`load_scripts`).",
        "",
        "| target | workload | keys | msgs | s | acquires/msg | round trips/msg | client cmds/msg | client cmds by name /msg "
        "| server calls/msg (incl. in-script) | Redis CPU ms /1,000 msgs (masters) | replicas |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for label, t in results["targets"].items():
        for wl, r in t["workloads"].items():
            p = r["per"]
            lines.append(
                f"| {label} | {wl} | {r['distinct_keys']:,} | {r['messages'] + r['scheduled']:,} | {r['handled_s']} "
                f"| {p['acquires_per_msg']} | {p['round_trips_per_msg']} | {p['client_commands_total_per_msg']} "
                f"| {fmt_calls(p['client_commands_per_msg'])} | {p['server_calls_total_per_msg']} "
                f"| {p['cpu_ms_per_1000_msgs_masters']} | {p['cpu_ms_per_1000_msgs_replicas'] if p['cpu_ms_per_1000_msgs_replicas'] is not None else '-'} |"
            )
    lines += [
        "",
        "Runs: "
        + "; ".join(
            f"{label}: commit `{t['commit']}`, {t['date']}, load average {t['loadavg']['before']} -> {t['loadavg']['after']}"
            f"{', exclusive quiet lock held' if t.get('quiet_lock') else ', quiet lock NOT held (busy machine)'}"
            for label, t in results["targets"].items()
        ),
        "",
    ]
    lines += ["", "Server calls per message by command (masters):", ""]
    for label, t in results["targets"].items():
        for wl, r in t["workloads"].items():
            lines.append(f"- {label} / {wl}: {fmt_calls(r['per']['server_calls_per_msg'], 20)}")
    lines += ["", "## Background of one idle instance (no messages)", ""]
    for label, t in results["targets"].items():
        if "idle" in t:
            i = t["idle"]
            lines.append(
                f"- {label}: {i['per_s']['round_trips_per_s']} round trips/s, client commands/s "
                f"{fmt_calls(i['per_s']['client_commands_per_s'])}; server calls/s "
                f"{i['per_s']['server_calls_per_s']}; Redis CPU {i['per_s']['cpu_ms_per_s_masters']} ms/s "
                f"({i['seconds']} s window; this instance is the scheduler)"
            )
    lines += [
        "",
        "## Memory (used_memory deltas over masters; MEMORY USAGE of sample keys)",
        "",
        "| target | lease held, B/key | left after release (fencing counter), B/key | MEMORY USAGE lease / fence "
        "| parked, B/message | parked entry, B | MEMORY USAGE list / seen / pbytes (per key) | scheduled, B/message |",
        "| --- | ---: | ---: | --- | ---: | ---: | --- | ---: |",
    ]
    for label, t in results["targets"].items():
        m = t["memory"]
        lines.append(
            f"| {label} | {m['lease_held_bytes_per_key']} | {m['after_release_bytes_per_key']} "
            f"| {m['memory_usage_lease_key']} / {m['memory_usage_fence_key']} | {m['parked_bytes_per_message']} "
            f"| {m['parked_entry_bytes']} | {m['memory_usage_park_list']} / {m['memory_usage_seen_hash']} / "
            f"{m['memory_usage_pbytes']} ({m['parked_per_key']} messages a key) | {m['scheduled_bytes_per_message']} |"
        )
    lines += ["", f"({results['memory_note']})", ""]
    if "capacity" in results:
        cap = results["capacity"]
        lines += [
            "## Capacity of one Redis (redis-benchmark, AOF appendfsync always)",
            "",
            f"Commit `{cap['commit']}`, {cap['date']}, load average {cap['loadavg_before']} -> {cap['loadavg_after']}"
            f"{', exclusive quiet lock held' if cap.get('quiet_lock') else ', quiet lock NOT held (busy machine)'}.",
            "",
            "| script | connections | pipeline | calls/s | p50 ms | p99 ms | Redis CPU us/call | Redis CPU busy |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in cap["runs"]:
            lines.append(
                f"| {r['script']} | {r['clients']} | {r['pipeline']} | {r['rps']:,.0f} | {r['p50_ms']} | {r['p99_ms']} "
                f"| {r['cpu_us_per_call']} | {r['cpu_busy_share']:.0%} |"
            )
        if "fsync" in cap:
            f = cap["fsync"]
            lines += [
                "",
                f"`fsync` after a 100 B append in the Redis's directory ({f['dir']}), 300 times: p50 {f['p50_ms']} ms, "
                f"p90 {f['p90_ms']} ms, p99 {f['p99_ms']} ms, mean {f['mean_ms']} ms (what `appendfsync always` waits "
                "for once per event-loop iteration; Redis's CPU is not charged while it waits).",
            ]
        lines.append("")
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--brokers", default="127.0.0.1:9092")
    ap.add_argument("--redis", default=None, help="a single Redis URL")
    ap.add_argument("--redis-cluster", default=None, help="a redis+cluster:// URL")
    ap.add_argument("--messages", type=int, default=20_000)
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--workloads", default="reuse,distinct,park")
    ap.add_argument("--idle-s", type=float, default=10.0)
    ap.add_argument("--cap-s", type=float, default=120.0)
    ap.add_argument(
        "--smoke", action="store_true", help="2,000 messages, 2 s idle, small memory samples (< 1 min)"
    )
    ap.add_argument(
        "--cluster-fix",
        action="store_true",
        help="also measure the cluster with EVALSHA routed client-side in pipelines (route_scripts_client_side)",
    )
    ap.add_argument(
        "--label-commit",
        action="store_true",
        help="name each target <target>@<commit> (with --merge: several commits side by side)",
    )
    ap.add_argument(
        "--capacity",
        type=int,
        default=0,
        metavar="N",
        help="only: N calls of the acquire and release scripts by redis-benchmark against --redis (capacity of one Redis)",
    )
    ap.add_argument(
        "--quiet-lock", action="store_true", help="say in the report that it ran under the exclusive lock"
    )
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument(
        "--merge", action="store_true", help="add the targets measured to an existing redis_cost.json"
    )
    args = ap.parse_args()
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.mem_leases, args.mem_parked, args.mem_parked_keys, args.mem_scheduled = 10_000, 10_000, 1_000, 2_000
    if args.smoke:
        args.messages, args.idle_s, args.cap_s = 2_000, 2.0, 40.0
        args.mem_leases, args.mem_parked, args.mem_parked_keys, args.mem_scheduled = 1_000, 1_000, 100, 200
    targets = [(k, u) for k, u in (("single", args.redis), ("cluster", args.redis_cluster)) if u]
    if args.capacity:
        targets = []
    if args.redis_cluster and args.cluster_fix:
        targets.append(("cluster-fix", args.redis_cluster))
    if not targets and not (args.capacity and args.redis):
        ap.error("give --redis and/or --redis-cluster (--capacity: --redis)")
    CLIENT.install()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "redis_cost.json"
    results: dict[str, Any] = {"targets": {}}
    if args.merge and json_path.exists():
        results = json.loads(json_path.read_text())
    results.update(
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        machine=suite.machine_info(None),
        messages=args.messages,
        partitions=args.partitions,
        loadavg_before=suite.loadavg(),
        quiet_lock=args.quiet_lock,
        command=" ".join(["bench/redis_cost.py", *sys.argv[1:]]),
        memory_note=(
            f"{args.mem_leases:,} leases acquired with the sequencer's acquire script and released; "
            f"{args.mem_parked:,} parked messages over {args.mem_parked_keys:,} keys with its park script; "
            f"{args.mem_scheduled:,} scheduled messages with its schedule script"
        ),
    )
    results["commit"] = os.environ.get("KC_COMMIT") or results["machine"]["keyedconsumer_commit"]
    results["kc_src"] = KC_SRC
    if args.capacity:
        rdir = str(redis.Redis.from_url(args.redis).config_get("dir")["dir"])
        results["capacity"] = {
            "commit": results["commit"],
            "date": results["date"],
            "loadavg_before": suite.loadavg(),
            "quiet_lock": args.quiet_lock,
            "fsync": {"dir": rdir, **fsync_probe(rdir)},
            "runs": capacity(args.redis, args.capacity),
        }
        results["capacity"]["loadavg_after"] = suite.loadavg()
    for label, url in targets:
        route_scripts_client_side(label == "cluster-fix")
        load_before = suite.loadavg()
        t = measure_target(args, label, url)
        t["loadavg"] = {"before": load_before, "after": suite.loadavg()}
        t["quiet_lock"] = args.quiet_lock
        t["command"] = results["command"]
        t["commit"] = results["commit"]
        t["date"] = results["date"]
        results["targets"][f"{label}@{results['commit']}" if args.label_commit else label] = t
    results["loadavg_after"] = suite.loadavg()
    json_path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    write_markdown(results, out_dir / "redis_cost.md")
    print((out_dir / "redis_cost.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
