"""`bench/floor.py` still runs: its five passes on a small topic of the real broker (~10 s).

It asserts no speed: only that every pass ran and the report has its fields.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.kafka
@pytest.mark.timeout(180)
def test_floor_runs_its_passes_and_reports_the_floor(kafka_bootstrap: str) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "floor.py"),
            "--brokers",
            kafka_bootstrap,
            "--messages",
            "30000",
            "--repeats",
            "1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = proc.stdout.strip().splitlines()[-1]
    assert re.search(
        r"median of 1: raw [\d.]+ us/msg wall, [\d.]+ us CPU; floor [\d.]+ us \(poll [\d.]+, engine [\d.]+, "
        r"handler [\d.]+\); best W1 ratio to raw [\d.]+x .*; with the lean pass \([\d.]+ us\) in the "
        r"engine's place [\d.]+x",
        line,
    ), proc.stdout
