"""The dashboard answers only the hosts it is meant to be reached by, in a real browser.

A DNS-rebinding attack: a page of ``rebind.test`` whose name, after it loaded, resolves to the
dashboard's address (here the browser maps it to 127.0.0.1 from the start), reads the dashboard as
its own origin. The browser then sends ``Host: rebind.test:<port>``: the dashboard refuses it (400)
and no dead letter reaches the page. The loopback names and the hosts allowed by ``--allowed-host``,
``KEYEDCONSUMER_WEB_ALLOWED_HOSTS`` or the TOML file's ``web_allowed_hosts`` are answered.
"""

from __future__ import annotations

import http.client
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from .conftest import Dashboard

pytestmark = [pytest.mark.kafka]

SECRET = b"card 4111 1111 1111 1111"


def _shows(browser: Any, url: str, text: str, timeout_s: float = 20.0) -> bool:
    """Open ``url`` until its page holds ``text`` (the first sample may not be taken yet)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        browser.get(url)
        if text in browser.page_source:
            return True
        time.sleep(0.3)
    return False


def _status(port: int, host: str, path: str) -> tuple[int, bytes]:
    """A raw request with the given ``Host`` header (what a browser sends for that name)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path, headers={"Host": host})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


@pytest.fixture(scope="module")
def dlq(kafka_bootstrap: str) -> Iterator[str]:
    name = f"hosts-{uuid.uuid4().hex[:8]}.dlq"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(name, 1, 1)])[name].result(timeout=30)
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    p.produce(name, key=b"cust-1", value=SECRET, headers=[("kafka_dlt-original-topic", b"orders")])
    assert p.flush(30) == 0
    yield name


@pytest.mark.timeout(120)
def test_a_dns_rebinding_page_gets_400_and_no_dead_letter(
    kafka_bootstrap: str, dlq: str, browser: Any, tmp_path: Path
) -> None:
    # given the dashboard started with one more allowed host in the environment
    d = Dashboard(
        ["--brokers", kafka_bootstrap, "--dead-letter-topic", dlq, "--refresh", "1"],
        {"KEYEDCONSUMER_WEB_ALLOWED_HOSTS": "dash.test"},
        tmp_path / "hosts.log",
    )
    try:
        assert _shows(browser, f"http://127.0.0.1:{d.port}/dead-letters/{dlq}", "cust-1"), "sampled"
        # when the browser opens the dead letters under the rebound name, then it gets 400, no record
        browser.get(f"http://rebind.test:{d.port}/dead-letters/{dlq}")
        assert "Invalid host header" in browser.page_source
        assert SECRET.decode() not in browser.page_source and "cust-1" not in browser.page_source
        # and a script of that origin reading it as same-origin gets the same
        answer = browser.execute_async_script(
            "const done = arguments[arguments.length - 1];"
            "fetch(arguments[0]).then(async (r) => done([r.status, await r.text()])).catch((e) => done([0, String(e)]));",
            f"/dead-letters/{dlq}",
        )
        assert answer[0] == 400 and SECRET.decode() not in answer[1], answer
        # when opened as localhost, 127.0.0.1 or the allowed name, then the dead letter is shown
        for host in ("localhost", "127.0.0.1", "dash.test"):
            assert _shows(browser, f"http://{host}:{d.port}/dead-letters/{dlq}", SECRET.decode()), host
        # and [::1] (IPv6 loopback), every other name, a name that only ends like an allowed one, refused
        assert _status(d.port, f"[::1]:{d.port}", "/groups")[0] == 200
        for host in (f"rebind.test:{d.port}", "evil.dash.test", "dash.test.evil.example", "0x7f.1", ""):
            status, body = _status(d.port, host, f"/dead-letters/{dlq}")
            assert status == 400 and SECRET not in body, host
    finally:
        d.stop()


@pytest.mark.timeout(60)
def test_allowed_hosts_come_from_the_flag_or_the_toml_file(
    kafka_bootstrap: str, dlq: str, tmp_path: Path
) -> None:
    # given the allowed host in the TOML file, and a flag that beats it
    toml = tmp_path / "kc.toml"
    toml.write_text('web_allowed_hosts = ["toml.test", "*.proxy.test"]\n')
    d = Dashboard(["--brokers", kafka_bootstrap, "--config", str(toml)], {}, tmp_path / "toml.log")
    try:
        assert _status(d.port, "toml.test", "/groups")[0] == 200
        assert _status(d.port, "a.proxy.test", "/groups")[0] == 200
        assert _status(d.port, "dash.test", "/groups")[0] == 400
        assert "toml.test, *.proxy.test" in d.log()  # the start line names the hosts answered
    finally:
        d.stop()
    d = Dashboard(
        ["--brokers", kafka_bootstrap, "--config", str(toml), "--allowed-host", "dash.test"],
        {},
        tmp_path / "f.log",
    )
    try:
        assert _status(d.port, "dash.test", "/groups")[0] == 200
        assert _status(d.port, "toml.test", "/groups")[0] == 400
    finally:
        d.stop()
