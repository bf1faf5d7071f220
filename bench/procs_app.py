"""The app of bench/scaling.py's multi-process contender (``keyedconsumer-procs``), one route:

    KC_BENCH_SPEC='<spec json>' python -m keyedconsumer run procs_app:app --app-dir bench --processes N

The spec is bench/contender.py's (brokers, topic, group, concurrency, ordering, mode, sleep_ms,
max_in_flight, sample_s, lat_every, target) plus ``work_dir``. The supervisor imports nothing of it:
each child imports this module after the fork, so everything here is the child's own. A child
counts and checks its messages with bench/common.py's ``Recorder`` and the same handler as
bench/contender.py (``make_handlers``), rewrites ``<work_dir>/progress-<pid>`` at each sample, and,
in the app's shutdown hook (the supervisor's SIGTERM drained it), writes
``<work_dir>/result-<pid>.json``: the fields of contender.py's result that bench/scaling.py reads.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Recorder, Sampler  # noqa: E402
from contender import Block, kc_options, make_handlers, progress_writer  # noqa: E402

from keyedconsumer import KeyedApp, Message  # noqa: E402

T_PROCESS = time.perf_counter()
SPEC: dict[str, Any] = json.loads(os.environ["KC_BENCH_SPEC"])
WORK = Path(SPEC["work_dir"])

rec = Recorder(SPEC["target"], SPEC.get("lat_every", 1))
sampler = Sampler(rec, SPEC.get("sample_s", 1.0))
sampler.on_sample = progress_writer(str(WORK / f"progress-{os.getpid()}"), rec)
sync_h, async_h = make_handlers(SPEC, rec, Block(None, 0, 0.0))

# the same options as the instances' KeyedConsumer; the route's group is the spec's
options = {k: v for k, v in kc_options(SPEC).items() if k not in ("name", "topics")}
app = KeyedApp(group_id=SPEC["group"], **options)

if SPEC["mode"] == "async":

    @app.handler(SPEC["topic"], name="bench")
    async def handle_async(msg: Message) -> None:
        await async_h(msg.key, msg.value, msg.timestamp_ms)

else:

    @app.handler(SPEC["topic"], name="bench")
    def handle(msg: Message) -> None:
        sync_h(msg.key, msg.value, msg.timestamp_ms)


@app.on_startup
def start_sampling() -> None:
    sampler.start()


@app.on_shutdown
def write_result() -> None:
    sampler.stop()
    result = {
        "handled": rec.handled,
        "startup_s": round(rec.t_first - T_PROCESS, 2) if rec.t_first is not None else None,
        "order_violations": rec.violations,
        "order_backward": rec.backward,
        "peak_rss_mb": max((s[1] for s in sampler.samples), default=None),
        "rss_samples": sampler.samples,
        "samples_t0": sampler.t0,
        "error": None,
    }
    tmp = WORK / f"result-{os.getpid()}.json.tmp"
    tmp.write_text(json.dumps(result))
    tmp.replace(WORK / f"result-{os.getpid()}.json")
