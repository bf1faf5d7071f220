"""``event_loop``: which loop the engine starts for ``async def`` handlers (uvloop when installed)."""

from __future__ import annotations

import asyncio

import pydantic
import pytest
import uvloop

from keyedconsumer.config import ConsumerConfig
from keyedconsumer.engine.workers import new_event_loop

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(("kind", "uv"), [("auto", True), ("uvloop", True), ("asyncio", False)])
def test_the_engine_starts_the_loop_asked_for(kind: str, uv: bool) -> None:
    loop = new_event_loop(kind)
    try:
        assert isinstance(loop, uvloop.Loop) is uv
        assert loop.run_until_complete(asyncio.sleep(0, "ran")) == "ran"
    finally:
        loop.close()


def test_an_unknown_event_loop_is_a_validation_error_naming_the_field() -> None:
    with pytest.raises(pydantic.ValidationError) as err:
        ConsumerConfig(name="n", topics=["t"], event_loop="trio")
    assert err.value.errors()[0]["loc"] == ("event_loop",)
