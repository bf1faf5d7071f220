"""bench/rebalance_sim.py, the simulations behind docs/scaling.md: fast checks of its models."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def sim() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "bench" / "rebalance_sim.py"
    spec = importlib.util.spec_from_file_location("rebalance_sim", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_join_and_a_leave_end_balanced_with_every_partition_owned_once(sim: ModuleType) -> None:
    m = sim.moves(100, 10)
    for step in ("start", "one_joins", "one_leaves", "double"):
        assert m[step]["max_load"] - m[step]["min_load"] <= 1
    assert m["one_joins"]["members"] == 11 and m["one_leaves"]["members"] == 10
    assert m["one_joins"]["moved"] >= m["one_joins"]["minimum"] == 9  # 100 over 11: the newcomer gets 9
    assert m["one_leaves"]["moved"] == m["one_leaves"]["minimum"] == 9  # the leaver's 9 (100 over 11 held)


def test_min_moves_counts_a_leaver_s_partitions_and_the_excess_over_the_quotas(sim: ModuleType) -> None:
    before = {p: ("a" if p < 6 else "b") for p in range(8)}  # a: 6, b: 2
    assert sim.min_moves(before, {"a", "b"}, 8) == 2  # a gives 2 to b
    assert sim.min_moves(before, {"a", "b", "c"}, 8) == 3  # a keeps 3 and gives 3 (to c); b keeps its 2
    assert sim.min_moves(before, {"a"}, 8) == 2  # b left: its 2 move


def test_one_key_with_steady_traffic_keeps_its_lease(sim: ModuleType) -> None:
    c = sim.lease_churn(rate=100.0, keys=1, seconds=10.0, service_s=0.0, linger_s=1.0)
    assert c["acquires_per_s"] == pytest.approx(0.1, abs=0.01)  # one acquire in 10 s
    assert c["avg_leases_held"] == pytest.approx(1.0, abs=0.01)
    assert c["renewals_per_s"] == pytest.approx(0.4, abs=0.01)  # ttl 10 s: renewed every 2.5 s


def test_uniform_keys_match_the_closed_form(sim: ModuleType) -> None:
    c = sim.lease_churn(rate=1_000.0, keys=2_000, seconds=30.0, service_s=0.0, linger_s=1.0)
    # the first message of each key always acquires: compare the steady part (30 s >> 2 s per key)
    assert c["acquires_per_msg"] == pytest.approx(math.exp(-0.5), abs=0.03)
