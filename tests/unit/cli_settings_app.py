"""A ``KeyedApp`` for tests/unit/test_cli_settings.py (``keyedconsumer run ... --print-settings``:
nothing connects): route ``fast`` sets its own concurrency, route ``plain`` sets nothing; the app
sets the group."""

from __future__ import annotations

from keyedconsumer import KeyedApp, Message

app = KeyedApp(brokers=["127.0.0.1:1"], group_id="billing")


@app.handler("payments", concurrency=16)
def fast(msg: Message) -> None: ...


@app.handler("refunds")
def plain(msg: Message) -> None: ...
