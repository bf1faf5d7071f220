"""One consumer process of the harness: ``ordering="key"``, the Redis sequencer, retry and dead letters.

    python -m tests.faults.consumer RUN_DIR

Settings come from ``RUN_DIR/run.json``; its ``bug`` (a negative control) is planted here, in this
process, by :mod:`tests.faults.bugs`. The handler waits about 3 ms, raises on the first attempt of
messages flagged ``once``, always raises for poison keys, and runs longer than the lease TTL for
messages flagged ``overrun``. The one message flagged ``hold`` (targeted runs only) is held on its
first run: it sleeps ``hold_s`` (``kills``, ``stops``), or is parked in Redis with a back-off of
``hold_s`` (``redis``), so the orchestrator can land its fault at a known point of that message. A successful run makes a fenced write:
a Lua script on Redis accepts it only if the message's fencing token is at least the highest token
that key's store has seen (how a real handler guards its side effects with ``msg.fencing_token``).
Every start and end is appended, unbuffered, to ``RUN_DIR/events/<pid>.log`` (formats in
:mod:`tests.faults.common`).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import redis
from keyedconsumer.middleware import DeadLetter, Retry

from keyedconsumer import KeyedConsumer, Message, RedisSequencer, RetryLater
from keyedconsumer.sequencing.store import connect

from . import bugs
from .common import HOLD, ONCE, OVERRUN, SIZES, key_names, load_json

# KEYS[1] the key's external record; ARGV[1] token, ARGV[2] seq -> the record's new version (> 0)
# when accepted, 0 when refused (a token below the highest seen). Versions order the accepted writes.
FENCED_WRITE = """
local top = tonumber(redis.call('HGET', KEYS[1], 'token') or '0')
if tonumber(ARGV[1]) < top then return 0 end
redis.call('HSET', KEYS[1], 'token', ARGV[1], 'seq', ARGV[2])
return redis.call('HINCRBY', KEYS[1], 'ver', 1)
"""
# The same write without the token check (--harness-skip-fencing: a store that does not fence).
UNFENCED_WRITE = """
redis.call('HSET', KEYS[1], 'token', ARGV[1], 'seq', ARGV[2])
return redis.call('HINCRBY', KEYS[1], 'ver', 1)
"""


class PoisonError(Exception):
    """Raised for every message of a poison key."""


class FlakyError(Exception):
    """Raised on the first attempt of a message flagged ``once``."""


def record_parking(rec: Any, pid: int) -> None:
    """Write a ``K`` record when a message's parking is acknowledged by Redis (its offset then
    counts done although it has not run: the checker must know). There is no public hook for it,
    so this wraps the engine's sequencer port, ``LanePort.parked`` (test instrumentation only)."""
    from keyedconsumer.engine import port

    original = port.Port.parked

    def parked(self: Any, ds: Any) -> None:
        ds = list(ds)
        for d in ds:
            msg = d.msg
            try:
                v = json.loads(msg.value or b"{}")
                key, seq = v["k"], v["s"]
            except (ValueError, KeyError):
                key, seq = "-", 0
            rec(
                f"K {pid} {msg.partition} {msg.offset} {key} {seq} {msg.fencing_token} {msg.attempt} "
                f"{time.monotonic_ns()}"
            )
        original(self, ds)

    port.Port.parked = parked  # type: ignore[method-assign]


def main() -> int:
    run_dir = Path(sys.argv[1])
    cfg = load_json(run_dir / "run.json")
    size = SIZES[cfg["size"]]
    _, _, poison = key_names(size)
    poison_keys = set(poison)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    pid = os.getpid()
    (run_dir / "events").mkdir(exist_ok=True)
    fd = os.open(run_dir / "events" / f"{pid}.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def rec(line: str) -> None:
        os.write(fd, (line + "\n").encode())

    bug = cfg.get("bug") or ""
    rec(f"P {pid} {time.monotonic_ns()} start {bug or '-'}")
    hold = cfg.get("hold") or {}
    ext = connect(
        cfg.get("db_url") or cfg["redis_url"], 2.0
    )  # the handler's database (cluster runs: its own)
    fenced = ext.register_script(UNFENCED_WRITE if cfg.get("harness_skip_fencing") else FENCED_WRITE)
    ns = cfg["namespace"]

    def fenced_write(key: str, token: int, seq: int) -> int:
        """The handler's side effect: the accepted write's version, or 0 if refused. Retried while
        Redis is down (a Redis restart is not the message's failure)."""
        deadline = time.monotonic() + 60.0
        while True:
            try:
                return int(fenced(keys=[f"ext:{ns}:{key}"], args=[token, seq]))
            except (
                redis.ConnectionError,
                redis.TimeoutError,
                redis.BusyLoadingError,
                redis.exceptions.ClusterError,
                redis.exceptions.RedisClusterException,
            ):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def handle(msg: Message) -> None:
        v = json.loads(msg.value or b"{}")
        key, seq, flag = v["k"], v["s"], v["f"]
        base = f"{pid} {msg.partition} {msg.offset} {key} {seq} {msg.fencing_token} {msg.attempt}"
        rec(f"S {base} {time.monotonic_ns()}")
        try:
            if flag == HOLD and hold.get("mode") == "redis" and msg.attempt == 1:
                raise RetryLater(float(hold["hold_s"]), park=True)  # parked, due hold_s later
            if flag == HOLD and ext.set(f"hold:{ns}:{v['id']}", 1, nx=True):
                time.sleep(float(hold["hold_s"]))  # its first run only
            else:
                time.sleep(size.lease_ttl_s * 1.5 if flag == OVERRUN else size.handler_s)
            if key in poison_keys:
                raise PoisonError(f"poison key {key}")
            if flag == ONCE and msg.attempt == 1:
                raise FlakyError(f"first attempt of {key}#{seq}")
            ver = fenced_write(key, msg.fencing_token or 0, seq)
            wrote_ns = time.monotonic_ns()
        except Exception as exc:
            rec(f"X {base} {time.monotonic_ns()} {type(exc).__name__}")
            raise
        rec(f"E {base} {time.monotonic_ns()} {'ok' if ver else 'refused'} {wrote_ns} {ver}")

    def record_dead_letters(handler: Any) -> Any:
        """Outermost middleware: a ``D`` record once ``DeadLetter`` has published the message."""

        def wrapped(msg: Message) -> None:
            handler(msg)
            if msg.state.get("dead_lettered"):
                v = json.loads(msg.value or b"{}")
                rec(
                    f"D {pid} {msg.partition} {msg.offset} {v['k']} {v['s']} {msg.fencing_token} "
                    f"{msg.attempt} {time.monotonic_ns()}"
                )

        return wrapped

    if cfg.get("park"):
        record_parking(rec, pid)
    retry_options: dict[str, Any] = {
        "max_attempts": 3,
        "initial_delay_s": 0.05,
        "multiplier": 2.0,
        "max_delay_s": 1.0,
        "jitter": 0.1,
    }
    if cfg.get("park"):
        retry_options["park"] = True  # ordered non-blocking retries in Redis (parking)
    sequencer = RedisSequencer(
        cfg["redis_url"],
        ns,
        lease_ttl_s=size.lease_ttl_s,
        require_durable=not cfg.get("nondurable_redis", False),
    )
    if bug == "skip_fencing":
        bugs.plant_skip_fencing()
    consumer = KeyedConsumer(
        name=cfg["group"],
        client_factory=bugs.commit_on_poll_factory if bug == "commit_on_poll" else None,
        handler=handle,
        middlewares=[
            record_dead_letters,
            DeadLetter(brokers=[cfg["bootstrap"]], topic=cfg["dlq_topic"], timeout_s=180.0),
            Retry(**retry_options),
        ],
        brokers=[cfg["bootstrap"]],
        topics=[cfg["topic"]],
        concurrency=size.concurrency,
        ordering="key",
        max_in_flight=size.max_in_flight,
        startup_timeout_s=120.0,
        sequencer=sequencer,
        config={
            "session.timeout.ms": int(cfg.get("session_timeout_ms") or size.session_timeout_ms),
            "heartbeat.interval.ms": 1000,
            "auto.commit.interval.ms": size.auto_commit_interval_ms,
        },
    )

    stop_watch = threading.Event()

    def watch_assignment() -> None:
        last: list[int] | None = None
        while not stop_watch.wait(0.1):
            now = sorted(p for _t, p in consumer.assignment)
            if now != last:
                rec(f"A {pid} {time.monotonic_ns()} {','.join(map(str, now)) or '-'}")
                last = now

    threading.Thread(target=watch_assignment, name="harness-assignment", daemon=True).start()
    rc = 0
    detail = "ok"
    try:
        consumer.run()
    except Exception as exc:  # reported by the orchestrator as an unexpected exit
        logging.getLogger("harness").exception("run() raised")
        detail, rc = type(exc).__name__, 3
    stop_watch.set()
    rec(f"P {pid} {time.monotonic_ns()} exit {detail}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
