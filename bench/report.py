"""results.md and the goals printed on stdout, from bench/run.py's results (standard library only)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from goals import denominators, find, fmt, paired, spread, spread_of
from machine_load import BUSY_CORES, BUSY_WINDOW_S

#: a full-size run shorter than this is flagged "short" (every run is meant to last 10 s or more)
MIN_RUN_S = 10.0


def side_by_side(data: dict[str, Any]) -> list[str]:
    """keyedconsumer (key) next to Confluent Parallel Consumer (KEY) and pyrallel-consumer
    (key_hash) at each concurrency: median msg/s (min-max); the ratios are per repeat, then the median."""
    runs = data["runs"]
    cs = sorted(
        {x["concurrency"] for x in runs if x["contender"] == "parallel-consumer"}
        | {x["concurrency"] for x in runs if x["contender"] == "keyedconsumer" and x["ordering"] == "key"}
    )
    if not any(x["contender"] == "parallel-consumer" for x in runs):
        return []
    eff = bool(data.get("sleep_ms"))
    what = "efficiency vs ideal" if eff else "ratio to raw"
    L = [
        "| concurrency | keyedconsumer key sync | keyedconsumer key async | parallel-consumer KEY (sync commits) "
        "| keyedconsumer sync / parallel-consumer | keyedconsumer async / parallel-consumer "
        f"| pyrallel-consumer key_hash async | {what}: kc sync / kc async / PC |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for c in cs:
        ids = [
            f"keyedconsumer/key/c{c}/sync",
            f"keyedconsumer/key/c{c}/async",
            f"parallel-consumer/key/c{c}/sync",
        ]
        ks, ka, p = (find(runs, i) for i in ids)
        py = find(runs, f"pyrallel-consumer/key/c{c}/async")
        ratios = [spread_of(paired(data, i, ids[2])) for i in ids[:2]]
        key = "efficiency" if eff else "ratio_to_raw"
        rel = " / ".join(fmt(x.get(key), 2) if x else "–" for x in (ks, ka, p))
        L.append(
            f"| {c} | {msgs(ks)} | {msgs(ka)} | {msgs(p)} | {ratios[0]} | {ratios[1]} | {msgs(py)} | {rel} |"
        )
    return L


def msgs(x: dict[str, Any] | None) -> str:
    return spread(x, "msg_per_s", 0) if x else "–"


def met_text(met: bool | None, no: str = "**no**") -> str:
    return "–" if met is None else ("yes" if met else no)


def header(results: dict[str, Any]) -> list[str]:
    m = results["machine"]
    noise = results.get("noise") or {}
    L = [f"# keyedconsumer benchmark ({results['size']} size)", ""]
    L.append(
        f"- date: {results['started']} UTC, wall time {results['wall_s'] / 60:.1f} min; "
        f"{results.get('repeats', 1)} repeat(s) of every contender, round-robin"
        + ("; each repeat a quiet and a noisy pass (`--noise`)" if noise.get("enabled") else "")
    )
    L.append(
        f"- machine: {m['nproc']} CPUs ({m['cpu']}), {m['memory_gb']} GB RAM, {m['os']}; "
        f"load average at start {m.get('loadavg_start')}, at end {m.get('loadavg_end')}"
    )
    L.append(
        f"- python {m['python']}, confluent-kafka {m['confluent_kafka']}, librdkafka {m['librdkafka']}; "
        f"keyedconsumer {m.get('keyedconsumer_commit')}"
    )
    pv = m.get("peers_venv")
    if pv:
        L.append("- peers venv: " + ", ".join(f"{k} {v}" for k, v in pv.items()))
    if m.get("parallel_consumer"):
        L.append(
            f"- Confluent Parallel Consumer: parallel-consumer-core {m['parallel_consumer']} on {m.get('java')}"
        )
    L.append(f"- broker: {results['brokers']}; command: `{results['command']}`")
    if noise.get("passes"):
        used = [p["cores_used"] for p in noise["passes"] if p.get("cores_used") is not None]
        L.append(
            f"- noise: a busy-loop process beside each noisy pass ({len(noise['passes'])} passes, "
            f"{spread_of(used)} cores used by it); after each, up to {fmt(noise.get('cool_down_limit_s'), 0)} s "
            "of cool-down for the other work's CPU"
        )
    busy = sum(
        len(x.get("busy_repeats") or []) for d in results["workloads"].values() for x in d.get("runs", [])
    )
    if busy:
        L.append(
            f"- **{busy} run(s) started while other work kept more than {BUSY_CORES} cores busy: "
            '"busy: not comparable" in the tables**'
        )
    return [*L, ""]


def goals_section(results: dict[str, Any]) -> list[str]:
    L = [
        "## Goals (ratios within one run: median over the repeats, min–max in brackets)",
        "",
        "| row | goal | result | met |",
        "| --- | --- | --- | :---: |",
    ]
    L += [f"| {g['row']} | {g['goal']} | {g['result']} | {met_text(g['met'])} |" for g in results["goals"]]
    L += ["", "Denominators (raw, msg/s median (min–max) over the repeats, and its runs' length):", ""]
    L += [f"- {d}" for d in denominators(results)] + [""]
    noisy = results.get("goals_noisy")
    if noisy:
        L += [
            "### The same goals under noise (a busy-loop process beside the noisy pass)",
            "",
            "| row | goal | quiet | noisy | met (noisy) |",
            "| --- | --- | --- | --- | :---: |",
        ]
        for q, n in zip(results["goals"], noisy, strict=False):
            L.append(f"| {q['row']} | {q['goal']} | {q['result']} | {n['result']} | {met_text(n['met'])} |")
        L.append("")
    if results.get("other_checks"):
        L += [
            "### Other checks (goals of earlier issues)",
            "",
            "| check | result | met |",
            "| --- | ---: | :---: |",
        ]
        L += [f"| {g['check']} | {g['result']} | {met_text(g['met'])} |" for g in results["other_checks"]]
        L.append("")
    return L


def run_notes(results: dict[str, Any], data: dict[str, Any], x: dict[str, Any]) -> list[str]:
    notes = []
    if x.get("busy_repeats"):
        reps = ", ".join(str(r + 1) for r in x["busy_repeats"])
        notes.append(f"**busy: not comparable** (repeat {reps}: other work > {BUSY_CORES} cores before it)")
    if x.get("error"):
        notes.append("ERROR: " + x["error"].splitlines()[0][:160])
    elif not x.get("complete"):
        notes.append(f"capped at {x.get('seconds')} s (median run)")
    if (
        results["size"] == "full"
        and x.get("seconds") is not None
        and x["seconds"] < MIN_RUN_S
        and not data.get("demo")
    ):
        notes.append(f"short: {x['seconds']} s")
    if x.get("target") and x["target"] < data["messages"] and not data.get("demo"):
        notes.append(f"prefix of {x['target']:,}")
    if x.get("ideal"):
        notes.append(f"ideal {x['ideal']['ideal_msg_per_s']:,.0f}/s ({x['ideal']['bound']})")
    if x.get("ratio_to_in_memory") is not None:
        notes.append(f"{spread(x, 'ratio_to_in_memory', 2, 'x')} the in-memory sequencer")
    if x.get("speed_up") is not None:
        notes.append(f"speed-up {spread(x, 'speed_up', 1, 'x')} over concurrency=1")
    loop = (x.get("settings") or {}).get("event_loop")
    if loop:
        notes.append(f"event_loop={loop!r}")
    if data.get("demo"):
        st = x.get("settings") or {}
        notes.append(
            f"start-up {st.get('startup_s')} s and stop() {st.get('stop_s')} s not counted; "
            f"mean handler inside the run {st.get('handler_ms_mean')} ms"
        )
    if x.get("block"):
        notes.append(
            f"block released after {x['block'].get('released_after_s')} s "
            f"at {fmt(x['block'].get('handled_at_release'))} handled, "
            f"RSS then {x['block'].get('rss_mb_at_release')} MB"
        )
    if x.get("rss_growth"):
        notes.append(
            f"RSS 25%→90% of backlog: {x['rss_growth']['rss_mb_at_25pct']}→{x['rss_growth']['rss_mb_at_90pct']} MB"
        )
    if x.get("peak_in_flight") is not None:
        notes.append(f"peak in-flight {x['peak_in_flight']:,}")
    acq = (x.get("settings") or {}).get("lease_acquire_calls")
    if acq is not None and x.get("handled"):
        notes.append(f"Redis lease acquires {acq:,} ({acq / x['handled']:.2f} per message)")
    return notes


def pair(x: dict[str, Any], a: str, b: str) -> str:
    return f"{fmt(x.get(a))} / {fmt(x.get(b))}" if x.get(a) is not None else "–"


def loads(x: dict[str, Any]) -> str:
    """Each repeat's 1-minute load average before → after its run."""
    return ", ".join(f"{fmt(a, 1)}→{fmt(b, 1)}" for a, b in x.get("load_1min") or []) or "–"


def workload_table(
    results: dict[str, Any], wl: str, data: dict[str, Any], runs: list[dict[str, Any]]
) -> list[str]:
    L = [
        "| contender | workload | ordering | concurrency | sync/async | repeats | handled (median run) "
        "| msg/s median (min–max) | ratio to raw | efficiency vs ideal "
        "| p50/p99 latency ms (produce→start) | p50/p99 ms backlog-aligned "
        "| peak RSS MB | order violations | load 1-min before→after (each repeat) | notes |",
        "| --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for x in runs:
        L.append(
            f"| {x['contender']} | {wl.upper()} | {x['ordering']} | {x['concurrency']} | {x['mode']} "
            f"| {x.get('repeats', 1)} | {fmt(x.get('handled'))} | {spread(x, 'msg_per_s', 0)} "
            f"| {spread(x, 'ratio_to_raw')} | {spread(x, 'efficiency')} | {pair(x, 'lat_p50_ms', 'lat_p99_ms')} "
            f"| {pair(x, 'aligned_p50_ms', 'aligned_p99_ms')} | {fmt(x.get('peak_rss_mb'))} "
            f"| {fmt(x.get('order_violations'))} | {loads(x)} | {'; '.join(run_notes(results, data, x))} |"
        )
    return [*L, ""]


def workload_section(results: dict[str, Any], wl: str, data: dict[str, Any]) -> list[str]:
    if data.get("demo"):
        L = [
            f"## {wl.upper()} {data['title']}: examples/flights.py on the first {data['messages']:,} flights, "
            f"8 partitions keyed by aircraft, a 2 ms handler; concurrency=1 on a sample of "
            f"{data['sample']:,}, concurrency=64 on all"
        ]
    else:
        L = [
            f"## {wl.upper()} {data['title']}: {data['messages']:,} x {data['size']} B, "
            f"{data['partitions']} partition(s), {data['keys']:,} keys"
            + (f", handler waits {data['sleep_ms']} ms" if data["sleep_ms"] else ", no-op handler")
        ]
    L.append("")
    run = data.get("run") or {}
    if run and (run.get("started") != results["started"] or run.get("command") != results["command"]):
        L += [
            f"- run separately: {run.get('started')} UTC, {fmt(run.get('wall_s'), 0)} s, `{run.get('command')}`, "
            f"{run.get('repeats', 1)} repeat(s), keyedconsumer {run.get('keyedconsumer_commit')}",
            "",
        ]
    if data.get("notes"):
        L += [f"- {n}" for n in data["notes"]] + [""]
    L += workload_table(results, wl, data, data["runs"])
    if data.get("noisy_runs"):
        L += [f"### {wl.upper()} noisy pass (a busy-loop process beside it)", ""]
        L += workload_table(results, wl, data, data["noisy_runs"])
    return L


def write_markdown(results: dict[str, Any], path: Path) -> None:
    L = header(results)
    if results.get("goals"):
        L += goals_section(results)
    for wl, data in results["workloads"].items():
        sbs = side_by_side(data) if wl in ("w1", "w2", "w3") else []
        if sbs:
            L += [
                f"## {wl.upper()} side by side: keyedconsumer and Confluent Parallel Consumer (msg/s, median "
                "(min–max) over the repeats)",
                "",
                *sbs,
                "",
            ]
    for wl, data in results["workloads"].items():
        L += workload_section(results, wl, data)
    if results.get("skipped"):
        L += ["## Not run", ""] + [f"- {s['id']}: {s['reason']}" for s in results["skipped"]] + [""]
    L += ["## How to read this", ""] + [f"- {n}" for n in results["notes"]] + [""]
    path.write_text("\n".join(L))


def print_goals(results: dict[str, Any]) -> None:
    """The goals table on stdout (the same as in results.md), raw's figures, and the noisy pass's."""

    def table(title: str, goals: list[dict[str, Any]]) -> None:
        rows = [(g["row"], g["goal"], g["result"], met_text(g["met"], "NO")) for g in goals]
        w = [max(len(r[i]) for r in rows) for i in range(2)]
        print(title)
        for row, goal, res, met in rows:
            print(f"  {row:{w[0]}}  {goal:{w[1]}}  {met:3}  {res}")

    if not results.get("goals"):
        return
    n = results.get("repeats", 1)
    table(f"\nGoals ({n} repeat(s); median of the per-repeat ratios, min–max in brackets)", results["goals"])
    for d in denominators(results):
        print(f"  {d}")
    if results.get("goals_noisy"):
        table("\nThe same goals in the noisy pass (a busy-loop process beside it)", results["goals_noisy"])
    print(flush=True)


NOTES = [
    "Every contender runs in its own process on the same topic data, each run with a fresh consumer group. "
    "Each workload runs its contenders round-robin, once per repeat (raw, keyedconsumer..., peers; then again), "
    "so a change of the machine's load hits raw and keyedconsumer alike. Absolute numbers depend on the (shared, "
    "noisy) machine; ratios compare runs of one repeat.",
    "msg/s: the median over the repeats, with the lowest and highest in brackets. Ratios (to raw, to the ideal, "
    "Redis to in-memory, keyedconsumer to a peer, c16 to c1, c64 to c1) are computed within each repeat (and pass) "
    "against the run of the same repeat; the table shows their median and min–max. Handled count, latency and RSS "
    "samples are those of the repeat with the median msg/s; order violations are summed over the repeats and peak "
    "RSS is the highest.",
    "msg/s of one run: handled messages / seconds from the first handler start to the end of the last handled "
    "message. A run ends when its target is handled or at its cap (max_seconds after its first message: 12 s for "
    "workload 1, 15 s for workload 2, 30 s for workload 3, 120 s for workload 4 (30 s for the peers)); a capped run "
    'counts what was handled by the cap, over the time to the cap ("capped"). Neither counts the contender\'s '
    "start-up nor its stop.",
    'Sizing: every full-size run lasts about 10 s or more (a shorter one is flagged "short"). Workload 1 has '
    "10,000,000 messages, more than any contender consumes in its 12 s, so every run, raw's too, is time-boxed at "
    "12 s. Workloads 2 and 3: each run handles the prefix of the topic whose ideal time is 10 s "
    '("prefix of N"), e.g. 2,000 messages at concurrency 1 and 512,000 at 256, and is compared with the ideal of '
    "that prefix.",
    "efficiency = msg/s / ideal; ideal = usable concurrency / handler wait, where usable concurrency is "
    "min(concurrency, distinct keys among the first max_in_flight messages) for ordering=key, "
    "min(concurrency, partitions) for ordering=partition (and for raw: 1), concurrency for ordering=none; "
    "bounded by the longest chain of one key for ordering=key (workload 3's hot keys). Workload 5 (flights): "
    "ideal = 1 / the time per message of the same handler called back to back with no consumer running.",
    "keyedconsumer's async runs use uvloop (event_loop='uvloop'); async-asyncio runs use asyncio's default loop "
    "(event_loop='asyncio').",
    "load 1-min before→after: the machine's 1-minute load average (/proc/loadavg) when each repeat's run started "
    "and ended. A run before which other work kept more than "
    f"{BUSY_CORES} cores busy (/proc/stat over {BUSY_WINDOW_S:.0f} s while the bench ran nothing) shared the machine and is "
    'marked "busy: not comparable" (not in the noisy pass, whose load is expected).',
    "--noise: each repeat runs every contender twice, a quiet pass and then a noisy one with a busy-loop process "
    '(one core of pure Python) beside it; ratios are taken within a pass. "a busy machine" compares each goal '
    "figure of the noisy pass with the quiet pass's.",
    "latency (produce→start) = handler start - the record's produce timestamp (Kafka CreateTime, set by the "
    "producer; pyrallel-consumer does not expose it, so it is read from the value, where the producer wrote the same number). "
    "The input is produced once before all runs, so it mostly measures how long the backlog waited; "
    "backlog-aligned latency subtracts (first handler start - first produce time), i.e. it is the latency of a replay of the "
    "topic at its produce rate started when the run started (clamped at 0): comparable across contenders.",
    "peak RSS: the highest RSS of the contender process and its children, sampled every second (the harness's own "
    "per-message latency array, 8 bytes per sampled message, is included for every contender; parallel-consumer is a JVM "
    "with its default heap sizing).",
    "order violations: a message whose per-key sequence number is not the previous one + 1 (reordering, duplicate "
    "or gap); must be 0 for ordering key and partition. ordering=none and faststream-unordered promise no order.",
    "raw gets keyedconsumer's librdkafka fetch settings (queued.max.messages.kbytes, fetch.queue.backoff.ms: "
    "bench/common.py FETCH_SETTINGS, read from keyedconsumer's config at run time; see its settings in results.json), "
    "so workload 4's ratio compares the consumers, not two prefetch configurations.",
]
