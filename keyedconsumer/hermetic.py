"""Hermetic in-memory runs: while one is on, the real network clients refuse to start.

:mod:`keyedconsumer.testing` opens a *scope* for each in-memory run (``InMemoryBroker.run``,
``InMemoryBroker.run_app``) and for each test that takes the ``kc_broker`` fixture. While any scope
is open in the process, every place where keyedconsumer itself would reach a network address calls
:func:`check` first, which refuses: it raises :class:`NetworkRefusedError` naming what tried to
connect and where, logs it, and records it in every open scope, so that the run (or the test) fails
at its end even when the caller swallowed the error. The places:

- a Kafka consumer client (``keyedconsumer.kafka.client.connect``, the default client factory);
- a real producer (:class:`~keyedconsumer.Publisher`: when built, and when it publishes, for one
  built before the scope opened);
- the command line's Kafka tools (``keyedconsumer.kafka.admin``);
- a Redis client (``RedisSequencer``, ``keyedconsumer.sequencing.connection.connect``).

Not covered: clients the application builds itself (``confluent_kafka.Producer``, ``redis.Redis``,
an HTTP client), and the throw-away consumer ``ConsumerConfig`` builds to let librdkafka check its
properties (bootstrap ``127.0.0.1:9``, closed at once: it never reaches a broker). Servers that
*listen* (``Metrics(http_port=...)``, ``Health.serve``) are not refused.

The scope is process-wide, not per thread: the engine's poll thread, its worker threads and a
handler's own threads all run under it.
"""

from __future__ import annotations

import itertools
import logging
import threading

from .errors import KeyedConsumerError

__all__ = ["NetworkRefusedError", "open_scope", "close_scope", "open_scopes", "refusals", "check", "active"]

log = logging.getLogger("keyedconsumer.testing")

_lock = threading.Lock()
_ids = itertools.count(1)
#: open scope id -> (what opened it, the refusals seen while it is open)
_scopes: dict[int, tuple[str, list[str]]] = {}


class NetworkRefusedError(KeyedConsumerError):
    """Something tried to reach a network address while an in-memory run (or a test with the
    ``kc_broker`` fixture) was on. The message names what tried, the address, and what to do."""


def open_scope(what: str) -> int:
    """Open a scope (``what`` names it in the errors, e.g. ``"InMemoryBroker.run_app(app)"``);
    returns its id for :func:`close_scope` and :func:`refusals`."""
    with _lock:
        scope = next(_ids)
        _scopes[scope] = (what, [])
        return scope


def close_scope(scope: int) -> list[str]:
    """Close the scope; returns the refusals seen while it was open (closing twice returns ``[]``)."""
    with _lock:
        _, seen = _scopes.pop(scope, ("", []))
        return seen


def refusals(scope: int) -> list[str]:
    """The refusals seen so far while the scope is open (a copy)."""
    with _lock:
        return list(_scopes.get(scope, ("", []))[1])


def active() -> bool:
    """Whether any scope is open."""
    with _lock:
        return bool(_scopes)


def open_scopes() -> dict[int, str]:
    """``{scope id: what opened it}`` of every open scope."""
    with _lock:
        return {scope: what for scope, (what, _) in _scopes.items()}


def check(who: str, address: str) -> None:
    """Called where keyedconsumer is about to reach ``address`` on behalf of ``who`` (e.g.
    ``"a Kafka producer (DeadLetter, Audit or Publisher)"``); returns at once when no scope is open.

    Raises
    ------
    NetworkRefusedError
        A scope is open: the error is also logged and recorded in every open scope.
    """
    with _lock:
        if not _scopes:
            return
        opened_by = ", ".join(what for what, _ in _scopes.values())
        message = (
            f"{who} tried to reach {address} during an in-memory run ({opened_by}): in-memory tests "
            "do not use the network. Give the consumer the in-memory broker's client factory (every "
            "producer of its middleware then writes into the broker), pass publisher=broker.publisher(), "
            "or run this test against a real broker"
        )
        for _, seen in _scopes.values():
            seen.append(message)
    log.error("%s", message)
    raise NetworkRefusedError(message)
