"""The deterministic simulation of the engine's owner (tests/sim/engine_sim.py): a fixed budget of
seeded events keeps every promise, and each bug the tests plant (tests/sim/bugs.py) is caught on
every seed. ``scripts/simulate --events N`` runs more by hand; a failing seed replays exactly."""

from __future__ import annotations

import pytest

from tests.sim.bugs import BUGS, RUN_BUGS, planted
from tests.sim.engine_sim import SimConfig, Simulation, Violation, simulate

#: The CI budget: 50 seeds of 2,000 events (100,000 events) of the default shape.
SEEDS, EVENTS = 50, 2_000


@pytest.mark.timeout(120)
def test_a_hundred_thousand_seeded_events_keep_every_promise() -> None:
    for seed in range(1, SEEDS + 1):
        simulate(seed, EVENTS)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "config",
    [
        SimConfig(batch_size=4),
        SimConfig(conflate=True, batch_size=3),
        SimConfig(conflate=True),
        SimConfig(partitions=1, keys=2, workers=1),
        SimConfig(workers=1, only_done=True),
        SimConfig(partitions=4, keys=30, workers=8, max_in_flight=100, batch=20, metadata_max_bytes=0),
        SimConfig(fast=True, keys=2),
        SimConfig(fast=True, partitions=1, keys=1, workers=2),
        SimConfig(fast=True, workers=1, only_done=True),
    ],
    ids=[
        "batches",
        "conflated-batches",
        "conflation",
        "one-worker-two-keys",
        "one-worker-offset-order",
        "wide-no-metadata",
        "lane-runs-hot-keys",
        "lane-runs-one-lane",
        "lane-runs-one-worker-offset-order",
    ],
)
def test_other_shapes_keep_every_promise(config: SimConfig) -> None:
    for seed in range(1, 11):
        simulate(seed, EVENTS, config)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bug", sorted(BUGS))
def test_each_planted_bug_is_caught_on_every_seed(bug: str) -> None:
    for seed in range(1, 6):
        with planted(bug), pytest.raises(Violation):
            simulate(seed, EVENTS)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bug", sorted(RUN_BUGS))
def test_each_planted_lane_run_bug_is_caught_on_every_seed(bug: str) -> None:
    # fast handlers: chunks carry lanes' runs, which only these bugs break
    for seed in range(1, 6):
        with planted(bug), pytest.raises(Violation):
            simulate(seed, EVENTS, SimConfig(fast=True, keys=2))


def test_a_seed_replays_exactly() -> None:
    # given two simulations of one seed
    a, b = Simulation(7), Simulation(7)
    # then they go through the same events and end in the same state
    assert [a.step() for _ in range(1_500)] == [b.step() for _ in range(1_500)]
    assert a.committed == b.committed and a.done_ever == b.done_ever and a.log == b.log
