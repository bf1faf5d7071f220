"""A ``KeyedApp`` for tests/unit/test_cli_settings.py (``keyedconsumer run ... --print-settings``:
nothing connects): route ``fast`` sets its own concurrency, route ``plain`` sets nothing, route
``remote`` reads another cluster (its own brokers and ``client.id``); the app sets the brokers, the
group and a librdkafka property."""

from __future__ import annotations

from keyedconsumer import KeyedApp, Message

app = KeyedApp(brokers=["127.0.0.1:1"], group_id="billing", config={"client.id": "app", "linger.ms": 7})


@app.handler("payments", concurrency=16)
def fast(msg: Message) -> None: ...


@app.handler("refunds")
def plain(msg: Message) -> None: ...


@app.handler("audit", brokers=["10.0.0.1:9092"], config={"client.id": "remote"})
def remote(msg: Message) -> None: ...
