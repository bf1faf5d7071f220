"""Redis memory over many distinct keys: what the sequencer leaves in Redis once each key's lease is
released (issue 27 §1: 0 B of lasting state per distinct key).

    .venv/bin/python bench/redis_memory.py --redis redis://127.0.0.1:23201/0 --keys 10000000 \\
        [--batch 2000] [--checkpoints 100000,1000000] [--out bench/results]

Each distinct key is acquired and released through the sequencer's own store
(:class:`~keyedconsumer.sequencing.store.LeaseStore`, its Lua scripts), in batches of ``--batch``
keys (one acquire round trip and one release round trip per batch). ``INFO memory`` (used_memory,
summed over the masters) and the number of keys in the namespace are read before the first key and
at every checkpoint: every 1,000,000 keys, and the ``--checkpoints`` given. What stays is the
fencing counters of the hash slots the keys fell in: at most 16,384 per namespace, whatever the
number of distinct keys, so memory stops growing once every slot has one.

Run it against a Redis of its own (e.g. ``redis-server --port 23201 --appendonly yes
--appendfsync always``): the namespace is fresh, but the used_memory of a shared Redis moves with
its other users. Writes ``<out>/redis_memory.json`` and ``<out>/redis_memory.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, os.environ.get("KC_SRC") or str(ROOT))

from redis_cost import Nodes  # noqa: E402  (bench/redis_cost.py: every node of a target)

from keyedconsumer.sequencing import keys as kkeys  # noqa: E402
from keyedconsumer.sequencing.store import LeaseStore  # noqa: E402


def namespace_keys(nodes: Nodes, ns: str) -> dict[str, int]:
    """Keys of namespace ``ns`` on the masters, by kind (``SCAN``)."""
    kinds: dict[str, int] = {}
    for c in nodes.clients.values():
        if c.info("replication")["role"] != "master":
            continue
        for name in c.scan_iter(match=f"kc:{ns}:*", count=5000):
            tag, _, kind = name.decode().rpartition("}:")
            kind = "slot counter" if "{_f" in tag else kind
            kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def used_memory(nodes: Nodes) -> int:
    return sum(s["used_memory"] for s in nodes.snapshot().values() if s["role"] == "master")


def run(url: str, n_keys: int, batch: int, checkpoints: set[int]) -> dict[str, Any]:
    ns = f"mem{uuid.uuid4().hex[:8]}"
    nodes = Nodes(url)
    store = LeaseStore(url, ns, 5.0)
    owner = uuid.uuid4().hex
    rows: list[dict[str, Any]] = []

    def checkpoint(done: int, t0: float) -> None:
        mem = used_memory(nodes)
        kinds = namespace_keys(nodes, ns)
        rows.append(
            {
                "distinct_keys": done,
                "used_memory": mem,
                "namespace_keys": sum(kinds.values()),
                "by_kind": kinds,
                "seconds": round(time.monotonic() - t0, 1),
            }
        )
        print(json.dumps(rows[-1]), flush=True)

    t0 = time.monotonic()
    checkpoint(0, t0)
    done = 0
    while done < n_keys:
        n = min(batch, n_keys - done)
        req = [(kkeys.lease_id(b"d%010d" % i, "t", 0), owner) for i in range(done, done + n)]
        granted = store.acquire(req, 30_000)
        if any(tok <= 0 for tok, _depth in granted):
            raise RuntimeError(f"a fresh key was not granted: {granted[:5]}")
        if not all(store.release(req)):
            raise RuntimeError("a lease was not ours at its release")
        done += n
        if done in checkpoints or done % 1_000_000 == 0 or done == n_keys:
            checkpoint(done, t0)
    store.close()
    nodes.close()
    # from the first checkpoint at 1,000,000 keys or half the run, whichever comes first (by then
    # every slot's counter exists) to the end
    first_full = next(r for r in rows if r["distinct_keys"] >= min(1_000_000, n_keys // 2))
    last = rows[-1]
    grown = last["used_memory"] - first_full["used_memory"]
    span = last["distinct_keys"] - first_full["distinct_keys"]
    return {
        "url": url,
        "namespace": ns,
        "keys": n_keys,
        "batch": batch,
        "rows": rows,
        "per_key_from": first_full["distinct_keys"],
        "bytes_per_key_after": round(grown / span, 4) if span else None,
        "slot_counters": last["by_kind"].get("slot counter", 0),
        "other_keys_left": {k: v for k, v in last["by_kind"].items() if k != "slot counter"},
    }


def write_md(res: dict[str, Any], path: Path) -> None:
    lines = [
        "# Redis memory over distinct keys",
        "",
        f"`bench/redis_memory.py`: {res['keys']:,} distinct keys, each acquired and released through the",
        f"sequencer's store (batches of {res['batch']:,}), against `{res['url']}`. `used_memory` summed over",
        "the masters (`INFO memory`); the namespace's keys counted with `SCAN`.",
        "",
        "| distinct keys | used_memory (bytes) | change since 0 | keys in the namespace | seconds |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    base = res["rows"][0]["used_memory"]
    for r in res["rows"]:
        lines.append(
            f"| {r['distinct_keys']:,} | {r['used_memory']:,} | {r['used_memory'] - base:+,} | "
            f"{r['namespace_keys']:,} | {r['seconds']} |"
        )
    lines += [
        "",
        f"Left in the namespace at the end: {res['slot_counters']:,} slot fencing counters (at most 16,384), "
        f"other keys: {res['other_keys_left'] or 'none'}.",
        f"Memory change per distinct key from {res['per_key_from']:,} keys to the end: {res['bytes_per_key_after']} B.",
        "",
    ]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--redis", required=True, help="redis:// or redis+cluster:// URL (a Redis of its own)")
    ap.add_argument("--keys", type=int, default=10_000_000)
    ap.add_argument("--batch", type=int, default=2000)
    ap.add_argument("--checkpoints", default="100000")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    a = ap.parse_args(argv)
    cps = {int(x) for x in a.checkpoints.split(",") if x}
    res = run(a.redis, a.keys, a.batch, cps)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "redis_memory.json").write_text(json.dumps(res, indent=1))
    write_md(res, a.out / "redis_memory.md")
    print((a.out / "redis_memory.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
