"""The first hour of a new user (issue 26): mistakes found when the code is loaded, not at the first
message, and errors and help that say where to look. No broker: the in-memory one, or none."""

from __future__ import annotations

import functools
import logging
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pydantic
import pytest
from typer.testing import CliRunner

from keyedconsumer import KeyedApp, KeyedConsumer, Message
from keyedconsumer.cli import app as cli

pytestmark = pytest.mark.timeout(60)
runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]


# -- a handler that cannot take the message ---------------------------------------------------------------


def test_a_handler_that_cannot_take_the_message_is_refused_at_registration_naming_the_route() -> None:
    app = KeyedApp()
    # given handlers that take no argument, or two: refused when decorated, naming the route
    with pytest.raises(
        TypeError, match=r"route 'orders': handler orders\(\) cannot be called as handler\(message\)"
    ):

        @app.handler("orders")
        def orders() -> None: ...

    with pytest.raises(TypeError, match=r"route 'payments': handler <lambda>\(msg, extra\) cannot be called"):
        app.handler("payments", name="payments")(lambda msg, extra: None)

    def pay(msg: Message, extra: int) -> None: ...

    with pytest.raises(TypeError, match=r"route 'pay': handler pay\(msg: 'Message', extra: 'int'\) cannot"):
        app.handler("payments")(pay)
    with pytest.raises(
        TypeError, match=r"route 'many': batch_handler .* cannot be called as batch_handler\(messages\)"
    ):
        app.batch_handler("payments", name="many")(lambda a, b: None)
    # and an error handler that cannot take (error, message), naming the route too
    with pytest.raises(TypeError, match=r"route 'refunds': error_handler.*\(error, message\)"):
        app.handler("refunds", name="refunds", error_handler=lambda error: None)(lambda msg: None)
    assert app.routes == []
    # and KeyedConsumer refuses them when built
    with pytest.raises(TypeError, match=r"cannot be called as handler\(message\)"):
        KeyedConsumer(name="c", topics=["t"], handler=lambda: None)
    with pytest.raises(TypeError, match=r"cannot be called as batch_handler\(messages\)"):
        KeyedConsumer(name="c", topics=["t"], batch_handler=lambda a, b: None)


def test_every_handler_that_takes_the_message_is_accepted() -> None:
    class Handler:
        def __call__(self, msg: Message) -> None: ...

    def with_default(msg: Message, retries: int = 3) -> None: ...

    async def in_async(msg: Message) -> None: ...

    app = KeyedApp()
    for i, fn in enumerate(
        [
            with_default,
            in_async,
            Handler(),
            functools.partial(with_default, retries=1),
            print,
            lambda *a: None,
        ]
    ):
        app.handler("t", name=f"r{i}")(fn)
        KeyedConsumer(name=f"c{i}", topics=["t"], handler=fn)
    assert len(app.routes) == 6


# -- a bad option of a route ------------------------------------------------------------------------------


def test_a_bad_route_option_names_the_route_and_the_field() -> None:
    app = KeyedApp(group_id="billing")
    with pytest.raises(pydantic.ValidationError) as info:

        @app.handler("orders", concurrency=0)
        def orders(msg: Message) -> None: ...

    assert info.value.title == "route 'orders' (ConsumerConfig)"
    assert [e["loc"] for e in info.value.errors()] == [("concurrency",)]
    assert "route 'orders'" in str(info.value) and "greater than or equal to 1" in str(info.value)
    # and when the command line's settings are put under the routes, the same
    app.handler("refunds", name="refunds")(lambda msg: None)
    with pytest.raises(pydantic.ValidationError, match="route 'refunds'"):
        app.apply_settings({"max_in_flight": 0})


# -- two routes failing at once: no asyncio "Task exception was never retrieved" -------------------------


#: Two routes that both fail, "payments" first, then "orders"; the app's error, then a collection.
_TWO_FAILING_ROUTES = """
import gc, logging, sys, threading, time
from keyedconsumer import KeyedApp, Message
from keyedconsumer.testing import InMemoryBroker
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(name)s: %(message)s")
b = InMemoryBroker()
for t in ("orders", "payments"):
    b.create_topic(t, partitions=1)
    b.produce(t, "bad", key="k")
app = KeyedApp(client_factory=b.client_factory, clock=b.clock, poll_timeout_s=0.01)
orders_started, payments_failing = threading.Event(), threading.Event()
@app.handler("orders")
def orders(msg):
    orders_started.set()
    assert payments_failing.wait(30)
    while app.consumers[1].running:  # until the payments route failed and stopped
        time.sleep(0.005)
    raise ValueError("orders boom")
@app.handler("payments")
def payments(msg):
    assert orders_started.wait(30)  # both messages run: the stop cannot keep "orders" from failing
    payments_failing.set()
    raise ValueError("payments boom")
try:
    app.run()
except Exception as exc:
    print("raised:", exc)
gc.collect()  # a task whose exception nobody retrieved is reported when it is collected
print("collected")
"""


def test_two_failing_routes_leave_no_unretrieved_task_exception() -> None:
    # given two routes that both fail (in a process of its own: pytest's log capture keeps the
    # errors, and so the tasks, alive), when the app runs and its tasks are collected
    out = subprocess.run(
        [sys.executable, "-c", _TWO_FAILING_ROUTES], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    # then the first error is raised, the other logged, and no task's exception was left unretrieved
    assert out.returncode == 0, out.stderr
    assert "raised: unhandled failure of message topic=payments" in out.stdout, out.stdout
    assert "route orders stopped too" in out.stdout and "orders boom" in out.stdout, out.stdout
    assert out.stdout.rstrip().endswith("collected"), out.stdout
    assert "never retrieved" not in out.stdout + out.stderr, out.stdout + out.stderr


# -- keyedconsumer replay -------------------------------------------------------------------------------


def test_a_nested_command_named_at_the_top_is_suggested() -> None:
    result = runner.invoke(cli, ["replay", "--from", "orders.dlq"])
    assert result.exit_code == 2
    assert "No such command 'replay'. Did you mean 'dead-letter replay'?" in result.output, result.output
    result = runner.invoke(cli, ["inspct"])  # typer's own suggestion, among the top commands, stays
    assert "Did you mean 'inspect'?" in result.output, result.output


# -- run --help ---------------------------------------------------------------------------------------


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def test_run_help_groups_the_options_in_sections_and_cuts_no_sentence() -> None:
    from keyedconsumer.cli.flags import generated_flags
    from keyedconsumer.cli.run import _SPELLED_OUT

    result = runner.invoke(cli, ["run", "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0
    sections = re.findall(r"^(\S[^:\n]*):$", result.output, re.M)
    assert sections == [
        "Arguments",
        "Handler and topics",
        "Kafka",
        "Retry and dead letters",
        "Processing",
        "Exactly-once results",
        "Redis sequencer",
        "Logs, health, metrics",
        "Options",
    ], result.output
    text = _flat(result.output)
    # the help of a setting's flag is its documentation's first sentence, whole (not cut at a ";")
    assert "--name TEXT The consumer's name; also the consumer group id unless group_id is given." in text
    for flag, _path, annotation, _default in generated_flags(_SPELLED_OUT).values():
        help_text = annotation.__metadata__[0].help
        assert re.search(r"[.)]$", help_text), (flag, help_text)
        assert _flat(help_text) in text, (flag, help_text)
    # and no help text is cut with an ellipsis (click's "...", rich's "…"), the list of commands included
    top = runner.invoke(cli, ["--help"]).output
    for output in (result.output, top):
        assert "…" not in output
        assert not [x for x in output.splitlines()[1:] if x.rstrip().endswith("...")], (
            output
        )  # [ARGS]... of Usage


# -- a missing topic's message -----------------------------------------------------------------------------


def test_a_missing_topic_is_named_with_the_closest_existing_name() -> None:
    from keyedconsumer.kafka.client import missing_topic_text

    known = ["orders", "payments", "__consumer_offsets", "refunds"]
    assert missing_topic_text("order", known).startswith(
        "subscribed topic 'order' does not exist (did you mean 'orders'?)"
    )
    assert "did you mean" not in missing_topic_text("inventory", known)
    assert "did you mean" not in missing_topic_text("__consumer_offset", known)  # internal topics left out


# -- the log of repeated client errors --------------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_repeats_log_the_first_then_a_count(caplog: pytest.LogCaptureFixture) -> None:
    from keyedconsumer.kafka.logs import RepeatCollapsingLog, Repeats

    clock = _Clock()
    log = RepeatCollapsingLog(logging.getLogger("kc.test.repeats"), ignore_args=(1,))
    log.repeats = Repeats(every_s=60.0, clock=clock, on_forget=log._tell)
    caplog.set_level(logging.DEBUG, "kc.test.repeats")
    fail = "[thrd:b/bootstrap]: b/bootstrap: Connect to ipv4#127.0.0.1:1 failed: Connection refused (after {}ms in state CONNECT)"
    # given the same failure 100 times in 10 s, from two clients, with librdkafka's timing varying
    for i in range(100):
        log.error("%s [%s] %s", "FAIL", f"rdkafka#consumer-{i % 2}", fail.format(i % 7))
        clock.now += 0.1
    # then the first is logged, the others counted
    assert [r.getMessage() for r in caplog.records] == [f"FAIL [rdkafka#consumer-0] {fail.format(0)}"]
    # when another kind comes, it is logged at once; and after 60 s the next repeat comes with the count
    log.warning("%s", "Kafka client error: _ALL_BROKERS_DOWN: 1/1 brokers are down")
    clock.now += 60
    log.error("%s [%s] %s", "FAIL", "rdkafka#producer-3", fail.format(1))
    messages = [r.getMessage() for r in caplog.records]
    assert messages[1] == "Kafka client error: _ALL_BROKERS_DOWN: 1/1 brokers are down"
    assert messages[2] == f"FAIL [rdkafka#producer-3] {fail.format(1)} (99 more like it in the last 70 s)"
    # and a flush tells what was not told yet, with the latest of them
    log.error("%s [%s] %s", "FAIL", "rdkafka#consumer-1", fail.format(5))
    clock.now += 2
    log.flush()
    assert (
        caplog.records[-1].getMessage()
        == f"FAIL [rdkafka#consumer-1] {fail.format(5)} (1 more like it in the last 2 s)"
    )
    assert caplog.records[-1].levelno == logging.ERROR
    log.flush()
    assert len(caplog.records) == 4
    # and librdkafka's debug output is never collapsed
    for _ in range(3):
        log.debug("%s [%s] %s", "HEARTBEAT", "rdkafka#consumer-0", "Heartbeat for group g")
    assert len(caplog.records) == 4 + 3


def test_repeats_remember_a_bounded_number_of_kinds(caplog: pytest.LogCaptureFixture) -> None:
    from keyedconsumer.kafka.logs import RepeatCollapsingLog, Repeats

    log = RepeatCollapsingLog(logging.getLogger("kc.test.kinds"))
    told: list[Any] = []
    log.repeats = Repeats(max_kinds=3, on_forget=lambda sample, count, s: told.append((sample[2], count)))
    caplog.set_level(logging.INFO, "kc.test.kinds")
    for kind in ("a", "a", "b", "c", "d"):
        log.warning("error %s", kind)
    # the oldest kind is forgotten past the bound, and its untold count handed on
    assert told == [(("a",), 1)]
    assert [r.getMessage() for r in caplog.records] == ["error a", "error b", "error c", "error d"]
