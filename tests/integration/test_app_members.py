"""Several consumers in one process (issue 25, item 19), against the real broker: a ``KeyedApp`` of
five routes in one consumer group with different subscriptions (four routes on a topic of one
partition, one on a topic of four), under the default assignor, cooperative-sticky, run by
``keyedconsumer run`` (``tests/integration/procs/routes_app.py``).

- each member has a ``client.id`` of its own, naming its route;
- librdkafka's main threads stay idle once the group is stable, before and after members join and
  leave (librdkafka #4783: the cooperative-sticky assignor could loop for good, at 100% of a core,
  when a topic had fewer partitions than members; fixed in librdkafka 2.6.1);
- a process closing its consumers while the group rebalances (its own members' joins) exits 0,
  never aborts (librdkafka #4312 / #4381: an assertion or a segfault when closing during a
  cooperative-sticky rebalance; fixed in librdkafka 2.3.0), and the other process rebalances on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from keyedconsumer.kafka.admin import GroupDescription, describe_group

from .kafkautil import produce, wait_until

pytestmark = [pytest.mark.kafka]

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.integration.procs.routes_app:app"
ROUTES = ("a", "b", "c", "d", "e")
#: the group states of a rebalance (confluent-kafka's ConsumerGroupState names, lower case)
REBALANCING = ("preparing_rebalancing", "completing_rebalancing")


class App:
    """One ``keyedconsumer run`` process of the four-route app."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "keyedconsumer", "run", APP],
            cwd=ROOT,
            env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def main_threads_cpu_s(self) -> dict[int, float]:
        """CPU seconds so far of each of librdkafka's main threads (``rdk:main``), by thread id."""
        tick = os.sysconf("SC_CLK_TCK")
        out: dict[int, float] = {}
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            try:
                if (task / "comm").read_text().strip() != "rdk:main":
                    continue
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # the thread ended meanwhile
                continue
            out[int(task.name)] = (int(fields[11]) + int(fields[12])) / tick
        return out

    def stop(self, timeout_s: float = 60.0) -> tuple[int, str]:
        self.proc.send_signal(signal.SIGTERM)
        try:
            out, err = self.proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
            pytest.fail(f"the app did not stop within {timeout_s} s:\n{err[-3000:]}")
        return self.proc.returncode, out + err


@pytest.fixture
def apps(kafka_bootstrap: str, new_topic: Callable[..., str]) -> tuple[dict[str, str], Callable[[], App]]:
    """``(env, start)``: the app's topics (one partition and four, with some records) and group,
    and ``start()`` that runs one more process of it; every process still running at teardown is
    killed."""
    topics = [new_topic(1), new_topic(4)]
    produce(kafka_bootstrap, topics[0], [(f"k{i}".encode(), b"v", 0) for i in range(10)])
    produce(kafka_bootstrap, topics[1], [(f"k{i}".encode(), b"v", i % 4) for i in range(20)])
    env = {
        "KC_RT_BROKERS": kafka_bootstrap,
        "KC_RT_GROUP": f"rt-{uuid.uuid4().hex[:8]}",
        "KC_RT_TOPIC1": topics[0],
        "KC_RT_TOPIC2": topics[1],
    }
    started: list[App] = []

    def start() -> App:
        app = App(env)
        started.append(app)
        return app

    yield env, start
    for app in started:
        if app.proc.poll() is None:
            app.proc.kill()
            app.proc.communicate()


def _group(kafka_bootstrap: str, env: dict[str, str]) -> GroupDescription:
    return describe_group({"bootstrap.servers": kafka_bootstrap}, env["KC_RT_GROUP"], 10.0)


def _stable_with(kafka_bootstrap: str, env: dict[str, str], members: int) -> Callable[[], bool]:
    def check() -> bool:
        g = _group(kafka_bootstrap, env)
        return g.state == "stable" and g.members == members and len(g.assigned) == 5

    return check


def _idle_main_threads(app: App, window_s: float = 4.0) -> dict[int, float]:
    """CPU seconds each ``rdk:main`` thread of ``app`` used over ``window_s`` seconds."""
    before = app.main_threads_cpu_s()
    time.sleep(window_s)
    after = app.main_threads_cpu_s()
    return {tid: after[tid] - before[tid] for tid in before if tid in after}


@pytest.mark.timeout(240)
def test_routes_of_one_group_have_their_own_client_ids_and_the_assignor_stays_idle(
    kafka_bootstrap: str, apps: tuple[dict[str, str], Callable[[], App]]
) -> None:
    env, start = apps
    # given one process of the app: five members, four subscribed to a topic of one partition
    first = start()
    assert wait_until(_stable_with(kafka_bootstrap, env, 5), 90, 0.2), _group(kafka_bootstrap, env)
    # then each member's client.id is its own, naming its route
    ids = sorted(m.client_id for m in _group(kafka_bootstrap, env).member_list)
    assert ids == [f"keyedconsumer-{r}" for r in ROUTES], ids
    # and librdkafka's main threads (where the assignor runs) are idle: no busy loop
    idle = _idle_main_threads(first)
    assert len(idle) == 5 and max(idle.values()) < 0.5, idle
    # when a second process of it joins (ten members: eight on one partition) and the group is
    # stable again, then both processes' main threads are idle again
    second = start()
    assert wait_until(_stable_with(kafka_bootstrap, env, 10), 90, 0.2), _group(kafka_bootstrap, env)
    for app in (first, second):
        idle = _idle_main_threads(app)
        assert len(idle) == 5 and max(idle.values()) < 0.5, idle
    # when the second leaves, then the first is stable with its five again, idle, and both exit 0
    code, output = second.stop()
    assert code == 0 and "Traceback" not in output, output[-3000:]
    assert wait_until(_stable_with(kafka_bootstrap, env, 5), 90, 0.2), _group(kafka_bootstrap, env)
    idle = _idle_main_threads(first)
    assert max(idle.values()) < 0.5, idle
    code, output = first.stop()
    assert code == 0 and "Traceback" not in output, output[-3000:]


@pytest.mark.timeout(300)
def test_closing_during_a_cooperative_rebalance_never_aborts_a_process(
    kafka_bootstrap: str, apps: tuple[dict[str, str], Callable[[], App]]
) -> None:
    env, start = apps
    # given one process of the app, its group stable
    first = start()
    assert wait_until(_stable_with(kafka_bootstrap, env, 5), 90, 0.2), _group(kafka_bootstrap, env)
    closed_in: list[str] = []
    for delay_s in (0.0, 0.3, 0.8):
        # when a second process joins, and gets SIGTERM while the group rebalances for its members
        # (at once, or a little later, while the rebalance goes on)
        second = start()
        assert wait_until(
            lambda: _group(kafka_bootstrap, env).state in REBALANCING,
            60,
            0.02,
        ), _group(kafka_bootstrap, env)
        time.sleep(delay_s)
        closed_in.append(_group(kafka_bootstrap, env).state)
        code, output = second.stop()
        # then it exits 0 (an abort would be -6, a segfault -11), having stopped gracefully
        assert code == 0, (code, output[-3000:])
        assert "Traceback" not in output and "Assertion" not in output, output[-3000:]
        # and the first process is still there, its group stable with its five members again
        assert first.proc.poll() is None
        assert wait_until(_stable_with(kafka_bootstrap, env, 5), 90, 0.2), _group(kafka_bootstrap, env)
    code, output = first.stop()
    assert code == 0 and "Traceback" not in output, output[-3000:]
    assert any(s in REBALANCING for s in closed_in), closed_in  # at least one close met a rebalance
