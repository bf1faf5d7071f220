"""A ``KeyedApp`` that the CLI tests run with ``keyedconsumer run tests.integration.procs.cli_app:app``.

Two routes, ``KC_CLI_TOPIC1`` (sync handler) and ``KC_CLI_TOPIC2`` (``async def``), in one consumer
group ``KC_CLI_GROUP``, on ``KC_CLI_BROKERS``; handled messages are logged as
:mod:`tests.integration.procs.cli_handlers` logs them, and the shutdown hook logs
``shutdown -1 -1 - -``.
"""

from __future__ import annotations

import os

from keyedconsumer import KeyedApp

from .cli_handlers import handle, handle_async

app = KeyedApp(brokers=[os.environ["KC_CLI_BROKERS"]], group_id=os.environ["KC_CLI_GROUP"], concurrency=8)
app.handler(os.environ["KC_CLI_TOPIC1"], name="first")(handle)
app.handler(os.environ["KC_CLI_TOPIC2"], name="second")(handle_async)


@app.on_shutdown
def log_shutdown() -> None:
    with open(os.environ["KC_CLI_LOG"], "a") as f:
        f.write("shutdown -1 -1 - -\n")
