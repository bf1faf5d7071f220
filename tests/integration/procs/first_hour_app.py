"""A ``KeyedApp`` that tests/integration/test_first_hour.py runs with ``keyedconsumer run``.

As a new user writes it: the brokers hard-coded in the code (``KC_FH_BROKERS``), two routes, one of
them with ``DeadLetter`` and ``Retry``, and a startup hook. The hook and the handled messages append
a line to the file ``KC_FH_LOG``: ``startup``, ``handled <topic> <key>``.
"""

from __future__ import annotations

import os

from keyedconsumer.middleware import DeadLetter, Retry

from keyedconsumer import KeyedApp, Message

app = KeyedApp(brokers=[os.environ["KC_FH_BROKERS"]], group_id=os.environ["KC_FH_GROUP"])


def _log(line: str) -> None:
    with open(os.environ["KC_FH_LOG"], "a") as f:
        f.write(line + "\n")


@app.on_startup
async def open_pool() -> None:
    _log("startup")


@app.handler(
    os.environ["KC_FH_TOPIC"],
    middlewares=[DeadLetter(topic=os.environ["KC_FH_TOPIC"] + ".dlq"), Retry(max_attempts=2)],
)
async def orders(msg: Message) -> None:
    _log(f"handled {msg.topic} {(msg.key or b'-').decode()}")


@app.handler(os.environ["KC_FH_TOPIC"] + "-payments")
def payments(msg: Message) -> None:
    _log(f"handled {msg.topic} {(msg.key or b'-').decode()}")
