"""The README's first service, exactly as printed, on the real broker: ``python make_orders.py``
creates the topics and produces three orders, ``keyedconsumer run orders:app`` accepts two and
dead-letters the third, and SIGTERM stops it with exit code 0.

The README's topics and group are fixed names (``orders``, ``orders.accepted``, ``orders.dlq``,
``orders-service``), so the test does not assume a fresh broker: it reads the records written after
the end offsets it saw before producing, and the group's lag. Only the broker address is replaced when
the test broker is not the README's 127.0.0.1:9092.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient

from tests.readme import commands, write_first_service

from .kafkautil import wait_until

README_BROKERS = "127.0.0.1:9092"
TOPICS = ("orders", "orders.accepted", "orders.dlq")
GROUP = "orders-service"

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180)]


def _ends(bootstrap: str) -> dict[tuple[str, int], int]:
    """End offsets of the README's topics that exist (none yet on a fresh broker)."""
    meta = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=15)
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"probe-{uuid.uuid4().hex}"})
    try:
        return {
            (t, p): c.get_watermark_offsets(TopicPartition(t, p), timeout=10)[1]
            for t in TOPICS
            if t in meta.topics
            for p in meta.topics[t].partitions
        }
    finally:
        c.close()


def _new_records(bootstrap: str, topic: str, since: dict[tuple[str, int], int]) -> list[Any]:
    """The records of ``topic`` after the offsets in ``since`` (all of a partition not in it)."""
    c = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"reader-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
        }
    )
    try:
        parts = (
            AdminClient({"bootstrap.servers": bootstrap})
            .list_topics(topic, timeout=15)
            .topics[topic]
            .partitions
        )
        c.assign([TopicPartition(topic, p, since.get((topic, p), 0)) for p in parts])
        out, idle_until = [], time.monotonic() + 3.0
        while time.monotonic() < idle_until:
            m = c.poll(0.2)
            if m is not None and m.error() is None:
                out.append(m)
                idle_until = time.monotonic() + 1.0
        return out
    finally:
        c.close()


def _lag(bootstrap: str) -> int | None:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": GROUP, "enable.auto.commit": False})
    try:
        parts = (
            AdminClient({"bootstrap.servers": bootstrap})
            .list_topics("orders", timeout=15)
            .topics["orders"]
            .partitions
        )
        committed = c.committed([TopicPartition("orders", p) for p in parts], timeout=10)
        lag = 0
        for tp in committed:
            end = c.get_watermark_offsets(TopicPartition("orders", tp.partition), timeout=10)[1]
            lag += end - (tp.offset if tp.offset >= 0 else 0)
        return lag
    finally:
        c.close()


def _keyedconsumer() -> str:
    found = Path(sys.executable).with_name("keyedconsumer")
    return str(found) if found.exists() else shutil.which("keyedconsumer") or "keyedconsumer"


def test_the_first_service_runs_as_printed_on_the_real_broker(kafka_bootstrap: str, tmp_path: Path) -> None:
    # given the README's files, exactly as printed (the broker address only, when the test broker
    # is elsewhere)
    write_first_service(tmp_path)
    extra: list[str] = []
    if kafka_bootstrap != README_BROKERS:
        maker = tmp_path / "make_orders.py"
        maker.write_text(maker.read_text().replace(f'"{README_BROKERS}"', f'"{kafka_bootstrap}"'))
        extra = ["--brokers", kafka_bootstrap]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEYEDCONSUMER_")}
    before = _ends(kafka_bootstrap)
    # when `python make_orders.py` runs, then `keyedconsumer run orders:app`
    made = subprocess.run(
        [sys.executable, "make_orders.py"], cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env
    )
    assert made.returncode == 0, made.stdout + made.stderr
    log = (tmp_path / "run.log").open("w")
    run = subprocess.Popen(
        [_keyedconsumer(), "run", "orders:app", *extra],
        cwd=tmp_path,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        # then o-1 and o-2 are accepted, o-3 dead-lettered, and every order committed
        def done() -> bool:
            accepted = [
                json.loads(m.value())["id"] for m in _new_records(kafka_bootstrap, "orders.accepted", before)
            ]
            dead = [json.loads(m.value())["id"] for m in _new_records(kafka_bootstrap, "orders.dlq", before)]
            return {"o-1", "o-2"} <= set(accepted) and "o-3" in dead and _lag(kafka_bootstrap) == 0

        assert wait_until(done, timeout_s=90, interval_s=0.5), (tmp_path / "run.log").read_text()
        accepted = _new_records(kafka_bootstrap, "orders.accepted", before)
        ids = [json.loads(m.value())["id"] for m in accepted]
        assert ids.index("o-1") < ids.index("o-2")  # one customer's orders, in order
        assert "o-3" not in ids
        dead = [
            m
            for m in _new_records(kafka_bootstrap, "orders.dlq", before)
            if json.loads(m.value())["id"] == "o-3"
        ]
        headers = dict(dead[0].headers() or [])
        assert headers["kafka_dlt-exception-fqcn"] == b"keyedconsumer.outcomes.PermanentError"
        assert headers["kafka_dlt-attempts"] == b"1"  # a PermanentError is not retried
    finally:
        # and SIGTERM drains, commits and exits 0
        run.send_signal(signal.SIGTERM)
        code = run.wait(timeout=60)
        log.close()
    assert code == 0, (tmp_path / "run.log").read_text()
    # and the README's dead-letter replay, as printed, shows the refused order and sends nothing;
    # it leaves pending no record of this run (only, on a used broker, older ones it cannot place)
    ends = _ends(kafka_bootstrap)
    (replay,) = commands("keyedconsumer dead-letter replay")
    shown = subprocess.run(
        [_keyedconsumer(), *replay.split()[1:], *extra],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    out = shown.stdout + shown.stderr
    pending = [(int(p), int(o)) for p, o in re.findall(r"orders\.dlq\[(\d+)\]@(\d+) left pending", out)]
    assert all(o < before.get(("orders.dlq", p), 0) for p, o in pending), out
    assert shown.returncode == (1 if pending else 0), out
    assert "c-8" in shown.stdout, out
    assert _ends(kafka_bootstrap) == ends  # a dry run sends nothing
