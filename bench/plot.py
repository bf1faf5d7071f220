"""throughput.png from results.json: msg/s against concurrency, one line per contender series, one
panel per workload (raw as a dashed line; the ideal for the I/O-bound workloads as a dotted line);
each point is the median over the repeats, its error bar the min-max.

    bench/.venv-peers/bin/python bench/plot.py bench/results/results.json bench/results/throughput.png

Needs matplotlib, which lives in bench/.venv-peers (never a dependency of the package).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STYLE = {
    "keyedconsumer": dict(marker="o"),
    "keyedconsumer-redis": dict(marker="D"),
    "parallel-consumer": dict(marker="P"),
    "pyrallel-consumer": dict(marker="s"),
    "faststream": dict(marker="^"),
    "faststream-unordered": dict(marker="v"),
}


def main(src: str, dst: str) -> None:
    res = json.load(open(src))
    wls = [(k, v) for k, v in res["workloads"].items() if k not in ("w4", "w5") and v.get("runs")]
    if not wls:
        wls = list(res["workloads"].items())
    fig, axes = plt.subplots(1, len(wls), figsize=(6.2 * len(wls), 5.2), squeeze=False)
    for ax, (wl, data) in zip(axes[0], wls, strict=False):
        series: dict[str, list[tuple[int, float, float, float]]] = defaultdict(list)
        raw = None
        ideal: dict[int, float] = {}
        for r in data["runs"]:
            if not r.get("msg_per_s"):
                continue
            if r["contender"] == "raw":
                raw = r["msg_per_s"]
                continue
            label = f"{r['contender']} {r['ordering']} {r['mode']}"
            v = r["msg_per_s"]  # the median over the repeats; the error bar spans min-max
            series[label].append(
                (r["concurrency"], v, v - r.get("msg_per_s_min", v), r.get("msg_per_s_max", v) - v)
            )
            if r["contender"] == "keyedconsumer" and r["ordering"] == "key" and r.get("ideal"):
                ideal[r["concurrency"]] = r["ideal"]["ideal_msg_per_s"]
        for label, pts in sorted(series.items()):
            pts.sort()
            name = label.split()[0]
            ls = "-" if label.endswith("sync") and not label.endswith("async") else "--"
            ax.errorbar(
                [p[0] for p in pts],
                [p[1] for p in pts],
                yerr=[[p[2] for p in pts], [p[3] for p in pts]],
                fmt=ls,
                capsize=2,
                label=label,
                **STYLE.get(name, {}),
            )
        if raw:
            ax.axhline(raw, color="black", ls="-.", lw=1, label=f"raw confluent-kafka ({raw:,.0f}/s)")
        if ideal:
            xs = sorted(ideal)
            ax.plot(xs, [ideal[x] for x in xs], ":", color="gray", lw=2, label="ideal (ordering key)")
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 8, 16, 64, 256])
        ax.set_xticklabels(["1", "8", "16", "64", "256"])
        ax.set_xlim(0.8, 320)
        ax.set_yscale("log")
        ax.set_xlabel("concurrency")
        ax.set_ylabel("msg/s")
        ax.set_title(f"{wl.upper()} {data['title']} ({data['messages']:,} msgs)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    m = res["machine"]
    fig.suptitle(
        f"keyedconsumer benchmark {res['started']} UTC, {m['nproc']} CPUs {m['cpu']}, "
        f"python {m['python']}, librdkafka {m['librdkafka']} ({res['size']} size; median of "
        f"{res.get('repeats', 1)} repeat(s), bars: min-max)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
