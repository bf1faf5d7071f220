"""A parked key's last error and the dashboard's actions in the audit trail, on the real broker and
real Redis: the error that parked a key is stored with it (cut to its byte bound, on the Redis
clock), shown escaped by the dashboard and by ``keyedconsumer inspect --redis``; each action (un-park,
cancel) is written to the audit topic with who, what, which key and the result, where
``keyedconsumer audit`` finds it."""

from __future__ import annotations

import json
import re
import threading
import uuid
from collections.abc import Callable

import pytest
from typer.testing import CliRunner

from keyedconsumer import KeyedConsumer, Message, RedisSequencer, RetryLater
from keyedconsumer.cli import app as cli_app
from keyedconsumer.cli.audit import find
from keyedconsumer.sequencing import inspect_redis
from keyedconsumer.sequencing.parking import MAX_ERROR_BYTES

from .kafkautil import committed, produce, wait_until

pytest.importorskip("starlette")
from starlette.testclient import TestClient  # noqa: E402

from keyedconsumer.web import WebOptions, create_app  # noqa: E402

pytestmark = [pytest.mark.kafka, pytest.mark.redis]

TOKEN = "it-" + uuid.uuid4().hex
XSS = '<script>window.__xss=1</script>"><img src=x onerror=alert(1)>'


@pytest.mark.timeout(120)
def test_the_last_error_is_stored_shown_escaped_and_each_action_reaches_the_audit_trail(
    kafka_bootstrap: str, redis_url: str, new_topic: Callable[..., str]
) -> None:
    # given key "stuck" whose first attempt parks it (due in 10 min) with an error whose message is a
    # script payload followed by 2,000 two-byte characters
    topic, audit_topic = new_topic(2), new_topic(3, prefix="audit")
    ns = f"webact-{uuid.uuid4().hex[:8]}"
    group = f"g-{ns}"
    message = XSS + "é" * 2000
    ran: list[tuple[bytes | None, int]] = []

    def handle(msg: Message) -> None:
        ran.append((msg.key, msg.attempt))
        if msg.key == b"stuck" and msg.attempt == 1:
            raise RetryLater(600.0, park=True) from ConnectionError(message)

    seq = RedisSequencer(redis_url, ns, lease_ttl_s=2.0)
    consumer = KeyedConsumer(
        name=group, handler=handle, brokers=[kafka_bootstrap], topics=[topic], sequencer=seq
    )
    [(p, o)] = produce(kafka_bootstrap, topic, [(b"stuck", b"pay", None)])
    t = threading.Thread(target=consumer.run, daemon=True)
    t.start()
    try:
        assert wait_until(lambda: bool(inspect_redis(redis_url, ns)["parked"]), 30)
        assert wait_until(lambda: committed(kafka_bootstrap, group, topic, 2)[p] == o + 1, 30)  # parked: done
        # then the error is stored with the key: class, message cut to its byte bound at a character
        # boundary, the failed message and attempt, the time on the Redis server's clock
        state = inspect_redis(redis_url, ns)
        [pk] = state["parked"]
        err = pk["last_error"]
        assert (
            err["type"] == "builtins.ConnectionError"
            and err["at"] == f"{topic}[{p}]@{o}"
            and err["attempt"] == 1
        )
        stored = err["message"].encode()
        assert (
            len(stored) <= MAX_ERROR_BYTES
            and len(stored) >= MAX_ERROR_BYTES - 1
            and message.startswith(err["message"])
        )
        assert 0 <= state["now_s"] - err["time_s"] < 30
        # and `keyedconsumer inspect --redis` shows it (as text: no markup), and all of it with --json
        runner = CliRunner()
        args = [
            "inspect",
            "--group",
            group,
            "--brokers",
            kafka_bootstrap,
            "--redis",
            redis_url,
            "--namespace",
            ns,
        ]
        shown = runner.invoke(cli_app, args, env={"COLUMNS": "400"})
        assert shown.exit_code == 0, shown.output
        assert f"builtins.ConnectionError: {XSS}" in shown.output, shown.output
        assert f"({topic}[{p}]@{o}, attempt 1, " in shown.output, shown.output
        data = runner.invoke(cli_app, [*args, "--json"])
        assert json.loads(data.stdout)["redis"]["parked"][0]["last_error"]["message"] == err["message"]

        # when the dashboard (writing its actions to the audit topic) shows the keys
        sid = seq.schedule(topic, b"later", b"remind me", delay_s=600)
        options = WebOptions(
            {"bootstrap.servers": kafka_bootstrap},
            groups=[group],
            redis_url=redis_url,
            namespaces=[ns],
            actions=True,
            token=TOKEN,
            audit_topic=audit_topic,
        )
        app = create_app(options, start_sampler=False)
        app.state.dashboard.sampler.sample()
        with TestClient(app, base_url="http://127.0.0.1") as client:
            page = client.get(f"/keys?ns={ns}").text
            # then the parked key's last error is there, escaped
            assert (
                "builtins.ConnectionError" in page and "&lt;script&gt;window.__xss=1&lt;/script&gt;" in page
            )
            assert "<script>window" not in page and "<img src=x" not in page
            # when a signed-in person un-parks the key and a script cancels the scheduled message
            client.post(
                "/login",
                content=f"token={TOKEN}",
                headers={"content-type": "application/x-www-form-urlencoded"},
            )
            csrf = re.search(r'name="csrf-token" content="([^"]+)"', client.get("/groups").text)
            assert csrf is not None
            r = client.post(
                "/actions/unpark",
                json={"namespace": ns, "lid": pk["lid"]},
                headers={"X-CSRF-Token": csrf.group(1)},
            )
            assert r.status_code == 200 and "due now" in r.json()["message"], r.json()
            r = client.post(
                "/actions/cancel-scheduled",
                json={"namespace": ns, "id": sid},
                headers={"Authorization": f"Bearer {TOKEN}"},
            )
            assert r.status_code == 200 and "cancelled" in r.json()["message"], r.json()
        # then the key's message runs again at once, and the list and its last error are gone
        assert wait_until(
            lambda: (b"stuck", 2) in ran and inspect_redis(redis_url, ns)["parked"] == [], 30
        ), ran
    finally:
        consumer.stop()
        t.join(60)
    # and each action is in the audit topic: who, what, which key, the result
    conf = {"bootstrap.servers": kafka_bootstrap}
    actions = list(find(conf, audit_topic, outcome="ACTION", timeout_s=30))
    by = {d["action"]: d for d in actions}
    assert len(actions) == 2 and set(by) == {"unpark", "cancel-scheduled"}, actions
    unpark, cancel = by["unpark"], by["cancel-scheduled"]
    assert (unpark["key"], unpark["namespace"], unpark["lid"], unpark["result"]) == (
        "stuck",
        ns,
        pk["lid"],
        "done",
    )
    assert re.fullmatch(r"session-[0-9a-f]{8}", unpark["session"]) and unpark["client"] == "testclient"
    assert (cancel["key"], cancel["scheduled_id"], cancel["topic"], cancel["session"], cancel["result"]) == (
        "later",
        sid,
        topic,
        "bearer token",
        "done",
    )
    # and `keyedconsumer audit --key stuck` finds the un-park on the key's partition of the audit topic
    assert [d["action"] for d in find(conf, audit_topic, key="stuck", timeout_s=30)] == ["unpark"]
    assert TOKEN not in json.dumps(actions)
