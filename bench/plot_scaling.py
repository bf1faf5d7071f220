"""scaling.png from scaling.json (bench/scaling.py): msg/s against N, one panel per workload, one line
per contender (separate instances solid, ``keyedconsumer run --processes N`` dashed), each
contender's linear scaling from its N=1 rate dotted, and **the CPU limit of this machine** as a
horizontal line (its cores / the machine's CPU seconds per message at N=1: an estimate; a starved instance needs
less CPU a message, so N past it can go a little past it), so
that a fall below linear shows whether it is the machine or the design. Each point is the median
over the comparable repeats, its error bar the min-max; a point with no comparable run is hollow.

    bench/.venv-peers/bin/python bench/plot_scaling.py bench/results/scaling.json bench/results/scaling.png

Needs matplotlib, which lives in bench/.venv-peers (never a dependency of the package).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STYLE = {
    "raw": dict(marker="x", color="black"),
    "keyedconsumer": dict(marker="o", color="tab:blue"),
    "keyedconsumer-redis": dict(marker="D", color="tab:green"),
    "keyedconsumer-procs": dict(marker="s", color="tab:orange", ls="--"),
}
TITLES = {"w1": "W1 no-op handler", "w2": "W2 I/O-bound handler"}


def main(src: str, dst: str) -> None:
    res = json.load(open(src))
    rows = res["summary"]
    workloads = sorted({r.get("workload", "w2") for r in rows})
    fig, axes = plt.subplots(1, len(workloads), figsize=(6.4 * len(workloads), 5.2), squeeze=False)
    ncpu = res["machine"].get("nproc")
    for ax, wl in zip(axes[0], workloads, strict=True):
        series: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in rows:
            if r.get("workload", "w2") == wl and r.get("msg_per_s"):
                series[r["contender"]].append(r)
        top = 0.0
        for c, pts in sorted(series.items()):
            pts.sort(key=lambda r: r["instances"])
            xs = [r["instances"] for r in pts]
            ys = [r["msg_per_s"] for r in pts]
            lo = [y - min(r.get("msg_per_s_all") or [y]) for r, y in zip(pts, ys, strict=True)]
            hi = [max(r.get("msg_per_s_all") or [y]) - y for r, y in zip(pts, ys, strict=True)]
            style = dict(STYLE.get(c, {}))
            ls = style.pop("ls", "-")
            ax.errorbar(xs, ys, yerr=[lo, hi], fmt=ls, capsize=2, label=c, **style)
            hollow = [
                (x, y) for x, y, r in zip(xs, ys, pts, strict=True) if not r.get("comparable_repeats", 1)
            ]
            if hollow:
                ax.plot(*zip(*hollow, strict=True), "o", mfc="white", color=style.get("color"))
            one = next((r["msg_per_s"] for r in pts if r["instances"] == 1), None)
            if one:
                ax.plot(xs, [one * x for x in xs], ":", lw=1, color=style.get("color"))
            limit = pts[0].get("cpu_limit_msg_per_s")
            if limit and c in ("keyedconsumer", "keyedconsumer-redis"):
                ax.axhline(
                    limit,
                    color=style.get("color"),
                    ls="-.",
                    lw=1.2,
                    label=f"CPU limit of this machine ({ncpu} cores), {c}: {limit:,.0f} msg/s",
                )
            top = max(top, *ys, limit or 0)
        ax.set_xscale("log", base=2)
        ns = sorted({r["instances"] for r in rows})
        ax.set_xticks(ns)
        ax.set_xticklabels([str(n) for n in ns])
        ax.set_ylim(0, top * 1.15 if top else 1)
        ax.set_xlabel("N (instances, or processes of one supervisor)")
        ax.set_ylabel("msg/s")
        ax.set_title(TITLES.get(wl, wl.upper()))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    m = res["machine"]
    fig.suptitle(
        f"keyedconsumer scaling {res['started']} UTC, {m.get('nproc')} CPUs {m.get('cpu')}, "
        f"python {m.get('python')}, librdkafka {m.get('librdkafka')}\n({res['size']} size; median of the "
        "comparable repeats, bars: min-max; dotted: linear from N=1)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
