"""The dashboard in a real browser (headless Chromium) against the real broker and Redis.

Given a running consumer with a parked key, three dead letters (one whose key, value, error and
headers are HTML and script payloads) and ``keyedconsumer web`` with actions enabled, a person opens
each page, sees what the consumer does, signs in, replays a dead letter (seen consumed again) and
un-parks the parked key. A second dashboard pointed at a Redis that does not answer still shows
Kafka and says so.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka.admin import AdminClient, NewTopic
from keyedconsumer.middleware import DeadLetter, Retry

from keyedconsumer import KeyedConsumer, Message, PermanentError, RedisSequencer
from keyedconsumer.kafka.partitioners import partition_for
from keyedconsumer.sequencing import inspect_redis

from ..integration.conftest import Running
from ..integration.kafkautil import end_offsets, produce, wait_until
from .conftest import Dashboard, screenshot_dir

pytestmark = [pytest.mark.kafka, pytest.mark.redis]

TOKEN = "e2e-" + uuid.uuid4().hex
XSS_KEY = b"<script>window.__xss=1</script>"
XSS_VALUE = b'"><img src=x onerror="window.__xss=2">'
XSS_HEADER = b"<script>window.__xss=3</script>"


class Scene:
    """The consumer, its topics and what its handler saw."""

    def __init__(self, bootstrap: str, redis_url: str) -> None:
        self.bootstrap, self.redis_url = bootstrap, redis_url
        tag = uuid.uuid4().hex[:8]
        self.topic, self.group = f"web-orders-{tag}", f"web-{tag}"
        self.dlq = f"{self.topic}.dlq"
        self.audit_topic = f"web-audit-{tag}"
        admin = AdminClient({"bootstrap.servers": bootstrap})
        futures = admin.create_topics(
            [NewTopic(self.topic, 2, 1), NewTopic(self.dlq, 1, 1), NewTopic(self.audit_topic, 2, 1)]
        )
        for f in futures.values():
            f.result(timeout=30)
        self.fail_poison = True
        self.scheduled_id = ""
        self.seen: list[tuple[bytes | None, bytes | None, int]] = []
        self.lock = threading.Lock()
        self.seq = RedisSequencer(redis_url, self.group, lease_ttl_s=5.0)
        self.consumer = KeyedConsumer(
            name=self.group,
            handler=self.handle,
            brokers=[bootstrap],
            topics=[self.topic],
            concurrency=4,
            sequencer=self.seq,
            middlewares=[
                DeadLetter(brokers=[bootstrap]),
                Retry(max_attempts=None, initial_delay_s=600, max_delay_s=600, jitter=0, park=True),
            ],
        )
        self.running = Running(self.consumer)

    def handle(self, msg: Message) -> None:
        with self.lock:
            self.seen.append((msg.key, msg.value, msg.attempt))
        if msg.key == b"stuck":
            raise ConnectionError("the payments service is down")
        if self.fail_poison and (msg.key or b"").startswith((b"poison", b"<")):
            raise PermanentError(f"cannot parse {msg.value!r}")

    def values_seen(self, value: bytes) -> int:
        with self.lock:
            return sum(1 for _, v, _ in self.seen if v == value)

    def stop(self) -> None:
        assert self.running.stop(30) and self.running.error is None


@pytest.fixture(scope="module")
def scene(kafka_bootstrap: str, redis_url: str) -> Iterator[Scene]:
    s = Scene(kafka_bootstrap, redis_url)
    try:
        records: list[tuple[bytes | None, bytes | None, int | None]] = [
            (f"k{i}".encode(), f"v{i}".encode(), None) for i in range(40)
        ]
        records += [
            (b"stuck", b"pay 42 EUR", None),
            (b"poison-1", b"not json 1", None),
            (b"poison-2", b"not json 2", None),
        ]
        produce(kafka_bootstrap, s.topic, records)
        from confluent_kafka import Producer

        p = Producer({"bootstrap.servers": kafka_bootstrap})
        p.produce(
            s.topic,
            key=XSS_KEY,
            value=XSS_VALUE,
            headers=[("x-note", XSS_HEADER), ("<b>name</b>", b"<i>v</i>")],
        )
        p.flush(10)
        assert wait_until(lambda: end_offsets(kafka_bootstrap, s.dlq, 1)[0] == 3, 60), "3 dead letters"
        assert wait_until(
            lambda: any(pk["key"] == "stuck" for pk in inspect_redis(redis_url, s.group)["parked"]), 30
        )
        s.scheduled_id = s.seq.schedule(s.topic, b"later", b"remind me", delay_s=600)
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def dashboard(scene: Scene, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dashboard]:
    d = Dashboard(
        [
            "--brokers",
            scene.bootstrap,
            "--group",
            scene.group,
            "--redis",
            redis_url,
            "--dead-letter-topic",
            scene.dlq,
            "--enable-actions",
            "--refresh",
            "1",
            "--stall-after",
            "30",
            "--audit-topic",
            scene.audit_topic,
            "--partitioner",  # the scene's producers are librdkafka's (its default partitioner)
            "consistent_random",
        ],
        {"KEYEDCONSUMER_WEB_TOKEN": TOKEN},
        tmp_path_factory.mktemp("web") / "dashboard.log",
    )
    try:
        yield d
    finally:
        d.stop()
        assert TOKEN not in d.log(), "the token never appears in the log"


def _wait(driver: Any, pred: Any, timeout_s: float = 20.0, what: str = "") -> Any:
    """Wait until ``pred(driver)`` is truthy; an element replaced by a live refresh or a page load
    meanwhile (stale) just means: look again.

    chromedriver reports an element of a document that a navigation (a form's submit) replaced
    between finding it and reading it not always as stale: seen in CI, a generic
    ``WebDriverException`` "unhandled inspector error: Node with given id does not belong to the
    document" while waiting for the page after signing in. That one means the same: look again."""
    from selenium.common.exceptions import (
        NoSuchElementException,
        StaleElementReferenceException,
        WebDriverException,
    )
    from selenium.webdriver.support.ui import WebDriverWait

    def look(d: Any) -> Any:
        try:
            return pred(d)
        except WebDriverException as exc:  # stale / no such element: re-raised, ignored by the wait
            if "does not belong to the document" in str(exc):
                return False
            raise

    wait = WebDriverWait(
        driver,
        timeout_s,
        poll_frequency=0.2,
        ignored_exceptions=(StaleElementReferenceException, NoSuchElementException),
    )
    return wait.until(look, what)


def _click(driver: Any, css: str, what: str = "") -> None:
    """Click the first element matching ``css`` (found again if a refresh replaced it)."""

    def click(d: Any) -> bool:
        d.find_element("css selector", css).click()
        return True

    _wait(driver, click, what=what or css)


def _text(driver: Any) -> str:
    return str(driver.find_element("tag name", "body").text)


def _shot(driver: Any, name: str) -> None:
    target = screenshot_dir()
    if target is not None:
        target.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(Path(target) / f"web-{name}.png"))


@pytest.mark.timeout(90)
def test_the_group_page_shows_members_offsets_and_throughput_and_refreshes_live(
    scene: Scene, dashboard: Dashboard, browser: Any
) -> None:
    # when a person opens the groups overview
    browser.get(dashboard.url + "/groups")
    _wait(browser, lambda d: scene.group in _text(d), what="the group is listed")
    _wait(
        browser,
        lambda d: "stable" in d.find_element("css selector", f'tr[data-group="{scene.group}"]').text,
        what="stable",
    )
    # and the group's page
    browser.get(f"{dashboard.url}/groups/{scene.group}")
    browser.execute_script("window.__same_page = 1")
    _wait(
        browser,
        lambda d: len(d.find_elements("css selector", "table.partitions tbody tr")) == 2,
        what="two partitions",
    )
    # then it shows the member, its partitions, the committed and end offsets: the consumer caught up
    text = _text(browser)
    assert "Members" in text and f"{scene.topic}[0]" in text and f"{scene.topic}[1]" in text
    _wait(
        browser,
        lambda d: all(
            "caught up" in r.text for r in d.find_elements("css selector", "table.partitions tbody tr")
        ),
        30,
        "both partitions caught up (the parked key let its partition move on)",
    )
    # and the throughput chart fills in by itself, without a reload (messages keep coming meanwhile)
    trickle = threading.Thread(
        target=lambda: [
            (produce(scene.bootstrap, scene.topic, [(f"k{i}".encode(), b"more", None)] * 50), time.sleep(0.4))
            for i in range(12)
        ],
        daemon=True,
    )
    trickle.start()
    _wait(
        browser, lambda d: d.find_elements("css selector", "figure.chart polyline.consumed"), 20, "the chart"
    )
    _wait(
        browser,
        lambda d: int(d.find_element("id", "live").get_attribute("data-refreshed") or 0) >= 2,
        10,
        "live refreshes",
    )
    assert browser.execute_script("return window.__same_page") == 1, "refreshed in place, not reloaded"
    _wait(
        browser,
        lambda d: "consumed 0.0/s" not in d.find_element("css selector", "figure.chart").text,
        20,
        "a rate",
    )
    _shot(browser, "group")
    trickle.join(30)
    browser.get(dashboard.url + "/groups")
    _wait(
        browser,
        lambda d: d.find_elements("css selector", f'tr[data-group="{scene.group}"] figure.chart'),
        20,
        "overview chart",
    )
    _shot(browser, "groups")


@pytest.mark.timeout(60)
def test_the_keys_page_shows_the_parked_key_its_lease_and_the_instance(
    scene: Scene, dashboard: Dashboard, browser: Any
) -> None:
    browser.get(dashboard.url + "/keys")
    _wait(
        browser,
        lambda d: d.find_elements("css selector", 'table.parked tr[data-key="stuck"]'),
        what="the parked key",
    )
    cells = _wait(
        browser,
        lambda d: [
            c.text
            for c in d.find_element("css selector", 'table.parked tr[data-key="stuck"]').find_elements(
                "tag name", "td"
            )
        ],
    )
    assert cells[1] == "1" and cells[2].startswith("in ") and cells[4] == "2", (
        cells
    )  # depth 1, due later, attempt 2 next
    # and the error that parked it, stored with the key in Redis
    assert (
        cells[5].startswith("builtins.ConnectionError: the payments service is down")
        and "attempt 1" in cells[5]
    ), cells
    assert "Instances (1)" in _text(browser) and "Scheduled messages (1)" in _text(browser)
    _wait(
        browser,
        lambda d: (
            scene.scheduled_id in d.find_element("css selector", 'table.scheduled tr[data-key="later"]').text
        ),
    )
    assert scene.seq.instance_id in _text(browser)
    _shot(browser, "keys")
    # and the search keeps only matching keys
    browser.get(dashboard.url + "/keys?q=stu")
    _wait(browser, lambda d: d.find_elements("css selector", 'table.parked tr[data-key="stuck"]'))
    browser.get(dashboard.url + "/keys?q=nothing-like-this")
    _wait(browser, lambda d: "Parked keys (1, 0 shown)" in _text(d), what="filtered out")


@pytest.mark.timeout(60)
def test_dead_letters_are_listed_with_their_failure_headers_escaped(
    scene: Scene, dashboard: Dashboard, browser: Any
) -> None:
    browser.get(dashboard.url + "/dead-letters")
    _wait(browser, lambda d: scene.dlq in _text(d), what="the dead-letter topic")
    browser.get(f"{dashboard.url}/dead-letters/{scene.dlq}")
    _wait(
        browser,
        lambda d: len(d.find_elements("css selector", "table.dead-letters tr[data-record]")) == 3,
        what="3 records",
    )
    text = _text(browser)
    assert "poison-1" in text and "PermanentError" in text and "cannot parse b'not json 1'" in text
    assert f"{scene.topic}[" in text, "the original topic and partition"
    # the payloads are shown as text, never run
    browser.execute_script(
        "document.querySelectorAll('details').forEach((d) => { d.open = true; })"
    )  # also pauses the refresh
    text = _text(browser)
    assert (
        XSS_KEY.decode() in text
        and XSS_VALUE.decode() in text
        and XSS_HEADER.decode() in text
        and "<b>name</b>" in text
    )
    assert "Traceback" in text and "kafka_dlt-exception-fqcn" in text
    source = browser.page_source
    assert "<script>window.__xss" not in source and "&lt;script&gt;window.__xss=1&lt;/script&gt;" in source
    assert '<img src="x"' not in source and "<img src=x" not in source
    time.sleep(1.5)  # a live refresh replaces the table meanwhile: still nothing runs
    assert browser.execute_script("return typeof window.__xss") == "undefined"
    assert not browser.find_elements("css selector", "main img, main b, main i")
    _shot(browser, "dead-letters")
    # and the filters by key and by error keep the matching records
    browser.get(f"{dashboard.url}/dead-letters/{scene.dlq}?key=poison-2")
    _wait(browser, lambda d: len(d.find_elements("css selector", "tr[data-record]")) == 1)
    browser.get(f"{dashboard.url}/dead-letters/{scene.dlq}?error=img+src")
    _wait(browser, lambda d: len(d.find_elements("css selector", "tr[data-record]")) == 1)
    browser.get(f"{dashboard.url}/dead-letters/{scene.dlq}?since=2999-01-01T00:00:00Z")
    _wait(browser, lambda d: "0 of the 3 latest records match" in _text(d))


def _sign_in(browser: Any, dashboard: Dashboard) -> None:
    browser.get(dashboard.url + "/login")
    browser.find_element("name", "token").send_keys("wrong-token")
    browser.find_element("css selector", "form.login button").click()
    _wait(browser, lambda d: "not the access token" in _text(d))
    browser.find_element("name", "token").send_keys(TOKEN)
    browser.find_element("css selector", "form.login button").click()
    _wait(browser, lambda d: "actions enabled" in _text(d), what="signed in")


def _confirm(browser: Any) -> None:
    _wait(
        browser,
        lambda d: d.find_element("id", "confirm").get_attribute("open") is not None,
        what="confirmation",
    )
    browser.find_element("id", "confirm-ok").click()


@pytest.mark.timeout(90)
def test_a_signed_in_person_replays_a_dead_letter_and_unparks_a_key(
    scene: Scene, dashboard: Dashboard, browser: Any
) -> None:
    # given the handler now accepts the poison messages, and no action is possible before signing in
    scene.fail_poison = False
    browser.get(f"{dashboard.url}/dead-letters/{scene.dlq}")
    assert not browser.find_elements("css selector", "input.select")
    _sign_in(browser, dashboard)
    # when they select poison-1, replay it and confirm
    browser.get(f"{dashboard.url}/dead-letters/{scene.dlq}?key=poison-1")
    _click(browser, "input.select", "a checkbox")
    browser.find_element("id", "replay-selected").click()
    # then the confirmation names the record's target: its original topic, its key's partition now
    partition = partition_for("consistent_random", b"poison-1", 2)
    _wait(
        browser, lambda d: d.find_element("id", "confirm").get_attribute("open") is not None, what="confirm"
    )
    text = browser.find_element("id", "confirm-text").text
    assert (
        "Replay 1 of the 1 selected dead letter(s)" in text
        and f"(key poison-1) -> {scene.topic}[{partition}]" in text
    ), text
    _shot(browser, "replay-confirm")
    _confirm(browser)
    # then it is sent once, consumed again by the running consumer, and shown as replayed; the page
    # says so where it can be seen
    _wait(
        browser,
        lambda d: "replayed 1 of 1 selected" in d.find_element("id", "flash").text,
        40,
        "the replay's answer",
    )
    flash = browser.find_element("id", "flash")
    assert flash.is_displayed() and flash.get_attribute("class") == "ok"
    assert browser.execute_script(
        "const r = arguments[0].getBoundingClientRect(); return r.top >= 0 && r.bottom <= window.innerHeight;",
        flash,
    ), "the success message is in view"
    assert f"-> {scene.topic}[{partition}]@" in flash.text
    assert wait_until(lambda: scene.values_seen(b"not json 1") == 2, 30), scene.seen
    _wait(
        browser,
        lambda d: "replayed" in d.find_element("css selector", "tr[data-record]").text,
        20,
        "replayed status",
    )
    assert scene.values_seen(b"not json 2") == 1, "the others stay in the dead-letter topic"
    _shot(browser, "replayed")
    # when they un-park the parked key now and confirm
    before = scene.values_seen(b"pay 42 EUR")
    browser.get(dashboard.url + "/keys")
    _click(browser, 'tr[data-key="stuck"] button.action', "un-park")
    _confirm(browser)
    _wait(browser, lambda d: "due now" in d.find_element("id", "flash").text, 20, "the un-park's answer")
    # then its parked message runs at once (attempt 2), not in 10 minutes
    assert wait_until(lambda: scene.values_seen(b"pay 42 EUR") > before, 20), scene.seen
    assert (b"stuck", b"pay 42 EUR", 2) in scene.seen
    # when they cancel the scheduled message and confirm
    _click(browser, 'table.scheduled tr[data-key="later"] button.action', "cancel")
    _confirm(browser)
    _wait(browser, lambda d: "cancelled" in d.find_element("id", "flash").text, 20, "the cancel's answer")
    # then it is no longer scheduled
    assert inspect_redis(scene.redis_url, scene.group)["scheduled"] == 0
    _wait(browser, lambda d: "Scheduled messages (0)" in _text(d), 20, "the page shows it gone")
    # and each action was logged, without the token
    log = dashboard.log()
    assert (
        "action replay" in log
        and "action unpark" in log
        and "action cancel-scheduled" in log
        and "sign-in refused" in log
    )
    assert TOKEN not in log
    # and written to the audit topic: by the one session, what, which key and offsets, the result
    from keyedconsumer.cli.audit import find

    records = list(
        find({"bootstrap.servers": scene.bootstrap}, scene.audit_topic, outcome="ACTION", timeout_s=30)
    )
    got = sorted((r["action"], r["key"] or "", r["result"]) for r in records)
    assert got == [
        ("cancel-scheduled", "later", "done"),
        ("replay", "", "done"),
        ("replay", "poison-1", "done"),
        ("unpark", "stuck", "done"),
    ], records
    assert len({r["session"] for r in records}) == 1 and records[0]["session"].startswith("session-")
    assert f"by {records[0]['session']} from" in log
    summary = next(r for r in records if r["action"] == "replay" and r["key"] is None)
    sent = next(r for r in records if r["key"] == "poison-1")
    assert (
        summary["dlq_topic"] == scene.dlq
        and summary["selected"] == 1
        and summary["records"] == [[0, sent["dlq_offset"]]]
    )
    assert sent["topic"] == scene.topic and sent["offset"] is not None
    assert sent["partition"] == partition and summary["targets"] == [
        [0, sent["dlq_offset"], scene.topic, partition]
    ]


@pytest.mark.timeout(60)
def test_with_redis_down_the_kafka_views_still_work_and_say_so(
    scene: Scene, browser: Any, tmp_path: Path
) -> None:
    d = Dashboard(
        [
            "--brokers",
            scene.bootstrap,
            "--group",
            scene.group,
            "--redis",
            "redis://:sekret-pw@127.0.0.1:1/0",
            "--refresh",
            "1",
        ],
        {},
        tmp_path / "down.log",
    )
    try:
        browser.get(d.url + "/keys")
        _wait(browser, lambda b: "did not answer" in _text(b), 20, "Redis down")
        assert "the Kafka views still work" in _text(browser) and "sekret-pw" not in browser.page_source
        browser.get(f"{d.url}/groups/{scene.group}")
        _wait(
            browser,
            lambda b: len(b.find_elements("css selector", "table.partitions tbody tr")) == 2,
            20,
            "Kafka still shown",
        )
        assert "read-only" in _text(browser)
    finally:
        d.stop()
