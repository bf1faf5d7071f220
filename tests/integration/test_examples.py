"""Every example runs against the real services (a smaller data size than the README run)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.kafka]
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_flights_example_keeps_order_and_reaches_lag_zero(kafka_bootstrap: str) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "examples/flights.py",
            "--brokers",
            kafka_bootstrap,
            "--limit",
            "30000",
            "--sample",
            "300",
            "--no-progress",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "order violations    0" in out.stdout
    assert "lag 0               True" in out.stdout
    assert "RESULT              OK" in out.stdout


@pytest.mark.timeout(180)
def test_retry_and_dead_letter_example(kafka_bootstrap: str) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "examples/retry_and_dead_letter.py",
            "--brokers",
            kafka_bootstrap,
            "--events",
            "1000",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "order violations    0" in out.stdout and "RESULT              OK" in out.stdout
    assert "kafka_dlt-exception-fqcn" in out.stdout


@pytest.mark.timeout(180)
def test_latest_prices_example_conflates_and_audits_every_tick(kafka_bootstrap: str) -> None:
    out = subprocess.run(
        [sys.executable, "examples/latest_prices.py", "--brokers", kafka_bootstrap, "--ticks", "2000"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    for line in (
        "prices only rise    True",
        "cache = last prices True",
        "every tick counted  True",
        "audit has each tick True",
        "committed offsets   2000 of 2000",
        "RESULT              OK",
    ):
        assert line in out.stdout, out.stdout


@pytest.mark.redis
@pytest.mark.timeout(40)
def test_redis_parking_example(kafka_bootstrap: str, redis_url: str) -> None:
    # the flaky account is parked while the offset moves on; reminders fire; Redis ends clean
    out = subprocess.run(
        [
            sys.executable,
            "examples/redis_parking.py",
            "--brokers",
            kafka_bootstrap,
            "--redis-url",
            redis_url,
            "--events",
            "3000",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=35,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "handled             3000 of 3000 events" in out.stdout, out.stdout
    assert "in order, once      True" in out.stdout and "offset passed park  True" in out.stdout, out.stdout
    assert out.stdout.count("reminder            acct-") == 3, out.stdout
    assert "redis clean         True" in out.stdout and "RESULT              OK" in out.stdout, out.stdout


@pytest.mark.timeout(120)
def test_unit_test_example_passes_without_kafka() -> None:
    # examples/unit_test_example.py is itself a pytest file on keyedconsumer.testing (no broker used)
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "examples/unit_test_example.py", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 passed" in out.stdout


@pytest.mark.timeout(120)
def test_exactly_once_example(kafka_bootstrap: str) -> None:
    # each payment's two ledger entries, read_committed, exactly once across a hand-over to a second consumer
    out = subprocess.run(
        [sys.executable, "examples/exactly_once.py", "--brokers", kafka_bootstrap, "--events", "1000"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ledger entries      2000 (read_committed)" in out.stdout, out.stdout
    assert "each entry once     True" in out.stdout and "debits in order     True" in out.stdout, out.stdout
    assert "RESULT              OK" in out.stdout, out.stdout
