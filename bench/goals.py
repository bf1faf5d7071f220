"""The goals table of bench/run.py (issue 24, "Done when"), the checks of earlier issues, and the
formatting they share with the report. Standard library only.

Every goal is a ratio within one run: for each repeat, a run against another run of the *same
repeat and pass* (keyedconsumer / raw, msg/s / ideal, Redis / in-memory, keyedconsumer / Parallel
Consumer, c16 / c1); the table gives the median over the repeats and the min-max. A goal's row is met
when every part reaches its threshold and its runs had no order violation and no error; "–" (``met``
None) when one of its runs did not run. With ``--noise`` the same rows are computed for the noisy pass
(``goals_noisy``), and the row "a busy machine" compares each figure of the two passes.
"""

from __future__ import annotations

import statistics
from typing import Any

CONCURRENCIES = (1, 16, 64, 256)
MODES = ("sync", "async")
ASYNCIO = "async-asyncio"
#: "a busy machine": a noisy figure within this fraction of the quiet one, either way
NOISE_TOLERANCE = 0.20
#: W4: the peak RSS of every keyedconsumer run must stay under this (MB)
W4_RSS_MB = 300
KC = "keyedconsumer/key"


def fmt(v: Any, nd: int = 0) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:,.{nd}f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def find(runs: list[dict[str, Any]], rid: str) -> dict[str, Any] | None:
    return next((x for x in runs if x["id"] == rid), None)


def spread(x: dict[str, Any], key: str, nd: int = 2, unit: str = "") -> str:
    """'0.93x (0.90-0.95)': the median and, with more than one repeat, the min-max."""
    v = x.get(key)
    if v is None:
        return "–"
    lo, hi = x.get(key + "_min"), x.get(key + "_max")
    s = f"{v:,.{nd}f}{unit}"
    if x.get("repeats", 1) > 1 and lo is not None and hi is not None:
        s += f" ({lo:,.{nd}f}–{hi:,.{nd}f})"
    return s


def spread_of(vals: list[float], nd: int = 2, unit: str = "") -> str:
    if not vals:
        return "–"
    s = f"{statistics.median(vals):.{nd}f}{unit}"
    return s + (f" ({min(vals):.{nd}f}–{max(vals):.{nd}f})" if len(vals) > 1 else "")


def paired(data: dict[str, Any], a: str, b: str, noise: bool = False) -> list[float]:
    """msg/s of run ``a`` / msg/s of run ``b``, one ratio per repeat in which both ran (in the quiet
    pass, or in the noisy one with ``noise``)."""
    by_rep: dict[int, dict[str, float]] = {}
    for x in data.get("repeat_runs", []):
        if x["id"] in (a, b) and x.get("msg_per_s") and bool(x.get("noise")) == noise:
            by_rep.setdefault(x.get("repeat", 0), {})[x["id"]] = x["msg_per_s"]
    return [round(d[a] / d[b], 3) for d in by_rep.values() if a in d and b in d]


class View:
    """One pass of a run's results: the quiet one, or the noisy one (``noise``)."""

    def __init__(self, results: dict[str, Any], noise: bool) -> None:
        self.wls: dict[str, Any] = results["workloads"]
        self.noise = noise

    def runs(self, wl: str) -> list[dict[str, Any]]:
        """The aggregated runs of one workload in this pass ([] when it did not run)."""
        data = self.wls.get(wl) or {}
        return list(data.get("noisy_runs" if self.noise else "runs") or [])

    def run(self, wl: str, rid: str) -> dict[str, Any] | None:
        return find(self.runs(wl), rid)

    def values(self, wl: str, rid: str, key: str) -> list[float]:
        """A per-repeat figure (``ratio_to_raw``, ``efficiency``, ``ratio_to_in_memory``) of one run id."""
        data = self.wls.get(wl) or {}
        return [
            x[key]
            for x in data.get("repeat_runs", [])
            if x["id"] == rid and bool(x.get("noise")) == self.noise and x.get(key) is not None
        ]

    def paired(self, wl: str, a: str, b: str) -> list[float]:
        return paired(self.wls.get(wl) or {}, a, b, self.noise)


def part(
    label: str,
    vals: list[float],
    runs: list[dict[str, Any] | None],
    thr: float | None,
    unit: str = "",
    strict: bool = False,
) -> dict[str, Any]:
    """One figure of a goal: its per-repeat values, the runs it comes from, and its threshold (None:
    reported, not part of the goal; ``strict``: the median must exceed it)."""
    return {"label": label, "vals": vals, "runs": runs, "thr": thr, "unit": unit, "strict": strict}


def _ordered(x: dict[str, Any] | None) -> bool:
    return bool(x) and not (x or {}).get("order_violations") and not (x or {}).get("error")


def row(
    name: str, goal: str, parts: list[dict[str, Any]], short: str | None = None, extra: str = ""
) -> dict[str, Any]:
    """A goals row from its parts: ``met`` False if any part misses, None if any did not run. Each
    figure is named ``short`` (default: the row's name) + its part's label in "a busy machine"."""
    texts: list[str] = []
    status: list[bool | None] = []
    figures: list[dict[str, Any]] = []
    busy: set[int] = set()
    for p in parts:
        label = f"{p['label']}: " if p["label"] else ""
        if not p["vals"] or any(x is None for x in p["runs"]):
            texts.append(f"{label}not run")
            if p["thr"] is not None:
                status.append(None)
            continue
        v = statistics.median(p["vals"])
        ok = all(_ordered(x) for x in p["runs"])
        figures.append({"label": " ".join(filter(None, (short or name, p["label"]))), "value": round(v, 3)})
        text = label + spread_of(p["vals"], 2, p["unit"])
        if p["thr"] is None:
            text += " (reported, not a goal)"
        else:
            status.append((v > p["thr"] if p["strict"] else v >= p["thr"]) and ok)
        if not ok:
            text += " (order violations or error)"
        busy |= {r + 1 for x in p["runs"] for r in (x or {}).get("busy_repeats", [])}
        texts.append(text)
    if extra:
        texts.append(extra)
    if busy:
        texts.append(
            f"**busy: not comparable** (repeat {', '.join(map(str, sorted(busy)))}: load above the cores)"
        )
    met = False if False in status else (None if None in status or not status else True)
    values = [f["value"] for f in figures]
    return {
        "row": name,
        "goal": goal,
        "result": "; ".join(texts),
        "value": values[0] if len(values) == 1 else (values or None),
        "figures": figures,
        "met": met,
    }


def goal_rows(view: View) -> list[dict[str, Any]]:
    """Issue 24's goals for one pass (the quiet or the noisy one), without "a busy machine"."""
    out: list[dict[str, Any]] = []

    def to_raw(wl: str, rid: str, thr: float | None, label: str = "") -> dict[str, Any]:
        return part(label, view.values(wl, rid, "ratio_to_raw"), [view.run(wl, rid)], thr, "x")

    def eff(rid: str, thr: float | None, label: str = "") -> dict[str, Any]:
        return part(label, view.values("w2", rid, "efficiency"), [view.run("w2", rid)], thr)

    out.append(row("W1 c1 sync", ">= 0.60x raw", [to_raw("w1", f"{KC}/c1/sync", 0.60)]))
    c1, c16 = f"{KC}/c1/sync", f"{KC}/c16/sync"
    out.append(
        row(
            "W1 c16 sync / c16 async",
            ">= 0.50x raw each, and c16 sync no slower than c1 sync",
            [
                to_raw("w1", c16, 0.50, "c16 sync"),
                to_raw("w1", f"{KC}/c16/async", 0.50, "c16 async"),
                part(
                    "c16 sync / c1 sync",
                    view.paired("w1", c16, c1),
                    [view.run("w1", c16), view.run("w1", c1)],
                    1.0,
                ),
            ],
            "W1",
        )
    )
    out.append(
        row(
            "W1 c64 sync / c256 async",
            ">= 0.50x raw each",
            [
                to_raw("w1", f"{KC}/c64/sync", 0.50, "c64 sync"),
                to_raw("w1", f"{KC}/c256/async", 0.50, "c256 async"),
            ],
            "W1",
        )
    )
    out.append(
        row(
            "W2 c64 sync / c64 async",
            ">= 0.95 of ideal each",
            [eff(f"{KC}/c64/sync", 0.95, "c64 sync"), eff(f"{KC}/c64/async", 0.95, "c64 async")],
            "W2",
        )
    )
    out.append(row("W2 c256 sync", ">= 0.75 of ideal", [eff(f"{KC}/c256/sync", 0.75)]))
    out.append(
        row(
            "W2 c256 async",
            ">= 0.90 of ideal with uvloop; asyncio's default loop reported",
            [eff(f"{KC}/c256/async", 0.90, "uvloop"), eff(f"{KC}/c256/{ASYNCIO}", None, "asyncio")],
        )
    )
    out.append(w4_row(view))
    points = [f"c{c}/{m}" for c in CONCURRENCIES[1:] for m in MODES]  # every point must run to be met
    out.append(
        row(
            "Redis sequencer / in-memory, W2",
            ">= 0.85 at every point",
            [
                part(
                    p,
                    view.values("w2", f"keyedconsumer-redis/key/{p}", "ratio_to_in_memory"),
                    [view.run("w2", f"keyedconsumer-redis/key/{p}"), view.run("w2", f"{KC}/{p}")],
                    0.85,
                    "x",
                )
                for p in points
            ],
            "Redis / in-memory",
        )
    )
    out.append(pc_row(view))
    return out


def w4_row(view: View) -> dict[str, Any]:
    w4 = [x for x in view.runs("w4") if x["contender"] == "keyedconsumer"]
    name, goal = "W4 1 KB backlog, one blocked key", f">= 0.70x raw, RSS < {W4_RSS_MB} MB"
    if not w4:
        return row(name, goal, [part("", [], [None], 0.70)])
    g = row(
        name,
        goal,
        [
            part(
                x["id"].removeprefix("keyedconsumer/"),
                view.values("w4", x["id"], "ratio_to_raw"),
                [x],
                0.70,
                "x",
            )
            for x in w4
        ],
        "W4",
        "peak RSS " + " / ".join(f"{fmt(x.get('peak_rss_mb'))} MB" for x in w4),
    )
    if any((x.get("peak_rss_mb") or 0) >= W4_RSS_MB for x in w4):
        g["met"] = False
    return g


def pc_row(view: View) -> dict[str, Any]:
    """keyedconsumer key sync / Confluent Parallel Consumer KEY at every concurrency both ran, W1 and
    W2 (both run the handlers on threads): ahead means a median ratio above 1."""
    parts = []
    for wl in ("w1", "w2"):
        for c in CONCURRENCIES:
            k, p = f"{KC}/c{c}/sync", f"parallel-consumer/key/c{c}/sync"
            if view.run(wl, k) and view.run(wl, p):
                parts.append(
                    part(
                        f"{wl.upper()} c{c}",
                        view.paired(wl, k, p),
                        [view.run(wl, k), view.run(wl, p)],
                        1.0,
                        "x",
                        True,
                    )
                )
    return row(
        "Confluent Parallel Consumer, W1 and W2",
        "keyedconsumer (key, sync) ahead at every concurrency both run",
        parts or [part("", [], [None], 1.0)],
        "keyedconsumer / PC",
    )


def busy_row(quiet: list[dict[str, Any]], noisy: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The row "a busy machine": every figure of the quiet pass's goals against the same figure in the noisy
    pass (a busy-loop process beside it, ``--noise``): met when each is within NOISE_TOLERANCE."""
    name = "a busy machine"
    goal = f"the same ratios within {NOISE_TOLERANCE:.0%} with a CPU-bound process beside the bench (--noise)"
    if noisy is None:
        return {
            "row": name,
            "goal": goal,
            "result": "not run (scripts/bench --noise)",
            "value": None,
            "figures": [],
            "met": None,
        }
    pairs = []
    for q, n in zip(quiet, noisy, strict=True):
        nf = {f["label"]: f["value"] for f in n["figures"]}
        for f in q["figures"]:
            if f["label"] in nf and f["value"]:
                pairs.append((f["label"], f["value"], nf[f["label"]], round(nf[f["label"]] / f["value"], 3)))
    if not pairs:
        return {"row": name, "goal": goal, "result": "not run", "value": None, "figures": [], "met": None}
    off = [p for p in pairs if abs(p[3] - 1) > NOISE_TOLERANCE]
    worst = max(pairs, key=lambda p: abs(p[3] - 1))
    shown = off or [worst]
    text = f"{len(pairs) - len(off)} of {len(pairs)} figures within {NOISE_TOLERANCE:.0%}; " + (
        "outside: " if off else "farthest: "
    )
    text += "; ".join(f"{lab} {a:.2f} → {b:.2f} (x{r:.2f})" for lab, a, b, r in shown)
    return {
        "row": name,
        "goal": goal,
        "result": text,
        "value": [p[3] for p in pairs],
        "figures": [{"label": p[0], "quiet": p[1], "noisy": p[2], "noisy_over_quiet": p[3]} for p in pairs],
        "met": not off,
    }


def has_noisy(results: dict[str, Any]) -> bool:
    return any(d.get("noisy_runs") for d in results["workloads"].values())


def goals(results: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(the goals table of the quiet pass with "a busy machine" last, the noisy pass's rows or None)."""
    quiet = goal_rows(View(results, noise=False))
    noisy = goal_rows(View(results, noise=True)) if has_noisy(results) else None
    return [*quiet, busy_row(quiet, noisy)], noisy


def denominators(results: dict[str, Any]) -> list[str]:
    """raw's msg/s per workload, median (min–max) over the repeats, and how long its runs lasted."""
    out = []
    noisy = has_noisy(results)
    for wl, data in results["workloads"].items():
        for key, what in (("runs", " (quiet)" if noisy else ""), ("noisy_runs", " (noisy)")):
            raw = find(data.get(key) or [], "raw")
            if not raw:
                continue
            secs = [
                x["seconds"]
                for x in data.get("repeat_runs", [])
                if x["id"] == "raw" and bool(x.get("noise")) == (key == "noisy_runs") and x.get("seconds")
            ]
            out.append(
                f"{wl.upper()} raw{what}: {spread(raw, 'msg_per_s', 0)} msg/s over "
                f"{spread_of(secs, 1)} s" + ("" if raw.get("complete") else " (time-boxed)")
            )
    return out


def other_checks(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Goals of earlier issues, kept for comparison (not part of issue 24's table)."""
    out: list[dict[str, Any]] = []
    wls = results["workloads"]
    if "w2" in wls:
        for c in CONCURRENCIES[1:]:  # at concurrency 1 both are bound by the 5 ms handler (200 msg/s)
            for mode in MODES:
                r = paired(wls["w2"], f"{KC}/c{c}/{mode}", f"pyrallel-consumer/key/c{c}/async")
                if r:
                    v = statistics.median(r)
                    out.append(
                        {
                            "check": f"W2: keyedconsumer key c{c} {mode} >= 2x pyrallel-consumer key_hash c{c}",
                            "result": spread_of(r),
                            "value": round(v, 3),
                            "met": v >= 2.0,
                        }
                    )
    if "w4" in wls:
        out += w4_rss_checks(wls["w4"]["runs"])
    f1 = find((wls.get("w5") or {}).get("runs") or [], f"{KC}/c1/sync")
    if f1 and f1.get("efficiency") is not None and f1.get("ideal"):
        out.append(
            {
                "check": "flights demo, concurrency=1: >= 0.95 of ideal (the handler alone, back to back)",
                "result": f"{spread(f1, 'efficiency', 2)} of {f1['ideal']['ideal_msg_per_s']:,.0f} msg/s "
                f"({f1['ideal']['bound']}); measured {spread(f1, 'msg_per_s', 0)} msg/s",
                "value": f1["efficiency"],
                "met": f1["efficiency"] >= 0.95 and _ordered(f1),
            }
        )
    return out


def w4_rss_checks(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    raw = find(runs, "raw") or {}
    ref = f"; raw: {raw['rss_growth_max_mb_per_100k']}" if raw.get("rss_growth_max_mb_per_100k") else ""
    for x in runs:
        g = x.get("rss_growth_max_mb_per_100k")
        if x["contender"] != "keyedconsumer" or g is None:
            continue
        net = x.get("rss_net_growth_max_mb_per_100k")
        if net is None:  # a run without the in-flight column: the plain slope
            out.append(
                {
                    "check": f"W4: {x['id']} RSS does not grow with the backlog (highest MB per 100k "
                    f"messages handled over the repeats, 25%→90% of the backlog{ref}; < 2 is flat)",
                    "result": f"{g}",
                    "value": g,
                    "met": g < 2,
                }
            )
        else:
            out.append(
                {
                    "check": f"W4: {x['id']} RSS does not grow with the backlog beyond the blocked key's "
                    "messages it holds by design up to max_in_flight (highest MB per 100k messages "
                    "handled over the repeats, 25%→90% of the backlog, less the held messages' "
                    "values; < 2 is flat)",
                    "result": f"{net} (plain slope {g}{ref})",
                    "value": net,
                    "met": net < 2,
                }
            )
    return out
