"""The fault-injection run (issue 6): one command, bounded in time, stopping by itself.

    python -m tests.faults.run --size ci|full --seed N [--bug NAME] [--faults all|kills|stops|redis]
                               [--park] [--cluster] --out DIR

1. Starts its own Kafka 4.1 (KRaft) and Redis with ``scripts/services`` (own run dir, own ports;
   the shared 9092/6379 are never touched), creates a 12-partition topic and its dead-letter topic.
2. Produces 60 % of the seeded plan as a backlog (idempotent, ``acks=all``, every ack logged).
3. Starts 3 consumer processes (``tests/faults/consumer.py``) and the steady producer of the rest.
4. Runs the seeded fault schedule, logging each fault: SIGKILL / SIGTERM / SIGSTOP+SIGCONT of a
   consumer every U(a, b) s (killed and terminated consumers restart after 1-5 s), a SIGKILL of
   Redis (restarted 2 s later), a fourth consumer that joins and later leaves, a SIGKILL of the
   broker (restarted 2 s later). Meanwhile committed offsets are sampled every 250 ms (AdminClient)
   and consumer RSS and Redis memory every second.
5. Stops the faults, waits until the producer is done and the group's lag is 0 (with ``--park``, also
   until no key is parked), SIGTERMs everything,
   records the end state (end offsets, final commits, dead-letter records, Redis keys left), stops
   its services, and runs the checker (``tests/faults/checker.py``), whose exit code it returns.

``--cluster`` (root): 3 brokers and a Redis Cluster instead of the single broker and Redis, each
consumer slot on a host of its own (a network namespace, :mod:`tests.faults.hosted`), and the
schedule gains a SIGKILL of the broker leading the most partitions, of a Redis master (after its
failover, it rejoins as a replica) and a host cut off for longer than the lease TTL and the session
timeout (tests/faults/README.md, "Cluster run").

``--bug`` plants a deliberate bug in the consumers (:mod:`tests.faults.bugs`) for the negative
controls: ``commit_on_poll``, ``skip_fencing``; ``no_aof`` runs Redis without AOF
(``require_durable=False``) and turns parking on. ``--faults kills|stops|redis`` (the default for a
``--bug``) replaces the seeded schedule by one *targeted* fault, landed at a known point of one
message flagged ``hold``, so that a planted bug's effect is certain, not a matter of timing:

- ``kills``: the hold message sleeps in its handler; once a commit sample is past its offset, its
  process is SIGKILLed. With ``commit_on_poll`` the message is committed while it runs, so it is
  lost (check 1) and a commit was ahead of it (check 3), every time; the engine never commits past
  it, so the kill only re-runs it.
- ``stops``: the hold message's process is SIGSTOPped while the message runs (for less than the
  session timeout, so it keeps its partitions); once the key's lease has expired the orchestrator
  takes the lease over as another instance would (a higher fencing token and a fenced write), then
  SIGCONTs the process, and later releases the lease. The late write is refused; with
  ``skip_fencing`` the run counts anyway and the message is lost (check 1), every time; the engine
  runs it again under a new lease.
- ``redis``: the hold message is parked in Redis with a long back-off; once a commit sample is past
  its offset, Redis is SIGKILLed and restarted. Without AOF (``no_aof``) the parked message is gone
  (check 1), every time; with AOF it runs when due.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from keyedconsumer.sequencing.store import connect

from . import checker
from .common import HOLD, REPO, SIZES, Size, plan
from .hosted import ClusterServices, used_memory
from .services import Services, pick_ports

BUGS = ("commit_on_poll", "skip_fencing", "no_aof")
PY = sys.executable


def ns() -> int:
    return time.monotonic_ns()


class Interrupted(Exception):
    pass


# ------------------------------------------------------------------------------------------- plan
def fault_schedule(
    size: Size, seed: int, faults: str, window_s: float, cluster: bool = False
) -> list[tuple[float, str]]:
    """``[(seconds after the consumers started, kind)]``, sorted. Kinds: ``kill``, ``term``,
    ``stop`` (a consumer), ``join``, ``leave``, ``redis``, ``kafka``; with ``cluster``, also ``cut``
    (a consumer's host off the network, with no consumer fault from 12 s before it until 3 s after
    its heal), and at the full size a second ``cut``, ``redis`` and ``kafka``."""
    rng = random.Random(f"faults-{seed}")
    out: list[tuple[float, str]] = []
    lo, hi = size.consumer_fault_every_s
    if faults == "all":
        kinds: list[str] = []
        t = rng.uniform(lo, hi) * 0.5
        while t < window_s - 8:
            if not kinds:
                kinds = ["kill", "term", "stop"]
                rng.shuffle(kinds)
            out.append((t, kinds.pop()))
            t += rng.uniform(lo, hi)
        out.append((rng.uniform(0.12, 0.22) * window_s, "join"))
        out.append((rng.uniform(0.50, 0.60) * window_s, "leave"))
        out.append((rng.uniform(0.30, 0.42) * window_s, "redis"))
        out.append((rng.uniform(0.64, 0.74) * window_s, "kafka"))
        if cluster:  # the first cut while the backlog runs: its victim has runs in progress
            cuts = [rng.uniform(0.10, 0.14) * window_s]
            if window_s >= 200:  # the full size: a second cut, Redis master and broker
                cuts.append(rng.uniform(0.44, 0.48) * window_s)
                out += [
                    (rng.uniform(0.78, 0.81) * window_s, "redis"),
                    (rng.uniform(0.86, 0.89) * window_s, "kafka"),
                ]
            # no consumer fault from shortly before a cut until after its heal: the others take over
            quiet = [(c - 12.0, c + size.cut_s[1] + 3.0) for c in cuts]
            out = [
                (t, k)
                for t, k in out
                if k not in ("kill", "term", "stop") or not any(a <= t <= b for a, b in quiet)
            ]
            out += [(c, "cut") for c in cuts]
    elif faults not in TARGETED:
        raise ValueError(f"unknown --faults {faults!r}")
    return sorted(out)  # a targeted run's one fault is landed by Run.targeted(), not by the clock


#: Targeted runs: ``{faults: (seconds the hold message is held, session.timeout.ms)}``. ``stops``
#: pauses a process for about one lease TTL: the session timeout is far above that, so the paused
#: process certainly keeps its partitions.
TARGETED = {"kills": (120.0, None), "stops": (4.0, 20_000), "redis": (25.0, None)}
#: The hold message's index in the plan (an early backlog message).
HOLD_INDEX = 300
#: How long a targeted run waits for each condition before it gives up (the fault is then not landed
#: where it should be, and the run says so in faults.log).
TARGET_WAIT_S = 30.0
#: How long a host cut (cluster runs) waits for a consumer that has partitions before it is skipped.
CUT_WAIT_S = 60.0
#: How long a targeted run waits for a commit past the hold message before it lands its fault anyway.
#: With auto.commit.interval.ms 1000 a commit sample shows a stored offset within about 1.5 s.
COMMIT_WAIT_S = 10.0


# -------------------------------------------------------------------------------------- processes
class Proc:
    def __init__(self, role: str, popen: subprocess.Popen[bytes]) -> None:
        self.role = role
        self.popen = popen
        self.pid = popen.pid
        self.stopped = False
        self.isolated = False  # its host is cut off (cluster runs)
        self.expect_exit = False
        self.exited_ns: int | None = None


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cluster = bool(args.cluster)
        self.size = SIZES[f"cluster-{args.size}" if self.cluster else args.size]
        self.out: Path = args.out.resolve()
        self.bug: str = args.bug or ""
        self.faults: str = args.faults or {
            "commit_on_poll": "kills",
            "skip_fencing": "stops",
            "no_aof": "redis",
        }.get(self.bug, "all")
        targeted = self.faults != "all"
        self.window_s = 45.0 if targeted else self.size.fault_window_s
        self.stop_s = self.size.stop_s
        self.park = bool(args.park or self.bug == "no_aof")
        self.flog_lock = threading.Lock()
        self.timers: list[tuple[float, int, str, Any]] = []
        self.tseq = itertools.count()
        self.procs: dict[str, Proc] = {}  # slot -> current process
        self.all_procs: list[Proc] = []
        self.stop_samplers = threading.Event()
        self.svc_queue: list[tuple[str, Callable[[], None]]] = []
        self.svc_cv = threading.Condition()
        self.svc_busy = False
        self.unexpected = 0
        self.cutting = False  # a host is cut off, or a cut waits for its victim (cluster runs)
        self.sampler: subprocess.Popen[bytes] | None = None

    # -- logging --------------------------------------------------------------------------------
    def flog(self, kind: str, pid: int | str = "-", detail: str = "-") -> None:
        with self.flog_lock:
            with open(self.out / "faults.log", "a") as f:
                f.write(f"{ns()} {kind} {pid} {detail}\n")

    def say(self, text: str) -> None:
        print(f"[faults {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)

    # -- setup ----------------------------------------------------------------------------------
    def setup(self) -> None:
        if self.out.exists() and any(self.out.iterdir()):
            raise SystemExit(f"--out {self.out} is not empty")
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "events").mkdir()
        (self.out / "logs").mkdir()
        self.svc_dir = Path(tempfile.mkdtemp(prefix="kc-faults-"))
        self.svc: Services | ClusterServices
        if self.cluster:
            if self.bug or self.args.faults not in (None, "all"):
                raise SystemExit("--cluster runs the seeded schedule only (no --bug, no targeted --faults)")
            ports: tuple[int, ...] = ()
            self.svc = ClusterServices(self.svc_dir, os.getpid(), self.flog)
        else:
            ports = pick_ports((self.args.kafka_port, self.args.kafka_port + 1, self.args.redis_port))
            self.svc = Services(self.svc_dir, ports, durable_redis=self.bug != "no_aof")
        tag = uuid.uuid4().hex[:8]
        self.topic = f"faults-{self.args.seed}-{tag}"
        hold_index = HOLD_INDEX if self.faults in TARGETED else None
        msgs = plan(self.size, self.args.seed, hold_index)
        backlog = int(len(msgs) * self.size.backlog_share)
        self.cfg: dict[str, Any] = {
            "size": self.size.name,
            "seed": self.args.seed,
            "bug": self.bug or None,
            "faults": self.faults,
            "park": self.park,
            "nondurable_redis": self.bug == "no_aof",
            "harness_skip_fencing": bool(self.args.harness_skip_fencing),
            "bootstrap": self.svc.bootstrap,
            "redis_url": self.svc.redis_url,
            "services_dir": str(self.svc_dir),
            "ports": list(ports),
            "topic": self.topic,
            "dlq_topic": f"{self.topic}.dlq",
            "group": f"g-{tag}",
            "namespace": f"f{tag}",
            "partitions": self.size.partitions,
            "messages": len(msgs),
            "backlog": backlog,
            "window_s": self.window_s,
            "steady_s": max(5.0, self.window_s - 6.0),
            "schedule": fault_schedule(self.size, self.args.seed, self.faults, self.window_s, self.cluster),
            "size_params": {k: v for k, v in vars(self.size).items()},
        }
        if isinstance(self.svc, ClusterServices):
            self.cfg.update(self.svc.describe())
        if hold_index is not None:
            hold_s, session_ms = TARGETED[self.faults]
            self.cfg["hold_index"] = hold_index
            self.cfg["hold"] = {"mode": self.faults, "hold_s": hold_s}
            if session_ms:
                self.cfg["session_timeout_ms"] = session_ms
        self.write_cfg()
        watchdog = self.spawn(
            ["tests.faults.watchdog", str(os.getpid()), str(self.out)], "watchdog.err", new_session=True
        )
        self.flog("watchdog", watchdog.pid)

    def stop_sampler(self) -> None:
        s = self.sampler
        if s is not None and s.poll() is None:
            s.terminate()
            try:
                s.wait(10)
            except subprocess.TimeoutExpired:
                s.kill()
                s.wait(5)

    def write_cfg(self) -> None:
        (self.out / "run.json").write_text(json.dumps(self.cfg, indent=1, default=list))

    def start_services(self) -> None:
        self.say(f"services: Kafka {self.svc.bootstrap}, Redis {self.svc.redis_url}, dir {self.svc_dir}")
        self.svc.up()
        self.flog("services_up")
        admin = AdminClient({"bootstrap.servers": self.svc.bootstrap})
        # the brokers' default replication: 1 on the single broker, 3 on the cluster
        fs = admin.create_topics(
            [NewTopic(self.topic, self.size.partitions), NewTopic(self.cfg["dlq_topic"], 1)]
        )
        for f in fs.values():
            f.result(60)

    # -- the service worker (scripts/services calls, one at a time, off the main loop) ----------
    def svc_worker(self) -> None:
        while True:
            with self.svc_cv:
                while not self.svc_queue:
                    self.svc_busy = False
                    self.svc_cv.notify_all()
                    self.svc_cv.wait()
                self.svc_busy = True
                name, fn = self.svc_queue.pop(0)
            if name == "quit":
                with self.svc_cv:
                    self.svc_busy = False
                    self.svc_cv.notify_all()
                return
            try:
                fn()
            except Exception as exc:  # reported, and the end checks will show the consequences
                self.say(f"service action {name} failed: {exc}")
                self.flog("service_error", "-", name)

    def svc_do(self, name: str, fn: Callable[[], None]) -> None:
        with self.svc_cv:
            self.svc_queue.append((name, fn))
            self.svc_busy = True
            self.svc_cv.notify_all()

    def svc_wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self.svc_cv:
            while (self.svc_queue or self.svc_busy) and time.monotonic() < deadline:
                self.svc_cv.wait(0.5)

    # -- samplers -------------------------------------------------------------------------------
    def spawn(
        self,
        argv: list[str],
        log_name: str,
        env: dict[str, str] | None = None,
        new_session: bool = False,
        prefix: tuple[str, ...] = (),
    ) -> subprocess.Popen[bytes]:
        """Start a harness program (listed in pids.txt for the watchdog); ``prefix`` runs it on a
        host (``ip netns exec NS``, which execs it: the pid is the program's)."""
        with open(self.out / "logs" / log_name, "ab") as err:
            popen = subprocess.Popen(
                [*prefix, PY, "-m", *argv],
                cwd=REPO,
                env=env,
                stdout=err,
                stderr=err,
                start_new_session=new_session,
            )
        with open(self.out / "pids.txt", "a") as f:
            f.write(f"{popen.pid}\n")
        return popen

    def start_sampler(self) -> None:
        self.sampler = self.spawn(["tests.faults.sampler", str(self.out)], "sampler.err")
        self.flog("sampler", self.sampler.pid)

    def last_commit(self) -> dict[int, int]:
        """The latest committed offsets the sampler saw."""
        try:
            with open(self.out / "commits.log", "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 8192))
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return {}
        for line in reversed(lines[1:] or lines):
            x = line.split()
            if len(x) >= 3 and x[2] != "ERR":
                return (
                    {int(a): int(b) for a, b in (i.split(":") for i in x[2].split(","))}
                    if x[2] != "-"
                    else {}
                )
        return {}

    def sample_resources(self) -> None:
        r = connect(self.svc.redis_url, 0.5)
        with open(self.out / "resources.log", "a", buffering=1) as f:
            while not self.stop_samplers.wait(1.0):
                rss = []
                for p in list(self.procs.values()):
                    if p.exited_ns is None:
                        try:
                            for line in Path(f"/proc/{p.pid}/status").read_text().splitlines():
                                if line.startswith("VmRSS:"):
                                    rss.append(f"{p.pid}:{line.split()[1]}")
                        except OSError:
                            pass
                f.write(f"{ns()} rss {','.join(rss) or '-'}\n")
                try:
                    f.write(f"{ns()} redis {used_memory(r)}\n")
                except Exception:
                    f.write(f"{ns()} redis ERR\n")

    # -- consumers ------------------------------------------------------------------------------
    def start_consumer(self, slot: str, role: str = "base") -> Proc:
        prefix = tuple(self.svc.exec_prefix(slot)) if isinstance(self.svc, ClusterServices) else ()
        popen = self.spawn(
            ["tests.faults.consumer", str(self.out)],
            f"consumer-{slot}-{time.monotonic_ns()}.err",
            None,
            new_session=True,
            prefix=prefix,
        )
        p = Proc(role, popen)
        self.procs[slot] = p
        self.all_procs.append(p)
        self.flog("join" if role == "joiner" else "start", p.pid, slot)
        return p

    def signal(self, p: Proc, sig: signal.Signals) -> None:
        try:
            os.kill(p.pid, sig)
        except ProcessLookupError:
            pass

    def at(self, delay_s: float, action: str, arg: Any = None) -> None:
        heapq.heappush(self.timers, (time.monotonic() + delay_s, next(self.tseq), action, arg))

    def assigned(self, p: Proc) -> bool:
        """Whether the consumer's last recorded assignment (its ``A`` records) is non-empty."""
        try:
            data = (self.out / "events" / f"{p.pid}.log").read_bytes()
        except OSError:
            return False
        i = data.rfind(b"\nA ")
        if i < 0:
            return False
        return not data[i + 1 :].split(b"\n", 1)[0].endswith(b" -")

    def running_now(self, p: Proc) -> bool:
        """Whether the consumer has a handler run in progress (a start record without its end, in
        the tail of its events)."""
        try:
            with open(self.out / "events" / f"{p.pid}.log", "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 16384))
                lines = f.read().decode(errors="replace").splitlines()[1:]
        except OSError:
            return False
        open_runs: set[tuple[str, str]] = set()
        for line in lines:
            x = line.split()
            if len(x) > 3 and x[0] == "S":
                open_runs.add((x[2], x[3]))
            elif len(x) > 3 and x[0] in ("E", "X"):
                open_runs.discard((x[2], x[3]))
        return bool(open_runs)

    def victim(
        self, rng: random.Random, busy_only: bool = False, running: bool = False
    ) -> tuple[str, Proc] | None:
        """A live base consumer, preferring one that has partitions (a fault on an idle member
        proves little); with ``busy_only``, only one that has partitions; with ``running`` too, only
        one with a handler run in progress."""
        live = [
            (s, p)
            for s, p in sorted(self.procs.items())
            if s.startswith("c")
            and p.exited_ns is None
            and not p.stopped
            and not p.isolated
            and not p.expect_exit
        ]
        busy = [(s, p) for s, p in live if self.assigned(p) and (not running or self.running_now(p))]
        if busy_only:
            return rng.choice(busy) if busy else None
        return rng.choice(busy or live) if live else None

    def do(self, action: str, arg: Any, rng: random.Random) -> None:
        if action in ("kill", "term", "stop") and self.cutting:  # the others take over the cut host's work
            self.say(f"{action}: a host is cut off, skipped")
            self.flog("skipped", "-", action)
        elif action in ("kill", "term", "stop"):
            v = self.victim(rng)
            if v is None:
                self.say(f"{action}: no live consumer, skipped")
                self.flog("skipped", "-", action)
                return
            slot, p = v
            if action == "kill":
                p.expect_exit = True
                self.signal(p, signal.SIGKILL)
                self.flog("kill", p.pid, slot)
                self.at(rng.uniform(*self.size.restart_after_s), "restart", slot)
            elif action == "term":
                p.expect_exit = True
                self.signal(p, signal.SIGTERM)
                self.flog("term", p.pid, slot)
            else:
                p.stopped = True
                self.signal(p, signal.SIGSTOP)
                self.flog("stop", p.pid, slot)
                self.at(rng.uniform(*self.stop_s), "cont", p)
            self.say(f"{action} {slot} (pid {p.pid})")
        elif action == "cont":
            p = arg
            self.signal(p, signal.SIGCONT)
            p.stopped = False
            self.flog("cont", p.pid)
            self.say(f"cont pid {p.pid}")
        elif action == "cut" and isinstance(self.svc, ClusterServices):
            # a cut waits (at most CUT_WAIT_S) for a consumer with partitions, preferably (the first
            # half of that time) one with a run in progress: that run's write comes after the heal
            first = time.monotonic() if arg is None else float(arg)
            waited = time.monotonic() - first
            self.cutting = True
            v = self.victim(rng, busy_only=True, running=waited < CUT_WAIT_S / 2)
            if v is None:
                if waited < CUT_WAIT_S:
                    self.at(0.05, "cut", first)
                else:
                    self.cutting = False
                    self.say("cut: no consumer with partitions, skipped")
                    self.flog("skipped", "-", action)
                return
            slot, p = v
            p.isolated = True
            if waited >= 0.1:
                self.flog("cut_waited", "-", f"{waited:.1f}s")
            self.flog("cut", p.pid, slot)  # logged before the cut: the window covers it
            self.svc.cut(slot)
            self.at(rng.uniform(*self.size.cut_s), "heal", (slot, p))
            self.say(f"cut {slot}'s host (pid {p.pid})")
        elif action == "heal" and isinstance(self.svc, ClusterServices):
            slot, p = arg
            self.svc.heal(slot)
            p.isolated = False
            self.cutting = False
            self.flog("heal", p.pid, slot)  # logged after the heal
            self.say(f"heal {slot}'s host (pid {p.pid})")
        elif action == "restart":
            if self.procs.get(arg) is None or self.procs[arg].exited_ns is not None:
                p = self.start_consumer(arg)
                self.say(f"restart {arg} (pid {p.pid})")
        elif action == "join":
            p = self.start_consumer("j4", "joiner")
            self.say(f"join (pid {p.pid})")
        elif action == "leave":
            p4 = self.procs.get("j4")
            if p4 is not None and p4.exited_ns is None:
                p4.expect_exit = True
                self.signal(p4, signal.SIGCONT)
                self.signal(p4, signal.SIGTERM)
                self.flog("leave", p4.pid)
                self.say(f"leave (pid {p4.pid})")
        elif action == "redis":

            def redis_fault() -> None:
                self.flog("redis_kill")
                self.svc.redis_kill()
                self.flog("redis_down")
                time.sleep(self.size.redis_down_s)
                self.svc.redis_start()
                self.flog("redis_up")

            self.svc_do("redis", redis_fault)
            self.say("redis kill")
        elif action == "kafka":

            def kafka_fault() -> None:
                self.flog("kafka_kill")
                self.svc.kafka_kill()
                self.flog("kafka_down")
                time.sleep(self.size.kafka_down_s)
                self.svc.kafka_start()
                self.flog("kafka_up")

            self.svc_do("kafka", kafka_fault)
            self.say("kafka kill")

    def reap(self) -> None:
        """Notice exits; restart consumers that were terminated (1-5 s later) or died unexpectedly,
        and the sampler if it died."""
        if self.sampler is not None and self.sampler.poll() is not None and not self.stop_samplers.is_set():
            self.flog("sampler_exit", self.sampler.pid, str(self.sampler.returncode))
            self.say(f"commit sampler exited with {self.sampler.returncode}; restarted")
            self.start_sampler()
        for slot, p in list(self.procs.items()):
            if p.exited_ns is not None:
                continue
            rc = p.popen.poll()
            if rc is None:
                continue
            p.exited_ns = ns()
            expected = p.expect_exit
            self.flog("exit", p.pid, f"{rc}:{'expected' if expected else 'unexpected'}")
            if not expected:
                self.unexpected += 1
                self.say(f"consumer {slot} (pid {p.pid}) exited unexpectedly with {rc}")
            if self.in_faults and slot.startswith("c"):
                if expected and rc != -signal.SIGKILL:  # SIGTERM'd: restart 1-5 s after it left
                    self.at(self.rng.uniform(*self.size.restart_after_s), "restart", slot)
                elif not expected:
                    self.at(1.0, "restart", slot)

    def loop_until(self, end: float, pred: Callable[[], bool] | None = None) -> bool:
        while time.monotonic() < end:
            now = time.monotonic()
            while self.timers and self.timers[0][0] <= now:
                _, _, action, arg = heapq.heappop(self.timers)
                if self.in_faults or action in ("cont", "restart", "heal"):
                    self.do(action, arg, self.rng)
            self.reap()
            if self.scenario is not None and self.in_faults:
                try:
                    next(self.scenario)
                except StopIteration:
                    self.scenario = None
            if pred is not None and pred():
                return True
            time.sleep(0.02 if self.scenario is not None else 0.05)
        return False

    # -- the targeted runs (one fault landed at a known point of the hold message) ---------------
    def hold_record(self) -> tuple[int, int, str, int]:
        """``(partition, offset, key, seq)`` of the hold message (read from the backlog's acks)."""
        for line in (self.out / "acks-backlog.log").read_text().splitlines():
            p, o, key, seq, _id, flag, _t = line.split()
            if flag == HOLD:
                return int(p), int(o), key, int(seq)
        raise RuntimeError("the hold message was not acknowledged by the broker")

    def find_event(self, kind: str, partition: int, offset: int) -> int | None:
        """The pid of the first ``kind`` record (``S``, ``K`` ...) of ``(partition, offset)``."""
        want = f"{kind} "
        for f in sorted((self.out / "events").glob("*.log")):
            for line in f.read_text(errors="replace").splitlines():
                if line.startswith(want):
                    x = line.split()
                    if int(x[2]) == partition and int(x[3]) == offset:
                        return int(x[1])
        return None

    def wait_for(self, what: str, cond: Callable[[], Any], timeout_s: float = TARGET_WAIT_S) -> Any:
        """Yield until ``cond()`` is truthy (then return it) or ``timeout_s`` passes (then None)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = cond()
            if value:
                return value
            yield
        self.say(f"targeted run: gave up waiting for {what}")
        self.flog("target_timeout", "-", what.replace(" ", "_"))
        return None

    def proc_of(self, pid: int) -> Proc | None:
        return next((p for p in self.all_procs if p.pid == pid), None)

    def targeted(self) -> Any:
        """The one fault of a targeted run (a generator stepped by :meth:`loop_until`)."""
        part, off, key, seq = self.hold_record()
        self.flog("hold", "-", f"{part}:{off}:{key}")
        self.say(f"hold message {key}#{seq} at partition {part} offset {off}")
        committed_past = lambda: self.last_commit().get(part, -1) > off  # noqa: E731
        if self.faults == "kills":
            pid = yield from self.wait_for(
                "the hold message to start", lambda: self.find_event("S", part, off)
            )
            if pid is None:
                return
            # the engine never commits past a running message: then the kill lands after COMMIT_WAIT_S
            yield from self.wait_for("a commit past the hold message", committed_past, COMMIT_WAIT_S)
            p = self.proc_of(pid)
            if p is not None and p.exited_ns is None:
                p.expect_exit = True
                self.signal(p, signal.SIGKILL)
                self.flog("kill", p.pid, "hold")
                self.say(f"kill pid {pid} (running the hold message)")
                self.at(
                    self.rng.uniform(*self.size.restart_after_s),
                    "restart",
                    next(s for s, q in self.procs.items() if q is p),
                )
        elif self.faults == "redis":
            if (
                yield from self.wait_for(
                    "the hold message to be parked", lambda: self.find_event("K", part, off)
                )
            ) is None:
                return
            yield from self.wait_for("a commit past the parked hold message", committed_past, COMMIT_WAIT_S)
            self.do("redis", None, self.rng)
        elif self.faults == "stops":
            yield from self.stop_and_take_over(part, off, key, seq)

    def stop_and_take_over(self, part: int, off: int, key: str, seq: int) -> Any:
        from keyedconsumer.sequencing import keys

        pid = yield from self.wait_for("the hold message to start", lambda: self.find_event("S", part, off))
        p = self.proc_of(pid) if pid is not None else None
        if p is None or p.exited_ns is not None:
            return
        p.stopped = True
        self.signal(p, signal.SIGSTOP)
        self.flog("stop", p.pid, "hold")
        self.say(f"stop pid {pid} (running the hold message)")
        from keyedconsumer.sequencing.store import LeaseStore

        r = connect(self.svc.redis_url, 2)
        ns_ = self.cfg["namespace"]
        lid = keys.lease_id(key.encode(), self.topic, part)
        store = LeaseStore(self.svc.redis_url, ns_, 2.0)  # the sequencer's own scripts: its tokens
        owner = f"harness-takeover-{uuid.uuid4().hex[:8]}"
        token = 0

        def take_over() -> bool:  # what another instance does once the lease expired
            nonlocal token
            got = store.acquire([(lid, owner)], 60_000)[0][0]
            if got <= 0:
                return False
            token = got
            r.hset(f"ext:{ns_}:{key}", mapping={"token": token, "seq": seq})  # its fenced write
            r.hincrby(f"ext:{ns_}:{key}", "ver", 1)
            return True

        took = yield from self.wait_for("the stopped process's lease to expire", take_over)
        self.flog("takeover", "-", f"{key}:{token}" if took else "none")
        self.say(f"took the lease of {key} over with fencing token {token}")
        p.stopped = False
        self.signal(p, signal.SIGCONT)
        self.flog("cont", p.pid)
        end = time.monotonic() + 3.0  # the resumed process's late write is refused meanwhile
        while time.monotonic() < end:
            yield
        store.release([(lid, owner)])
        store.close()
        self.flog("takeover_released", "-", key)

    # -- end state ------------------------------------------------------------------------------
    def end_offsets(self) -> dict[int, int]:
        c = Consumer(
            {"bootstrap.servers": self.svc.bootstrap, "group.id": f"probe-{uuid.uuid4().hex}", "log_level": 0}
        )
        try:
            return {
                p: c.get_watermark_offsets(TopicPartition(self.topic, p), timeout=10)[1]
                for p in range(self.size.partitions)
            }
        finally:
            c.close()

    def retried(self, what: str, fn: Callable[[], dict[int, int]], timeout_s: float = 60.0) -> dict[int, int]:
        """``fn()``, tried again for ``timeout_s`` while it fails: just after a broker restart the
        group's coordinator answers ``COORDINATOR_LOAD_IN_PROGRESS`` for a while."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return fn()
            except Exception as exc:
                if time.monotonic() > deadline:
                    raise
                self.say(f"{what}: {exc}; trying again")
                time.sleep(1.0)

    def committed_now(self) -> dict[int, int]:
        from confluent_kafka import ConsumerGroupTopicPartitions

        admin = AdminClient({"bootstrap.servers": self.svc.bootstrap})
        req = [
            ConsumerGroupTopicPartitions(
                self.cfg["group"], [TopicPartition(self.topic, p) for p in range(self.size.partitions)]
            )
        ]
        res = admin.list_consumer_group_offsets(req, request_timeout=10)[self.cfg["group"]].result(15)
        return {tp.partition: tp.offset for tp in res.topic_partitions if tp.offset >= 0}

    def dump_dlq(self) -> int:
        topic = self.cfg["dlq_topic"]
        c = Consumer(
            {
                "bootstrap.servers": self.svc.bootstrap,
                "group.id": f"dlq-{uuid.uuid4().hex}",
                "enable.auto.commit": False,
                "log_level": 0,
            }
        )
        n = 0
        try:
            high = c.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)[1]
            c.assign([TopicPartition(topic, 0, 0)])
            with open(self.out / "dlq.log", "w") as f:
                deadline = time.monotonic() + 60
                while n < high and time.monotonic() < deadline:
                    for m in c.consume(500, 1.0):
                        if m.error() is not None:
                            continue
                        h = {k: (v or b"").decode() for k, v in (m.headers() or [])}
                        f.write(
                            f"{h.get('kafka_dlt-original-partition')} {h.get('kafka_dlt-original-offset')} "
                            f"{(m.key() or b'-').decode()} {h.get('kafka_dlt-attempts')}\n"
                        )
                        n += 1
        finally:
            c.close()
        return n

    def parked_left(self) -> int:
        """Keys parked or messages scheduled in the namespace now (-1: Redis did not answer)."""
        import redis

        nsp = self.cfg["namespace"]
        try:
            r = connect(self.svc.redis_url, 2)
            return int(r.zcard(f"kc:{nsp}:{{_sched}}:due")) + int(r.zcard(f"kc:{nsp}:{{_sched}}:sdue"))
        except (redis.RedisError, redis.exceptions.RedisClusterException):
            return -1

    def redis_keys(self) -> dict[str, Any]:
        """What the namespace left in Redis: key counts by kind (``lease``, ``fence``, ``park``,
        ``seen`` ..., and ``sched.<kind>`` for the namespace-wide ``{_sched}`` keys)."""
        r = connect(self.svc.redis_url, 5)
        nsp = self.cfg["namespace"]
        kinds: dict[str, int] = {}
        names: dict[str, list[str]] = {}
        for k in r.scan_iter(f"kc:{nsp}:*", count=1000):
            name = k.decode()
            tag, _, kind = name.rpartition("}:")
            kind = ("sched." + kind) if tag.endswith("{_sched") else kind
            kinds[kind] = kinds.get(kind, 0) + 1
            names.setdefault(kind, [])
            if len(names[kind]) < 20:
                names[kind].append(name)
        totals = {k.decode(): v.decode() for k, v in r.hgetall(f"kc:{nsp}:{{_sched}}:totals").items()}
        db = connect(self.cfg.get("db_url") or self.svc.redis_url, 5)  # the handler's database
        ext = sum(1 for _ in db.scan_iter(f"ext:{nsp}:*", count=1000))
        return {
            "by_kind": kinds,
            "examples": names,
            "totals": totals,
            "ext_keys": ext,
            "used_memory": used_memory(r),
        }

    def thread_deaths(self) -> list[str]:
        """``file: thread`` for every thread of a consumer that died of an exception (Python prints
        ``Exception in thread NAME:`` to the process's stderr): the process goes on without it, a
        lease renewer for instance, so it is an engine fault even if no check notices it."""
        out = []
        for f in sorted((self.out / "logs").glob("consumer-*.err")):
            for line in f.read_text(errors="replace").splitlines():
                if line.startswith("Exception in thread "):
                    out.append(f"{f.name}: {line[len('Exception in thread ') :].rstrip(':')}")
        return out

    # -- the run --------------------------------------------------------------------------------
    def run(self) -> int:
        self.setup()
        self.rng = random.Random(f"actions-{self.args.seed}")
        self.in_faults = False
        self.scenario: Any = None
        started = time.monotonic()
        svc_thread = threading.Thread(target=self.svc_worker, name="services", daemon=True)
        svc_thread.start()
        samplers: list[threading.Thread] = []
        steady: subprocess.Popen[bytes] | None = None
        try:
            self.start_services()
            self.say(
                f"topic {self.topic}: {self.cfg['messages']} messages, backlog {self.cfg['backlog']}, "
                f"bug {self.bug or 'none'}, faults {self.faults}, window {self.window_s:.0f} s"
            )
            backlog = self.spawn(["tests.faults.producer", str(self.out), "backlog"], "producer-backlog.err")
            if backlog.wait(600) != 0:
                raise RuntimeError(f"the backlog producer failed (see {self.out}/logs/producer-backlog.err)")
            self.flog("backlog_done")
            self.start_sampler()
            t = threading.Thread(target=self.sample_resources, name="resources", daemon=True)
            t.start()
            samplers.append(t)
            for i in range(self.size.consumers):
                self.start_consumer(f"c{i + 1}")
            steady = self.spawn(["tests.faults.producer", str(self.out), "steady"], "producer-steady.err")
            self.flog("steady_start", steady.pid)
            self.in_faults = True
            t0 = time.monotonic()
            for at_s, kind in self.cfg["schedule"]:
                heapq.heappush(self.timers, (t0 + at_s, next(self.tseq), kind, None))
            if self.faults in TARGETED:
                self.scenario = self.targeted()
            self.loop_until(t0 + self.window_s)
            # stop the faults: resume the paused, restart the killed, services back up
            self.in_faults = False
            self.flog("faults_end")
            self.say("faults end")
            pending = [(a, x) for _, _, a, x in sorted(self.timers) if a in ("cont", "restart", "heal")]
            self.timers.clear()
            for action, arg in pending:
                self.do(action, arg, self.rng)
            self.svc_wait(180)
            for slot in [s for s in ("c1", "c2", "c3")]:
                p = self.procs.get(slot)
                if p is not None and p.exited_ns is None and p.expect_exit:  # terminating: wait, restart
                    try:
                        p.popen.wait(60)
                    except subprocess.TimeoutExpired:
                        self.signal(p, signal.SIGKILL)
                        p.popen.wait(10)
                self.reap()
                p = self.procs.get(slot)
                if p is None or p.exited_ns is not None:
                    self.start_consumer(slot)
            try:
                steady.wait(300)
            except subprocess.TimeoutExpired:
                self.say("steady producer did not finish")
            self.flog("producer_done", steady.pid, str(steady.returncode))
            # drain to lag 0
            ends: dict[int, int] = {}
            next_end = 0.0

            def drained() -> bool:
                nonlocal ends, next_end
                if time.monotonic() >= next_end:
                    try:
                        ends = self.end_offsets()
                    except Exception:
                        ends = {}
                    next_end = time.monotonic() + 2.0
                c = self.last_commit()
                if not (ends and all(c.get(p, -1) >= e for p, e in ends.items())):
                    return False
                return not self.park or self.parked_left() == 0  # parked messages run too

            t_drain = time.monotonic()
            # a targeted control run (a bug on) may never drain: a short wait is enough to show it
            drain_s = self.size.drain_timeout_s if self.faults == "all" else 60.0
            ok = self.loop_until(time.monotonic() + drain_s, drained)
            self.flog("drained", "-", f"{'lag0' if ok else 'timeout'}:{time.monotonic() - t_drain:.1f}s")
            self.say(f"drain {'done' if ok else 'TIMED OUT'} in {time.monotonic() - t_drain:.1f} s")
            # SIGTERM everything
            live = [p for p in self.procs.values() if p.exited_ns is None]
            for p in live:
                p.expect_exit = True
                self.signal(p, signal.SIGCONT)
                self.signal(p, signal.SIGTERM)
                self.flog("term_end", p.pid)
            for p in live:
                try:
                    p.popen.wait(60)
                except subprocess.TimeoutExpired:
                    self.signal(p, signal.SIGKILL)
                    self.flog("kill_end", p.pid, "no exit 60 s after SIGTERM")
                    p.popen.wait(10)
            self.reap()
            time.sleep(0.6)  # a last commit sample after the final commits
            self.stop_samplers.set()
            self.stop_sampler()
            for t in samplers:
                t.join(10)
            final = {
                "end_offsets": self.retried("end offsets", self.end_offsets),
                "committed": self.retried("committed offsets", self.committed_now),
                "dlq_records": self.dump_dlq(),
                "redis": self.redis_keys(),
                "drained": ok,
                "unexpected_exits": self.unexpected,
                "thread_deaths": self.thread_deaths(),
                "seconds": round(time.monotonic() - started, 1),
            }
            (self.out / "final.json").write_text(json.dumps(final, indent=1))
        finally:
            self.stop_samplers.set()
            self.stop_sampler()
            for p in self.all_procs:
                if p.popen.poll() is None:
                    self.signal(p, signal.SIGCONT)
                    self.signal(p, signal.SIGKILL)
                    p.popen.wait(10)
            if steady is not None and steady.poll() is None:
                steady.kill()
                steady.wait(10)
            with self.svc_cv:
                self.svc_queue.clear()
            self.svc_do("quit", lambda: None)
            svc_thread.join(200)
            try:
                self.svc.down()
            except Exception as exc:
                self.say(f"services down failed: {exc}")
            for src, dst in (
                ("kafka/logs/server.log", "kafka-server.log"),
                ("redis/redis.log", "redis.log"),
                ("services.out", "services.out"),
            ):
                if (self.svc_dir / src).exists():
                    shutil.copy(self.svc_dir / src, self.out / "logs" / dst)
            if not self.args.keep_services_dir:
                shutil.rmtree(self.svc_dir, ignore_errors=True)
        self.say(f"run done in {time.monotonic() - started:.0f} s; checking {self.out}")
        return checker.main([str(self.out)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.faults.run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="ci")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--bug", choices=BUGS, default=None, help="negative control: a deliberate bug")
    ap.add_argument(
        "--faults",
        choices=("all", "kills", "stops", "redis"),
        default=None,
        help="all (default), or one kind for a targeted control run (default for --bug)",
    )
    ap.add_argument(
        "--park", action="store_true", help="Retry(..., park=True): ordered retries parked in Redis"
    )
    ap.add_argument(
        "--harness-skip-fencing",
        action="store_true",
        help="the handler's own fenced write skips its token check (fails check 5 whatever the engine does)",
    )
    ap.add_argument(
        "--cluster",
        action="store_true",
        help="3 brokers, a Redis Cluster, consumers on network-namespace hosts, host cuts (needs root)",
    )
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--kafka-port", type=int, default=24092)
    ap.add_argument("--redis-port", type=int, default=24379)
    ap.add_argument("--keep-services-dir", action="store_true")
    args = ap.parse_args(argv)

    def interrupted(_s: int, _f: Any) -> None:
        raise Interrupted()

    signal.signal(signal.SIGTERM, interrupted)
    try:
        return Run(args).run()
    except Interrupted:
        print("[faults] interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
