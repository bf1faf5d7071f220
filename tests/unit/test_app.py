"""``KeyedApp``: routes, hooks on the handlers' loop, one stop for all, failure of one route."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pydantic
import pytest

from keyedconsumer import KeyedApp, Message, MessageError
from keyedconsumer.testing import InMemoryBroker

pytestmark = pytest.mark.timeout(60)


def _broker(*topics: str) -> InMemoryBroker:
    b = InMemoryBroker()
    for t in topics:
        b.create_topic(t, partitions=3)
    return b


def _idle(b: InMemoryBroker, group_topics: dict[str, list[str]], timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while any(v for g, ts in group_topics.items() for v in b.lag(g, ts).values()):
        assert time.monotonic() < deadline, {g: b.lag(g, ts) for g, ts in group_topics.items()}
        time.sleep(0.005)


def _run_in_thread(app: KeyedApp) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def main() -> None:
        try:
            app.run()
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=main, daemon=True)
    t.start()
    return t, errors


def test_two_routes_sync_and_async_share_the_app_loop_with_its_hooks() -> None:
    # given two topics, and an app with a sync and an async route and a startup and shutdown hook
    b = _broker("payments", "refunds")
    for i in range(30):
        b.produce("payments", f"p{i}", key=f"acct-{i % 5}")
        b.produce("refunds", f"r{i}", key=f"acct-{i % 5}")
    app = KeyedApp(client_factory=b.client_factory, clock=b.clock, group_id="billing", poll_timeout_s=0.01)
    events: list[Any] = []
    seen: dict[str, list[bytes]] = {"payments": [], "refunds": []}
    loops: set[int] = set()

    @app.on_startup
    async def open_pool() -> None:
        loops.add(id(asyncio.get_running_loop()))
        events.append("startup")

    @app.on_shutdown
    async def close_pool() -> None:
        loops.add(id(asyncio.get_running_loop()))
        events.append(("shutdown", dict(b.committed("billing"))))

    @app.handler("payments", concurrency=4)
    async def payment(msg: Message) -> None:
        loops.add(id(asyncio.get_running_loop()))
        seen["payments"].append(msg.value or b"")

    @app.handler("refunds", concurrency=2)
    def refund(msg: Message) -> None:
        seen["refunds"].append(msg.value or b"")

    # when it runs until both topics are committed, then is stopped
    t, errors = _run_in_thread(app)
    _idle(b, {"billing": ["payments", "refunds"]})
    assert [c.config.name for c in app.consumers] == ["payment", "refund"]
    app.stop()
    t.join(30)
    # then every message ran once, the hooks ran once each, startup first, shutdown after the last
    # commit, all on the one loop of the async handler
    assert not t.is_alive() and errors == []
    assert sorted(seen["payments"]) == sorted(f"p{i}".encode() for i in range(30))
    assert sorted(seen["refunds"]) == sorted(f"r{i}".encode() for i in range(30))
    assert events[0] == "startup" and events[1][0] == "shutdown" and len(events) == 2
    assert sum(events[1][1].values()) == 60  # both topics' offsets committed before the shutdown hook
    assert len(loops) == 1
    # and the function is still the user's function, callable directly
    assert refund.__name__ == "refund"


def test_one_failing_route_stops_the_others_and_the_error_is_raised_after_shutdown() -> None:
    # given an app whose "orders" route fails on a message (no middleware, no error handler)
    b = _broker("orders", "audit")
    b.produce("orders", "bad", key="k")
    for i in range(10):
        b.produce("audit", f"a{i}", key=f"k{i}")
    app = KeyedApp(client_factory=b.client_factory, clock=b.clock, poll_timeout_s=0.01)
    shut: list[str] = []
    audit_runs = threading.Event()

    @app.handler("orders")
    def orders(msg: Message) -> None:
        audit_runs.wait(10)
        raise ValueError("boom")

    @app.handler("audit")
    def audit(msg: Message) -> None:
        audit_runs.set()

    app.on_shutdown(lambda: shut.append("down"))
    # when it runs
    t, errors = _run_in_thread(app)
    t.join(30)
    # then the whole app stopped, the shutdown hook ran, and the route's error is raised
    assert not t.is_alive()
    assert shut == ["down"]
    assert len(errors) == 1 and isinstance(errors[0], MessageError)
    assert b.committed("audit")  # the route is its own group: named after it, no app-wide group_id
    assert all(off == 0 for off in b.committed("orders").values())  # never past the failed message


def test_a_stop_during_startup_starts_no_consumer_and_still_runs_shutdown() -> None:
    b = _broker("t")
    app = KeyedApp(client_factory=b.client_factory, clock=b.clock)
    ran: list[str] = []

    @app.handler("t")
    def h(msg: Message) -> None:
        ran.append("handler")

    @app.on_startup
    def startup() -> None:
        app.stop()  # e.g. SIGTERM while a pool opens
        ran.append("startup")

    app.on_shutdown(lambda: ran.append("shutdown"))
    app.run()
    assert ran == ["startup", "shutdown"]


def test_a_failing_startup_hook_starts_nothing_and_is_raised() -> None:
    b = _broker("t")
    app = KeyedApp(client_factory=b.client_factory, clock=b.clock)
    app.handler("t")(lambda m: None)
    ran: list[str] = []

    @app.on_startup
    def startup() -> None:
        raise ConnectionError("database down")

    app.on_shutdown(lambda: ran.append("shutdown"))
    with pytest.raises(ConnectionError, match="database down"):
        app.run()
    assert ran == [] and app.consumers == []


def test_bad_options_are_refused_at_registration_naming_the_field() -> None:
    with pytest.raises(ValueError, match="not a ConsumerConfig field: concurency"):
        KeyedApp(concurency=4)
    with pytest.raises(ValueError, match="belongs to a route"):
        KeyedApp(topics=["t"])
    app = KeyedApp()
    with pytest.raises(pydantic.ValidationError, match="concurrency"):
        app.handler("t", concurrency=0)(lambda m: None)
    with pytest.raises(ValueError, match="at least one topic"):
        app.handler()
    app.handler("t", name="x")(lambda m: None)
    with pytest.raises(ValueError, match="named 'x' exists"):
        app.handler("u", name="x")(lambda m: None)


def test_route_options_replace_the_apps_and_the_group_follows_the_documented_rule() -> None:
    app = KeyedApp(group_id="svc", concurrency=8, brokers=["k1:9092"])

    @app.handler("a")
    def a(msg: Message) -> None: ...

    @app.handler("b", concurrency=2, group_id="other")
    def b(msg: Message) -> None: ...

    solo = KeyedApp()

    @solo.handler("c")
    def c(msg: Message) -> None: ...

    ra, rb = app.routes
    assert (ra.settings.group, ra.settings.concurrency, ra.settings.brokers) == ("svc", 8, ["k1:9092"])
    assert (rb.settings.group, rb.settings.concurrency) == ("other", 2)
    assert solo.routes[0].settings.group == "c"


def test_no_route_is_an_error() -> None:
    from keyedconsumer import KeyedConsumerError

    with pytest.raises(KeyedConsumerError, match="no route"):
        KeyedApp().run()


def test_many_routes_on_one_loop_all_start() -> None:
    # more routes than the loop's default executor has threads (min(32, cpus + 4)): all must run
    b = _broker(*[f"t{i}" for i in range(12)])
    for i in range(12):
        b.produce(f"t{i}", "x", key="k")
    app = KeyedApp(client_factory=b.client_factory, clock=b.clock, poll_timeout_s=0.01)
    for i in range(12):
        app.handler(f"t{i}", name=f"r{i}")(lambda m: None)
    t, errors = _run_in_thread(app)
    _idle(b, {f"r{i}": [f"t{i}"] for i in range(12)})
    app.stop()
    t.join(30)
    assert not t.is_alive() and errors == []


def test_an_app_is_tested_by_its_routes_on_the_in_memory_broker(kc_broker: InMemoryBroker) -> None:
    # given the app as the service defines it (real brokers named, no test wiring in it)
    app = KeyedApp(brokers=["kafka.prod:9092"], group_id="billing", poll_timeout_s=0.01)
    totals: dict[bytes, int] = {}
    calls: list[tuple[bytes | None, bytes | None]] = []
    pool: list[str] = []

    @app.on_startup
    async def open_pool() -> None:
        pool.append("open")

    @app.handler("payments", concurrency=8)
    async def payment(msg: Message) -> None:
        assert pool == ["open"]
        calls.append((msg.key, msg.value))
        totals[msg.key or b""] = totals.get(msg.key or b"", 0) + int(msg.value or b"0")

    # when the test publishes to the topic and runs the app until idle on the in-memory broker
    kc_broker.create_topic("payments", partitions=3)
    with kc_broker.run_app(app) as run:
        for i in range(50):
            kc_broker.produce("payments", str(i), key=f"acct-{i % 4}")
        run.until_idle()
        # then every message reached the handler, in order per key
        assert totals == {f"acct-{k}".encode(): sum(i for i in range(50) if i % 4 == k) for k in range(4)}
        for k in range(4):
            values = [int(v or b"0") for key, v in calls if key == f"acct-{k}".encode()]
            assert values == sorted(values)
    assert kc_broker.committed("billing") and len(calls) == 50


def test_the_plugin_keeps_keyedconsumer_environment_out_of_tests(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import os
    import subprocess
    import sys

    # given a developer's shell with KEYEDCONSUMER_CONCURRENCY=7, and a test that builds a config
    test = tmp_path / "test_inner.py"
    test.write_text(
        "from keyedconsumer import ConsumerConfig\n"
        "def test_default():\n"
        "    assert ConsumerConfig(name='x', topics=['t']).concurrency == 1\n"
    )
    env = {**os.environ, "KEYEDCONSUMER_CONCURRENCY": "7"}

    def inner(*args: str) -> int:
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, str(test)]
        return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, timeout=120).returncode

    # then with the plugin (installed with the package) the test sees the defaults
    assert inner() == 0
    # and without it the variable would have leaked in (the control: the plugin is what keeps it out)
    assert inner("-p", "no:keyedconsumer") == 1


def test_an_app_is_a_health_source_and_app_middleware_wraps_every_route(kc_broker: InMemoryBroker) -> None:
    from keyedconsumer.health import Health

    kc_broker.create_topic("a", partitions=2)
    kc_broker.create_topic("b", partitions=1)
    seen: list[str] = []

    def outer(handler: Any) -> Any:
        def wrapped(msg: Message) -> None:
            seen.append(f"outer:{msg.topic}")
            handler(msg)

        return wrapped

    app = KeyedApp(poll_timeout_s=0.01, middlewares=[outer])
    app.handler("a")(lambda m: None)
    app.handler("b", name="bee")(lambda m: None)
    health = Health(app)
    assert not health.check().live  # no route polls yet
    with kc_broker.run_app(app) as run:
        kc_broker.produce("a", "1", key="k")
        kc_broker.produce("b", "2", key="k")
        run.until_idle()
        report = health.check()
        assert report.live and report.ready and report.assigned_partitions == 3
    assert sorted(seen) == ["outer:a", "outer:b"]
