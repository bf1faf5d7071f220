"""A ``KeyedApp`` of five routes in one consumer group, for the tests of several consumers in one
process: ``keyedconsumer run tests.integration.procs.routes_app:app``.

Routes ``a``, ``b``, ``c`` and ``d`` consume ``KC_RT_TOPIC1`` (one partition: three of them get
none) and route ``e`` consumes ``KC_RT_TOPIC2`` (four partitions), all in the group ``KC_RT_GROUP``
on ``KC_RT_BROKERS``, with the default assignor (cooperative-sticky): the members of one group have
different subscriptions, and a topic has fewer partitions than its members, the shape that made
librdkafka's cooperative-sticky assignor loop for good before 2.6.1 (librdkafka #4783). Handlers
do nothing.
"""

from __future__ import annotations

import os

from keyedconsumer import KeyedApp, Message

app = KeyedApp(brokers=[os.environ["KC_RT_BROKERS"]], group_id=os.environ["KC_RT_GROUP"], concurrency=2)


def handle(msg: Message) -> None:
    pass


for route in ("a", "b", "c", "d"):
    app.handler(os.environ["KC_RT_TOPIC1"], name=route)(handle)
app.handler(os.environ["KC_RT_TOPIC2"], name="e")(handle)
