"""Run ONE contender on one prepared topic and print its measurements as one JSON line.

    python bench/contender.py '<spec json>'

Started by bench/run.py as a subprocess: raw and keyedconsumer with the project venv's python,
pyrallel-consumer and faststream with bench/.venv-peers/bin/python (so the peers never import into
the project venv). Only the selected library is imported.

The spec (a JSON object) names: contender, ordering, concurrency, mode (sync|async), brokers, topic,
group, target (messages to handle before the run ends), sleep_ms (handler wait), max_seconds (cap
from the first message), max_in_flight, batch_size, block_key / block_count / stall_s (workload 4),
produce_t0_ms, event_loop (keyedconsumer's ``event_loop`` option for async handlers: a mode
``async`` or ``async-asyncio``; absent: the option's default); and, for runs of several instances in one group (bench/scaling.py): stop_file (the run
ends when this file exists) and progress_file (rewritten with "<handled> <perf_counter>" at each sample).

The last stdout line is ``BENCH_RESULT {json}``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import threading
import time
import traceback
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import FETCH_SETTINGS, Recorder, Sampler, percentile, value_ts, vm_hwm_bytes  # noqa: E402

T_PROCESS = time.perf_counter()


class Block:
    """Workload 4: every message of ``key`` waits until released. Released when the handled count
    has not moved for ``stall_s`` seconds (the consumer has stalled behind the blocked key) or when
    everything else is handled."""

    def __init__(self, key: bytes | None, others: int, stall_s: float) -> None:
        self.key = key
        self.others = others
        self.stall_s = stall_s
        self.released = threading.Event()
        if key is None:
            self.released.set()
        self.info: dict[str, Any] = {}

    def watch(self, rec: Recorder, sampler: Sampler) -> None:
        if self.key is None:
            return
        last, since = -1, time.perf_counter()
        while not self.released.is_set() and not rec.done.is_set():
            time.sleep(0.25)
            h = rec.handled
            now = time.perf_counter()
            if h != last:
                last, since = h, now
            if rec.t_first is None:
                since = now
                continue
            if now - since >= self.stall_s or h >= self.others:
                sampler.sample()
                self.info = {
                    "released_after_s": round(now - rec.t_first, 2),
                    "handled_at_release": h,
                    "reason": "all other keys handled"
                    if h >= self.others
                    else f"no progress for {self.stall_s:g} s",
                    "rss_mb_at_release": sampler.samples[-1][1],
                }
                self.released.set()


def make_handlers(spec: dict[str, Any], rec: Recorder, block: Block):  # type: ignore[no-untyped-def]
    """(sync_handle(key, value, ts_ms), async_handle(key, value, ts_ms)) for this workload."""
    sleep_s = spec["sleep_ms"] / 1000.0
    begin, end = rec.begin, rec.end
    bkey = block.key
    released = block.released

    if bkey is not None:

        def sync_h(key: bytes, value: bytes, ts: int) -> None:
            begin(key, value, ts)
            if key == bkey:
                released.wait()
            if sleep_s:
                time.sleep(sleep_s)
            end(key)

        async def async_h(key: bytes, value: bytes, ts: int) -> None:
            begin(key, value, ts)
            if key == bkey:
                while not released.is_set():
                    await asyncio.sleep(0.02)
            if sleep_s:
                await asyncio.sleep(sleep_s)
            end(key)

    elif sleep_s:

        def sync_h(key: bytes, value: bytes, ts: int) -> None:
            begin(key, value, ts)
            time.sleep(sleep_s)
            end(key)

        async def async_h(key: bytes, value: bytes, ts: int) -> None:
            begin(key, value, ts)
            await asyncio.sleep(sleep_s)
            end(key)

    else:

        def sync_h(key: bytes, value: bytes, ts: int) -> None:
            begin(key, value, ts)
            end(key)

        async def async_h(key: bytes, value: bytes, ts: int) -> None:
            begin(key, value, ts)
            end(key)

    return sync_h, async_h


def wait_done(rec: Recorder, spec: dict[str, Any], stop: threading.Event | None = None) -> None:
    """Block until the target is handled or ``max_seconds`` passed since the first message (or since
    start, plus ``startup_s``, if nothing arrives)."""
    max_s, startup_s = spec["max_seconds"], spec.get("startup_s", 60.0)
    stop_file = spec.get("stop_file")
    while not rec.done.wait(0.05):
        if stop is not None and stop.is_set():
            return
        if stop_file and os.path.exists(stop_file):
            return
        now = time.perf_counter()
        if rec.t_first is None:
            if now - T_PROCESS > startup_s:
                return
        elif now - rec.t_first > max_s:
            if rec.t_cap is None:
                rec.handled_at_cap, rec.t_cap = rec.handled, now
            return


async def await_done(rec: Recorder, spec: dict[str, Any]) -> None:
    await asyncio.to_thread(wait_done, rec, spec)


# ------------------------------------------------------------------------------------ contenders


def kc_options(spec: dict[str, Any]) -> dict[str, Any]:
    """The KeyedConsumer options of a keyedconsumer run (and the source of raw's fetch settings)."""
    opts: dict[str, Any] = dict(
        name=spec["group"],
        brokers=[spec["brokers"]],
        topics=[spec["topic"]],
        concurrency=spec["concurrency"],
        ordering=spec["ordering"] if spec["ordering"] in ("key", "partition", "none") else "key",
        max_in_flight=spec["max_in_flight"],
    )
    if spec.get("batch_size"):
        opts["batch_size"] = spec["batch_size"]
    if spec.get("event_loop") and is_async(spec):
        opts["event_loop"] = spec["event_loop"]  # "uvloop" (mode async) or "asyncio" (mode async-asyncio)
    return opts


def is_async(spec: dict[str, Any]) -> bool:
    """``async def`` handlers: mode ``async`` (and ``async-asyncio``, keyedconsumer on asyncio's loop)."""
    return str(spec["mode"]).startswith("async")


def kc_fetch_settings(spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the FETCH_SETTINGS keyedconsumer gives librdkafka for this run's options, its other fetch and
    queue properties, which raw does not get), read at run time from its config, so raw follows the
    engine's defaults when they change."""
    from keyedconsumer.config import ConsumerConfig

    conf = ConsumerConfig(**kc_options(spec)).librdkafka()
    other = {k: v for k, v in conf.items() if k.startswith(("fetch.", "queued.")) and k not in FETCH_SETTINGS}
    return {k: conf[k] for k in FETCH_SETTINGS if k in conf}, other


def run_raw(spec: dict[str, Any], rec: Recorder, block: Block) -> dict[str, Any]:
    from confluent_kafka import Consumer, KafkaError

    fetch, not_copied = kc_fetch_settings(spec)
    conf = {
        "bootstrap.servers": spec["brokers"],
        "group.id": spec["group"],
        "enable.auto.offset.store": False,
        "enable.auto.commit": True,
        "auto.offset.reset": "earliest",
        **fetch,  # the same prefetch bounds as keyedconsumer (bench/README.md, "Fetch settings")
    }
    c = Consumer(conf)
    c.subscribe([spec["topic"]])
    sync_h, _ = make_handlers(spec, rec, block)
    batch = spec.get("batch_size", 500)
    done = rec.done
    deadline_check = threading.Event()
    threading.Thread(target=lambda: (wait_done(rec, spec), deadline_check.set()), daemon=True).start()
    store = c.store_offsets
    try:
        while not done.is_set() and not deadline_check.is_set():
            for m in c.consume(num_messages=batch, timeout=0.1):
                if m.error() is not None:
                    if m.error().code() != KafkaError._PARTITION_EOF:
                        print("raw: consume error", m.error(), file=sys.stderr)
                    continue
                sync_h(m.key(), m.value(), m.timestamp()[1])
                store(message=m)
    finally:
        c.close()
    unset = [k for k in FETCH_SETTINGS if k not in fetch]
    return {
        "settings": {
            "client": "confluent-kafka Consumer",
            "consume(num_messages)": batch,
            "enable.auto.offset.store": False,
            "store_offsets": "per message",
            "enable.auto.commit": True,
            "fetch settings from keyedconsumer's config": fetch,
            **({"librdkafka defaults (keyedconsumer sets none)": unset} if unset else {}),
            "keyedconsumer's other fetch settings (not copied)": not_copied,
        }
    }


def run_keyedconsumer(spec: dict[str, Any], rec: Recorder, block: Block, sampler: Sampler) -> dict[str, Any]:
    from keyedconsumer import KeyedConsumer

    sync_h, async_h = make_handlers(spec, rec, block)
    if is_async(spec):

        async def handler(msg):  # type: ignore[no-untyped-def]
            await async_h(msg.key, msg.value, msg.timestamp_ms)

    else:

        def handler(msg):  # type: ignore[no-untyped-def]
            sync_h(msg.key, msg.value, msg.timestamp_ms)

    opts = kc_options(spec)
    seq = None
    if spec["contender"] == "keyedconsumer-redis":  # the Redis sequencer: per-key leases across instances
        from keyedconsumer import RedisSequencer

        seq = RedisSequencer(spec["redis_url"], spec["group"])
    kc = KeyedConsumer(handler=handler, sequencer=seq, **opts)
    sampler.held = lambda: kc.in_flight  # W4: the blocked key's messages wait in the engine, by design

    def stopper() -> None:
        wait_done(rec, spec)
        block.released.set()
        kc.stop()

    threading.Thread(target=stopper, daemon=True).start()
    kc.run()
    settings: dict[str, Any] = {k: v for k, v in opts.items() if k not in ("name", "brokers", "topics")}
    lib = kc.config.librdkafka()
    settings["librdkafka fetch settings"] = {k: lib[k] for k in FETCH_SETTINGS if k in lib}
    if seq is not None:
        settings["sequencer"] = repr(seq)
        settings["lease_acquire_calls"] = seq.acquire_calls
    return {"settings": settings, "peak_in_flight": kc.peak_in_flight}


def run_pyrallel(spec: dict[str, Any], rec: Recorder, block: Block) -> dict[str, Any]:
    from pyrallel_consumer.config import KafkaConfig
    from pyrallel_consumer.consumer import PyrallelConsumer
    from pyrallel_consumer.dto import ExecutionMode, OrderingMode

    if spec["mode"] != "async":
        raise SystemExit("pyrallel-consumer runs sync workers only in its process mode (not benchmarked)")
    _, async_h = make_handlers(spec, rec, block)

    async def worker(item):  # type: ignore[no-untyped-def]
        v = item.payload
        await async_h(item.key, v, value_ts(v))

    cfg = KafkaConfig(
        BOOTSTRAP_SERVERS=spec["brokers"],
        CONSUMER_GROUP=spec["group"],
        AUTO_OFFSET_RESET="earliest",
        dlq_enabled=False,
    )
    pc = cfg.parallel_consumer
    pc.ordering_mode = {
        "key": OrderingMode.KEY_HASH,
        "partition": OrderingMode.PARTITION,
        "none": OrderingMode.UNORDERED,
    }[spec["ordering"]]
    pc.execution.mode = ExecutionMode.ASYNC
    pc.execution.max_in_flight = spec["concurrency"]
    pc.execution.max_retries = 1
    pc.queue_max_messages = spec["max_in_flight"]
    settings = {
        "execution.mode": "async",
        "ordering_mode": pc.ordering_mode.value,
        "execution.max_in_flight (concurrent tasks)": pc.execution.max_in_flight,
        "queue_max_messages (pause above)": pc.queue_max_messages,
        "poll_batch_size": pc.poll_batch_size,
        "dlq_enabled": False,
        "commits": "its own, synchronous, after completion (ENABLE_AUTO_COMMIT=False)",
    }

    async def main() -> None:
        consumer = PyrallelConsumer(config=cfg, worker=worker, topic=spec["topic"])
        await consumer.start()
        try:
            await await_done(rec, spec)
        finally:
            block.released.set()
            await consumer.stop()

    asyncio.run(main())
    return {"settings": settings}


def run_faststream(spec: dict[str, Any], rec: Recorder, block: Block, unordered: bool) -> dict[str, Any]:
    from faststream.kafka import KafkaBroker
    from faststream.middlewares import AckPolicy

    sync_h, async_h = make_handlers(spec, rec, block)
    c = spec["concurrency"]
    # apply_types=False: no FastDepends validation/injection per message, and the record is read from
    # the context instead of a `msg: KafkaMessage` annotated parameter (which FastDepends resolves
    # through a thread-pool hop per message: ~1,500 msg/s instead of ~8,000 on a no-op handler here).
    broker = KafkaBroker(spec["brokers"], logger=None, apply_types=False)
    get_local = broker.context.get_local
    sub_kw: dict[str, Any] = dict(group_id=spec["group"], auto_offset_reset="earliest")
    if unordered:
        # ConcurrentDefaultSubscriber: one consumer, up to max_workers handlers at once, no order;
        # ACK_FIRST (aiokafka auto commit of consumed positions)
        sub_kw.update(max_workers=c, ack_policy=AckPolicy.ACK_FIRST)
        workers = c
        desc = "ConcurrentDefaultSubscriber (no order)"
        ack = "ACK_FIRST (aiokafka auto commit every 5 s)"
    elif c > 1:
        # ConcurrentBetweenPartitionsSubscriber: max_workers aiokafka consumers in the group, each
        # sequential over its partitions; needs a manual ack policy (ACK = commit after each message)
        workers = min(c, spec["partitions"])
        sub_kw.update(max_workers=workers, ack_policy=AckPolicy.ACK)
        desc = f"ConcurrentBetweenPartitionsSubscriber ({workers} consumers, partition order)"
        ack = "ACK (commit after each message)"
    else:
        workers = 1
        sub_kw.update(ack_policy=AckPolicy.ACK_FIRST)
        desc = "DefaultSubscriber (one message at a time, partition order)"
        ack = "ACK_FIRST (aiokafka auto commit every 5 s)"

    if spec["mode"] == "async":

        @broker.subscriber(spec["topic"], **sub_kw)
        async def handle(body: bytes) -> None:
            r = get_local("message").raw_message
            await async_h(r.key, r.value, r.timestamp)

    else:

        @broker.subscriber(spec["topic"], **sub_kw)
        def handle(body: bytes) -> None:  # faststream runs it in anyio's thread pool
            r = get_local("message").raw_message
            sync_h(r.key, r.value, r.timestamp)

    async def main() -> None:
        if spec["mode"] == "sync" and c > 40:
            import anyio.to_thread

            anyio.to_thread.current_default_thread_limiter().total_tokens = c
        await broker.start()
        try:
            await await_done(rec, spec)
        finally:
            block.released.set()
            await broker.stop()

    asyncio.run(main())
    return {
        "settings": {
            "subscriber": desc,
            "max_workers": workers,
            "ack_policy": ack,
            "client": "aiokafka",
            "auto_offset_reset": "earliest",
            "apply_types": False,
            "record": "broker.context.get_local('message').raw_message",
        }
    }


# ------------------------------------------------------------------------------------------ main


def progress_writer(path: str, rec: Recorder):  # type: ignore[no-untyped-def]
    """A Sampler callback that rewrites ``path`` with ``<handled> <perf_counter>`` (atomically), so the
    orchestrator of several instances sees each one's progress while it runs."""

    def write(_samples: list[tuple[float, float, int, int]]) -> None:
        tmp = f"{path}.{threading.get_ident()}.tmp"  # the sampler thread and its stop() may write at once
        try:
            with open(tmp, "w") as f:
                f.write(f"{rec.handled} {time.perf_counter()}\n")
            os.replace(tmp, path)
        except OSError as exc:  # the progress is a hint for the orchestrator: never fail the run for it
            print(f"progress file {path}: {exc}", file=sys.stderr)

    return write


def main() -> None:
    spec = json.loads(sys.argv[1])
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if spec.get("chdir"):
        os.chdir(spec["chdir"])  # pydantic-settings of the peers read ./.env: keep it empty
    rec = Recorder(spec["target"], spec.get("lat_every", 1))
    block = Block(
        spec["block_key"].encode() if spec.get("block_key") else None,
        spec["target"] - spec.get("block_count", 0),
        spec.get("stall_s", 3.0),
    )
    sampler = Sampler(rec, spec.get("sample_s", 1.0))
    if spec.get("progress_file"):
        sampler.on_sample = progress_writer(spec["progress_file"], rec)
    sampler.start()
    threading.Thread(target=block.watch, args=(rec, sampler), daemon=True).start()
    name = spec["contender"]
    out: dict[str, Any] = {}
    error = None
    try:
        if name == "raw":
            out = run_raw(spec, rec, block)
        elif name in ("keyedconsumer", "keyedconsumer-redis"):
            out = run_keyedconsumer(spec, rec, block, sampler)
        elif name == "pyrallel-consumer":
            out = run_pyrallel(spec, rec, block)
        elif name in ("faststream", "faststream-unordered"):
            out = run_faststream(spec, rec, block, unordered=name == "faststream-unordered")
        else:
            raise SystemExit(f"unknown contender {name!r}")
    except BaseException as exc:  # report, do not hide
        error = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    sampler.stop()
    # msg/s: from the first handler start to the end of the target-th message, or, for a run stopped by
    # its time cap, to the cap (what was handled by then): never the contender's stop or close
    if rec.t_last is not None:
        t_end, handled = rec.t_last, rec.target
    elif rec.t_cap is not None and rec.handled_at_cap is not None:
        t_end, handled = rec.t_cap, rec.handled_at_cap
    else:
        t_end, handled = time.perf_counter(), rec.handled
    secs = (t_end - rec.t_first) if rec.t_first is not None else None
    lat = rec.latencies()
    shift = (rec.wall_first * 1000.0 - spec["produce_t0_ms"]) if rec.wall_first is not None else 0.0

    def ms(v: float | None) -> float | None:
        return None if v is None else round(v, 2)

    p50, p99 = percentile(lat, 0.50), percentile(lat, 0.99)
    result = {
        "handled": handled,
        "target": rec.target,
        "complete": rec.t_last is not None,
        "seconds": round(secs, 3) if secs else None,
        "msg_per_s": round(handled / secs, 1) if secs else None,
        "startup_s": round(rec.t_first - T_PROCESS, 2) if rec.t_first is not None else None,
        "lat_p50_ms": ms(p50),
        "lat_p99_ms": ms(p99),
        "aligned_p50_ms": ms(max(0.0, p50 - shift)) if p50 is not None else None,
        "aligned_p99_ms": ms(max(0.0, p99 - shift)) if p99 is not None else None,
        "order_violations": rec.violations,
        "order_backward": rec.backward,
        "peak_rss_mb": max((s[1] for s in sampler.samples), default=None),
        "vm_hwm_mb": round(vm_hwm_bytes() / 1e6, 1),
        "rss_samples": sampler.samples,
        "samples_t0": sampler.t0,  # time.perf_counter() of the samples' 0 (CLOCK_MONOTONIC: one clock for all processes)
        "block": block.info or None,
        "error": error,
        **out,
    }
    sys.stdout.flush()
    print("BENCH_RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # do not wait for library threads that may linger after stop()


if __name__ == "__main__":
    main()
