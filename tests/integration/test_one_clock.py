"""One clock: instances whose wall clocks are wrong neither fire scheduled messages or parked retries
early (or very late) nor see each other as gone; misfires are measured on the Redis server's clock.

Scheduled jobs run early when instances' clocks differ (rq-scheduler #246; NServiceBus.SqlServer
#463). The instance with the wrong clock is a separate process whose ``time.time`` is shifted before
``keyedconsumer`` is imported (``procs/skewed_consumer.py``): by +20 s (ahead) or -60 s (behind).
Times are compared on one clock: the Redis server's ``TIME``, and this machine's monotonic clock
(shared by every process, never shifted). Real broker, real Redis.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis

from keyedconsumer import KeyedConsumer, Message, RedisSequencer, RetryLater
from keyedconsumer.sequencing import inspect_redis
from keyedconsumer.sequencing.store import connect

from .kafkautil import log_lines, produce, wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.redis]
ROOT = Path(__file__).resolve().parents[2]
SKEWS = pytest.mark.parametrize("skew_s", [20.0, -60.0], ids=["clock-ahead-20s", "clock-behind-60s"])
#: Seconds ahead that messages are scheduled and retries parked.
DELAY_S = 4.0
#: The most a message may run after its due time here (the scheduler looks every 50 ms); a clock
#: 60 s behind would run it 60 s late.
LATE_BOUND_MS = 10_000


class Skewed:
    """A ``skewed_consumer`` process: its log of handler starts and its last status."""

    def __init__(
        self, skew_s: float, bootstrap: str, topic: str, redis_url: str, ns: str, tmp: Path, *extra: str
    ) -> None:
        tag = f"{'ahead' if skew_s > 0 else 'behind'}{abs(skew_s):g}"
        self.log, self.status_file = tmp / f"{tag}.log", tmp / f"{tag}.status.json"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.integration.procs.skewed_consumer",
                str(skew_s),
                bootstrap,
                topic,
                f"g-{ns}-{tag}",
                str(self.log),
                str(self.status_file),
                redis_url,
                ns,
                *extra,
            ],
            cwd=ROOT,
        )

    def status(self) -> dict[str, Any]:
        try:
            return dict(json.loads(self.status_file.read_text()))
        except (FileNotFoundError, ValueError):
            return {}

    def starts(self, value: str | None = None) -> list[dict[str, Any]]:
        """Handler starts: ``{"key", "value", "attempt", "redis_ms", "mono_ns"}``."""
        out = []
        for line in log_lines(self.log):
            _, _pid, key, val, attempt, redis_ms, mono = line.split()
            if value is None or val == value:
                out.append(
                    {
                        "key": key,
                        "value": val,
                        "attempt": int(attempt),
                        "redis_ms": float(redis_ms),
                        "mono_ns": int(mono),
                    }
                )
        return out

    def stop(self) -> dict[str, Any]:
        """Stop gracefully (SIGTERM) and return the final status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        return self.status()


def _redis_ms(r: redis.Redis) -> float:
    sec, usec = r.time()
    return sec * 1000 + usec / 1000


@pytest.mark.timeout(120)
@SKEWS
def test_a_scheduler_with_a_wrong_clock_runs_a_delayed_message_neither_early_nor_late(
    skew_s: float,
    kafka_bootstrap: str,
    redis_url: str,
    new_topic,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    # given the namespace's only scheduler: a process whose wall clock is off by skew_s
    topic, ns = new_topic(1), f"clock-{uuid.uuid4().hex[:8]}"
    p = Skewed(skew_s, kafka_bootstrap, topic, redis_url, ns, tmp_path)
    r = connect(redis_url, 5.0)
    try:
        assert wait_until(lambda: p.status().get("scheduler"), 60), p.status()
        # when a process with a correct clock schedules a message DELAY_S ahead
        mono0, t0 = time.monotonic_ns(), _redis_ms(r)
        RedisSequencer(redis_url, ns).schedule(topic, b"k", b"delayed", delay_s=DELAY_S)
        # then it runs no earlier than DELAY_S later (on the Redis server's clock and on this
        # machine's monotonic clock), and less than LATE_BOUND_MS late
        assert wait_until(lambda: p.starts("delayed"), DELAY_S + LATE_BOUND_MS / 1000 + 5), (
            p.starts(),
            p.status(),
        )
        first = p.starts("delayed")[0]
        assert first["redis_ms"] >= t0 + DELAY_S * 1000, (first["redis_ms"] - t0, skew_s)
        assert first["mono_ns"] - mono0 >= DELAY_S * 1e9
        assert first["redis_ms"] - (t0 + DELAY_S * 1000) < LATE_BOUND_MS
        assert first["attempt"] == 1 and first["key"] == "k"
    finally:
        p.stop()
        r.close()


@pytest.mark.timeout(120)
@SKEWS
def test_a_parked_retry_keeps_its_back_off_whatever_the_schedulers_clock(
    skew_s: float,
    kafka_bootstrap: str,
    redis_url: str,
    new_topic,
    start,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    # given the namespace's only scheduler: a process whose wall clock is off by skew_s (consuming
    # a topic of its own), and a consumer here (correct clock, not a scheduler) whose handler parks
    # message "retry-me" on its first attempt for DELAY_S
    sched_topic, topic, ns = new_topic(1), new_topic(1), f"clock-{uuid.uuid4().hex[:8]}"
    p = Skewed(skew_s, kafka_bootstrap, sched_topic, redis_url, ns, tmp_path)
    r = connect(redis_url, 5.0)
    failed: list[tuple[float, int]] = []

    def handle(msg: Message) -> None:
        if msg.attempt == 1:
            failed.append((_redis_ms(r), time.monotonic_ns()))
            raise RetryLater(DELAY_S, park=True)

    seq = RedisSequencer(redis_url, ns, lease_ttl_s=2.0, scheduler=False)
    try:
        assert wait_until(lambda: p.status().get("scheduler"), 60), p.status()
        run = start(
            KeyedConsumer(
                name=f"g-{ns}",
                handler=handle,
                brokers=[kafka_bootstrap],
                topics=[topic],
                concurrency=2,
                sequencer=seq,
            )
        )
        # when it fails and is parked
        produce(kafka_bootstrap, topic, [(b"r", b"retry-me", None)])
        assert wait_until(lambda: failed and seq.parker is not None and seq.parker.parked == 1, 60)
        # then the scheduler runs its second attempt no earlier than DELAY_S after the failure (on
        # the Redis server's clock and on this machine's monotonic clock), less than LATE_BOUND_MS late
        assert wait_until(lambda: p.starts("retry-me"), DELAY_S + LATE_BOUND_MS / 1000 + 5), (
            p.starts(),
            p.status(),
        )
        fail_ms, fail_ns = failed[0]
        first = p.starts("retry-me")[0]
        assert first["attempt"] == 2
        assert first["redis_ms"] >= fail_ms + DELAY_S * 1000, (first["redis_ms"] - fail_ms, skew_s)
        assert first["mono_ns"] - fail_ns >= DELAY_S * 1e9
        assert first["redis_ms"] - (fail_ms + DELAY_S * 1000) < LATE_BOUND_MS
        assert len(failed) == 1
        assert run.stop(30) and run.error is None
    finally:
        p.stop()
        r.close()


@pytest.mark.timeout(120)
def test_instances_whose_clocks_differ_by_80_s_check_in_on_redis_time_and_never_see_each_other_gone(
    kafka_bootstrap: str,
    redis_url: str,
    new_topic,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    # given two instances of one namespace, one 20 s ahead, one 60 s behind (lease TTL 2 s: a
    # check-in every 0.5 s, gone after 6 s of silence)
    ns = f"clock-{uuid.uuid4().hex[:8]}"
    ahead = Skewed(20.0, kafka_bootstrap, new_topic(1), redis_url, ns, tmp_path)
    behind = Skewed(-60.0, kafka_bootstrap, new_topic(1), redis_url, ns, tmp_path)
    r = connect(redis_url, 5.0)
    try:
        assert wait_until(lambda: ahead.status() and behind.status(), 60)
        ids = {ahead.status()["instance"], behind.status()["instance"]}
        # when both have run for longer than the instance timeout
        time.sleep(7.0)
        # then neither saw the other as gone
        assert [ahead.status()["gone"], behind.status()["gone"]] == [[], []]
        # and both are live instances, each last seen within seconds of the Redis server's time
        now_ms = _redis_ms(r)
        live = {i["id"]: i["last_seen_s"] * 1000 for i in inspect_redis(redis_url, ns)["instances"]}
        assert set(live) == ids, live
        assert all(abs(now_ms - seen) < 3000 for seen in live.values()), {
            k: now_ms - v for k, v in live.items()
        }
    finally:
        final = [ahead.stop(), behind.stop()]
        r.close()
    # and neither did until it stopped
    assert [s["gone"] for s in final] == [[], []], final


@pytest.mark.timeout(120)
@SKEWS
def test_misfires_are_counted_on_the_redis_servers_clock(
    skew_s: float,
    kafka_bootstrap: str,
    redis_url: str,
    new_topic,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    # given the namespace's only scheduler: a process whose wall clock is off by skew_s
    topic, ns = new_topic(1), f"clock-{uuid.uuid4().hex[:8]}"
    p = Skewed(skew_s, kafka_bootstrap, topic, redis_url, ns, tmp_path)
    r = connect(redis_url, 5.0)
    try:
        assert wait_until(lambda: p.status().get("scheduler"), 60), p.status()
        # when one message is scheduled due 5 s ago on the Redis server's clock (a misfire) and one
        # due in 2 s (not a misfire)
        t0 = _redis_ms(r)
        seq = RedisSequencer(redis_url, ns)
        seq.schedule(topic, b"past", b"past", at=(t0 - 5000) / 1000)
        seq.schedule(topic, b"future", b"future", delay_s=2.0)
        # then both run, and exactly one misfire is counted
        assert wait_until(
            lambda: p.starts("past") and p.starts("future") and p.status().get("moved") == 2, 30
        ), (p.starts(), p.status())
        assert p.status()["misfires"] == 1, p.status()
        # and the future one did not run before its due time
        assert p.starts("future")[0]["redis_ms"] >= t0 + 2000
    finally:
        final = p.stop()
        r.close()
    assert final["moved"] == 2 and final["misfires"] == 1, final
