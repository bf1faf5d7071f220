"""Simulations for docs/scaling.md: partitions moved per join / leave at 1,000 partitions and 100
instances, on the in-memory group coordinator, and the Redis sequencer's lease churn for a key
distribution and message rate.

    .venv/bin/python bench/rebalance_sim.py [--smoke] [--out bench/results]

**Moves** use :class:`keyedconsumer.testing.group.ConsumerGroup`, the coordinator of the in-memory
broker (cooperative-sticky: owners keep their partitions, a join or leave moves only what balance
needs; a partition goes to its new owner after the old owner's revoke returned). Each member runs its
callbacks until none is left; counted: partitions that changed owner, revoke and assign callbacks.
It models *which* partitions move, not *when*: it has no heartbeats, no network, no JoinGroup/SyncGroup
rounds (bench/rebalance.py measures time on a real broker).

**Lease churn** models the lease policy of :mod:`keyedconsumer.sequencing.leases` on one instance:
a message whose key holds no lease makes the instance acquire one (one ``EVALSHA``); a key keeps its
lease while it has work and ``linger_s`` after it ran dry, then it is released (one ``EVALSHA``);
every lease held (busy or lingering) is renewed every ``lease_ttl_s / 4`` (one ``EVALSHA`` each,
pipelined: one round trip per renewal tick). Messages arrive as a Poisson process of ``rate`` per
second, keys drawn from a uniform or Zipf distribution over ``keys`` keys; a key runs one message at
a time for ``service_s`` (workers are assumed free). Not modelled: the batching of acquires and
releases into one round trip per tick (10-50 ms), in-flight bounds, Kafka's batch arrival.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, os.environ.get("KC_SRC") or str(ROOT))

from keyedconsumer.testing.group import ConsumerGroup  # noqa: E402

TOPIC = "t"

# ------------------------------------------------------------------------------------ moves


class Group:
    """A :class:`ConsumerGroup` on one topic whose members run their callbacks at once."""

    def __init__(self, partitions: int) -> None:
        self.g = ConsumerGroup("sim")
        self.parts = {TOPIC: partitions}
        self.n = 0
        self.revokes = 0
        self.assigns = 0
        self.rounds = 0

    def owners(self) -> dict[int, str]:
        return {p: m for m, tps in self.g.assignments().items() for _, p in tps}

    def settle(self) -> None:
        """Run every member's callbacks, round after round, until none is left."""
        while True:
            busy = False
            for member in list(self.g.assignments()):
                ev = self.g.next_event(member)
                while ev is not None:
                    busy = True
                    kind, tps = ev
                    if kind == "revoke":
                        self.revokes += 1
                        self.g.revoked(member, tps)
                    elif kind == "assign":
                        self.assigns += 1
                    ev = self.g.next_event(member)
            if not busy:
                return
            self.rounds += 1

    def join(self, count: int = 1) -> list[str]:
        ids = []
        for _ in range(count):
            self.n += 1
            ids.append(f"m{self.n}")
            self.g.join(ids[-1], [TOPIC], self.parts)
        self.settle()
        return ids

    def leave(self, member: str) -> None:
        self.g.leave(member, self.parts)
        self.settle()

    def step(self, action: Any) -> dict[str, Any]:
        """Run ``action()`` and count what it moved."""
        before = self.owners()
        r0, a0, n0 = self.revokes, self.assigns, self.rounds
        action()
        after = self.owners()
        assert len(after) == self.parts[TOPIC], "a partition without an owner after settling"
        loads: dict[str, int] = {}
        for m in after.values():
            loads[m] = loads.get(m, 0) + 1
        moved = sum(1 for p, m in before.items() if after.get(p) != m)
        return {
            "moved": moved,
            "minimum": min_moves(before, set(loads), self.parts[TOPIC]),
            "revoke_callbacks": self.revokes - r0,
            "assign_callbacks": self.assigns - a0,
            "rounds": self.rounds - n0,
            "members": len(loads),
            "max_load": max(loads.values()),
            "min_load": min(loads.values()),
        }


def min_moves(before: dict[int, str], members_after: set[str], partitions: int) -> int:
    """The fewest partitions any assignor must move from ``before`` to a balanced assignment over
    ``members_after``: those of members that left, plus each staying member's excess over its quota
    (the larger quotas going to the members that hold the most)."""
    n = len(members_after)
    held: dict[str, int] = {m: 0 for m in members_after}
    gone = 0
    for m in before.values():
        if m in held:
            held[m] += 1
        else:
            gone += 1
    quotas = [partitions // n + (1 if i < partitions % n else 0) for i in range(n)]
    return gone + sum(max(0, h - q) for h, q in zip(sorted(held.values(), reverse=True), quotas, strict=True))


def moves(partitions: int, members: int) -> dict[str, Any]:
    """Partitions moved by the usual membership changes of a group of ``members`` instances."""
    out: dict[str, Any] = {"partitions": partitions, "members": members}
    g = Group(partitions)
    out["start"] = g.step(lambda: g.join(members))
    out["one_joins"] = g.step(lambda: g.join(1))
    last = f"m{g.n}"
    out["one_leaves"] = g.step(lambda: g.leave(last))
    roll = []  # a rolling restart: each instance leaves, then its replacement joins
    for m in sorted(g.g.assignments(), key=lambda x: int(x[1:])):
        roll.append(g.step(lambda m=m: g.leave(m)))
        roll.append(g.step(lambda: g.join(1)))
    out["rolling_restart"] = {
        "steps": len(roll),
        "moved_total": sum(s["moved"] for s in roll),
        "minimum_total": sum(s["minimum"] for s in roll),
        "moved_per_step_max": max(s["moved"] for s in roll),
        "revoke_callbacks_total": sum(s["revoke_callbacks"] for s in roll),
    }
    half = Group(partitions)
    half.join(members // 2)
    out["double"] = half.step(lambda: half.join(members - members // 2))
    return out


def series(partitions: int, steps: list[int]) -> list[dict[str, Any]]:
    """Moves along member counts ``steps`` (members added or the newest removed), as bench/rebalance.py does."""
    g = Group(partitions)
    live: list[str] = []
    out = []
    for target in steps:
        if target > len(live):

            def grow(n: int = target - len(live)) -> None:
                live.extend(g.join(n))

            out.append({"to": target, **g.step(grow)})
        else:

            def shrink(n: int = target) -> None:
                while len(live) > n:
                    g.leave(live.pop())

            out.append({"to": target, **g.step(shrink)})
    return out


def engine_run(partitions: int, members: int, messages: int, keys: int = 100_000) -> dict[str, Any]:
    """The real engine on the in-memory broker: ``members`` KeyedConsumers (threads of this process)
    on a ``partitions``-partition topic; ``messages`` handled, then one member joins and one leaves
    while ``messages`` more are handled. Counted: offsets handled more than once (re-runs), records
    never handled, partitions moved (from the rebalance callbacks), and the wall and CPU time of
    the process (the in-memory broker has no network: these times say what the engine costs, not
    how long a real rebalance takes)."""
    import random
    import threading

    from keyedconsumer.testing import InMemoryBroker

    broker = InMemoryBroker()
    broker.create_topic(TOPIC, partitions=partitions)
    seen: dict[tuple[int, int], int] = {}
    lock = threading.Lock()

    def handle(msg: Any) -> None:
        time.sleep(0.001)  # 1 ms of work, so the join and the leave land while messages run
        with lock:
            k = (msg.partition, msg.offset)
            seen[k] = seen.get(k, 0) + 1

    rng = random.Random(5)

    def produce(n: int) -> None:
        for _ in range(n):
            k = rng.randrange(keys)
            broker.produce(TOPIC, b"x", key=b"k%07d" % k)

    def member(i: int) -> Any:
        return broker.consumer(name="sim", handler=handle, topics=[TOPIC], concurrency=4, poll_timeout_s=0.05)

    out: dict[str, Any] = {"partitions": partitions, "members": members, "messages": 2 * messages}
    produce(messages)
    t0, c0 = time.perf_counter(), time.process_time()
    cons = [member(i) for i in range(members)]
    with broker.run(*cons) as run:
        run.until_idle(timeout_s=600)
        out["first_pass_s"] = round(time.perf_counter() - t0, 1)
        n_cb = len(broker.callbacks("sim"))
        produce(messages)
        t1, c1 = time.perf_counter(), time.process_time()
        extra = member(members)
        run.add(extra)  # one joins while the second half flows
        run.wait_for(
            lambda: any(kind == "assign" for _, kind, _ in broker.callbacks("sim")[n_cb:]),
            timeout_s=300,
            what="the newcomer's assignment",
        )
        run.stop(cons[0])  # one leaves, gracefully
        run.until_idle(timeout_s=600)
        out["second_pass_s"] = round(time.perf_counter() - t1, 1)
        out["second_pass_cpu_s"] = round(time.process_time() - c1, 1)
        cbs = broker.callbacks("sim")[n_cb:]
    out["first_pass_cpu_s"] = round(c1 - c0, 1)
    out["revoked_partitions"] = sum(len(tps) for _, kind, tps in cbs if kind == "revoke")
    out["assigned_partitions"] = sum(len(tps) for _, kind, tps in cbs if kind == "assign")
    out["lost_partitions"] = sum(len(tps) for _, kind, tps in cbs if kind == "lost")
    out["callbacks"] = len(cbs)
    out["handled_twice"] = sum(1 for v in seen.values() if v > 1)
    out["never_handled"] = 2 * messages - len(seen)
    return out


# ------------------------------------------------------------------------------- lease churn


def lease_churn(
    rate: float,
    keys: int,
    dist: str = "uniform",
    zipf_s: float = 1.0,
    seconds: float = 60.0,
    service_s: float = 0.001,
    linger_s: float = 1.0,
    ttl_s: float = 10.0,
    seed: int = 1,
) -> dict[str, Any]:
    """One instance's lease operations per second (see the module's docstring)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    n = int(rng.poisson(rate * seconds))
    times = np.sort(rng.uniform(0.0, seconds, n))
    if dist == "uniform":
        ks = rng.integers(0, keys, n)
    else:
        w = 1.0 / np.arange(1, keys + 1) ** zipf_s
        ks = rng.choice(keys, size=n, p=w / w.sum())
    free_at: dict[int, float] = {}  # when the key's last message ends
    held_from: dict[int, float] = {}  # key -> when its current lease was acquired
    acquires = releases = 0
    held_s = 0.0
    for t, k in zip(times.tolist(), ks.tolist(), strict=True):
        f = free_at.get(k)
        if f is not None and t > f + linger_s:  # released linger_s after it ran dry
            releases += 1
            held_s += f + linger_s - held_from.pop(k)
            f = None
        if f is None:
            acquires += 1
            held_from[k] = t
            f = t
        free_at[k] = max(f, t) + service_s
    for k, f in free_at.items():  # leases still held at the end: released at their time, if within it
        if k in held_from:
            end = min(seconds, f + linger_s)
            held_s += end - held_from[k]
            if f + linger_s <= seconds:
                releases += 1
    renew_interval = ttl_s / 4
    avg_held = held_s / seconds
    return {
        "rate": rate,
        "keys": keys,
        "dist": dist if dist == "uniform" else f"zipf s={zipf_s}",
        "messages": n,
        "seconds": seconds,
        "service_s": service_s,
        "linger_s": linger_s,
        "lease_ttl_s": ttl_s,
        "distinct_keys_seen": len(free_at),
        "acquires_per_s": round(acquires / seconds, 1),
        "releases_per_s": round(releases / seconds, 1),
        "acquires_per_msg": round(acquires / max(1, n), 4),
        "avg_leases_held": round(avg_held, 1),
        "renewals_per_s": round(avg_held / renew_interval, 1),
        "lease_evalsha_per_s": round((acquires + releases) / seconds + avg_held / renew_interval, 1),
        "lease_evalsha_per_msg": round(
            ((acquires + releases) / seconds + avg_held / renew_interval) / rate, 4
        ),
    }


def expected_acquires_per_msg_uniform(rate: float, keys: int, linger_s: float) -> float:
    """Closed form for Poisson arrivals over uniform keys with no service time: a message acquires
    when its key's previous message is more than ``linger_s`` older (or there is none)."""
    return math.exp(-rate / keys * linger_s)


# ------------------------------------------------------------------------------------- main


def write_markdown(res: dict[str, Any], path: Path) -> None:
    lines = [
        "# Simulations for docs/scaling.md",
        "",
        f"`bench/rebalance_sim.py`, {res['date']}, commit `{res['commit']}`. Command: `{res['command']}`.",
        "",
        "## Partitions moved (in-memory coordinator, cooperative-sticky model)",
        "",
        "Each cell: moved by the model (the fewest any balanced assignor must move).",
        "",
        "| partitions | members | start: callbacks | one joins: moved | one leaves: moved | rolling restart: moved in all (max a step) | half -> all at once: moved |",
        "| ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for m in res["moves"]:
        j, lv, r, d = m["one_joins"], m["one_leaves"], m["rolling_restart"], m["double"]
        lines.append(
            f"| {m['partitions']:,} | {m['members']} | {m['start']['assign_callbacks']} | {j['moved']} ({j['minimum']}) "
            f"| {lv['moved']} ({lv['minimum']}) | {r['moved_total']:,} ({r['minimum_total']:,}; max a step {r['moved_per_step_max']}) "
            f"| {d['moved']} ({d['minimum']}) |"
        )
    lines += ["", "Series as bench/rebalance.py runs them on the real broker (moved per step):", ""]
    for p, s in res["series"].items():
        lines.append(
            f"- {p} partitions: " + ", ".join(f"-> {x['to']}: {x['moved']} ({x['minimum']})" for x in s)
        )
    lines += [
        "",
        "## Lease churn of one instance",
        "",
        "| rate msg/s | keys | distribution | service ms | acquires/s | releases/s | acquires/msg | leases held (avg) | renewals/s | lease EVALSHA/s | per msg |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in res["churn"]:
        lines.append(
            f"| {c['rate']:,} | {c['keys']:,} | {c['dist']} | {c['service_s'] * 1000:g} | {c['acquires_per_s']:,} "
            f"| {c['releases_per_s']:,} | {c['acquires_per_msg']} | {c['avg_leases_held']:,} | {c['renewals_per_s']:,} "
            f"| {c['lease_evalsha_per_s']:,} | {c['lease_evalsha_per_msg']} |"
        )
    lines += [
        "",
        "Closed form check (uniform keys, no service time): acquires/msg = exp(-rate/keys x linger): "
        + ", ".join(f"{k}: {v:.4f}" for k, v in res["closed_form"].items()),
        "",
    ]
    if "engine" in res:
        e = res["engine"]
        lines += [
            "",
            "## The engine on the in-memory broker",
            "",
            f"{e['members']} KeyedConsumers (concurrency 4, a 1 ms handler, threads of one process) on {e['partitions']:,} partitions: "
            f"{e['messages'] // 2:,} messages handled ({e['first_pass_s']} s, {e['first_pass_cpu_s']} s CPU), then one "
            f"member joins and one leaves while {e['messages'] // 2:,} more are handled ({e['second_pass_s']} s, "
            f"{e['second_pass_cpu_s']} s CPU). Partitions revoked {e['revoked_partitions']}, assigned "
            f"{e['assigned_partitions']}, lost {e['lost_partitions']} ({e['callbacks']} callbacks); offsets handled "
            f"more than once: **{e['handled_twice']}**; never handled: **{e['never_handled']}**.",
            "",
        ]
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--smoke", action="store_true", help="100 partitions / 10 members, short churn runs (seconds)"
    )
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument(
        "--engine",
        default="",
        metavar="P/N/M",
        help="also run the engine on the in-memory broker: P partitions, N members, M messages a pass "
        "(e.g. 1000/100/50000)",
    )
    args = ap.parse_args()
    t0 = time.perf_counter()
    if args.smoke:
        shapes, seconds = [(100, 10)], 5.0
        churn_cases = [(1_000, 10_000, "uniform", 0.001), (1_000, 10_000, "zipf", 0.001)]
    else:
        shapes, seconds = [(1_000, 100), (1_000, 50), (256, 8), (64, 8)], 60.0
        # per instance: 1,000 partitions over 100 instances; 100k and 1M msg/s in all -> 1k and 10k per instance;
        # 10M keys in all -> 100k per instance (each key on one partition, so one instance)
        churn_cases = [
            (r, k, d, s)
            for r in (1_000, 10_000)
            for k in (100_000, 10_000)
            for d in ("uniform", "zipf")
            for s in (0.005,)
        ]
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(["bench/rebalance_sim.py", *sys.argv[1:]]),
    }
    try:
        import subprocess

        res["commit"] = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        res["commit"] = "?"
    res["moves"] = [moves(p, m) for p, m in shapes]
    res["series"] = {str(p): series(p, [1, 2, 4, 8, 4, 2, 1]) for p in ((16,) if args.smoke else (64, 256))}
    res["churn"] = [lease_churn(r, k, d, seconds=seconds, service_s=s) for r, k, d, s in churn_cases]
    res["closed_form"] = {
        f"{r}/s over {k:,} keys": expected_acquires_per_msg_uniform(r, k, 1.0)
        for r, k, d, s in churn_cases
        if d == "uniform"
    }
    if args.engine or args.smoke:
        p_, n_, m_ = (int(x) for x in (args.engine or "100/10/5000").split("/"))
        res["engine"] = engine_run(p_, n_, m_)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rebalance_sim.json").write_text(json.dumps(res, indent=1) + "\n")
    write_markdown(res, out / "rebalance_sim.md")
    print((out / "rebalance_sim.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
