"""The ``oauth_cb`` of every client the package builds (consumer, producers, admin): its tokens
checked, its failures retried, the first token fetched before the client is built.

confluent-kafka (>= 2.13) serves the token refresh on librdkafka's background thread, so an idle
client (a dead-letter producer that has had nothing to write for hours, an admin client) refreshes
its token at 80% of the token's lifetime like a busy one. What it does not do:

- a callback that returns nothing (``None``, a 1-tuple, an empty token, an expiry that is no
  number) makes its ``PyArg_ParseTuple`` fail: no token and no failure is set, the constructor
  waits its 10 s for a token and raises "OAuth token not set within 10 seconds timeout", which
  names no cause;
- a callback that raises at once (an identity provider's hiccup) is retried by librdkafka only
  after 10 s (``rd_kafka_oauthbearer_set_token_failure``): the constructor has given up by then.

:func:`with_token_source` replaces ``oauth_cb`` in a client's properties by a :class:`TokenSource`
around it, and fetches the first token in the calling thread, before the client is built: a
callback that returns no usable token raises :class:`TokenCallbackError` naming it and what it
returned, at once; one that raises is called again after :data:`RETRY_DELAYS_S` (its last error
raised as :class:`TokenCallbackError`). librdkafka's first call then gets that token. A later
refresh is tried the same way; one that still fails leaves the current token in use until it
expires and librdkafka asks again 10 s later.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import KafkaClientError

__all__ = ["TokenSource", "TokenCallbackError", "with_token_source", "RETRY_DELAYS_S"]

log = logging.getLogger("keyedconsumer.kafka")

#: Seconds between the calls of a callback that raised: three calls within 1.5 s of sleep, well
#: inside the 10 s confluent-kafka's constructors wait for the first token.
RETRY_DELAYS_S = (0.5, 1.0)
#: Seconds between the calls of a refresh (librdkafka's background thread): none, the calls follow
#: each other; not sleeping there keeps that thread's other work on time.
REFRESH_RETRY_DELAYS_S = (0.0, 0.0)
#: An expiry further than this (seconds) from now is taken for milliseconds (a common slip:
#: ``expiry_ms`` where seconds since the epoch are due), which would make the token never refresh.
MAX_LIFETIME_S = 10 * 365 * 86400.0
#: Seconds a first token fetched before the client was built is handed to librdkafka's first call.
PRIMED_FOR_S = 30.0

Token = tuple[Any, ...]


class TokenCallbackError(KafkaClientError):
    """``oauth_cb`` gave no usable token: it returned something else than ``(token, expiry)`` or
    ``(token, expiry, principal, extensions)``, or it kept raising (``__cause__``). Code
    ``_OAUTH_CB``. The message names the callback, never the token."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="_OAUTH_CB")


def _check(result: Any, name: str, now_s: float) -> Token:
    """``result`` as confluent-kafka takes it, or :class:`TokenCallbackError` saying what is wrong."""
    shape = "(token: str, expiry: seconds since the epoch[, principal: str, extensions: dict])"
    if not isinstance(result, (tuple, list)):
        raise TokenCallbackError(f"oauth_cb {name} returned {type(result).__name__}: it must return {shape}")
    if len(result) not in (2, 4):
        raise TokenCallbackError(
            f"oauth_cb {name} returned a {type(result).__name__} of {len(result)}: it must return {shape}"
        )
    token, expiry = result[0], result[1]
    if not isinstance(token, str) or not token:
        what = "an empty token" if token == "" else f"a token of type {type(token).__name__}"
        raise TokenCallbackError(f"oauth_cb {name} returned {what}: it must return {shape}")
    if isinstance(expiry, bool) or not isinstance(expiry, (int, float)) or not math.isfinite(expiry):
        raise TokenCallbackError(
            f"oauth_cb {name} returned an expiry of type {type(expiry).__name__}: the expiry must be "
            "a number of seconds since the epoch (time.time() + lifetime)"
        )
    if expiry <= now_s:
        raise TokenCallbackError(
            f"oauth_cb {name} returned a token that expired {now_s - expiry:.0f} s ago: the expiry is "
            "seconds since the epoch (time.time() + lifetime), not a lifetime"
        )
    if expiry - now_s > MAX_LIFETIME_S:
        raise TokenCallbackError(
            f"oauth_cb {name} returned an expiry {expiry:.0f}, more than ten years ahead: milliseconds? "
            "It is seconds since the epoch"
        )
    if len(result) == 4 and not (isinstance(result[2], str) and isinstance(result[3], Mapping)):
        raise TokenCallbackError(
            f"oauth_cb {name} returned a principal or extensions of the wrong type: {shape}"
        )
    return (token, float(expiry), *result[2:4])


class TokenSource:
    """What librdkafka calls as ``oauth_cb``: the user's callback, its result checked, retried
    after :data:`RETRY_DELAYS_S` when it raises. Errors are logged (librdkafka keeps only "OAuth
    callback raised exception") and raised. Safe from any thread.

    Parameters
    ----------
    callback:
        The user's ``oauth_cb(sasl_oauthbearer_config) -> (token, expiry_epoch_s[, principal,
        extensions])``.
    sleep:
        Sleeps between retries (tests pass a fake one).
    """

    def __init__(self, callback: Callable[[Any], Any], sleep: Callable[[float], None] = time.sleep) -> None:
        self.callback = callback
        self.name = getattr(callback, "__qualname__", None) or type(callback).__qualname__
        self._sleep = sleep
        self._lock = threading.Lock()
        self._primed: tuple[Token, float] | None = None  # (first token, when it was fetched)

    def fetch(self, oauthbearer_config: Any, delays_s: tuple[float, ...] = RETRY_DELAYS_S) -> Token:
        """Call the callback (again after each delay of :data:`RETRY_DELAYS_S` while it raises)
        and check its token.

        Raises
        ------
        TokenCallbackError
            It returned no usable token (not retried: a configuration error), or it raised on every
            call (the last exception is the ``__cause__``).
        """
        for attempt, delay_s in enumerate((*delays_s, None), start=1):
            try:
                result = self.callback(oauthbearer_config)
            except Exception as exc:
                if delay_s is None:
                    raise TokenCallbackError(
                        f"oauth_cb {self.name} raised {type(exc).__name__} on {attempt} calls: {exc}"
                    ) from exc
                log.warning(
                    "oauth_cb %s raised %s: %s (again in %g s)", self.name, type(exc).__name__, exc, delay_s
                )
                if delay_s > 0:
                    self._sleep(delay_s)
                continue
            return _check(result, self.name, time.time())
        raise AssertionError("unreachable")  # pragma: no cover

    def prime(self, oauthbearer_config: Any) -> None:
        """Fetch the first token now, in the calling thread (:meth:`fetch`), for librdkafka's first
        call. Raises as :meth:`fetch`."""
        token = self.fetch(oauthbearer_config)
        with self._lock:
            self._primed = (token, time.monotonic())

    def __call__(self, oauthbearer_config: Any) -> Token:
        with self._lock:
            primed, self._primed = self._primed, None
        if primed is not None and time.monotonic() - primed[1] < PRIMED_FOR_S:
            return primed[0]
        try:
            return self.fetch(oauthbearer_config, REFRESH_RETRY_DELAYS_S)
        except TokenCallbackError as exc:
            log.error(
                "%s; librdkafka asks again in 10 s, the current token stays in use until it expires", exc
            )
            raise

    def __repr__(self) -> str:
        return f"TokenSource({self.name})"


def with_token_source(conf: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of librdkafka properties ``conf`` whose ``oauth_cb``, if any, is a new
    :class:`TokenSource` (around the user's callback, also when ``conf`` holds another source)
    with its first token fetched; ``conf`` itself is not changed. Call it right before building a
    client.

    Raises
    ------
    TokenCallbackError
        The callback gave no usable token (see :meth:`TokenSource.fetch`).
    """
    out = dict(conf)
    callback = out.get("oauth_cb")
    if callback is None:
        return out
    if isinstance(callback, TokenSource):
        callback = callback.callback
    source = TokenSource(callback)
    source.prime(out.get("sasl.oauthbearer.config"))
    out["oauth_cb"] = source
    return out
