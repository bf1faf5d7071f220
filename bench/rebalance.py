"""Rebalance time on a real broker, classic (cooperative-sticky) against KIP-848 (``group.protocol=consumer``).

    .venv/bin/python bench/rebalance.py --brokers 127.0.0.1:9092 [--partitions 64,256]
        [--steps 1,2,4,8,4,2,1] [--protocols classic,consumer,consumer-hb5000] [--smoke] [--out bench/results]

For each protocol and partition count, a topic of its own and a fresh group; members are plain
confluent-kafka consumers with the librdkafka properties KeyedConsumer gives them
(``ConsumerConfig(...).librdkafka()``), each polled by a thread of its own (``poll(0.02)``), that
record their assignment from their rebalance callbacks. The group goes through ``--steps`` member
counts: members are added (``subscribe``) or removed (``close``, a graceful leave), several at once
when the step says so, and the step's clock starts then. A step is **settled** when every partition
is assigned to exactly one live member and the assignment is balanced (member loads differ by at
most 1), and it stays so for 1 s. Per step: time to settle, partitions that moved (owner before !=
owner after), and partition-seconds without an owner (the availability cost of the step).

Protocols: ``classic`` (cooperative-sticky, librdkafka's heartbeat.interval.ms 3000 and
session.timeout.ms 45000, the defaults); ``consumer`` (KIP-848 at the broker's
group.consumer.heartbeat.interval.ms; scripts/services sets 500 ms); ``consumer-hb5000`` (KIP-848
with the group's ``consumer.heartbeat.interval.ms`` set to 5000, Kafka's default, through a group
config: IncrementalAlterConfigs on the GROUP resource). The broker's group.initial.rebalance.delay.ms
(0 in scripts/services, 3000 by default) delays only the first join of an empty classic group: the
first step is reported, and not used for the model.

Timings are only meaningful on a quiet machine: run it under ``flock -x /tmp/kc-quiet.lock``.
Writes ``<out>/rebalance.json`` and ``<out>/rebalance.md`` (``--name``: another base name).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
#: the keyedconsumer measured: this checkout, or KC_SRC (e.g. a `git archive <commit> keyedconsumer` tree)
KC_SRC = os.environ.get("KC_SRC") or str(ROOT)
sys.path.insert(0, KC_SRC)

import run as suite  # noqa: E402  (bench/run.py: topics, log, loadavg)
from confluent_kafka import Consumer  # noqa: E402

from keyedconsumer.config import ConsumerConfig  # noqa: E402

PROTOCOLS = {
    "classic": {"group.protocol": "classic"},
    "consumer": {"group.protocol": "consumer"},
    "consumer-hb5000": {"group.protocol": "consumer"},
}
GROUP_CONFIGS = {"consumer-hb5000": {"consumer.heartbeat.interval.ms": "5000"}}
STABLE_S = 1.0


class Member(threading.Thread):
    """One consumer in a thread of its own; its assignment as its callbacks tell it."""

    def __init__(self, conf: dict[str, Any], topic: str, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.conf = conf
        self.topic = topic
        self.owned: set[int] = set()
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self.closed = threading.Event()
        self.events = 0
        self.subscribed = threading.Event()

    def _assign(self, c: Consumer, parts: list[Any]) -> None:
        with self.lock:
            self.owned |= {p.partition for p in parts}
            self.events += 1

    def _revoke(self, c: Consumer, parts: list[Any]) -> None:
        with self.lock:
            self.owned -= {p.partition for p in parts}
            self.events += 1

    def run(self) -> None:
        c = Consumer(self.conf)
        c.subscribe([self.topic], on_assign=self._assign, on_revoke=self._revoke, on_lost=self._revoke)
        self.subscribed.set()
        while not self.stop_event.is_set():
            c.poll(0.02)
        c.close()
        with self.lock:
            self.owned = set()
        self.closed.set()

    def assignment(self) -> set[int]:
        with self.lock:
            return set(self.owned)


def settled(members: list[Member], partitions: int) -> tuple[bool, int]:
    """(every partition owned once and balanced, partitions without an owner)."""
    seen: dict[int, int] = {}
    loads = []
    for m in members:
        a = m.assignment()
        loads.append(len(a))
        for p in a:
            seen[p] = seen.get(p, 0) + 1
    unowned = partitions - len(seen)
    ok = unowned == 0 and all(v == 1 for v in seen.values()) and bool(loads) and max(loads) - min(loads) <= 1
    return ok, unowned


def owners(members: list[Member]) -> dict[int, str]:
    return {p: m.name for m in members for p in m.assignment()}


def run_protocol(args: argparse.Namespace, proto: str, partitions: int) -> dict[str, Any]:
    topic = f"rb-{uuid.uuid4().hex[:8]}-{proto}-{partitions}"
    group = f"rb-{uuid.uuid4().hex[:8]}"
    suite.create_topic(args.brokers, topic, partitions)
    if proto in GROUP_CONFIGS:
        set_group_config(args.brokers, group, GROUP_CONFIGS[proto])
    base = ConsumerConfig(
        name=group, topics=[topic], brokers=[args.brokers], config=PROTOCOLS[proto]
    ).librdkafka()
    base.update({"enable.auto.commit": False, "log_level": 3})
    members: list[Member] = []
    steps: list[dict[str, Any]] = []
    n = 0
    for target in args.steps:
        prev = len(members)
        before = owners(members)
        t0 = time.perf_counter()
        if target > len(members):
            new = [Member(base, topic, f"m{n + i}") for i in range(target - len(members))]
            n += len(new)
            for m in new:
                m.start()
            members += new
        else:
            leaving, members = members[target:], members[:target]
            for m in leaving:
                m.stop_event.set()
        t_settle, unowned_ps, last = None, 0.0, time.perf_counter()
        stable_since = None
        deadline = t0 + args.timeout_s
        while time.perf_counter() < deadline:
            time.sleep(0.01)
            now = time.perf_counter()
            ok, unowned = settled(members, partitions)
            unowned_ps += unowned * (now - last)
            last = now
            if ok:
                if stable_since is None:
                    stable_since = now
                if now - stable_since >= STABLE_S:
                    t_settle = stable_since - t0
                    break
            else:
                stable_since = None
        after = owners(members)
        moved = sum(
            1 for p in range(partitions) if before.get(p) is not None and after.get(p) != before.get(p)
        )
        step = {
            "members": target,
            "from": prev,
            "settle_s": None if t_settle is None else round(t_settle, 3),
            "moved": moved,
            "unowned_partition_s": round(unowned_ps, 1),
            "callbacks": sum(m.events for m in members),
        }
        steps.append(step)
        suite.log(f"{proto} P={partitions}: -> {target} members: {step}")
        if t_settle is None:
            suite.log(f"{proto} P={partitions}: not settled within {args.timeout_s} s; stopping this series")
            break
    for m in members:
        m.stop_event.set()
    for m in members:
        m.closed.wait(30)
    suite.delete_topics(args.brokers, [topic])
    return {
        "protocol": proto,
        "partitions": partitions,
        "topic": topic,
        "steps": steps,
        "config": {k: v for k, v in base.items() if k not in ("bootstrap.servers", "group.id")},
        "group_config": GROUP_CONFIGS.get(proto, {}),
    }


def set_group_config(brokers: str, group: str, conf: dict[str, str]) -> None:
    from confluent_kafka.admin import (  # type: ignore[attr-defined]
        AdminClient,
        AlterConfigOpType,
        ConfigEntry,
        ConfigResource,
        ResourceType,
    )

    admin = AdminClient({"bootstrap.servers": brokers})
    res = ConfigResource(
        ResourceType.GROUP,
        group,
        incremental_configs=[
            ConfigEntry(k, v, incremental_operation=AlterConfigOpType.SET) for k, v in conf.items()
        ],
    )
    for fut in admin.incremental_alter_configs([res]).values():
        fut.result(timeout=30)


def prefetch(args: argparse.Namespace, partitions: int, messages: int) -> dict[str, Any]:
    """RSS of one consumer process with KeyedConsumer's librdkafka properties, subscribed to a topic
    of ``partitions`` partitions holding ``messages`` x 100 B, that polls nothing for 15 s: what
    librdkafka prefetches (its queue bounds: queued.max.messages.kbytes for the whole consumer,
    queued.min.messages per partition). Measured in a child process of its own."""
    import subprocess

    topic = f"rb-{uuid.uuid4().hex[:8]}-prefetch-{partitions}"
    suite.create_topic(args.brokers, topic, partitions)
    import random as _random

    suite.produce(
        args.brokers,
        topic,
        {"size": 100},
        suite.keys_for({"messages": messages, "keys": 100_000}, _random.Random(3)),
    )
    code = f"""
import json, os, sys, time
sys.path.insert(0, {KC_SRC!r}); sys.path.insert(0, {str(HERE)!r})
from common import tree_rss_bytes
from confluent_kafka import Consumer
from keyedconsumer.config import ConsumerConfig
conf = ConsumerConfig(name="pf-{uuid.uuid4().hex[:8]}", topics=[{topic!r}], brokers=[{args.brokers!r}]).librdkafka()
r0 = tree_rss_bytes(os.getpid())
c = Consumer(conf)
c.subscribe([{topic!r}])
t0 = time.time()
while not c.assignment() and time.time() - t0 < 60:
    c.poll(0.1)  # until assigned; then nothing is polled and librdkafka prefetches alone
samples = []
t1 = time.time()
while time.time() - t1 < 15:
    time.sleep(1)
    samples.append(tree_rss_bytes(os.getpid()))
print(json.dumps({{"rss_before_mb": r0 / 1e6, "rss_peak_mb": max(samples) / 1e6, "assigned": len(c.assignment()),
                  "props": {{k: conf[k] for k in ("queued.max.messages.kbytes", "queued.min.messages")}}}}))
c.close()
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    suite.delete_topics(args.brokers, [topic])
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    out.update(partitions=partitions, messages=messages)
    suite.log(f"prefetch: {out}")
    return out


def write_markdown(results: dict[str, Any], path: Path) -> None:
    lines = [
        "# Rebalance time: classic cooperative-sticky against KIP-848",
        "",
        f"`bench/rebalance.py`, {results['date']}, commit `{results['commit']}`, Kafka 4.1.1 single broker "
        f"(scripts/services: group.consumer.heartbeat.interval.ms 500, group.initial.rebalance.delay.ms 0), "
        f"confluent-kafka {results['machine']['confluent_kafka']}, librdkafka {results['librdkafka']}. Load average at the "
        f"start {results['loadavg_before']}, at the end {results['loadavg_after']}"
        f"{'; under the exclusive quiet lock' if results.get('quiet_lock') else ''}. Command: `{results['command']}`.",
        "",
        "A step starts when members subscribe (or close, leaving gracefully) and is settled when every partition "
        "has exactly one owner and the loads differ by at most 1, for 1 s (the time shown is when that began). "
        "moved: partitions whose owner changed; unowned: partition-seconds without an owner during the step.",
        "",
        "| protocol | partitions | members | settle s | moved | unowned partition-s |",
        "| --- | ---: | --- | ---: | ---: | ---: |",
    ]
    for r in results["runs"]:
        prev = 0
        for s in r["steps"]:
            lines.append(
                f"| {r['protocol']} | {r['partitions']} | {prev} -> {s['members']} | {s['settle_s']} "
                f"| {s['moved']} | {s['unowned_partition_s']} |"
            )
            prev = s["members"]
    if results.get("prefetch"):
        lines += [
            "",
            "## librdkafka prefetch: RSS of a consumer that polls nothing for 15 s",
            "",
            "| partitions | messages in the topic | RSS before the client MB | peak RSS MB | properties |",
            "| ---: | ---: | ---: | ---: | --- |",
        ]
        for x in results["prefetch"]:
            lines.append(
                f"| {x['partitions']:,} | {x['messages']:,} | {x['rss_before_mb']:.0f} | {x['rss_peak_mb']:.0f} "
                f"| {x['props']} |"
            )
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    import confluent_kafka

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--brokers", default="127.0.0.1:9092")
    ap.add_argument("--partitions", default="64,256")
    ap.add_argument("--steps", default="1,2,4,8,4,2,1")
    ap.add_argument("--protocols", default="classic,consumer,consumer-hb5000")
    ap.add_argument("--timeout-s", type=float, default=120.0)
    ap.add_argument(
        "--smoke", action="store_true", help="16 partitions, 1 -> 2 -> 1 members, both protocols (< 1 min)"
    )
    ap.add_argument("--quiet-lock", action="store_true")
    ap.add_argument(
        "--prefetch",
        default="",
        metavar="P,P",
        help="only: RSS of a consumer that polls nothing, librdkafka prefetching from P partitions",
    )
    ap.add_argument("--name", default="rebalance", help="the results' file names: <out>/<name>.json and .md")
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args()
    if args.smoke:
        args.partitions, args.steps, args.protocols, args.timeout_s = "16", "1,2,1", "classic,consumer", 30.0
    args.steps = [int(x) for x in args.steps.split(",")]
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "loadavg_before": suite.loadavg(),
        "machine": suite.machine_info(None),
        "confluent_kafka": confluent_kafka.version()[0],
        "librdkafka": confluent_kafka.libversion()[0],
        "quiet_lock": args.quiet_lock,
        "command": " ".join(["bench/rebalance.py", *sys.argv[1:]]),
        "runs": [],
    }
    results["commit"] = os.environ.get("KC_COMMIT") or results["machine"]["keyedconsumer_commit"]
    if args.prefetch:
        results["prefetch"] = [prefetch(args, int(p), 2_000_000) for p in args.prefetch.split(",")]
        args.partitions = ""
    for p in [int(x) for x in args.partitions.split(",") if x]:
        for proto in args.protocols.split(","):
            results["runs"].append(run_protocol(args, proto, p))
    results["loadavg_after"] = suite.loadavg()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(results, indent=1) + "\n")
    write_markdown(results, out / f"{args.name}.md")
    print((out / f"{args.name}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
