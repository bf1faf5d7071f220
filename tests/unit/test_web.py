"""The dashboard's web layer without the brokers: rendering from a given snapshot (escaping,
pagination of 10,000 partitions, a group without members, Redis down), sign-in, CSRF and the
read-only default. What crosses Kafka and Redis is tested in tests/e2e against the real services."""

from __future__ import annotations

import re
from typing import Any

import pytest

pytest.importorskip("starlette")
from starlette.testclient import TestClient  # noqa: E402

from keyedconsumer.kafka.admin import GroupMember  # noqa: E402
from keyedconsumer.web import WebOptions, create_app  # noqa: E402
from keyedconsumer.web.auth import COOKIE, Guard  # noqa: E402
from keyedconsumer.web.chart import throughput_chart  # noqa: E402
from keyedconsumer.web.sampler import GroupSnapshot, Sampler, Snapshot, is_dead_letter_topic  # noqa: E402

TOKEN = "unit-test-token-0123456789"
XSS = '<script>window.__xss=1</script>"><img src=x onerror=alert(1)>'


class FixedSampler(Sampler):
    """A sampler whose snapshot is given (no thread, no broker)."""

    def __init__(self, snap: Snapshot) -> None:
        super().__init__({"bootstrap.servers": "127.0.0.1:1"})
        self.fixed = snap

    def snapshot(self) -> Snapshot:
        return self.fixed


def _row(topic: str, p: int, committed: int | None, end: int) -> dict[str, Any]:
    lag = None if committed is None else end - committed
    return {
        "topic": topic,
        "partition": p,
        "committed_offset": committed,
        "start_offset": 0,
        "end_offset": end,
        "lag": lag,
        "finished_above": 0,
        "oldest_unfinished_age_s": None,
        "stalled_for_s": None,
        "stalled": False,
    }


def _client(snap: Snapshot, **options: Any) -> TestClient:
    app = create_app(
        WebOptions({"bootstrap.servers": "127.0.0.1:1"}, **options),
        sampler=FixedSampler(snap),
        start_sampler=False,
    )
    return TestClient(app, base_url="http://127.0.0.1")


def _snap(**kw: Any) -> Snapshot:
    return Snapshot(sampled_s=1.0, **kw)


@pytest.mark.timeout(30)
def test_every_shown_value_is_escaped_and_no_inline_script_may_run() -> None:
    # given a group and a Redis namespace whose names and keys are script payloads
    g = GroupSnapshot(
        XSS,
        state="stable",
        members=(GroupMember("m1", XSS, "/10.0.0.1", ((XSS, 0),)),),
        rows=[_row(XSS, 0, 5, 9)],
        total_lag=4,
        sampled_s=1.0,
    )
    redis = {
        "ns": {
            "leases": [{"key": XSS, "lid": "k.00", "owner": XSS, "ttl_ms": 1, "fencing_token": 3}],
            "parked": [
                {
                    "key": XSS,
                    "lid": "k.00",
                    "depth": 1,
                    "next_due_s": None,
                    "attempt": 2,
                    "head": XSS,
                    "quarantined": True,
                    "last_error": {"type": XSS, "message": XSS, "at": XSS, "attempt": 1, "time_s": 1.0},
                }
            ],
            "scheduled": 1,
            "scheduled_messages": [{"id": "a" * 32, "key": XSS, "topic": XSS, "due_s": 5.0}],
            "instances": [{"id": XSS, "last_seen_s": 1.0}],
            "scheduler": XSS,
            "quarantined": [XSS],
            "now_s": 2.0,
        }
    }
    client = _client(_snap(groups={XSS: g}, redis=redis, topics={XSS: 1}), redis_url="redis://:pw@h:1/0")
    # when each page is rendered
    for path in ("/groups", f"/groups/{XSS}", "/keys?ns=ns&q=" + XSS):
        r = client.get(path)
        # then the payloads appear only escaped
        assert r.status_code == 200, path
        assert "<script>window" not in r.text and "<img src=x" not in r.text, path
        assert "&lt;script&gt;window.__xss=1&lt;/script&gt;" in r.text, path
        # and the policy forbids inline scripts and other origins anyway
        assert "script-src 'self'" in r.headers["content-security-policy"]
        assert "'unsafe-inline'" not in r.headers["content-security-policy"]
        assert "pw@" not in r.text  # the Redis password is never shown


@pytest.mark.timeout(30)
def test_ten_thousand_partitions_are_paginated() -> None:
    rows = [_row("big", p, p, p + 1) for p in range(10_000)]
    client = _client(
        _snap(groups={"g": GroupSnapshot("g", state="stable", rows=rows, total_lag=10_000, sampled_s=1.0)})
    )
    first = client.get("/groups/g")
    assert first.text.count("<tr data-tp=") == 100 and "page 1 of 100" in first.text
    last = client.get("/groups/g?page=100")
    assert 'data-tp="big[9999]"' in last.text and 'data-tp="big[0]"' not in last.text
    assert "page 100 of 100" in client.get("/groups/g?page=999").text  # out of range: the last page


@pytest.mark.timeout(30)
def test_a_group_without_members_and_a_deleted_topic_are_said_plainly() -> None:
    g = GroupSnapshot(
        "idle", state="empty", rows=[_row("gone-soon", 0, 3, 3)], note="topic(s) deleted: old", sampled_s=1.0
    )
    text = _client(_snap(groups={"idle": g})).get("/groups/idle").text
    assert "No members" in text and "topic(s) deleted: old" in text and "caught up" in text


@pytest.mark.timeout(30)
def test_with_redis_down_the_kafka_views_still_render_and_say_so() -> None:
    g = GroupSnapshot("g", state="stable", rows=[_row("t", 0, 1, 2)], sampled_s=1.0)
    client = _client(
        _snap(groups={"g": g}, redis_error="Redis redis://h:1/0 did not answer: ConnectionError"),
        redis_url="redis://h:1/0",
    )
    for path in ("/groups", "/groups/g", "/keys"):
        text = client.get(path).text
        assert "did not answer" in text and "the Kafka views still work" in text, path
    assert 'data-tp="t[0]"' in client.get("/groups/g").text


@pytest.mark.timeout(30)
def test_read_only_by_default_every_action_is_refused() -> None:
    client = _client(_snap(dead_letter_topics=["t.dlq"]))
    assert "read-only" in client.get("/groups").text
    for action in ("replay", "unpark", "cancel-scheduled"):
        r = client.post(
            f"/actions/{action}",
            json={"topic": "t.dlq", "records": [[0, 0]]},
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        assert r.status_code == 403 and "actions are off" in r.json()["message"]


def test_actions_need_a_token() -> None:
    with pytest.raises(ValueError, match="token"):
        create_app(
            WebOptions({}, actions=True, token=None), sampler=FixedSampler(_snap()), start_sampler=False
        )


@pytest.mark.timeout(30)
def test_an_action_needs_a_session_and_its_csrf_token() -> None:
    client = _client(_snap(), actions=True, token=TOKEN)
    body = {"namespace": "ns", "lid": "k.00"}
    # not signed in: refused
    assert client.post("/actions/unpark", json=body).status_code == 403
    # a wrong token does not sign in
    r = client.post(
        "/login", content="token=wrong", headers={"content-type": "application/x-www-form-urlencoded"}
    )
    assert "not the access token" in r.text and COOKIE not in client.cookies
    # the right one does: an HttpOnly, SameSite=Strict session cookie that is not the token
    r = client.post(
        "/login",
        content=f"token={TOKEN}",
        headers={"content-type": "application/x-www-form-urlencoded"},
        follow_redirects=False,
    )
    assert r.status_code == 303
    cookie = r.headers["set-cookie"]
    assert "httponly" in cookie.lower() and "samesite=strict" in cookie.lower() and TOKEN not in cookie
    page = client.get("/groups").text
    assert TOKEN not in page
    csrf = re.search(r'name="csrf-token" content="([^"]+)"', page)
    assert csrf is not None
    # the session cookie alone (what a cross-site form would send) is refused
    assert client.post("/actions/unpark", json=body).status_code == 403
    assert client.post("/actions/unpark", json=body, headers={"X-CSRF-Token": "guess"}).status_code == 403
    # with its CSRF token the action runs (here: there is no Redis to act on)
    r = client.post("/actions/unpark", json=body, headers={"X-CSRF-Token": csrf.group(1)})
    assert r.status_code == 400 and "no Redis sequencer" in r.json()["message"]
    # a script may use the token as a bearer credential instead
    r = client.post("/actions/unpark", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 400
    # after signing out the session is gone
    client.post("/logout", headers={"X-CSRF-Token": csrf.group(1)})
    client.cookies.clear()
    assert (
        client.post("/actions/unpark", json=body, headers={"X-CSRF-Token": csrf.group(1)}).status_code == 403
    )


def test_a_replay_is_only_of_a_dead_letter_topic_shown() -> None:
    client = _client(_snap(dead_letter_topics=["t.dlq"]), actions=True, token=TOKEN)
    r = client.post(
        "/actions/replay",
        json={"topic": "orders", "records": [[0, 1]]},
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    assert r.status_code == 400 and "not a dead-letter topic" in r.json()["message"]


def test_the_guard_compares_in_constant_time_and_expires_sessions() -> None:
    guard = Guard(TOKEN, session_s=0.0)
    assert not guard.token_ok(TOKEN[:-1]) and guard.token_ok(TOKEN)
    sid = guard.open(TOKEN)
    assert sid is not None and guard.csrf(sid) is None  # expired at once
    assert not Guard(None).enabled and Guard(None).open(TOKEN) is None


def test_dead_letter_topics_are_recognised_by_name() -> None:
    assert all(map(is_dead_letter_topic, ["orders.dlq", "orders-DLT", "orders_dlq", "payments.dead-letter"]))
    assert not any(map(is_dead_letter_topic, ["orders", "dlq-metrics-x", "deadline"]))


def test_the_chart_scales_to_the_highest_rate() -> None:
    assert throughput_chart([(0.0, 1.0, 1.0)]) is None
    c = throughput_chart([(0.0, 0.0, 0.0), (5.0, 100.0, 50.0), (10.0, 50.0, 50.0)], width=100, height=50)
    assert c is not None and c.top == 100.0 and c.last_consumed == 50.0
    assert c.consumed.split()[1] == "50.0,1.0"  # the top of the box at the highest rate


def test_a_partition_with_lag_whose_commit_does_not_move_is_stalled_and_ages_grow_between_reads() -> None:
    from keyedconsumer.web.sampler import _History

    h = _History(history_s=60.0)
    rows0 = [_row("t", 0, 5, 9) | {"oldest_unfinished_age_s": 2.0}, _row("t", 1, 7, 7)]
    h.keep_ages(100.0, rows0, fresh=True)
    h.add(100.0, rows0)
    # 30 s later the committed offsets have not moved; the ages are not read again
    rows1 = [_row("t", 0, 5, 12), _row("t", 1, 7, 9)]
    h.keep_ages(130.0, rows1, fresh=False)
    h.add(130.0, rows1)
    assert rows1[0]["oldest_unfinished_age_s"] == 32.0  # the same record, 30 s older
    assert h.unmoved_s(("t", 0), 130.0) == 30.0
    # and the rates: nothing consumed, 5 produced in 30 s
    assert h.rates() == [(130.0, 0.0, 5 / 30)]
    # once the commit moves, the partition is no longer unmoved
    rows2 = [_row("t", 0, 8, 12), _row("t", 1, 9, 9)]
    h.add(135.0, rows2)
    assert h.unmoved_s(("t", 0), 135.0) == 0.0


def test_only_dead_letter_topics_are_read() -> None:
    text = _client(_snap(dead_letter_topics=["t.dlq"])).get("/dead-letters/payments").text
    assert "payments is not a dead-letter topic shown here" in text


def _audited(snap: Snapshot, broker: Any, **options: Any) -> TestClient:
    from keyedconsumer.action_audit import ActionAudit

    audit = ActionAudit({}, "web.audit", publisher=broker.publisher)
    app = create_app(
        WebOptions({"bootstrap.servers": "127.0.0.1:1"}, **options),
        sampler=FixedSampler(snap),
        start_sampler=False,
        audit=audit,
    )
    return TestClient(app, base_url="http://localhost")


@pytest.mark.timeout(30)
def test_each_action_is_written_to_the_audit_topic_with_its_session_and_result(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import json

    from keyedconsumer.testing import InMemoryBroker
    from keyedconsumer.web import actions as web_actions

    # given a dashboard whose actions go to an audit topic (Redis stubbed here: tests/e2e use the real one)
    broker = InMemoryBroker()
    broker.create_topic("web.audit", partitions=3)
    monkeypatch.setattr(web_actions, "unpark_now", lambda url, ns, lid: lid == "k.6b6579")
    monkeypatch.setattr(web_actions, "cancel_scheduled", lambda url, ns, sid: True)
    snap = _snap(
        redis={
            "ns": {"scheduled_messages": [{"id": "a" * 32, "key": "later", "topic": "orders", "due_s": 5.0}]}
        }
    )
    client = _audited(snap, broker, actions=True, token=TOKEN, redis_url="redis://h:1/0")
    client.post(
        "/login", content=f"token={TOKEN}", headers={"content-type": "application/x-www-form-urlencoded"}
    )
    csrf = re.search(r'name="csrf-token" content="([^"]+)"', client.get("/groups").text)
    assert csrf is not None
    signed_in = {"X-CSRF-Token": csrf.group(1)}
    # when a signed-in person un-parks a key, a script cancels a scheduled message, one request is
    # bad, and a request without a session is refused
    assert (
        client.post(
            "/actions/unpark", json={"namespace": "ns", "lid": "k.6b6579"}, headers=signed_in
        ).status_code
        == 200
    )
    assert (
        client.post(
            "/actions/cancel-scheduled",
            json={"namespace": "ns", "id": "a" * 32},
            headers={"Authorization": f"Bearer {TOKEN}"},
        ).status_code
        == 200
    )
    assert (
        client.post("/actions/unpark", json={"namespace": "other", "lid": XSS}, headers=signed_in).status_code
        == 400
    )
    assert client.post("/actions/unpark", json={"namespace": "ns", "lid": "k.6b6579"}).status_code == 403
    # then each action that ran or was asked by a signed-in party has one record, keyed by its message key
    recs = [(r.key, json.loads(r.value or b"")) for r in broker.records("web.audit")]
    by_action = {(d["action"], d["result"]): (k, d) for k, d in recs}
    assert len(recs) == 3 and set(by_action) == {
        ("unpark", "done"),
        ("cancel-scheduled", "done"),
        ("unpark", "bad request"),
    }
    key, unpark = by_action[("unpark", "done")]
    session = unpark["session"]
    assert (
        key == b"key"
        and unpark["key"] == "key"
        and unpark["outcome"] == "ACTION"
        and unpark["lid"] == "k.6b6579"
    )
    assert (
        re.fullmatch(r"session-[0-9a-f]{8}", session)
        and unpark["client"] == "testclient"
        and "due now" in unpark["message"]
    )
    assert client.cookies.get(COOKIE) not in json.dumps(unpark)  # who, never the session id
    key, cancel = by_action[("cancel-scheduled", "done")]
    assert (key, cancel["scheduled_id"], cancel["topic"], cancel["session"]) == (
        b"later",
        "a" * 32,
        "orders",
        "bearer token",
    )
    _, bad = by_action[("unpark", "bad request")]
    assert (
        bad["session"] == session
        and bad["namespace"] == "other"
        and bad["lid"] == XSS[:200]
        and "not shown here" in bad["message"]
    )


@pytest.mark.timeout(30)
def test_an_action_whose_audit_record_is_refused_says_so() -> None:
    from keyedconsumer import PublishError
    from keyedconsumer.testing import InMemoryBroker

    broker = InMemoryBroker()
    broker.create_topic("web.audit")
    publisher = broker.publisher()
    publisher.error = PublishError("the audit topic refuses writes")
    client = _audited(
        _snap(dead_letter_topics=["t.dlq"]),
        type("B", (), {"publisher": lambda self: publisher})(),
        actions=True,
        token=TOKEN,
    )
    r = client.post(
        "/actions/replay",
        json={"topic": "orders", "records": [[0, 1]]},
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    assert (
        r.status_code == 400
        and "NOT in the audit trail" in r.json()["message"]
        and "refuses writes" in r.json()["message"]
    )
    assert broker.records("web.audit") == []


@pytest.mark.timeout(30)
def test_the_audit_topic_comes_from_the_option_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn
    from typer.testing import CliRunner

    from keyedconsumer.cli import app as cli_app

    served: list[Any] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served.append(app))
    runner = CliRunner()
    base = ["web", "--brokers", "127.0.0.1:1", "--enable-actions"]
    env = {"KEYEDCONSUMER_WEB_TOKEN": TOKEN}
    assert runner.invoke(cli_app, [*base, "--audit-topic", "ops.audit"], env=env).exit_code == 0
    assert (
        runner.invoke(cli_app, base, env={**env, "KEYEDCONSUMER_WEB_AUDIT_TOPIC": "env.audit"}).exit_code == 0
    )
    assert runner.invoke(cli_app, base, env=env).exit_code == 0
    audits = [app.state.dashboard.audit for app in served]
    assert [a.topic if a else None for a in audits] == ["ops.audit", "env.audit", None]


# -- the hosts the dashboard answers (DNS rebinding), its replay scope ---------------------------------


def test_an_allowed_host_is_a_name_a_pattern_or_an_address() -> None:
    from keyedconsumer.web.hosts import LOOPBACK_HOSTS, allowed_hosts, host_pattern

    assert host_pattern(" Dash.Example.COM. ") == "dash.example.com"
    assert host_pattern("*.proxy.example") == "*.proxy.example"
    assert host_pattern("::1") == host_pattern("[::1]") == "[::1]"
    assert host_pattern("10.0.0.5") == "10.0.0.5" and host_pattern("*") == "*"
    for bad in ("http://dash.example", "dash.example:8080", "a.*.example", "dash example", "-x.example", ""):
        with pytest.raises(ValueError, match="expected a host name"):
            host_pattern(bad)
    assert allowed_hosts(["localhost", "dash.example"]) == [*LOOPBACK_HOSTS, "dash.example"]


@pytest.mark.timeout(30)
def test_the_dashboard_answers_only_its_hosts() -> None:
    client = _client(_snap(dead_letter_topics=["t.dlq"]), allowed_hosts=["dash.example", "*.proxy.example"])
    for host in ("localhost", "127.0.0.1", "[::1]:8080", "dash.example:8080", "a.proxy.example"):
        assert client.get("/groups", headers={"host": host}).status_code == 200, host
    for host in (
        "rebind.attacker.example",
        "dash.example.attacker.example",
        "proxy.example",
        "127.0.0.1.nip.io",
    ):
        r = client.get("/dead-letters/t.dlq", headers={"host": host})
        assert r.status_code == 400 and r.text == "Invalid host header", host
        assert "default-src 'none'" in r.headers["content-security-policy"]  # the answer has the headers too
    with pytest.raises(ValueError, match="allowed host"):
        _client(_snap(), allowed_hosts=["http://dash.example"])


@pytest.mark.timeout(30)
def test_the_web_command_takes_allowed_hosts_from_the_flag_the_environment_or_the_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    import uvicorn
    from typer.testing import CliRunner

    from keyedconsumer.cli import app as cli_app

    served: list[Any] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served.append(app))
    runner = CliRunner()
    toml = tmp_path / "kc.toml"
    toml.write_text('web_allowed_hosts = ["toml.example"]\n')
    base = ["web", "--brokers", "127.0.0.1:1", "--config", str(toml)]
    env = {"KEYEDCONSUMER_WEB_ALLOWED_HOSTS": "env.example, *.env.example"}
    assert runner.invoke(cli_app, base).exit_code == 0
    assert runner.invoke(cli_app, base, env=env).exit_code == 0
    assert runner.invoke(cli_app, [*base, "--allowed-host", "flag.example"], env=env).exit_code == 0

    def answered(app: Any, host: str) -> bool:
        return bool(TestClient(app).get("/nothing", headers={"host": host}).status_code != 400)

    toml_app, env_app, flag_app = served
    assert answered(toml_app, "toml.example") and not answered(toml_app, "env.example")
    assert answered(env_app, "a.env.example") and not answered(env_app, "toml.example")
    assert answered(flag_app, "flag.example") and not answered(flag_app, "env.example")
    # a bad value is refused at start, naming where it came from
    bad = runner.invoke(cli_app, base, env={"KEYEDCONSUMER_WEB_ALLOWED_HOSTS": "https://x.example"})
    assert bad.exit_code == 2 and "environment KEYEDCONSUMER_WEB_ALLOWED_HOSTS" in bad.output
    toml.write_text("web_allowed_hosts = [1]\n")
    bad = runner.invoke(cli_app, base)
    assert bad.exit_code == 2 and f"file {toml}" in bad.output and "web_allowed_hosts" in bad.output
    bad = runner.invoke(cli_app, ["web", "--brokers", "127.0.0.1:1", "--partitioner", "random"])
    assert bad.exit_code == 2 and "random" in bad.output


@pytest.mark.timeout(30)
def test_a_replay_needs_the_dead_letters_groups_or_an_allowed_topic() -> None:
    client = _client(_snap(dead_letter_topics=["t.dlq"]), actions=True, token=TOKEN)
    r = client.post(
        "/actions/replay-plan",
        json={"topic": "t.dlq", "records": [[0, 1]]},
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    assert r.status_code == 400 and "start the dashboard with --group" in r.json()["message"]
    r = client.post(
        "/actions/replay-plan", json={"topic": "t.dlq", "records": [[0, 1]]}, headers={"X-CSRF-Token": "x"}
    )
    assert r.status_code == 403


# -- bytes as shown: text or a hex view, cut and saying so ----------------------------------------------


def test_bytes_are_shown_as_text_or_as_a_hex_view() -> None:
    from keyedconsumer.web.deadletters import MAX_SHOWN_BYTES, Shown

    assert Shown.of("café <b>".encode()) == Shown("café <b>", False, 9, False)
    binary = Shown.of(b"\xff\x00abc")
    assert binary.hex and binary.text == "00000000  ff 00 61 62 63" + " " * 33 + "  |..abc|"
    assert binary.one_line == "0xff00616263"
    # control characters and bidirectional overrides (a key that would look like another) are hex too
    assert Shown.of(b"\x1b[31mred").hex and Shown.of("\u202ecust-7".encode()).hex
    assert not Shown.of(b"line 1\nline 2\ttab").hex
    # a long value is cut to its first bytes; a cut inside a character is still text
    long = ("é" * MAX_SHOWN_BYTES).encode()
    shown = Shown.of(long)
    assert (
        not shown.hex and shown.cut and shown.size == len(long) and shown.text == "é" * (MAX_SHOWN_BYTES // 2)
    )
    assert Shown.of(b"\xff" * (3 * MAX_SHOWN_BYTES)).text.count("\n") == MAX_SHOWN_BYTES // 16 - 1


def test_any_bytes_are_shown_without_an_error() -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from keyedconsumer.web.deadletters import MAX_SHOWN_BYTES, Shown

    @settings(max_examples=300, deadline=None)
    @given(
        st.one_of(
            st.binary(max_size=64), st.text(max_size=64).map(str.encode), st.binary(min_size=MAX_SHOWN_BYTES)
        )
    )
    def check(raw: bytes) -> None:
        shown = Shown.of(raw)
        assert shown.size == len(raw) and shown.cut == (len(raw) > MAX_SHOWN_BYTES)
        if not shown.hex:
            assert raw.startswith(shown.text.encode())
        else:
            assert all(set(line[10:57]) <= set("0123456789abcdef ") for line in shown.text.splitlines())

    check()


def test_the_key_filter_is_the_exact_key() -> None:
    from keyedconsumer.deadletters import Failure
    from keyedconsumer.kafka.admin import Record
    from keyedconsumer.web.deadletters import Filters

    def rec(key: bytes | None) -> Record:
        return Record("t.dlq", 0, 0, key, b"v", [], 1)

    f = Filters(key=b"cust-7")
    assert [
        k for k in (b"cust-7", b"cust-70", b"CUST-7", b"xcust-7", None) if f.match(rec(k), Failure.of(rec(k)))
    ] == [b"cust-7"]


def test_the_dead_letters_kept_in_memory_are_bounded_whatever_they_hold() -> None:
    from keyedconsumer.deadletters import Failure
    from keyedconsumer.kafka.admin import Record
    from keyedconsumer.web import deadletters as dl

    # given 3,000 matching dead letters, each with a value and 200 headers of 4 KiB of binary
    def letter(offset: int) -> dl.DeadLetter:
        big = bytes(range(256)) * 16
        rec = Record("t.dlq", 0, offset, b"k", big, [(f"h{i}", big) for i in range(200)], offset)
        return dl.DeadLetter.of(rec, Failure.of(rec), False, "kafka_dlt-exception-stacktrace")

    rows = [letter(o) for o in range(0, 3000, 100)]
    # then each shows at most MAX_SHOWN_HEADERS headers and counts the others
    assert len(rows[0].headers) == dl.MAX_SHOWN_HEADERS and rows[0].more_headers == 100
    # and a listing keeps the newest failures within its character budget
    kept = dl._newest(list(rows))
    assert sum(d.size for d in kept) <= dl.MAX_LISTING_CHARS and 0 < len(kept) < len(rows)
    assert [d.offset for d in kept] == sorted((d.offset for d in rows), reverse=True)[: len(kept)]

    # and a reader keeps at most MAX_LISTINGS listings, whatever the searches asked
    class Reader(dl.DeadLetterReader):
        def _read(self, topic: str, filters: dl.Filters) -> dl.Listing:
            return dl.Listing(kept, len(kept), len(kept))

    reader = Reader({})
    for i in range(20):
        reader.records("t.dlq", dl.Filters(key=str(i).encode()))
        assert len(reader._cache) <= dl.MAX_LISTINGS
