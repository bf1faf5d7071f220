"""The scaling benchmark still runs: `bench/scaling.py --size ci` on the real broker and Redis (~1 min).

Runs 1 and 2 instances in one group (raw at 1, keyedconsumer in-memory and with the Redis
sequencer), each run draining a 3,000-record topic. Asserts that it exits 0, that every run drained
the topic (the group's committed offsets reached the end offsets, every record was handled at least
once) without a per-key repeat, and that the report has its figures. It asserts no speed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.kafka, pytest.mark.redis]
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(180)
def test_scaling_ci_size_runs_and_drains(kafka_bootstrap: str, redis_url: str, tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "bench/scaling.py",
            "--size",
            "ci",
            "--brokers",
            kafka_bootstrap,
            "--redis-url",
            redis_url,
            "--engine",
            "worktree",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]

    res = json.loads((tmp_path / "scaling.json").read_text())
    n = res["size_settings"]["messages"]
    ids = [r["id"] for r in res["runs"]]
    assert ids == [
        "raw/n1",
        "keyedconsumer/n1",
        "keyedconsumer-redis/n1",
        "keyedconsumer/n2",
        "keyedconsumer-redis/n2",
    ], ids
    for r in res["runs"]:
        assert not r["error"], (r["id"], r["error"])
        assert r["drained"] and r["lag_at_end"] == 0 and r["handled_total"] >= n, r
        assert len(r["per_instance"]) == r["instances"], r["id"]
        assert r["cpu"]["machine_cores_busy"] is not None and r["cpu"]["instances_cores"] is not None, r[
            "cpu"
        ]
        if r["contender"] != "raw":
            assert r["order_backward"] == 0, (r["id"], r["order_backward"])
    assert {(s["contender"], s["instances"]) for s in res["summary"]} == {
        ("raw", 1),
        ("keyedconsumer", 1),
        ("keyedconsumer", 2),
        ("keyedconsumer-redis", 1),
        ("keyedconsumer-redis", 2),
    }
    md = (tmp_path / "scaling.md").read_text()
    assert "| contender | N | msg/s | ideal | of ideal | ratio to linear |" in md
