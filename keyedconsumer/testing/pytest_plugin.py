"""The pytest plugin of :mod:`keyedconsumer.testing` (registered as ``keyedconsumer`` through the
``pytest11`` entry point, so installing the package enables it).

Fixtures:

``kc_broker``
    A fresh :class:`~keyedconsumer.testing.InMemoryBroker` per test.
``kc_clock``
    That broker's :class:`~keyedconsumer.testing.FakeClock` (``RetryLater`` back-off of minutes
    passes in milliseconds while consumers poll idle).

And, for every test, the process environment without ``KEYEDCONSUMER_*`` variables: a
:class:`~keyedconsumer.ConsumerConfig` reads them (pydantic-settings), so a developer's shell
setting would otherwise change what a test runs. A test that wants one sets it itself
(``monkeypatch.setenv``), after this fixture ran. Turn it off for a run with ``-p no:keyedconsumer``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

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


@pytest.fixture
def kc_broker() -> InMemoryBroker:
    """A fresh in-memory broker (no topics yet: ``kc_broker.create_topic(name, partitions=n)``)."""
    return InMemoryBroker()


@pytest.fixture
def kc_clock(kc_broker: InMemoryBroker) -> FakeClock:
    """The fake clock of ``kc_broker``."""
    return kc_broker.clock
