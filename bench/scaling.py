"""Scaling across instances: 1 to 16 processes in one consumer group, as instances or as one
``keyedconsumer run --processes N``, on I/O-bound (W2) and no-op (W1) work.

    .venv/bin/python bench/scaling.py                      # full size: starts its own 3-broker Kafka +
                                                           # Redis Cluster (scripts/services cluster-up)
    .venv/bin/python bench/scaling.py --size ci            # smoke size (seconds; asserts nothing about speed)
    .venv/bin/python bench/scaling.py --brokers H:P --redis-url redis://H:P/0   # services of your own
    scripts/bench --scaling ...                            # the same, after scripts/setup

One topic (16 partitions, replication factor 3 on the cluster, 10,000 keys, 100 B records) is
produced once. Each run starts N instances of ``bench/contender.py`` together, as separate processes
in a fresh consumer group: keyedconsumer (``concurrency=16``, a ``time.sleep(0.005)`` handler on its
worker threads, or ``asyncio.sleep`` with ``--mode async``), with the in-memory sequencer and with
``RedisSequencer`` on the Redis Cluster, and the raw confluent-kafka loop with the same handler (one
message at a time). Runs are interleaved round-robin over ``--repeats``.

**The steady window.** An instance's first message comes after its process start and its group
join, and the group rebalances each time one more instance joins. So a run waits until every
instance has handled a message, waits ``settle_s`` more (the last rebalances), then measures a
``window_s``-long window [t0, t1]: msg/s = messages handled by all instances in the window / its
length. Each instance samples its handled count every 0.25 s with a ``CLOCK_MONOTONIC`` time stamp
(one clock for every process), so its count at t0 and t1 is interpolated between its samples. The
backlog is big enough that no partition runs dry before t1 (checked: a run flags a window in which
the group's rate fell below half its median).

**CPU.** At t0 and t1 the orchestrator reads ``/proc/stat`` (the whole machine: user + nice + system
+ irq + softirq + steal, of every process) and ``/proc/<pid>/stat`` (utime + stime) of each instance,
each Kafka broker and each Redis node (pid files of the cluster it started): CPU seconds per 1,000
messages per instance, and cores busy over the window per component, so the point where the two
cores are used up shows.

``--size ci`` (the smoke test): 3,000 records with a 1 ms handler, N = 1 and 2; each run also drains
the topic (until the group's committed offsets reach the end offsets) and checks that every message
was handled (at least once) and committed.

**Workloads and the multi-process mode.** W2 is the I/O-bound handler above (the runs whose ids
carry no workload: ``keyedconsumer/n4``); W1 a no-op handler on the same topic (the engine's own
cost: ``w1/keyedconsumer/n4``), run for keyedconsumer only. ``keyedconsumer-procs`` is one
``keyedconsumer run --processes N`` of bench/procs_app.py (a ``KeyedApp`` of one route with the
instances' options and handler; N = ``--processes``, 1, 2 and 4 at full size) next to N separate
instances; its CPU is the supervisor's and its children's.

**Quiet runs.** Before each run the orchestrator waits up to ``--quiet-wait-s`` (120 s at full size)
for the 1-minute load average to fall to the core count, and records it: a run that starts above
is kept but marked not comparable, and the summary takes the median over the comparable ones. Rounds
are repeated, each rerunning only what lacks ``--repeats`` comparable runs (3 at full size), up to
``--max-rounds`` (5). The CPU limit of the machine (its cores / the machine's CPU seconds per
message of the instances, brokers and Redis at N=1) is reported per contender, with each figure's
ratio to min(linear, CPU limit);
bench/plot_scaling.py draws it as a line.

Writes ``<out>/scaling.json`` and ``<out>/scaling.md`` (default out: bench/results).
"""

from __future__ import annotations

import argparse
import datetime as dt
import fcntl
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import goals  # noqa: E402  (the suite's formatting helpers)
import run as bench  # noqa: E402  (topic, produce, machine info and formatting helpers of the suite)

SIZES: dict[str, dict[str, Any]] = {
    # 12 and 16 instances go past the two cores (about 60 us of CPU a message x 3,200 msg/s an
    # instance); 16 instances have one partition each: at their ideal (3,200 msg/s) a partition of
    # 125,000 records lasts 39 s, more than start, join, settle and window together
    "full": dict(
        messages=2_000_000,
        size=100,
        partitions=16,
        keys=10_000,
        sleep_ms=5,
        concurrency=16,
        settle_s=3.0,
        window_s=15.0,
        drain=False,
        # the instances run at nice 10: the brokers and Redis stand for machines of their own, and at
        # 16 instances on equal terms (load 25-35 on 2 cores) a broker missed its KRaft heartbeats for
        # ~50 s and half the group's sessions timed out (2026-12-05): a starved broker, not the design
        nice=10,
        repeats=3,  # quiet repeats: runs are repeated (up to max_rounds) until each config has these
        max_rounds=5,
        quiet_wait_s=120.0,
        instances="1,2,4,8,12,16",
        raw="all",
        workloads="w1,w2",
        processes="1,2,4",
    ),
    "ci": dict(
        messages=3_000,
        size=100,
        partitions=16,
        keys=1_000,
        sleep_ms=1,
        concurrency=16,
        settle_s=0.3,
        window_s=1.0,
        drain=True,
        drains_in_window=True,
        nice=0,
        repeats=1,
        max_rounds=1,
        quiet_wait_s=0.0,
        instances="1,2",
        raw="1",
        workloads="w2",
        processes="",
    ),
}
#: The multi-process contender: one ``keyedconsumer run --processes N`` of bench/procs_app.py.
PROCS = "keyedconsumer-procs"
CONTENDERS = ("raw", "keyedconsumer", "keyedconsumer-redis", PROCS)
SEQUENCER = {"raw": "–", "keyedconsumer": "in-memory", "keyedconsumer-redis": "Redis", PROCS: "in-memory"}
#: The workloads, by their handler's sleep (ms): W2 is the size's I/O-bound handler (the original
#: runs of this benchmark, whose run ids carry no workload), W1 a no-op handler (the engine's own cost).
WORKLOADS: dict[str, Any] = {"w2": lambda size: size["sleep_ms"], "w1": lambda size: 0}
#: The contenders of W1: keyedconsumer alone, as instances and as processes of one supervisor.
W1_CONTENDERS = ("keyedconsumer", PROCS)


def run_id(workload: str, contender: str, n: int) -> str:
    return f"{contender}/n{n}" if workload == "w2" else f"{workload}/{contender}/n{n}"


CLK_TCK = os.sysconf("SC_CLK_TCK")
NCPU = os.cpu_count() or 1
log = bench.log


# ----------------------------------------------------------------------------------- services


class Services:
    """The Kafka brokers and Redis this benchmark uses: the 3-broker Kafka and 6-node Redis Cluster
    of ``scripts/services cluster-up`` in a run dir of its own (started here, stopped at the end
    unless ``keep``), or the ones named by ``--brokers`` / ``--redis-url`` (left alone; their CPU is
    then counted in "other")."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.own = not args.brokers
        self.brokers: str = args.brokers or ""
        self.redis_url: str = args.redis_url or ""
        self.run_dir = Path(args.run_dir)
        self.env = dict(
            os.environ,
            KC_RUN_DIR=str(self.run_dir),
            CLUSTER_KAFKA_BASE=str(args.kafka_base),
            CLUSTER_REDIS_BASE=str(args.redis_base),
            KC_PYTHON=sys.executable,
        )

    def _services(self, cmd: str) -> str:
        out = subprocess.run(
            [str(ROOT / "scripts" / "services"), cmd],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if out.returncode != 0:
            raise RuntimeError(f"scripts/services {cmd} failed: {out.stderr.strip()[-2000:]}")
        return out.stdout

    def up(self) -> None:
        if not self.own:
            if not self.redis_url:
                raise SystemExit("--brokers needs --redis-url too")
            return
        ours = (self.run_dir / "cluster" / "kafka-1" / "kafka" / "kafka.pid").exists()
        if not ours:  # a service already answering there would be reused: not ours to measure or stop
            busy = [
                p
                for p in (
                    *[self.args.kafka_base + i for i in range(6)],
                    *[self.args.redis_base + i for i in range(6)],
                )
                if _port_open(p)
            ]
            if busy:
                raise SystemExit(f"ports {busy} are in use: choose --kafka-base / --redis-base")
        log(
            f"starting the cluster in {self.run_dir} (Kafka base {self.args.kafka_base}, Redis base {self.args.redis_base})"
        )
        out = self._services("cluster-up")
        env = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
        self.brokers = env["KAFKA_BOOTSTRAP_SERVERS"]
        self.redis_url = "redis+cluster://" + env["REDIS_CLUSTER_NODES"]

    def down(self) -> None:
        if self.own and not self.args.keep_cluster:
            log("stopping the cluster")
            self._services("cluster-down")

    def pids(self) -> dict[str, list[int]]:
        """{"brokers": [...], "redis": [...]} of the cluster started here (pid files); {} otherwise."""
        if not self.own:
            return {}
        out: dict[str, list[int]] = {"brokers": [], "redis": []}
        for kind, pat in (("brokers", "kafka-*/kafka/kafka.pid"), ("redis", "redis-*/redis/redis.pid")):
            for f in sorted((self.run_dir / "cluster").glob(pat)):
                try:
                    out[kind].append(int(f.read_text().strip()))
                except (OSError, ValueError):
                    pass
        return out


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def broker_count(brokers: str) -> int:
    from confluent_kafka.admin import AdminClient

    return len(AdminClient({"bootstrap.servers": brokers}).list_topics(timeout=30).brokers)


# ----------------------------------------------------------------------------------------- CPU


def machine_jiffies() -> tuple[int, int, int]:
    """(busy, total, kernel) clock ticks of all CPUs since boot, from /proc/stat (kernel: system +
    irq + softirq)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq, steal = v
    busy = user + nice + system + irq + softirq + steal
    return busy, busy + idle + iowait, system + irq + softirq


def proc_detail(pid: int) -> tuple[float, float, int] | None:
    """(utime s, stime s, context switches of all its threads) of a process; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        switches = 0
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/status") as f:
                    for line in f:
                        if "ctxt_switches:" in line:  # voluntary_ and nonvoluntary_
                            switches += int(line.split()[1])
            except (OSError, ValueError):
                pass
        return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK, switches
    except (OSError, IndexError, ValueError):
        return None


def proc_cpu_s(pid: int) -> float | None:
    """utime + stime of a process (all its threads), seconds; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK
    except (OSError, IndexError, ValueError):
        return None


def cpu_snapshot(groups: dict[str, list[int]]) -> dict[str, Any]:
    return {
        "t": time.perf_counter(),
        "machine": machine_jiffies(),
        "pids": {kind: {p: proc_cpu_s(p) for p in pids} for kind, pids in groups.items()},
        "instances": {p: proc_detail(p) for p in groups.get("instances", [])},
    }


def cpu_delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Cores busy over [a, b]: the machine's, and each group's (instances, brokers, redis, orchestrator)."""
    secs = b["t"] - a["t"]
    busy = b["machine"][0] - a["machine"][0]
    total = b["machine"][1] - a["machine"][1]
    out: dict[str, Any] = {
        "seconds": round(secs, 3),
        "machine_cores_busy": round(NCPU * busy / total, 3) if total else None,
        "machine_util": round(busy / total, 3) if total else None,
    }
    per: dict[str, dict[int, float]] = {}
    for kind, pids in b["pids"].items():
        per[kind] = {
            p: round(v - a["pids"][kind][p], 2)
            for p, v in pids.items()
            if v is not None and a["pids"][kind].get(p) is not None
        }
        out[f"{kind}_cores"] = round(sum(per[kind].values()) / secs, 3) if secs else None
    if out["machine_cores_busy"] is not None:
        known = sum(out.get(f"{k}_cores") or 0.0 for k in per)
        out["other_cores"] = round(out["machine_cores_busy"] - known, 3)
    out["machine_kernel_share"] = round((b["machine"][2] - a["machine"][2]) / busy, 3) if busy else None
    # the instances: user and system time, and context switches (all threads) over the window
    d = [(b["instances"][p], a["instances"].get(p)) for p in b.get("instances", {})]
    d = [(x, y) for x, y in d if x is not None and y is not None]
    user, system = sum(x[0] - y[0] for x, y in d), sum(x[1] - y[1] for x, y in d)
    out["instances_sys_share"] = round(system / (user + system), 3) if user + system else None
    out["instances_ctx_switches"] = sum(x[2] - y[2] for x, y in d)
    out["per_pid_cpu_s"] = per
    return out


# ------------------------------------------------------------------------------------- running


def interp(samples: list[tuple[float, int]], t: float) -> float:
    """A count at time ``t`` from (time, count) samples, linear between the two around it."""
    if not samples:
        return 0.0
    if t <= samples[0][0]:
        return float(samples[0][1])
    for (ta, ca), (tb, cb) in zip(samples, samples[1:], strict=False):
        if ta <= t <= tb:
            return ca + (cb - ca) * ((t - ta) / (tb - ta) if tb > ta else 1.0)
    return float(samples[-1][1])


def read_progress(path: Path) -> int:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def group_lag(brokers: str, topic: str, group: str, partitions: int) -> int | None:
    """end offsets - the group's committed offsets, summed (None if it cannot be read)."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": brokers, "group.id": group, "enable.auto.commit": False})
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        committed = c.committed(tps, timeout=10)
        lag = 0
        for tp in committed:
            hi = c.get_watermark_offsets(TopicPartition(topic, tp.partition), timeout=10)[1]
            lag += hi - max(tp.offset, 0)
        return lag
    except Exception as exc:  # noqa: BLE001
        log(f"lag of {group}: {exc}")
        return None
    finally:
        c.close()


def niced(nice: int) -> list[str]:
    """The command prefix that runs a contender at niceness ``nice`` (``nice(1)`` execs it: same pid)."""
    return ["nice", "-n", str(nice)] if nice else []


class Instances:
    """N separate instances: N ``bench/contender.py`` processes, each ending at the stop file."""

    def __init__(self, base: dict[str, Any], work: Path, n: int, env: dict[str, str], nice: int = 0) -> None:
        self.work, self.n = work, n
        self.procs: list[subprocess.Popen[bytes]] = []
        self.progress: list[Path] = []
        self.outs: list[tuple[Any, Any]] = []
        for i in range(n):
            spec = dict(base, progress_file=str(work / f"progress-{i}"))
            self.progress.append(Path(spec["progress_file"]))
            out_f, err_f = open(work / f"i{i}.out", "w"), open(work / f"i{i}.err", "w")  # noqa: SIM115
            self.outs.append((out_f, err_f))
            self.procs.append(
                subprocess.Popen(
                    [*niced(nice), sys.executable, str(HERE / "contender.py"), json.dumps(spec)],
                    cwd=work,
                    env=env,
                    stdout=out_f,
                    stderr=err_f,
                )
            )

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def measured_pids(self) -> list[int]:
        return self.pids()

    def counts(self) -> list[int]:
        return [read_progress(p) for p in self.progress]

    def exited(self) -> bool:
        return any(p.poll() is not None for p in self.procs)

    def stop(self, notes: list[str]) -> list[dict[str, Any]]:
        (self.work / "STOP").write_text("stop\n")
        results = []
        for i, p in enumerate(self.procs):
            try:
                p.wait(timeout=90)
            except subprocess.TimeoutExpired:
                p.kill()  # our own child, by its pid
                p.wait()
                notes.append(f"instance {i} did not stop within 90 s: killed")
            for f in self.outs[i]:
                f.close()
            text = (self.work / f"i{i}.out").read_text()
            line = next((ln for ln in reversed(text.splitlines()) if ln.startswith("BENCH_RESULT ")), None)
            if line is None:
                err = (self.work / f"i{i}.err").read_text().strip()[-1500:]
                results.append({"error": f"exit {p.returncode}, no result; stderr tail: {err}"})
            else:
                results.append(json.loads(line[len("BENCH_RESULT ") :]))
        return results


class Supervised:
    """The multi-process mode: one ``keyedconsumer run procs_app:app --processes N`` (bench/procs_app.py);
    its children are found by their progress files (``progress-<pid>``) and stopped by one SIGTERM to
    the supervisor, after which each has written ``result-<pid>.json``."""

    def __init__(self, base: dict[str, Any], work: Path, n: int, env: dict[str, str], nice: int = 0) -> None:
        self.work, self.n = work, n
        self.err = open(work / "i0.err", "w")  # noqa: SIM115  (the warnings count reads i*.err)
        spec = dict(base, work_dir=str(work))
        self.proc = subprocess.Popen(
            [
                *niced(nice),
                sys.executable,
                *("-m", "keyedconsumer", "run", "procs_app:app", "--app-dir", str(HERE)),
                *("--processes", str(n), "--log-level", "WARNING"),
            ],
            cwd=work,
            env=dict(env, KC_BENCH_SPEC=json.dumps(spec)),
            stdout=self.err,
            stderr=subprocess.STDOUT,
        )

    def pids(self) -> list[int]:
        """The children that started so far (a restarted one adds its own)."""
        return sorted(
            int(p.name.split("-", 1)[1]) for p in self.work.glob("progress-*") if p.name[9:].isdigit()
        )

    def measured_pids(self) -> list[int]:
        return [self.proc.pid, *self.pids()]

    def counts(self) -> list[int]:
        pids = self.pids()
        return [read_progress(self.work / f"progress-{p}") for p in pids] + [0] * max(0, self.n - len(pids))

    def exited(self) -> bool:
        return self.proc.poll() is not None

    def stop(self, notes: list[str]) -> list[dict[str, Any]]:
        self.proc.send_signal(signal.SIGTERM)  # the supervisor drains every child
        try:
            code = self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # our own child, by its pid (its children stop when they see it gone)
            code = self.proc.wait()
            notes.append("the supervisor did not stop within 120 s: killed")
        self.err.close()
        if code:
            notes.append(f"the supervisor exited {code}")
        results = []
        for pid in self.pids():
            f = self.work / f"result-{pid}.json"
            results.append(json.loads(f.read_text()) if f.exists() else {"error": f"child {pid}: no result"})
        return results


def wait_quiet(max_wait_s: float) -> list[float]:
    """The load average once its 1-minute figure is at most the core count, or after ``max_wait_s``."""
    deadline = time.perf_counter() + max_wait_s
    while True:
        load = bench.loadavg()
        if not load or load[0] <= NCPU or time.perf_counter() >= deadline:
            return load
        time.sleep(5.0)


def run_config(
    args: argparse.Namespace,
    size: dict[str, Any],
    svc: Services,
    meta: dict[str, Any],
    run: tuple[str, str, int],
    rep: int,
) -> dict[str, Any]:
    """N instances (or N processes of one supervisor) of one contender on one workload, in a fresh
    group: the steady window's msg/s and CPU."""
    workload, contender, n = run
    rid = run_id(workload, contender, n)
    # --drain-at: only these instance counts drain (a 1-instance full-size drain takes ~11 minutes)
    size = dict(size, drain=size["drain"] and (not size.get("drain_at") or n in size["drain_at"]))
    group = f"{meta['topic']}-{workload}-{contender}-n{n}-r{rep}-{uuid.uuid4().hex[:6]}"
    work = args.out / "tmp" / "scaling" / group
    work.mkdir(parents=True, exist_ok=True)
    window_s, settle_s = args.window_s or size["window_s"], size["settle_s"]
    sleep_ms = WORKLOADS[workload](size)
    base = {
        "contender": "keyedconsumer" if contender == PROCS else contender,
        "ordering": "key" if contender != "raw" else "partition",
        "concurrency": size["concurrency"] if contender != "raw" else 1,
        "mode": args.mode,
        "brokers": svc.brokers,
        "topic": meta["topic"],
        "group": group,
        "target": size["messages"] + 1,  # never reached: every run ends at its stop
        "partitions": size["partitions"],
        "sleep_ms": sleep_ms,
        "max_seconds": 600.0,
        "startup_s": 120.0,
        "max_in_flight": 10_000,
        "produce_t0_ms": meta["produce_t0_ms"],
        "sample_s": 0.25,
        "lat_every": 64,
        "redis_url": svc.redis_url,
        "stop_file": str(work / "STOP"),
    }
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    if args.engine_dir:
        env["PYTHONPATH"] = str(args.engine_dir)  # before the venv's editable install of the working tree
    load0 = wait_quiet(args.quiet_wait_s if args.quiet_wait_s is not None else size["quiet_wait_s"])
    launch: Instances | Supervised = (Supervised if contender == PROCS else Instances)(
        base, work, n, env, nice=size["nice"]
    )
    t_start = time.perf_counter()
    res: dict[str, Any] = {
        "id": rid,
        "workload": workload,
        "contender": contender,
        "sequencer": SEQUENCER[contender],
        "instances": n,
        "repeat": rep,
        "group": group,
        "loadavg_before": load0,
        # a run that starts on a machine busier than its cores measures the machine, not the design
        "comparable": bool(load0) and load0[0] <= NCPU,
        "notes": [],
    }
    if not res["comparable"]:
        res["notes"].append(f"not comparable: load average {load0[:1]} above the {NCPU} cores before the run")
    # 1. every instance has handled a message (its join is done), or the topic is drained (ci)
    t_all = None
    while time.perf_counter() - t_start < 150:
        counts = launch.counts()
        if all(counts) or (size["drain"] and sum(counts) >= size["messages"]):
            t_all = time.perf_counter()
            break
        if launch.exited():
            break
        time.sleep(0.05)
    res["all_handling_s"] = round(t_all - t_start, 2) if t_all is not None else None
    if t_all is None:
        res["notes"].append("not every instance handled a message within 150 s of the start")
        t_all = time.perf_counter()
    groups = {"instances": launch.measured_pids(), "orchestrator": [os.getpid()], **svc.pids()}
    # 2. the window: settle, then [t0, t1] with a CPU snapshot at each end
    time.sleep(max(0.0, t_all + settle_s - time.perf_counter()))
    snap0 = cpu_snapshot(groups)
    prof = None
    if args.profile == n and contender != "raw":  # instance 0 over the window, with py-spy (GIL samples)
        raw_out = args.out / f"profile-scaling-{workload}-{contender}-n{n}-r{rep}.raw.txt"
        prof = subprocess.Popen(
            [
                args.py_spy,
                "record",
                "--pid",
                str(launch.pids()[0]),
                "--duration",
                str(int(window_s)),
                "--rate",
                "100",
                "--gil",
                "--nonblocking",
                "--format",
                "raw",
                "-o",
                str(raw_out),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    time.sleep(max(0.0, snap0["t"] + window_s - time.perf_counter()))
    snap1 = cpu_snapshot(groups)
    if prof is not None:
        try:
            prof.wait(timeout=30)
        except subprocess.TimeoutExpired:
            prof.kill()  # our own child, by its pid
            prof.wait()
        res["profile"] = bench.summarize_profile(raw_out)
        res["notes"].append("py-spy recorded instance 0 during the window (not a measurement run)")
    # 3. ci: until the group has committed every offset (auto commit: every 5 s)
    if size["drain"]:  # the smoke size: 120 s; a full-size backlog: at a tenth of the ideal rate
        ideal_s = size["messages"] / max(1.0, n * base["concurrency"] * 1000.0 / max(sleep_ms, 1))
        deadline = time.perf_counter() + max(120.0, 10 * ideal_s)
        while time.perf_counter() < deadline:
            if sum(launch.counts()) >= size["messages"]:
                if group_lag(svc.brokers, meta["topic"], group, size["partitions"]) == 0:
                    break
            time.sleep(0.5)
    pids = launch.pids()
    results = launch.stop(res["notes"])
    res["wall_s"] = round(time.perf_counter() - t_start, 1)
    res["loadavg_after"] = bench.loadavg()
    res.update(measure(results, pids, snap0, snap1, size))
    # every instance's usable concurrency at once (10,000 keys: never bound by the keys)
    res["ideal_msg_per_s"] = n * base["concurrency"] * 1000.0 / sleep_ms if sleep_ms else None
    if size["drain"]:
        res["lag_at_end"] = group_lag(svc.brokers, meta["topic"], group, size["partitions"])
        res["handled_total"] = sum(r.get("handled") or 0 for r in results)
        res["drained"] = res["lag_at_end"] == 0 and res["handled_total"] >= size["messages"]
    res["warnings"] = warnings_of(work)
    errors = [f"instance {i}: {r['error']}" for i, r in enumerate(results) if r.get("error")]
    res["error"] = "; ".join(errors) or None
    return res


def warnings_of(work: Path) -> dict[str, int]:
    """The instances' log warnings, counted by kind (the message with its numbers taken out)."""
    import re

    counts: dict[str, int] = {}
    for f in sorted(work.glob("i*.err")):
        for line in f.read_text(errors="replace").splitlines():
            if line.startswith("WARNING:"):
                kind = re.sub(r"\d+(\.\d+)?", "N", line.split(":", 2)[-1])[:90]
                counts[kind] = counts.get(kind, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def measure(
    results: list[dict[str, Any]],
    pids: list[int],
    snap0: dict[str, Any],
    snap1: dict[str, Any],
    size: dict[str, Any],
) -> dict[str, Any]:
    """The window's figures from the instances' samples and the two CPU snapshots."""
    t0, t1 = snap0["t"], snap1["t"]
    series = [
        [(r["samples_t0"] + s[0], int(s[2])) for s in r.get("rss_samples") or []]
        if r.get("samples_t0")
        else []
        for r in results
    ]
    handled = [interp(s, t1) - interp(s, t0) for s in series]
    total = sum(handled)
    cpu = cpu_delta(snap0, snap1)
    inst_cpu = cpu["per_pid_cpu_s"].get("instances", {})
    per_inst = []
    for r, h, pid in zip(results, handled, pids, strict=True):
        cpu_s = inst_cpu.get(pid) or 0.0
        per_inst.append(
            {
                "handled_in_window": round(h),
                "cpu_s": cpu_s,
                "cpu_s_per_1000": round(1000 * cpu_s / h, 4) if h else None,
                "startup_s": r.get("startup_s"),
                "peak_rss_mb": r.get("peak_rss_mb"),
                "handled": r.get("handled"),
                "order_violations": r.get("order_violations"),
                "order_backward": r.get("order_backward"),
            }
        )
    # the group's rate second by second: steady, or did a partition run dry?
    secs = max(1, int(t1 - t0))
    step = (t1 - t0) / secs
    rates = [
        sum(interp(s, t0 + (k + 1) * step) - interp(s, t0 + k * step) for s in series) / step
        for k in range(secs)
    ]
    out: dict[str, Any] = {
        "window_s": round(t1 - t0, 3),
        "msg_per_s": round(total / (t1 - t0), 1) if total else None,
        "handled_in_window": round(total),
        "rate_per_second": [round(x) for x in rates],
        "cpu": {k: v for k, v in cpu.items() if k != "per_pid_cpu_s"},
        "cpu_per_pid_s": cpu["per_pid_cpu_s"],
        "per_instance": per_inst,
        "cpu_s_per_1000": round(1000 * sum(inst_cpu.values()) / total, 4) if total else None,
        "ctx_switches_per_msg": round(cpu["instances_ctx_switches"] / total, 2) if total else None,
        "order_violations": sum(r.get("order_violations") or 0 for r in results),
        "order_backward": sum(r.get("order_backward") or 0 for r in results),
        "peak_rss_mb": max((r.get("peak_rss_mb") or 0 for r in results), default=None),
    }
    med = statistics.median(rates) if rates else 0
    # the smoke size drains its topic inside the window: its rate falls to 0 there by design
    if not size.get("drains_in_window") and med and min(rates) < 0.5 * med:
        out["unsteady"] = True  # a partition ran dry, or a rebalance in the window
    return out


def engine_source(args: argparse.Namespace) -> dict[str, Any]:
    """The keyedconsumer the instances import: ``--engine REV`` exports that commit's ``keyedconsumer/``
    (``git archive``) and puts it first on their PYTHONPATH, so uncommitted edits in a shared working
    tree are not measured; ``--engine worktree`` imports the working tree (the venv's install)."""
    if args.engine == "worktree":
        args.engine_dir = None
        return {"engine": "working tree", "commit": bench.machine_info(None).get("keyedconsumer_commit")}
    rev = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", args.engine],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    dest = args.out / "tmp" / f"engine-{rev}"
    if not (dest / "keyedconsumer" / "__init__.py").exists():
        dest.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", rev, "keyedconsumer"], capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    args.engine_dir = dest
    return {"engine": f"commit {rev} (git archive into {dest})", "commit": rev}


# ----------------------------------------------------------------------------------- the lock


def take_lock(path: str, wait_s: float) -> tuple[Any, dict[str, Any]]:
    """An exclusive flock on ``path`` (others hold it shared during their heavy runs), waiting up to
    ``wait_s``; without it the runs go on and the results say so."""
    f = open(path, "a")  # noqa: SIM115
    t0 = time.perf_counter()
    load0 = bench.loadavg()
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return f, {"path": path, "held": True, "waited_s": round(time.perf_counter() - t0, 1)}
        except BlockingIOError:
            if time.perf_counter() - t0 > wait_s:
                f.close()
                return None, {
                    "path": path,
                    "held": False,
                    "waited_s": round(time.perf_counter() - t0, 1),
                    "loadavg_when_giving_up": bench.loadavg(),
                    "loadavg_when_asking": load0,
                }
            time.sleep(1.0)


# ----------------------------------------------------------------------------------- reporting


def summarize(runs: list[dict[str, Any]], instances: list[int]) -> list[dict[str, Any]]:
    """Per workload, contender and N: the median over the comparable repeats (min-max kept; over all
    of them, marked, when none was comparable) of msg/s, ratio to linear (msg/s / (N x the same
    repeat's N=1 msg/s)), ratio Redis / in-memory, ratio processes / instances, CPU figures; and the
    CPU limit of this machine (:func:`cpu_limit`) with the ratio to what it leaves attainable."""
    by: dict[tuple[str, str, int, int], dict[str, Any]] = {
        (r.get("workload", "w2"), r["contender"], r["instances"], r["repeat"]): r for r in runs
    }

    def ratio(r: dict[str, Any], other: dict[str, Any] | None) -> float | None:
        v = (other or {}).get("msg_per_s")
        return round(r["msg_per_s"] / v, 3) if v and r.get("msg_per_s") else None

    for r in runs:
        wl, c, n, rep = r.get("workload", "w2"), r["contender"], r["instances"], r["repeat"]
        one = by.get((wl, c, 1, rep), {}).get("msg_per_s")
        r["ratio_to_linear"] = round(r["msg_per_s"] / (n * one), 3) if one and r.get("msg_per_s") else None
        mem = by.get((wl, "keyedconsumer", n, rep))
        r["ratio_to_in_memory"] = ratio(r, mem) if c == "keyedconsumer-redis" else None
        r["ratio_to_instances"] = ratio(r, mem) if c == PROCS else None
        ideal = r.get("ideal_msg_per_s")
        r["of_ideal"] = round(r["msg_per_s"] / ideal, 3) if ideal and r.get("msg_per_s") else None
    rows = []
    for wl in WORKLOADS:
        for c in CONTENDERS:
            limit = cpu_limit(
                [r for r in runs if (r.get("workload", "w2"), r["contender"], r["instances"]) == (wl, c, 1)]
            )
            for n in instances:
                every = [
                    r for r in runs if (r.get("workload", "w2"), r["contender"], r["instances"]) == (wl, c, n)
                ]
                if not every:
                    continue
                quiet = [r for r in every if r.get("comparable", True)]
                rows.append(summary_row(wl, c, n, quiet or every, len(quiet), limit))
    return rows


def cpu_limit(ones: list[dict[str, Any]]) -> float | None:
    """The CPU limit of this machine for one contender, msg/s: its cores / the CPU seconds per message
    of the stack at N=1 (the instances', the brokers' and the Redis nodes' processes over the window;
    the brokers and Redis only when this benchmark started them, else the limit is too high by their
    share), the median over the comparable N=1 runs. Other people's work on the machine is not in it.
    A ratio to linear that falls where linear crosses it is the machine's, not the design's. It is
    an estimate, not a ceiling: a starved instance needs less CPU a message (its workers find more
    work a wake-up), so N past it can go a little past it too (1.1-1.3x on 2026-12-05)."""
    quiet = [r for r in ones if r.get("comparable", True)]
    vals = []
    for r in quiet:
        cpu = r.get("cpu") or {}
        stack = sum(cpu.get(k) or 0.0 for k in ("instances_cores", "brokers_cores", "redis_cores"))
        if r.get("msg_per_s") and stack > 0:
            vals.append(NCPU * r["msg_per_s"] / stack)
    return round(statistics.median(vals), 1) if vals else None


def summary_row(
    wl: str, c: str, n: int, xs: list[dict[str, Any]], comparable: int, limit: float | None
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "workload": wl,
        "contender": c,
        "sequencer": SEQUENCER[c],
        "instances": n,
        "repeats": len(xs),
        "comparable_repeats": comparable,
        "ideal_msg_per_s": xs[0].get("ideal_msg_per_s"),
        "cpu_limit_msg_per_s": limit,
    }
    for key, path in (
        ("msg_per_s", ()),
        ("ratio_to_linear", ()),
        ("ratio_to_in_memory", ()),
        ("ratio_to_instances", ()),
        ("of_ideal", ()),
        ("cpu_s_per_1000", ()),
        ("ctx_switches_per_msg", ()),
        ("instances_sys_share", ("cpu",)),
        ("machine_cores_busy", ("cpu",)),
        ("instances_cores", ("cpu",)),
        ("brokers_cores", ("cpu",)),
        ("redis_cores", ("cpu",)),
        ("other_cores", ("cpu",)),
    ):
        vals = [v for x in xs if (v := (x.get(path[0], {}) if path else x).get(key)) is not None]
        if vals:
            row[key] = statistics.median(vals)
            row[key + "_all"] = vals
    # of what is attainable: the lower of linear (N x the N=1 rate) and the CPU limit
    linear = [x["msg_per_s"] / x["ratio_to_linear"] for x in xs if x.get("ratio_to_linear")]
    if row.get("msg_per_s") and linear:
        attainable = statistics.median(linear) if limit is None else min(statistics.median(linear), limit)
        row["of_attainable"] = round(row["msg_per_s"] / attainable, 3)
    row["loadavg"] = [[x["loadavg_before"], x["loadavg_after"]] for x in xs]
    row["errors"] = [x["error"] for x in xs if x.get("error")]
    row["unsteady"] = sum(1 for x in xs if x.get("unsteady"))
    row["order_backward"] = sum(x.get("order_backward") or 0 for x in xs)
    return row


def write_markdown(res: dict[str, Any], path: Path) -> None:
    fmt, spread_of = goals.fmt, goals.spread_of
    m, s = res["machine"], res["size_settings"]
    lock = res["lock"]
    L = [
        "# Scaling across instances",
        "",
        f"{res['started']} UTC, `{res['command']}`, {res['repeats']} repeat(s), {m.get('nproc')} cores "
        f"({m.get('cpu')}), {m.get('memory_gb')} GB, Python {m.get('python')}, librdkafka {m.get('librdkafka')}, "
        f"keyedconsumer: {res['engine']['engine']}.",
        "",
        f"Kafka `{res['brokers']}` ({res['broker_count']} brokers, topic of {s['partitions']} partitions, "
        f"replication factor {res['replication_factor']}), Redis `{res['redis_url']}`. "
        f"{s['messages']:,} records of {s['size']} B on {s['keys']:,} keys, produced once; handler: "
        f"{'`time.sleep`' if res['mode'] == 'sync' else '`asyncio.sleep`'}({s['sleep_ms']} ms) "
        f'({res["mode"]}); keyedconsumer `concurrency={s["concurrency"]}`, `ordering="key"`, '
        "`max_in_flight=10_000`; raw: one message at a time. Each run: N processes in a fresh group, "
        f"{s['settle_s']:g} s after every instance handled its first message, a {s['window_s']:g} s window"
        + (
            f"; the contenders run at nice {s['nice']} (the brokers and Redis at 0: they stand for "
            "machines of their own)."
            if s.get("nice")
            else "."
        ),
        "",
        (
            "Exclusive lock `{}` held for the runs (waited {} s).".format(lock["path"], lock["waited_s"])
            if lock["held"]
            else "**The exclusive lock `{}` was not obtained within {} s: the runs went on while others ran** "
            "(load average when asking {}, when giving up {}).".format(
                lock["path"],
                lock["waited_s"],
                lock.get("loadavg_when_asking"),
                lock.get("loadavg_when_giving_up"),
            )
        ),
        f"Load average at the start {m.get('loadavg_start')}, at the end {m.get('loadavg_end')}.",
        "",
        "msg/s, ratio to linear (msg/s / (N x the same repeat's 1-instance msg/s)) and the ratios: median over "
        "the comparable repeats (a run is comparable when the 1-minute load average before it was at most "
        f"the {NCPU} cores; `quiet` counts them: when none was, the median is over all, marked), min–max in "
        "brackets. W2: the I/O-bound handler above; W1: a no-op handler (the engine's own cost). "
        "keyedconsumer-procs: one `keyedconsumer run --processes N` (bench/procs_app.py), next to N separate "
        "instances (keyedconsumer); processes / instances: their ratio at the same N. CPU limit: this "
        f"machine's {NCPU} cores / the CPU seconds per message at N=1 of the instances, brokers and Redis "
        "(theirs only when started here), msg/s; of attainable: "
        "msg/s / min(linear, CPU limit), so a fall below linear past the CPU limit is the machine's. "
        "CPU over the window: CPU s / 1,000 msgs = the instances' CPU (user + sys; with the supervisor) / the "
        "messages they handled; cores busy: of the machine (/proc/stat, every process), of the instances, "
        "the Kafka brokers, the Redis nodes, and the rest (other).",
        "",
        "| workload | contender | N | msg/s | ideal | of ideal | ratio to linear | Redis / in-memory | "
        "processes / instances | CPU limit | of attainable | quiet | CPU s / 1,000 msgs | "
        "sys share | context switches / msg | machine cores busy | instances | brokers | Redis | other | "
        "loadavg (1 min) before → after |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
        "---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in res["summary"]:

        def sp(key: str, nd: int = 2, row: dict[str, Any] = row) -> str:
            return spread_of(row.get(key + "_all") or [], nd)

        name = {
            "raw": "raw",
            "keyedconsumer": "keyedconsumer in-memory",
            "keyedconsumer-redis": "keyedconsumer Redis Cluster",
            PROCS: "keyedconsumer-procs (in-memory)",
        }[row["contender"]]
        flags = (
            (" (unsteady)" if row["unsteady"] else "")
            + (" **error**" if row["errors"] else "")
            + (" (no quiet run: not comparable)" if not row.get("comparable_repeats", row["repeats"]) else "")
        )
        loads = ", ".join(f"{a[0] if a else '?'} → {b[0] if b else '?'}" for a, b in row["loadavg"])
        L.append(
            f"| {row.get('workload', 'w2').upper()} | {name}{flags} | {row['instances']} | {sp('msg_per_s', 0)} | "
            f"{fmt(row['ideal_msg_per_s'])} | "
            f"{sp('of_ideal')} | {sp('ratio_to_linear')} | {sp('ratio_to_in_memory')} | {sp('ratio_to_instances')} | "
            f"{fmt(row.get('cpu_limit_msg_per_s'))} | {fmt(row.get('of_attainable'), 2)} | "
            f"{row.get('comparable_repeats', row['repeats'])} / {row['repeats']} | "
            f"{sp('cpu_s_per_1000', 3)} | {sp('instances_sys_share')} | {sp('ctx_switches_per_msg', 1)} | "
            f"{sp('machine_cores_busy')} | {sp('instances_cores')} | "
            f"{sp('brokers_cores')} | {sp('redis_cores')} | {sp('other_cores')} | {loads} |"
        )
    L += [
        "",
        "## Runs",
        "",
        "| run | repeat | msg/s | window s | rate per second in the window (min–max) | all handling after s | "
        "CPU s / 1,000 msgs per instance | per-key order: gaps+repeats / repeats | notes |",
        "| --- | ---: | ---: | ---: | --- | ---: | --- | --- | --- |",
    ]
    for r in res["runs"]:
        rates = r.get("rate_per_second") or []
        per = ", ".join(fmt(x.get("cpu_s_per_1000"), 3) for x in r.get("per_instance", []))
        warn = ", ".join(f"{c} x {k}" for k, c in list((r.get("warnings") or {}).items())[:2])
        notes = "; ".join(
            [
                *r.get("notes", []),
                *(["unsteady window"] if r.get("unsteady") else []),
                *([f"warnings: {warn}"] if warn else []),
                *([f"error: {r['error'][:200]}"] if r.get("error") else []),
                *(
                    [f"drained: {r['drained']} (lag {r.get('lag_at_end')}, handled {r.get('handled_total')})"]
                    if "drained" in r
                    else []
                ),
            ]
        )
        L.append(
            f"| {r['id']} | {r['repeat'] + 1} | {fmt(r.get('msg_per_s'))} | {r.get('window_s')} | "
            f"{fmt(min(rates)) if rates else '–'}–{fmt(max(rates)) if rates else '–'} | {r.get('all_handling_s')} | "
            f"{per} | {r.get('order_violations')} / {r.get('order_backward')} | {notes} |"
        )
    L += [
        "",
        "Per-key order: each instance checks that a key's sequence numbers follow one another; a key "
        "that moved to this instance at a rebalance shows a gap (counted in the first figure), a "
        "redelivered or reordered message a repeat (the second).",
        "",
    ]
    path.write_text("\n".join(L))


# ------------------------------------------------------------------------------------------ main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=tuple(SIZES), default="full")
    ap.add_argument(
        "--instances", default=None, help="instance counts, e.g. 1,2,4,8 (1 is always run: the base)"
    )
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument(
        "--raw",
        choices=("all", "1", "none"),
        default=None,
        help="raw loop at every instance count, at 1 only, or not (default: all at full size)",
    )
    ap.add_argument("--mode", choices=("sync", "async"), default="sync", help="keyedconsumer's handler")
    ap.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="comparable (quiet) repeats wanted per run: rounds are repeated until each has them (default: 3 at full size)",
    )
    ap.add_argument(
        "--max-rounds", type=int, default=None, help="the cap on rounds while quiet repeats are missing"
    )
    ap.add_argument(
        "--quiet-wait-s",
        type=float,
        default=None,
        help="before each run, wait up to this long for the 1-minute load average to fall to the core count",
    )
    ap.add_argument(
        "--workloads", default=None, help="w1 (no-op handler), w2 (the I/O-bound one), comma-separated"
    )
    ap.add_argument(
        "--processes",
        default=None,
        help=f"N of the multi-process contender ({PROCS}: one keyedconsumer run --processes N), e.g. 1,2,4; "
        "empty: none",
    )
    ap.add_argument("--window-s", type=float, default=None)
    ap.add_argument(
        "--nice",
        type=int,
        default=None,
        help="niceness of the contenders' processes (default: 10 at full size, so that they never starve "
        "the brokers and Redis, which stand for machines of their own; 0 at the ci size)",
    )
    ap.add_argument(
        "--drain",
        action="store_true",
        help="after the window, run each instance count's group until it committed every offset of the "
        "topic, and record whether it did (lag_at_end, drained); at the full size a 1-instance run then "
        "takes ~10 minutes",
    )
    ap.add_argument(
        "--drain-at",
        default=None,
        help="drain only the runs of these instance counts, e.g. 16 (implies --drain for them); the "
        "other runs end with their window",
    )
    ap.add_argument(
        "--brokers", default=None, help="use these brokers (and --redis-url) instead of starting a cluster"
    )
    ap.add_argument("--redis-url", default=None)
    ap.add_argument("--run-dir", default="/tmp/kc-scaling-run", help="KC_RUN_DIR of the cluster started here")
    ap.add_argument("--kafka-base", type=int, default=29092)
    ap.add_argument("--redis-base", type=int, default=27000)
    ap.add_argument(
        "--keep-cluster", action="store_true", help="leave the cluster running (reused by the next run)"
    )
    ap.add_argument("--lock", default=None, help="take an exclusive flock on this file for the measured runs")
    ap.add_argument("--lock-wait-s", type=float, default=1200.0)
    ap.add_argument(
        "--engine",
        default="HEAD",
        help="the keyedconsumer commit the instances run (git archive), or 'worktree' (default: HEAD)",
    )
    ap.add_argument(
        "--profile",
        type=int,
        default=None,
        help="record instance 0 of the keyedconsumer runs of this many instances with py-spy "
        "(--gil) over the window: <out>/profile-scaling-*.top.txt (its sampling costs CPU: "
        "not for measured runs)",
    )
    ap.add_argument("--py-spy", default=str(bench.PEERS_PY.parent / "py-spy"))
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--seed", type=int, default=20261202)
    ap.add_argument(
        "--rerender",
        action="store_true",
        help="only rewrite <out>/scaling.md (and the runs' warnings, from <out>/tmp) from <out>/scaling.json",
    )
    args = ap.parse_args()
    if args.rerender:
        jp = args.out.resolve() / "scaling.json"
        old = json.loads(jp.read_text())
        for r in old["runs"]:
            work = jp.parent / "tmp" / "scaling" / r["group"]
            if "warnings" not in r and work.exists():
                r["warnings"] = warnings_of(work)
        old["summary"] = summarize(old["runs"], sorted({r["instances"] for r in old["runs"]}))
        jp.write_text(json.dumps(old, indent=1))
        write_markdown(old, jp.with_name("scaling.md"))
        return 0
    size = SIZES[args.size]
    if args.window_s:
        size = dict(size, window_s=args.window_s)
    if args.drain:
        size = dict(size, drain=True)
    if args.nice is not None:
        size = dict(size, nice=args.nice)
    if args.drain_at:
        size = dict(size, drain=True, drain_at=sorted({int(x) for x in args.drain_at.split(",") if x}))
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    inst_counts = sorted({1, *(int(x) for x in (args.instances or size["instances"]).split(","))})
    counts = inst_counts
    contenders = [c for c in CONTENDERS if c in args.contenders.split(",")]
    raw = args.raw or size["raw"]
    repeats = args.repeats or size["repeats"]
    max_rounds = max(repeats, args.max_rounds or size["max_rounds"])
    workloads = [w for w in WORKLOADS if w in (args.workloads or size["workloads"]).split(",")][::-1]
    procs = sorted(
        {int(x) for x in (size["processes"] if args.processes is None else args.processes).split(",") if x}
    )
    if procs and PROCS in contenders:
        counts = sorted({*counts, *procs, 1})
    plan = [
        (wl, c, n)
        for wl in workloads
        for n in counts
        for c in contenders
        if (c != PROCS or n in procs)
        and (c != "raw" or raw == "all" or (raw == "1" and n == 1))
        and (wl == "w2" or c in W1_CONTENDERS)
        and (c == PROCS or n in inst_counts)
    ]
    svc = Services(args)
    started = dt.datetime.now(dt.timezone.utc)
    svc.up()
    topic = f"bench-scaling-{uuid.uuid4().hex[:8]}"
    runs: list[dict[str, Any]] = []
    res: dict[str, Any] = {
        "schema": 1,
        "size": args.size,
        "size_settings": size,
        "repeats": repeats,
        "mode": args.mode,
        "started": started.strftime("%Y-%m-%d %H:%M"),
        "command": " ".join(["bench/scaling.py", *sys.argv[1:]]),
        "brokers": svc.brokers,
        "redis_url": svc.redis_url,
        "machine": bench.machine_info(None),
        "runs": runs,
        "engine": engine_source(args),
    }
    lock_f = None
    failed = False
    try:
        nb = broker_count(svc.brokers)
        rf = min(3, nb)
        res.update(broker_count=nb, replication_factor=rf, topic=topic)
        bench.create_topic(svc.brokers, topic, size["partitions"], rf)
        key_ids = bench.keys_for(size, random.Random(args.seed))
        log(
            f"producing {size['messages']:,} x {size['size']} B to {topic} ({size['partitions']} partitions, RF {rf})"
        )
        meta = bench.produce(svc.brokers, topic, size, key_ids)
        meta["topic"] = topic
        if bench.end_offsets(svc.brokers, topic, size["partitions"]) != size["messages"]:
            raise RuntimeError(f"{topic} does not hold {size['messages']} records")
        res["produce_s"] = meta["produce_s"]
        if args.lock:
            log(f"waiting for an exclusive lock on {args.lock} (up to {args.lock_wait_s:g} s)")
            lock_f, res["lock"] = take_lock(args.lock, args.lock_wait_s)
            log(f"lock: {res['lock']}")
        else:
            res["lock"] = {"path": None, "held": False, "waited_s": 0}
        res["machine"]["loadavg_start"] = bench.loadavg()
        quiet: dict[tuple[str, str, int], int] = {}
        for rep in range(max_rounds):
            todo = [run for run in plan if quiet.get(run, 0) < repeats]
            if not todo:
                break
            for run in todo:
                r = run_config(args, size, svc, meta, run, rep)
                quiet[run] = quiet.get(run, 0) + (1 if r["comparable"] else 0)
                runs.append(r)
                res["summary"] = summarize(runs, counts)
                log(
                    f"r{rep + 1}/{max_rounds} {r['id']:30s} {bench.fmt(r.get('msg_per_s')):>8} msg/s "
                    f"(ideal {bench.fmt(r['ideal_msg_per_s'])}, x{bench.fmt(r.get('ratio_to_linear'), 2)} linear) "
                    f"cpu/1k {bench.fmt(r.get('cpu_s_per_1000'), 3)} s, machine {bench.fmt(r['cpu'].get('machine_cores_busy'), 2)} "
                    f"cores (inst {bench.fmt(r['cpu'].get('instances_cores'), 2)}, brokers "
                    f"{bench.fmt(r['cpu'].get('brokers_cores'), 2)}, redis {bench.fmt(r['cpu'].get('redis_cores'), 2)}) "
                    f"load {r['loadavg_before'][:1]}->{r['loadavg_after'][:1]} ({r['wall_s']} s) "
                    f"{'; '.join(r['notes'])} {r.get('error') or ''}"[:600]
                )
                if r.get("error") or r.get("drained") is False:
                    failed = True
                if r["contender"] != "raw" and r.get("order_backward") and r.get("drained") is not None:
                    failed = True
                res["machine"]["loadavg_end"] = bench.loadavg()
                (args.out / "scaling.json").write_text(json.dumps(res, indent=1))
    finally:
        if lock_f is not None:
            lock_f.close()
        bench.delete_topics(svc.brokers, [topic])
        svc.down()
    res["machine"]["loadavg_end"] = bench.loadavg()
    res["summary"] = summarize(runs, counts)
    (args.out / "scaling.json").write_text(json.dumps(res, indent=1))
    write_markdown(res, args.out / "scaling.md")
    log(f"wrote {args.out / 'scaling.json'} and {args.out / 'scaling.md'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
