"""The checker: reads a run's logs and proves (or refutes) each guarantee.

    python -m tests.faults.checker DIR

Prints a ``run`` line, then one line per check, ``PASS`` or ``FAIL`` with its figures; writes the
evidence of every failure (the log records involved) to ``DIR/evidence.txt`` and the results to
``DIR/checks.json``. Exits 1 if any check failed (or the run itself had unexpected consumer exits).
What each check proves, and the duplicate bound, are in tests/faults/README.md.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from keyedconsumer.offsets import FinishedOffsets

from .common import SIZES, key_names, load_json

INF = float("inf")
S_NS = 1_000_000_000
#: How long after a run from a parked list ends its entry may still be in Redis (it is removed by the
#: next poll-thread tick, or the next Redis round trip after an outage of at most a few seconds).
PARKED_SETTLE_NS = 5 * S_NS


@dataclasses.dataclass
class RunRec:
    pid: int
    p: int
    o: int
    key: str
    seq: int
    token: int
    attempt: int
    start: int
    end: float = INF
    kind: str = "open"  # E, X, or open (no end record)
    write: str | None = None  # ok | refused (E only)
    write_ns: int | None = None
    ver: int = 0  # the external record's version after an accepted write
    cut: str | None = None  # killed | exited | None

    def brief(self) -> str:
        return (
            f"pid {self.pid} p{self.p}@{self.o} {self.key}#{self.seq} token {self.token} attempt {self.attempt} "
            f"[{self.start}, {self.end}] {self.kind}{'/' + self.write if self.write else ''}"
            f"{' cut:' + self.cut if self.cut else ''}"
        )


@dataclasses.dataclass
class Check:
    n: int
    title: str
    ok: bool
    figures: str
    evidence: list[str] = dataclasses.field(default_factory=list)

    def line(self) -> str:
        return f"{self.n} {'PASS' if self.ok else 'FAIL'} {self.title}: {self.figures}"


class Logs:
    """Everything a run wrote, parsed."""

    def __init__(self, d: Path) -> None:
        self.dir = d
        self.cfg = load_json(d / "run.json")
        self.size = SIZES[self.cfg["size"]]
        self.final: dict[str, Any] = load_json(d / "final.json") if (d / "final.json").exists() else {}
        _, self.hot, poison = key_names(self.size)
        self.poison = set(poison)
        # acknowledged records
        self.acked: dict[tuple[int, int], tuple[str, int, str]] = {}
        self.backlog_end: dict[int, int] = defaultdict(int)
        for f in sorted(d.glob("acks-*.log")):
            for line in f.read_text().splitlines():
                p, o, key, seq, _id, flag, _t = line.split()
                self.acked[(int(p), int(o))] = (key, int(seq), flag)
                if f.name == "acks-backlog.log":
                    self.backlog_end[int(p)] = max(self.backlog_end[int(p)], int(o) + 1)
        self.nacks = sum(len(f.read_text().splitlines()) for f in d.glob("nacks-*.log"))
        # faults and process lifecycle
        self.faults: list[tuple[int, str, str, str]] = []
        if (d / "faults.log").exists():
            for line in (d / "faults.log").read_text().splitlines():
                t, kind, pid, detail = line.split(" ", 3)
                self.faults.append((int(t), kind, pid, detail))
        self.killed: dict[int, int] = {}
        self.exited: dict[int, tuple[int, str]] = {}
        self.started: dict[int, int] = {}
        self.termed: dict[int, int] = {}
        self.stops: dict[int, list[list[float]]] = defaultdict(list)
        self.cuts: dict[int, list[list[float]]] = defaultdict(list)  # its host off the network (cluster runs)
        self.redis_windows: list[tuple[int, float]] = []
        self.kafka_windows: list[tuple[int, float]] = []
        for t, kind, pid, detail in self.faults:
            if kind in ("kill", "kill_end"):
                self.killed[int(pid)] = t
            elif kind == "exit":
                self.exited[int(pid)] = (t, detail)
            elif kind in ("start", "join"):
                self.started[int(pid)] = t
            elif kind in ("term", "leave", "term_end"):
                self.termed.setdefault(int(pid), t)
            elif kind == "stop":
                self.stops[int(pid)].append([t, INF])
            if (
                kind in ("cont", "term_end", "kill")
                and self.stops.get(int(pid))
                and self.stops[int(pid)][-1][1] == INF
            ):
                self.stops[int(pid)][-1][1] = t
            if kind == "cut":
                self.cuts[int(pid)].append([t, INF])
            elif (
                kind in ("heal", "term_end", "kill")
                and self.cuts.get(int(pid))
                and self.cuts[int(pid)][-1][1] == INF
            ):
                self.cuts[int(pid)][-1][1] = t
            if kind == "redis_kill":
                self.redis_windows.append((t, INF))
            elif kind == "redis_up" and self.redis_windows:
                self.redis_windows[-1] = (self.redis_windows[-1][0], t)
            elif kind == "kafka_kill":
                self.kafka_windows.append((t, INF))
            elif kind == "kafka_up" and self.kafka_windows:
                self.kafka_windows[-1] = (self.kafka_windows[-1][0], t)
        # consumer records
        self.runs: list[RunRec] = []
        self.dead: list[tuple[int, int, int, int]] = []  # (p, o, pid, ns)
        self.parked: dict[tuple[int, int], int] = {}  # (p, o) -> when its parking was acknowledged
        self.parkings: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(
            list
        )  # (p, o) -> [(ns, pid)]
        self.double_starts: list[str] = []
        self.last_ns: dict[int, int] = {}
        for f in sorted((d / "events").glob("*.log")):
            open_runs: dict[tuple[int, int], RunRec] = {}
            for line in f.read_text().splitlines():
                x = line.split()
                if not x:
                    continue
                kind, pid = x[0], int(x[1])
                if kind in ("S", "E", "X", "D", "K"):
                    p, o, key, seq, attempt, t = int(x[2]), int(x[3]), x[4], int(x[5]), int(x[7]), int(x[8])
                    token = int(x[6]) if x[6] != "None" else 0
                    self.last_ns[pid] = max(self.last_ns.get(pid, 0), t)
                    if kind == "S":
                        if (p, o) in open_runs:
                            self.double_starts.append(line)
                        r = RunRec(pid, p, o, key, seq, token, attempt, t)
                        open_runs[(p, o)] = r
                        self.runs.append(r)
                    elif kind in ("E", "X"):
                        r2 = open_runs.pop((p, o), None)
                        if r2 is None:
                            continue
                        r2.end, r2.kind = t, kind
                        if kind == "E":
                            r2.write, r2.write_ns, r2.ver = x[9], int(x[10]), int(x[11])
                    elif kind == "K":
                        self.parked[(p, o)] = min(self.parked.get((p, o), t), t)
                        self.parkings[(p, o)].append((t, pid))
                    else:
                        self.dead.append((p, o, pid, t))
            for r in open_runs.values():
                if r.pid in self.killed:
                    r.end, r.cut = max(r.start, self.killed[r.pid]), "killed"
                elif r.pid in self.exited:
                    r.end, r.cut = max(r.start, self.exited[r.pid][0]), "exited"
        self.dlq: list[tuple[int, int, str]] = []
        if (d / "dlq.log").exists():
            for line in (d / "dlq.log").read_text().splitlines():
                p, o, key, _att = line.split()
                if p != "None":
                    self.dlq.append((int(p), int(o), key))
        # committed offsets: per partition, [(recv_ns, offset)] in sampling order, and the commit
        # metadata of each sample (the offsets finished above the committed one, or None)
        self.commits: dict[int, list[tuple[int, int]]] = defaultdict(list)
        self.commit_meta: dict[int, list[FinishedOffsets | None]] = defaultdict(list)
        self.samples = 0
        self.sample_errors = 0
        if (d / "commits.log").exists():
            for line in (d / "commits.log").read_text().splitlines():
                x = line.split()
                if len(x) < 3 or x[2] == "ERR":
                    self.sample_errors += 1
                    continue
                self.samples += 1
                recv = int(x[1])
                meta = (
                    dict(item.split("=", 1) for item in x[3].split(";")) if len(x) > 3 and x[3] != "-" else {}
                )
                if x[2] != "-":
                    for item in x[2].split(","):
                        p, o = item.split(":")
                        self.commits[int(p)].append((recv, int(o)))
                        self.commit_meta[int(p)].append(FinishedOffsets.decode(int(o), meta.get(p)))
        self.commit_t = {p: [t for t, _ in v] for p, v in self.commits.items()}
        self.commit_o = {p: [o for _, o in v] for p, v in self.commits.items()}
        self.commit_max = {p: _running_max(v) for p, v in self.commit_o.items()}

    def committed_before(self, p: int, t: float) -> int:
        """The highest committed offset of ``p`` observed (sample answered) before ``t``; -1 if none."""
        ts = self.commit_t.get(p)
        if not ts:
            return -1
        i = bisect.bisect_left(ts, t)
        return self.commit_max[p][i - 1] if i > 0 else -1

    def covered_before(self, p: int, o: int, t: float) -> bool:
        """Whether offset ``o`` of ``p`` was covered by the group's commit as last observed (sample
        answered) before ``t``: below the committed offset, or named finished by its metadata. A
        partition's next owner reads at least that much: every commit names at least what the one
        before it named (the engine stores and commits its metadata with every offset)."""
        ts = self.commit_t.get(p)
        if not ts:
            return False
        i = bisect.bisect_left(ts, t) - 1
        if i < 0:
            return False
        if o < self.commit_max[p][i]:
            return True
        fin = self.commit_meta[p][i]
        return fin is not None and fin.covers(o)


def _running_max(xs: list[int]) -> list[int]:
    out, m = [], -1
    for x in xs:
        m = max(m, x)
        out.append(m)
    return out


def _n(x: float) -> str:
    return f"{x:,}"


def _sec(t: float, t0: int) -> str:
    return f"{(t - t0) / S_NS:.2f}s" if t != INF else "never"


# ---------------------------------------------------------------------------------------- checks
def check_lost(g: Logs) -> Check:
    ended = {(r.p, r.o) for r in g.runs if r.kind == "E" and r.write == "ok"}
    dead = {(p, o) for p, o, _pid, _t in g.dead} | {(p, o) for p, o, _k in g.dlq}
    missing = sorted(set(g.acked) - ended - dead)
    ev = [
        f"lost: p{p}@{o} {g.acked[(p, o)][0]}#{g.acked[(p, o)][1]} (no accepted end record, no dead letter)"
        for p, o in missing[:50]
    ]
    refused_only = [k for k in missing if any(r.p == k[0] and r.o == k[1] and r.kind == "E" for r in g.runs)]
    return Check(
        1,
        "no message lost",
        not missing and bool(g.acked),
        f"{_n(len(g.acked))} acked, {_n(len(ended & set(g.acked)))} with an accepted end record, "
        f"{_n(len(dead & set(g.acked)))} dead-lettered, {_n(len(missing))} missing"
        f"{f' ({len(refused_only)} of them only ran with refused writes)' if refused_only else ''}",
        ev,
    )


def check_final_commits(g: Logs) -> Check:
    end = {int(k): v for k, v in g.final.get("end_offsets", {}).items()}
    com = {int(k): v for k, v in g.final.get("committed", {}).items()}
    bad = [(p, com.get(p), e) for p, e in sorted(end.items()) if com.get(p) != e]
    lag = sum(e - (com.get(p) or 0) for p, e in end.items())
    ev = [f"p{p}: committed {c}, end offset {e}" for p, c, e in bad]
    return Check(
        2,
        "final commits = end offsets",
        bool(end) and not bad,
        f"{len(end) - len(bad)}/{len(end)} partitions equal, total lag {_n(lag)}, "
        f"drain {'reached lag 0' if g.final.get('drained') else 'TIMED OUT'}",
        ev,
    )


def check_commits_safe(g: Logs) -> Check:
    first_done: dict[tuple[int, int], float] = {}
    for r in g.runs:
        if r.kind == "E" and r.write == "ok":
            k = (r.p, r.o)
            first_done[k] = min(first_done.get(k, INF), r.end)
    for p, o, _pid, t in g.dead:
        first_done[(p, o)] = min(first_done.get((p, o), INF), t)
    for k, t in g.parked.items():  # parked in Redis (acknowledged on disk): done for the offset
        first_done[k] = min(first_done.get(k, INF), t)
    t0 = min((t for t, *_ in g.faults), default=0)
    ahead, backwards, moving, named, ev = 0, 0, 0, 0, []
    by_part: dict[int, list[int]] = defaultdict(list)
    for p, o in g.acked:
        by_part[p].append(o)
    for p, samples in g.commits.items():
        offs = sorted(by_part.get(p, []))
        pm: list[float] = []
        m = -1.0
        for o in offs:
            m = max(m, first_done.get((p, o), INF))
            pm.append(m)
        prev = -1
        metas = g.commit_meta.get(p, [])
        last_named: tuple[int, tuple[tuple[int, int], ...]] | None = None
        for j, (recv, c) in enumerate(samples):
            fin = metas[j] if j < len(metas) else None
            spans = tuple(fin.spans()) if fin is not None else ()
            if spans and (c, spans) != last_named:  # the metadata names only finished offsets
                last_named = (c, spans)
                for lo, hi in spans:
                    for o in offs[bisect.bisect_left(offs, lo) : bisect.bisect_left(offs, hi)]:
                        if first_done.get((p, o), INF) > recv:
                            named += 1
                            if len(ev) < 40:
                                key, seq, _f = g.acked[(p, o)]
                                ev.append(
                                    f"named finished: p{p} committed {c} at {_sec(recv, t0)} with metadata "
                                    f"naming p{p}@{o} ({key}#{seq}) finished, which it was not "
                                    f"(first done {_sec(first_done.get((p, o), INF), t0)})"
                                )
            if c < prev and _coordinator_moving(g, recv):
                moving += 1
                if len(ev) < 40:
                    ev.append(
                        f"backwards while the group coordinator moved (excused): p{p} committed {prev} then "
                        f"{c} (sample at {_sec(recv, t0)})"
                    )
            elif c < prev:
                backwards += 1
                if len(ev) < 40:
                    ev.append(f"backwards: p{p} committed {prev} then {c} (sample at {_sec(recv, t0)})")
            prev = max(prev, c)
            i = bisect.bisect_left(offs, c) - 1
            if i >= 0 and pm[i] > recv:
                ahead += 1
                if len(ev) < 40:
                    o = next(o for o in offs[: i + 1] if first_done.get((p, o), INF) > recv)
                    key, seq, _f = g.acked[(p, o)]
                    ev.append(
                        f"ahead: p{p} committed {c} at {_sec(recv, t0)} while p{p}@{o} ({key}#{seq}) was "
                        f"unfinished (first done {_sec(first_done.get((p, o), INF), t0)})"
                    )
    n = sum(len(v) for v in g.commits.values())
    return Check(
        3,
        "commits never ahead of an unfinished message, never backwards",
        ahead == 0 and backwards == 0 and named == 0 and n > 0,
        f"{_n(g.samples)} samples ({_n(n)} partition offsets, {_n(g.sample_errors)} failed while the broker "
        f"was down), {_n(ahead)} ahead of an unfinished message, {_n(named)} unfinished named finished "
        f"by the commit metadata, {_n(backwards)} backwards (+ {_n(moving)} read while a killed broker's group "
        f"coordinator moved, KAFKA-20634)",
        ev,
    )


def check_order(g: Logs) -> Check:
    by_key: dict[str, list[RunRec]] = defaultdict(list)
    for r in g.runs:
        by_key[r.key].append(r)
    t0 = min((t for t, *_ in g.faults), default=0)
    disorder, ev = 0, []
    for key, rs in by_key.items():
        rs.sort(key=lambda r: r.start)
        seen: set[int] = set()
        last = 0
        for r in rs:
            if r.seq in seen:
                continue
            seen.add(r.seq)
            if r.seq < last:
                disorder += 1
                if len(ev) < 20:
                    ev.append(
                        f"order: {key}#{r.seq} first ran at {_sec(r.start, t0)} after #{last} ({r.brief()})"
                    )
            last = max(last, r.seq)
    starts: dict[tuple[int, int], int] = defaultdict(int)
    reruns, early = 0, 0
    for r in sorted(g.runs, key=lambda r: r.start):
        k = (r.p, r.o)
        if starts[k] and r.attempt == 1:
            reruns += 1
        starts[k] += 1
        c = g.committed_before(r.p, r.start)
        if r.o < c and not g.parked.get((r.p, r.o), INF) < r.start:  # a parked one runs from Redis
            early += 1
            if len(ev) < 40:
                ev.append(
                    f"behind the commit: p{r.p}@{r.o} started at {_sec(r.start, t0)} after commit {c} was "
                    f"observed ({r.brief()})"
                )
    return Check(
        4,
        "per-key order; re-runs start at or after the committed point",
        disorder == 0 and early == 0,
        f"{_n(len(by_key))} keys, {_n(disorder)} sequence numbers first seen out of order; {_n(reruns)} "
        f"re-deliveries, {_n(early)} runs started below an observed commit",
        ev,
    )


def _stopped_during(g: Logs, pid: int, a: float, b: float) -> bool:
    """Whether ``pid`` was SIGSTOPped, or its host cut off, at some time in ``(a, b)``: a run in
    progress then is a zombie once its lease lapsed (its results must not count)."""
    return any(s < b and c > a for s, c in g.stops.get(pid, []) + g.cuts.get(pid, []))


#: How long after a killed broker is back its group-coordinator partitions may still move back to it:
#: scripts/services sets ``leader.imbalance.check.interval.seconds=10`` (the preferred-leader
#: election), plus 5 s for the move itself on a loaded machine. In nanoseconds, as the logs' times.
COORDINATOR_SETTLE_NS = 15 * 10**9


def _coordinator_moving(g: Logs, t: float) -> bool:
    """Whether ``t`` lies between a broker's kill and ``COORDINATOR_SETTLE_NS`` after it is back: the
    group coordinator moves away and back then, and Kafka 4.1's coordinator can answer with the
    committed offsets of a moment earlier, or drop a commit it acknowledged (KAFKA-20634: a
    ``__consumer_offsets`` partition becoming a follower applies the new leader's high watermark
    over its own unreplicated records). Seen in CI: three partitions read one offset lower for
    0.5 s right after the preferred leader came back, then the earlier values again, with no commit
    in between. A committed offset lower than before is then the broker's, not the engine's; it
    re-runs messages (at-least-once holds: checks 1, 4 and 6 still apply)."""
    return any(k <= t <= u + COORDINATOR_SETTLE_NS for k, u in g.kafka_windows)


def _redis_out_during(g: Logs, a: float, b: float) -> bool:
    """Whether Redis was down (killed, not yet back) at some time in ``(a, b)``: a run in progress
    then could not renew its lease, which lapses after its TTL, so another instance may take the
    key over (a higher fencing token) while the run goes on: a zombie, as after a SIGSTOP."""
    return any(s < b and e > a for s, e in g.redis_windows)


def _resumed_just_before(g: Logs, r: RunRec, ends_by_pid_key: dict[tuple[int, str], list[float]]) -> bool:
    """``r`` started within 1 s after its process was continued, and no run of its key by that process
    ended in between: it had passed the engine's lease check before the SIGSTOP (a pause between the
    check and the handler's first line), not started new work under a lost lease. A start recorded
    between the logged SIGSTOP and SIGCONT happened at the resume itself (a stopped process records
    nothing; the orchestrator logs the SIGCONT just after sending it)."""
    for s, c in g.stops.get(r.pid, []):
        if s < r.start <= c + S_NS:
            ends = ends_by_pid_key.get((r.pid, r.key), [])
            i = bisect.bisect_right(ends, s)
            if i >= len(ends) or ends[i] >= r.start:
                return True
    return False


def _harmless_write(low: RunRec, writes: list[tuple[int, int]]) -> bool:
    """``low``'s write was refused, or it was accepted before any write with a higher token
    (``writes``: the key's accepted writes as ``(version, token)``, in version order)."""
    if low.write != "ok":
        return True
    return all(v > low.ver for v, t in writes if t > low.token)


def check_exclusive(g: Logs) -> Check:
    by_key: dict[str, list[RunRec]] = defaultdict(list)
    ends_by_pid_key: dict[tuple[int, str], list[float]] = defaultdict(list)
    for r in g.runs:
        by_key[r.key].append(r)
        if r.kind != "open":
            ends_by_pid_key[(r.pid, r.key)].append(r.end)
    for v in ends_by_pid_key.values():
        v.sort()
    ev_writes: list[str] = []
    writes: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for r in g.runs:
        if r.write == "ok":
            writes[r.key].append((r.ver, r.token))
    stale_writes = 0
    for key, ws in writes.items():
        ws.sort()
        top_w = 0
        for v, t in ws:
            if t < top_w:
                stale_writes += 1
                if len(ev_writes) < 20:
                    ev_writes.append(
                        f"stale write accepted: {key} version {v} with token {t} after token {top_w}"
                    )
            top_w = max(top_w, t)
    t0 = min((t for t, *_ in g.faults), default=0)
    overlaps, excused, stale, stale_excused, unended, ev = 0, 0, 0, 0, 0, []
    refused = sum(1 for r in g.runs if r.write == "refused")
    for key, rs in by_key.items():
        rs.sort(key=lambda r: r.start)
        active: list[RunRec] = []
        top, top_run = -1, None
        for r in rs:
            if r.end == INF:
                unended += 1
            # stale start: a token below one another run of this key already started with
            if r.token < top:
                ok = _resumed_just_before(g, r, ends_by_pid_key) and r.write != "ok"
                stale_excused += ok
                stale += not ok
                if not ok and len(ev) < 60:
                    ev.append(
                        f"stale start: {r.brief()} at {_sec(r.start, t0)} after token {top} "
                        f"({top_run.brief() if top_run else ''})"
                    )
            if r.token > top:
                top, top_run = r.token, r
            active = [a for a in active if a.end > r.start]
            for a in active:
                low, high = (a, r) if a.token <= r.token else (r, a)
                zombie = (
                    _stopped_during(g, low.pid, low.start, low.end)
                    or _redis_out_during(g, low.start, low.end)
                    or (low is r and _resumed_just_before(g, r, ends_by_pid_key))
                )
                if low.token < high.token and zombie and _harmless_write(low, writes[key]):
                    excused += 1
                else:
                    overlaps += 1
                    if len(ev) < 60:
                        ev.append(
                            f"overlap: {key}: {a.brief()} at {_sec(a.start, t0)}-{_sec(a.end, t0)} and "
                            f"{r.brief()} at {_sec(r.start, t0)}-{_sec(r.end, t0)}"
                        )
            active.append(r)
    killed_cut = sum(1 for r in g.runs if r.cut == "killed")
    return Check(
        5,
        "no two runs of one key at once",
        overlaps == 0 and stale == 0 and unended == 0 and stale_writes == 0,
        f"{_n(len(g.runs))} runs, {_n(overlaps)} overlaps + {_n(stale)} stale-token starts not excused; "
        f"{_n(excused)} overlaps by zombies of a SIGSTOP, a host cut or a Redis outage (lower token, write refused or before the newer "
        f"token's) + {_n(stale_excused)} excused stale starts; {_n(killed_cut)} runs cut by SIGKILL; "
        f"{_n(refused)} writes refused, {_n(stale_writes)} accepted after a higher token; "
        f"{_n(unended)} runs never ended",
        ev_writes + ev,
    )


def check_duplicates(g: Logs) -> Check:
    sz = g.size
    max_run = int((sz.lease_ttl_s * 1.5 + 2.0) * S_NS)
    ttl = int(sz.lease_ttl_s * S_NS)
    session = int(sz.session_timeout_ms * 1_000_000)
    t0 = min((t for t, *_ in g.faults), default=0)
    # completions: accepted end records and dead-letter records, per (p, o), in time order
    comps: dict[tuple[int, int], list[tuple[float, int, float]]] = defaultdict(list)  # (end, pid, start)
    for r in g.runs:
        if r.kind == "E" and r.write == "ok":
            comps[(r.p, r.o)].append((r.end, r.pid, r.start))
    run_starts: dict[tuple[int, int, int], list[int]] = defaultdict(list)
    for r in g.runs:
        run_starts[(r.p, r.o, r.pid)].append(r.start)
    for p, o, pid, t in g.dead:
        # a dead letter completes the run (its last attempt) that preceded it in that process
        mine = [s0 for s0 in run_starts.get((p, o, pid), []) if s0 <= t]
        comps[(p, o)].append((t, pid, max(mine) if mine else t))
    starts: dict[tuple[int, int], list[int]] = defaultdict(list)
    for r in g.runs:
        starts[(r.p, r.o)].append(r.start)
    for v in starts.values():
        v.sort()
    crashes = {pid: t for pid, (t, d) in g.exited.items() if d.endswith("unexpected")}
    kills = {**{pid: t for pid, t in g.killed.items()}, **crashes}

    def from_redis(p: int, o: int, start: float) -> bool:
        return g.parked.get((p, o), INF) < start

    def cause(p: int, o: int, t1: float, pid: int, t2: float, s1: float = 0.0) -> str | None:
        k = kills.get(pid)
        if k is not None and t1 <= k <= t2 and not g.covered_before(p, o, k):
            return "kill"
        for kind, pauses in (("stop", g.stops), ("cut", g.cuts)):  # a cut host is paused for the others
            for s, c in pauses.get(pid, []):
                if s <= t2 and t1 <= c + max_run and (t1 >= s or not g.covered_before(p, o, s)):
                    return kind
        if from_redis(p, o, s1):
            # run from a parked list: its entry is removed from Redis just after it ends, so a kill
            # of its process within PARKED_SETTLE_S after it ended may leave it to run again
            if k is not None and t1 <= k <= min(t2, t1 + PARKED_SETTLE_NS):
                return "kill"
            for s, _c in g.stops.get(pid, []):
                if t1 <= s <= min(t2, t1 + PARKED_SETTLE_NS):
                    return "stop"
            # and a Redis SIGKILL within that time loses the removal (or never saw it)
            for k3, _up in g.redis_windows:
                if t1 <= k3 <= min(t2, t1 + PARKED_SETTLE_NS):
                    return "redis"
        # parked: its offset counted done when its parker's parking was acknowledged; a kill of the
        # parker before that offset was committed re-delivers it from Kafka
        for tk, parker in g.parkings.get((p, o), []):
            if tk > t2:
                continue
            k = kills.get(parker)
            if k is not None and tk <= k <= t2 and not g.covered_before(p, o, k):
                return "kill"
            for s, c in g.stops.get(parker, []):
                if s <= t2 and tk <= c + max_run and (tk >= s or not g.covered_before(p, o, s)):
                    return "stop"
        for k2, up in g.kafka_windows:
            if t1 <= up + session + 10 * S_NS and t2 >= k2 and not g.covered_before(p, o, k2):
                return "broker"
        for k3, up in g.redis_windows:
            if k3 <= t1 <= up + ttl + 2 * S_NS:
                return "redis"
        return None

    dups: dict[str, int] = defaultdict(int)
    ev = []
    for (p, o), cs in comps.items():
        cs.sort()
        for (t1, pid1, s1), (t2c, pid2, s2) in zip(cs, cs[1:], strict=False):
            st = starts[(p, o)]
            i = bisect.bisect_right(st, t1)
            t2 = st[i] if i < len(st) else t2c
            # a SIGSTOP zombie's run that ends after the new owner's (check 5 judges it) counts for the stop
            zombie = _stopped_during(g, pid2, s2, t2c)
            why = (
                ("cut" if any(s < t2c and c > s2 for s, c in g.cuts.get(pid2, [])) else "stop")
                if zombie
                else cause(p, o, t1, pid1, t2, s1)
            )
            dups[why or "graceful"] += 1
            if why is None and len(ev) < 40:
                terms = [f"term/leave of {q} at {_sec(t, t0)}" for q, t in g.termed.items() if t1 <= t <= t2]
                joins = [f"join of {q} at {_sec(t, t0)}" for q, t in g.started.items() if t1 <= t <= t2]
                key, seq, _f = g.acked.get((p, o), ("?", 0, ""))
                ev.append(
                    f"duplicate without a kill: p{p}@{o} {key}#{seq} done by pid {pid1} at {_sec(t1, t0)}, "
                    f"again by pid {pid2} (started {_sec(t2, t0)}); between: {'; '.join(terms + joins) or 'nothing'}"
                )
    # the bound: per kill-type event, the completions at risk (done, not yet committed, by its victims)
    by_pid: dict[int, list[tuple[float, int, int]]] = defaultdict(list)
    every: list[tuple[float, int, int]] = []
    for (p, o), cs in comps.items():
        for t, pid, _s in cs:
            by_pid[pid].append((t, p, o))
            every.append((t, p, o))
    # with parking, also: the victim's parkings not yet committed, and its runs from parked lists
    # that ended within PARKED_SETTLE_S before the kill (their entries not yet removed)
    parked_by: dict[int, list[tuple[float, int, int]]] = defaultdict(list)
    for (p, o), ks in g.parkings.items():
        for t, pid in ks:
            parked_by[pid].append((t, p, o))
    redis_runs: dict[int, list[float]] = defaultdict(list)
    for (p, o), cs in comps.items():
        for t, pid, s1 in cs:
            if from_redis(p, o, s1):
                redis_runs[pid].append(t)
    bounds: dict[str, int] = defaultdict(int)
    for pid, k in kills.items():
        bounds["kill"] += sum(
            1 for t, p, o in by_pid.get(pid, []) if t <= k and not g.covered_before(p, o, k)
        )
        bounds["kill"] += sum(
            1 for t, p, o in parked_by.get(pid, []) if t <= k and not g.covered_before(p, o, k)
        )
        bounds["kill"] += sum(1 for t in redis_runs.get(pid, []) if k - PARKED_SETTLE_NS <= t <= k)
    for kind, pauses in (("stop", g.stops), ("cut", g.cuts)):
        for pid, ivs in pauses.items():
            for s, c in ivs:
                bounds[kind] += sum(
                    1
                    for t, p, o in by_pid.get(pid, [])
                    if t <= c + max_run and (t >= s or not g.covered_before(p, o, s))
                )
                bounds[kind] += sum(
                    1
                    for t, p, o in parked_by.get(pid, [])
                    if t <= c + max_run and (t >= s or not g.covered_before(p, o, s))
                )
                bounds[kind] += sum(1 for t in redis_runs.get(pid, []) if s - PARKED_SETTLE_NS <= t <= s)
    for k2, up in g.kafka_windows:
        bounds["broker"] += sum(
            1 for t, p, o in every if t <= up + session + 10 * S_NS and not g.covered_before(p, o, k2)
        )
    for k3, up in g.redis_windows:
        bounds["redis"] += sum(1 for t, _p, _o in every if k3 <= t <= up + ttl + 2 * S_NS)
        bounds["redis"] += sum(1 for ts in redis_runs.values() for t in ts if k3 - PARKED_SETTLE_NS <= t < k3)
    bound = sum(bounds.values())
    total = sum(dups.values())
    graceful = dups.get("graceful", 0)
    parts = ", ".join(f"{k} {_n(v)}" for k, v in sorted(dups.items()) if k != "graceful") or "none"
    bound_parts = ", ".join(f"{k} {_n(v)}" for k, v in sorted(bounds.items())) or "none"
    return Check(
        6,
        "duplicates only from kills, within the bound",
        graceful == 0 and total <= bound,
        f"{_n(total)} duplicate completions ({parts}); {_n(graceful)} not explained by a kill "
        f"(after SIGTERM/join/leave or nothing; must be 0); "
        f"bound {_n(bound)} ({bound_parts}) = messages done and not covered by the commit "
        f"(offset or metadata) when a kill hit",
        ev,
    )


def check_memory(g: Logs) -> Check:
    d = g.dir
    series: dict[int, list[tuple[int, int]]] = defaultdict(list)
    redis_mem: list[int] = []
    if (d / "resources.log").exists():
        for line in (d / "resources.log").read_text().splitlines():
            x = line.split()
            if x[1] == "rss" and x[2] != "-":
                for item in x[2].split(","):
                    pid, kib = item.split(":")
                    series[int(pid)].append((int(x[0]), int(kib)))
            elif x[1] == "redis" and x[2] != "ERR":
                redis_mem.append(int(x[2]))
    # the backlog phase: from the consumers' start until the commits first covered the backlog
    start = next((t for t, kind, *_ in g.faults if kind == "start"), 0)
    end = INF
    if g.backlog_end and g.commits:
        cand = []
        for p, e in g.backlog_end.items():
            t_cover = next((t for t, o in g.commits.get(p, []) if o >= e), INF)
            cand.append(t_cover)
        end = max(cand)
    phase = (end - start) / S_NS if end != INF else INF
    end = max(end, start + 30 * S_NS)  # a short backlog: judge its first 30 s all the same
    warm = 5 * S_NS
    judged, grown, ev = 0, 0, []
    peak = max((kib for s in series.values() for _, kib in s), default=0)
    worst = 0.0
    for pid, s in series.items():
        pts = [kib for t, kib in s if g.started.get(pid, start) + warm <= t <= end]
        if len(pts) < 6:
            continue
        judged += 1
        third = len(pts) // 3
        first, last = max(pts[:third]), max(pts[-third:])
        growth = last - first
        worst = max(worst, growth / 1024)
        if growth > max(16 * 1024, 0.10 * first):
            grown += 1
            ev.append(
                f"pid {pid}: RSS {first / 1024:.0f} MiB in the first third of the backlog, "
                f"{last / 1024:.0f} MiB in the last ({len(pts)} samples)"
            )
    return Check(
        7,
        "RSS plateaus during the backlog",
        judged > 0 and grown == 0,
        f"backlog phase {phase:.0f} s (judged over {(end - start) / S_NS if end != INF else INF:.0f} s), "
        f"{judged} consumer processes judged, largest growth "
        f"{worst:.1f} MiB (limit max(16 MiB, 10%)), {grown} growing; peak RSS {peak / 1024:.0f} MiB; "
        f"Redis used_memory peak {max(redis_mem, default=0) / 2**20:.1f} MiB, "
        f"end {(redis_mem[-1] if redis_mem else 0) / 2**20:.1f} MiB",
        ev,
    )


#: What may stay in the namespace after the end: fencing counters (must never repeat), the
#: idempotence markers of parking (``seen``, expiring) and the instances' check-in set.
ALLOWED_LEFT = {"fence", "seen", "sched.instances", "sched.totals"}


def check_clean_end(g: Logs) -> Check:
    red = g.final.get("redis", {})
    kinds = red.get("by_kind", {})
    leases = kinds.get("lease", 0) + kinds.get("sched.lease", 0)
    left = {k: v for k, v in kinds.items() if k not in ALLOWED_LEFT and k not in ("lease", "sched.lease")}
    totals = red.get("totals", {})  # parking's namespace counters: approximate by design, reported
    drift = f"n {totals.get('n', 0)}, bytes {totals.get('bytes', 0)}" if totals else "none"
    poison_msgs = {k for k, v in g.acked.items() if v[0] in g.poison}
    dlq_distinct = {(p, o) for p, o, _k in g.dlq}
    not_poison = [x for x in g.dlq if x[2] not in g.poison]
    ok = bool(red) and leases == 0 and not left and dlq_distinct == poison_msgs and not not_poison
    ev = [
        f"left in Redis: {name}"
        for kind, names in red.get("examples", {}).items()
        if kind not in ALLOWED_LEFT
        for name in names
    ]
    ev += [f"dead-lettered but not poison: p{p}@{o} {k}" for p, o, k in not_poison[:20]]
    ev += [f"poison message not dead-lettered: p{p}@{o}" for p, o in sorted(poison_msgs - dlq_distinct)[:20]]
    other = ", ".join(f"{k} {v}" for k, v in sorted(left.items())) or "none"
    kept = ", ".join(f"{k} {kinds[k]}" for k in sorted(ALLOWED_LEFT) if kinds.get(k)) or "none"
    return Check(
        8,
        "clean end",
        ok,
        f"{leases} leases left; parked/scheduled/other keys left: {other}; parked-totals counter "
        f"left at {drift}; "
        f"kept: {kept}; {len(dlq_distinct)} distinct dead letters ({len(g.dlq)} records) for "
        f"{len(poison_msgs)} poison messages, {len(not_poison)} not poison",
        ev,
    )


def check_all(d: Path) -> tuple[str, list[Check], bool]:
    g = Logs(d)
    kinds: dict[str, int] = defaultdict(int)
    for _t, kind, _pid, _detail in g.faults:
        kinds[kind] += 1
    faults = ", ".join(
        f"{k} {kinds[k]}"
        for k in ("kill", "term", "stop", "cut", "join", "leave", "redis_kill", "kafka_kill")
        if kinds[k]
    )
    unexpected = g.final.get("unexpected_exits", 0)
    deaths = g.final.get("thread_deaths", [])
    header = (
        f"run: {g.cfg['size']} seed {g.cfg['seed']} bug {g.cfg.get('bug') or 'none'} faults "
        f"{g.cfg.get('faults')}{' park' if g.cfg.get('park') else ''}; {_n(len(g.acked))} acked "
        f"({_n(g.cfg['backlog'])} backlog), {g.nacks} not acked; {g.cfg['partitions']} partitions, "
        f"{g.size.keys} keys; {_n(len(g.parked))} parked; faults: {faults or 'none'}; "
        f"unexpected consumer exits {unexpected}; consumer threads died {len(deaths)}"
        f"{' (' + ', '.join(deaths[:4]) + ')' if deaths else ''}; "
        f"{g.final.get('seconds', '?')} s"
    )
    checks = [
        check_lost(g),
        check_final_commits(g),
        check_commits_safe(g),
        check_order(g),
        check_exclusive(g),
        check_duplicates(g),
        check_memory(g),
        check_clean_end(g),
    ]
    if g.double_starts:
        checks[4].ok = False
        checks[4].figures += f"; {len(g.double_starts)} runs started twice in one process"
        checks[4].evidence += [f"double start: {x}" for x in g.double_starts[:20]]
    return header, checks, unexpected == 0 and not deaths


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m tests.faults.checker DIR", file=sys.stderr)
        return 2
    d = Path(argv[0])
    header, checks, clean = check_all(d)
    lines = [header] + [c.line() for c in checks]
    print("\n".join(lines), flush=True)
    with open(d / "evidence.txt", "w") as f:
        for c in checks:
            if c.evidence:
                f.write(f"== {c.line()}\n" + "\n".join(c.evidence) + "\n")
    (d / "checks.txt").write_text("\n".join(lines) + "\n")
    (d / "checks.json").write_text(
        json.dumps(
            {
                "header": header,
                "clean_run": clean,
                "checks": {str(c.n): {"ok": c.ok, "line": c.line()} for c in checks},
            },
            indent=1,
        )
    )
    if not clean:
        print(
            "RUN FAIL: a consumer exited unexpectedly, or one of its threads died (see faults.log and logs/)"
        )
    return 0 if clean and all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
