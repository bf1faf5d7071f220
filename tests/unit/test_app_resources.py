"""A handler's resources, typed, without dependency injection (docs/comparison.md, "Dependency
injection"): an object opened by a startup hook, closed by a shutdown hook, whose bound method is
the route's handler. It runs as written on the in-memory broker."""

from __future__ import annotations

import asyncio

import pytest
from keyedconsumer.middleware import Typed
from pydantic import BaseModel

from keyedconsumer import KeyedApp, Message
from keyedconsumer.testing import InMemoryBroker

pytestmark = pytest.mark.timeout(30)


class Order(BaseModel):
    id: str


class Database:
    """Stands for an async pool: bound to the event loop that opened it."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.rows: list[str] = []
        self.closed = False

    async def insert(self, order: Order) -> None:
        assert asyncio.get_running_loop() is self.loop  # used on the loop that opened it
        self.rows.append(order.id)


class Orders:
    db: Database  # opened by start(), before the first message

    async def start(self) -> None:
        self.db = Database()

    async def stop(self) -> None:
        self.db.closed = True

    async def accept(self, msg: Message[Order]) -> None:
        await self.db.insert(msg.payload)


def test_a_resource_opened_on_startup_is_used_by_a_bound_method_handler(kc_broker: InMemoryBroker) -> None:
    # given the pattern: one object, its hooks and its handler
    app = KeyedApp(group_id="orders-service")
    orders = Orders()
    app.on_startup(orders.start)
    app.on_shutdown(orders.stop)
    app.handler("orders", middlewares=[Typed(Order)])(orders.accept)
    kc_broker.create_topic("orders")
    # when the app runs
    with kc_broker.run_app(app) as run:
        kc_broker.produce("orders", '{"id": "o-1"}', key="c-7")
        kc_broker.produce("orders", '{"id": "o-2"}', key="c-7")
        run.until_idle()
    # then the handler used the resource the hook opened, on its loop, and the hook closed it
    assert orders.db.rows == ["o-1", "o-2"] and orders.db.closed
    assert app.routes[0].settings.name == "accept"  # the route is named after the method
