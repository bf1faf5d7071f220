"""Hostile bytes on every dashboard page, property-tested (hypothesis) against the app with the
dead letters on the real broker: whatever a dead letter holds (invalid UTF-8, control characters,
markup in the key, value, header names and values, failure headers given twice or holding
nonsense, values far above what is shown) and whatever a request's path or query holds, a page is
never a 500, holds no markup but the templates' own, shows text as text, binary as a hex view, and a
cut value says so."""

from __future__ import annotations

import uuid
from typing import Any
from urllib.parse import quote

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from markupsafe import escape

from .webcheck import structure_problems

pytest.importorskip("starlette")
from starlette.testclient import TestClient  # noqa: E402

from keyedconsumer.web import WebOptions, create_app  # noqa: E402
from keyedconsumer.web.deadletters import MAX_LINKED_KEY_BYTES, MAX_SHOWN_BYTES, Shown, hex_view  # noqa: E402
from keyedconsumer.web.sampler import Sampler, Snapshot  # noqa: E402

pytestmark = [pytest.mark.kafka]

TOKEN = "hostile-" + uuid.uuid4().hex
MARKUP = st.sampled_from(
    [
        "<script>window.__x=1</script>",
        '"><img src=x onerror=alert(1)>',
        "</td></tr></table><b>",
        "{{ 7*7 }}{% raw %}",
        "javascript:alert(1)",
        "&lt;&amp;",
        "\u202ecust-7",
        "\x00\x1b[31m\x7f",
        "' onmouseover='x",
    ]
)
TEXT = st.one_of(
    st.text(max_size=40),
    MARKUP,
    st.tuples(st.text(max_size=8), MARKUP, st.text(max_size=8)).map("".join),
)
BYTES = st.one_of(
    st.binary(max_size=120),
    TEXT.map(lambda t: t.encode()),
    st.tuples(MARKUP, st.integers(MAX_SHOWN_BYTES // 10, MAX_SHOWN_BYTES // 2)).map(
        lambda m: (m[0] * m[1]).encode()
    ),
    st.integers(MAX_SHOWN_BYTES + 1, 3 * MAX_SHOWN_BYTES).map(lambda n: bytes(range(256)) * (n // 256 + 1)),
)
FAILURE_HEADERS = st.sampled_from(
    [
        "kafka_dlt-original-topic",
        "kafka_dlt-original-partition",
        "kafka_dlt-original-offset",
        "kafka_dlt-exception-message",
        "kafka_dlt-exception-fqcn",
        "kafka_dlt-exception-stacktrace",
        "kafka_dlt-failed-at",
        "kafka_dlt-attempts",
    ]
)
NUMBERS = st.one_of(
    st.integers(-(2**70), 2**70), st.sampled_from(["nan", "1e400", "-0", "٣", " 12 ", "99999999999999999999"])
).map(lambda n: str(n).encode())
HEADERS = st.lists(
    st.tuples(st.one_of(FAILURE_HEADERS, TEXT), st.one_of(st.none(), BYTES, NUMBERS)), max_size=8
)
RECORD = st.fixed_dictionaries(
    {"key": st.one_of(st.none(), BYTES), "value": st.one_of(st.none(), BYTES), "headers": HEADERS}
)


class Shows(Sampler):
    """A sampler whose snapshot lists the dead-letter topics the test made (read from Kafka by the pages)."""

    def __init__(self, bootstrap: str) -> None:
        super().__init__({"bootstrap.servers": bootstrap})
        self.dlqs: list[str] = []

    def snapshot(self) -> Snapshot:
        return Snapshot(sampled_s=1.0, dead_letter_topics=list(self.dlqs), redis={"ns": {}})


def _shown_in(page: str, raw: bytes | None) -> bool:
    """``raw`` is on the page as the template shows it: escaped text, or a hex view (each cut)."""
    if raw is None:
        return True
    shown = Shown.of(raw)
    if shown.hex:
        return str(escape(hex_view(raw[:MAX_SHOWN_BYTES]))) in page
    return str(escape(shown.text)) in page


def _ok(response: Any, what: str) -> str:
    assert response.status_code < 500, (what, response.status_code, response.text[:2000])
    assert response.status_code in (200, 400, 404, 409), (what, response.status_code)
    page: str = response.text
    if response.headers.get("content-type", "").startswith("text/html"):
        assert structure_problems(page) == [], (what, structure_problems(page))
    return page


@pytest.mark.timeout(600)
def test_hostile_dead_letters_render_as_text_or_hex_never_markup_never_500(kafka_bootstrap: str) -> None:
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "message.max.bytes": 2_000_000})
    sampler = Shows(kafka_bootstrap)
    app = create_app(
        WebOptions(
            {"bootstrap.servers": kafka_bootstrap},
            interval_s=0.0,
            allow_topics=["t"],
            actions=True,
            token=TOKEN,
        ),
        sampler=sampler,
        start_sampler=False,
    )
    client = TestClient(app, base_url="http://127.0.0.1")
    client.post("/login", data={"token": TOKEN})

    @settings(
        max_examples=30,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        derandomize=True,
    )
    @given(records=st.lists(RECORD, min_size=1, max_size=3), path=TEXT, query=TEXT)
    def check(records: list[dict[str, Any]], path: str, query: str) -> None:
        # given a fresh dead-letter topic holding the records
        dlq = f"hostile-{uuid.uuid4().hex[:10]}.dlq"
        admin.create_topics([NewTopic(dlq, 1, 1)])[dlq].result(timeout=30)
        sampler.dlqs.append(dlq)
        for r in records:
            producer.produce(dlq, key=r["key"], value=r["value"], headers=r["headers"] or None)
        assert producer.flush(30) == 0
        # when its page is opened, then every record is there, as text or hex, and nothing else is markup
        page = _ok(client.get(f"/dead-letters/{dlq}"), "records page")
        assert page.count("<tr data-record=") == len(records)
        for r in records:
            assert _shown_in(page, r["key"]) and _shown_in(page, r["value"]), r
            for name, value in r["headers"]:
                if not name.startswith("kafka_dlt-exception-stacktrace"):
                    assert _shown_in(page, value), (name, value)
            if r["value"] is not None and len(r["value"]) > MAX_SHOWN_BYTES:
                assert f"the first {MAX_SHOWN_BYTES} of {len(r['value'])} bytes shown" in page
        # and a search for each key finds it (exact bytes), the live fragment and the replay plan answer
        for r in records:
            if r["key"] is not None and len(r["key"]) <= MAX_LINKED_KEY_BYTES:  # a longer one is not linked
                found = _ok(client.get(f"/dead-letters/{dlq}", params={"key_hex": r["key"].hex()}), "search")
                assert "<tr data-record=" in found
        _ok(
            client.get(f"/dead-letters/{dlq}", params={"fragment": "1", "key": query, "error": query}),
            "fragment",
        )
        selected = [[0, o] for o in range(len(records))]
        plan = client.post(
            "/actions/replay-plan",
            json={"topic": dlq, "records": selected},
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        assert plan.status_code == 200 and len(plan.json()["plan"]) == len(records), plan.text
        # and hostile path segments and query values get an answer, never a 500 nor markup
        segment = quote(path, safe="")
        for url in (
            f"/dead-letters/{segment}",
            f"/dead-letters/{segment}%ff%fe",
            f"/groups/{segment}",
            f"/dead-letters/{dlq}?since={quote(query)}&until=%ff&page={quote(query)}&key_hex={quote(query)}",
            f"/keys?ns={quote(query)}&q={quote(query)}",
            f"/groups?page={quote(query)}",
        ):
            _ok(client.get(url), url)

    try:
        check()
    finally:
        admin.delete_topics(sampler.dlqs) if sampler.dlqs else None
