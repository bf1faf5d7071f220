"""The pytest plugin of :mod:`keyedconsumer.testing` (registered as ``keyedconsumer`` through the
``pytest11`` entry point, so installing the package enables it).

Fixtures:

``kc_broker``
    A fresh :class:`~keyedconsumer.testing.InMemoryBroker` per test. The test is hermetic
    (:mod:`keyedconsumer.hermetic`): from its start to its end, a real Kafka or Redis client that
    anything tries to start is refused with ``NetworkRefusedError``, and the test fails at its
    end, naming what tried to connect, even when the code under test swallowed the error.
``kc_clock``
    That broker's :class:`~keyedconsumer.testing.FakeClock` (``RetryLater`` back-off of minutes
    passes in milliseconds while consumers poll idle).

For every test, an in-memory run the test left running (``broker.run(...)`` never stopped) stops
being hermetic when the test ends, with a warning, so later tests of the session may use the network.

And, for every test, the process environment without ``KEYEDCONSUMER_*`` variables: a
:class:`~keyedconsumer.ConsumerConfig` reads them (pydantic-settings), so a developer's shell
setting would otherwise change what a test runs. A test that wants one sets it itself
(``monkeypatch.setenv``), after this fixture ran. Turn it off for a run with ``-p no:keyedconsumer``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator

import pytest

from .. import hermetic
from ..config import ENV_PREFIX
from .broker import InMemoryBroker
from .clock import FakeClock

__all__ = ["kc_broker", "kc_clock"]


@pytest.fixture(autouse=True)
def _kc_without_keyedconsumer_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in list(os.environ):
        if name.upper().startswith(ENV_PREFIX):
            monkeypatch.delenv(name)
    yield


@pytest.fixture(autouse=True)
def _kc_hermetic_scopes_end_with_the_test() -> Iterator[None]:
    before = set(hermetic.open_scopes())
    yield
    for scope, what in hermetic.open_scopes().items():
        if scope not in before:
            hermetic.close_scope(scope)
            warnings.warn(
                f"{what} was still running at the end of the test: stop it (use it in a with block)",
                stacklevel=1,
            )


@pytest.fixture
def kc_broker(request: pytest.FixtureRequest) -> Iterator[InMemoryBroker]:
    """A fresh in-memory broker (no topics yet: ``kc_broker.create_topic(name, partitions=n)``); the
    test is hermetic (see the module docstring)."""
    scope = hermetic.open_scope(f"the test {request.node.name} with kc_broker")
    try:
        yield InMemoryBroker()
    finally:
        refused = hermetic.close_scope(scope)
    if refused:
        pytest.fail("; ".join(refused), pytrace=False)


@pytest.fixture
def kc_clock(kc_broker: InMemoryBroker) -> FakeClock:
    """The fake clock of ``kc_broker``."""
    return kc_broker.clock
