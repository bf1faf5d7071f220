"""The dashboard's dead letters and replay on the real broker (Starlette's test client in front of
the app, Kafka behind it): a replay goes only where the dead letters' own consumer group consumes,
each record to its key's partition now, after a confirmation that shows each target; the audit
trail names them; the key filter is exact and searches past the latest records."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from keyedconsumer.cli.audit import find
from keyedconsumer.kafka.partitioners import partition_for

from .kafkautil import end_offsets
from .test_cli import produce_dead_letters, read_committed_records
from .test_replay_targets import consume_as, failed_in

pytest.importorskip("starlette")
from starlette.testclient import TestClient  # noqa: E402

from keyedconsumer.web import WebOptions, create_app  # noqa: E402
from keyedconsumer.web.sampler import Sampler, Snapshot  # noqa: E402

pytestmark = [pytest.mark.kafka]

TOKEN = "it-" + uuid.uuid4().hex
BEARER = {"Authorization": f"Bearer {TOKEN}"}


class Shown(Sampler):
    """A sampler whose snapshot lists the given dead-letter topics (the pages read Kafka themselves)."""

    def __init__(self, bootstrap: str, topics: list[str]) -> None:
        super().__init__({"bootstrap.servers": bootstrap})
        self.topics = topics

    def snapshot(self) -> Snapshot:
        return Snapshot(sampled_s=1.0, dead_letter_topics=list(self.topics))


def dashboard(bootstrap: str, dlqs: list[str], **options: Any) -> TestClient:
    app = create_app(
        WebOptions({"bootstrap.servers": bootstrap}, interval_s=0.0, **options),
        sampler=Shown(bootstrap, dlqs),
        start_sampler=False,
    )
    return TestClient(app, base_url="http://127.0.0.1")


@pytest.mark.timeout(120)
def test_a_replay_shows_each_target_sends_only_where_allowed_and_audits_it(
    kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    # given orders (5 partitions, written by Java clients) consumed by the orders group, another
    # team's topic consumed by its own group, and in orders' dead-letter topic two real dead letters
    # and one that names the other team's topic
    orders, payments = new_topic(5, prefix="orders"), new_topic(1, prefix="payments")
    dlq, audit = new_topic(1, prefix="orders-dlq"), new_topic(2, prefix="audit")
    group = f"orders-svc-{uuid.uuid4().hex[:8]}"
    consume_as(kafka_bootstrap, group, orders, 5)
    consume_as(kafka_bootstrap, f"payments-svc-{uuid.uuid4().hex[:8]}", payments, 1)
    real = [b"order-1", b"order-2"]
    produce_dead_letters(
        kafka_bootstrap,
        dlq,
        [
            *(failed_in(orders, k, 5) for k in real),
            {"topic": payments, "key": b"acct-9", "value": b'{"pay": 1000000}', "failed_at_ms": 2},
        ],
    )
    client = dashboard(kafka_bootstrap, [dlq], groups=[group], actions=True, token=TOKEN, audit_topic=audit)
    with client:
        # when a person selects all three, then the confirmation says where each goes, or why it does not
        plan = client.post(
            "/actions/replay-plan", json={"topic": dlq, "records": [[0, 0], [0, 1], [0, 2]]}, headers=BEARER
        )
        assert plan.status_code == 200, plan.text
        rows = plan.json()["plan"]
        assert [(r["key"], r["topic"], r["partition"]) for r in rows[:2]] == [
            (k.decode(), orders, partition_for("murmur2_random", k, 5)) for k in real
        ]
        assert rows[0]["target"] == f"{orders}[{rows[0]['partition']}]" and rows[0]["refused"] is None
        assert (
            rows[2]["key"] == "acct-9"
            and f"names topic {payments!r}, which is not consumed" in rows[2]["refused"]
        )
        # a replay without the confirmed targets is refused
        r = client.post("/actions/replay", json={"topic": dlq, "records": [[0, 0]]}, headers=BEARER)
        assert r.status_code == 400 and "targets" in r.json()["message"]
        # when they confirm the two real ones and a forged request asks for the third too, with a
        # target a person never saw, then only the confirmed two are sent, each to its confirmed partition
        targets = [[r["dlq_partition"], r["dlq_offset"], r["topic"], r["partition"]] for r in rows[:2]]
        body = {"topic": dlq, "records": [[0, 0], [0, 1], [0, 2]], "targets": [*targets, [0, 2, payments, 0]]}
        r = client.post("/actions/replay", json=body, headers=BEARER)
        assert r.status_code == 200 and "replayed 2 of 3 selected" in r.json()["message"], r.json()
        assert "left pending 1" in r.json()["message"] and "not consumed by group" in r.json()["message"]
    sent = read_committed_records(kafka_bootstrap, orders, 2)
    assert sorted((m.key(), m.partition()) for m in sent) == sorted(
        (k, partition_for("murmur2_random", k, 5)) for k in real
    )
    assert end_offsets(kafka_bootstrap, payments, 1) == {0: 0}, "nothing reached the other team's topic"
    # and the audit trail names each target: the action's record lists them and the one left pending
    conf = {"bootstrap.servers": kafka_bootstrap}
    records = list(find(conf, audit, outcome="ACTION", timeout_s=30))
    assert sorted((d["result"], d["key"] is None) for d in records) == [
        ("bad request", True),
        ("done", False),
        ("done", False),
        ("done", True),
    ]
    summary = next(d for d in records if d["key"] is None and d["result"] == "done")
    assert summary["targets"] == targets and [x[:3] for x in summary["refused"]] == [[0, 2, payments]]
    per_record = sorted((d["key"], d["topic"], d["partition"]) for d in records if d["key"] is not None)
    assert per_record == sorted((k.decode(), orders, partition_for("murmur2_random", k, 5)) for k in real)


@pytest.mark.timeout(120)
def test_a_target_that_changed_after_the_confirmation_is_not_sent(
    kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    # given a dead letter whose confirmation showed orders[p]
    orders, dlq = new_topic(3, prefix="orders"), new_topic(1, prefix="orders-dlq")
    produce_dead_letters(kafka_bootstrap, dlq, [failed_in(orders, b"k", 3)])
    client = dashboard(kafka_bootstrap, [dlq], allow_topics=[orders], actions=True, token=TOKEN)
    [row] = client.post(
        "/actions/replay-plan", json={"topic": dlq, "records": [[0, 0]]}, headers=BEARER
    ).json()["plan"]
    # when the replay is asked with another partition than the one shown (the target moved meanwhile)
    wrong = (row["partition"] + 1) % 3
    r = client.post(
        "/actions/replay",
        json={"topic": dlq, "records": [[0, 0]], "targets": [[0, 0, orders, wrong]]},
        headers=BEARER,
    )
    # then nothing is sent and the answer says why
    assert r.status_code == 409 and "replayed 0 of 1" in r.json()["message"]
    assert f"not {orders}[{wrong}] as confirmed" in r.json()["message"]
    assert sum(end_offsets(kafka_bootstrap, orders, 3).values()) == 0


@pytest.mark.timeout(180)
def test_the_key_filter_is_exact_and_searches_past_the_latest_records(
    kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    # given a dead-letter topic of 2 partitions whose oldest records are cust-7's, then 600 of
    # cust-70 .. cust-79
    dlq = new_topic(2, prefix="search-dlq")
    old = [
        {
            "topic": "t",
            "key": b"cust-7",
            "value": f"mine-{i}".encode(),
            "failed_at_ms": 1,
            "dlq_partition": i % 2,
        }
        for i in range(4)
    ]
    newer = [
        {
            "topic": "t",
            "key": f"cust-7{i % 10}".encode(),
            "value": b"theirs",
            "failed_at_ms": 2,
            "dlq_partition": i % 2,
        }
        for i in range(600)
    ]
    produce_dead_letters(kafka_bootstrap, dlq, old + newer)
    client = dashboard(kafka_bootstrap, [dlq], allow_topics=["t"], actions=True, token=TOKEN)
    client.post("/login", data={"token": TOKEN})  # signed in: the page has its checkboxes
    # when the page is opened without a filter, then it shows the latest records, and says there are more
    page = client.get(f"/dead-letters/{dlq}").text
    assert "The latest 400 records; the topic holds 604" in page and "mine-0" not in page
    # when searching for key cust-7, then exactly cust-7's four records are found, older than the latest 400
    page = client.get(f"/dead-letters/{dlq}", params={"key": "cust-7"}).text
    assert "4 of the 604 latest records match" in page
    assert sorted(re.findall(r"mine-\d", page)) == ["mine-0", "mine-1", "mine-2", "mine-3"]
    assert "cust-70" not in page and "theirs" not in page
    # and "select all" then selects only those: the replay plan has only cust-7's records
    selected = re.findall(r'class="select" value="(\d+):(\d+)"', page)
    assert len(selected) == 4
    plan = client.post(
        "/actions/replay-plan",
        json={"topic": dlq, "records": [[int(p), int(o)] for p, o in selected]},
        headers=BEARER,
    ).json()["plan"]
    assert {r["key"] for r in plan} == {"cust-7"}
    # and a binary key is searched by its bytes in hex
    produce_dead_letters(
        kafka_bootstrap,
        dlq,
        [{"topic": "t", "key": b"\xff\x00k", "value": b"\x00\x01\xfe", "failed_at_ms": 3}],
    )
    page = client.get(f"/dead-letters/{dlq}", params={"key_hex": "ff006b"}).text
    assert "1 of the 605 latest records match" in page and "0xff006b" in page
    assert "00000000  00 01 fe" in page, "a binary value is shown in hex"
