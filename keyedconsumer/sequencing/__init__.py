"""Sequencers: who may run a lane's head.

The default (no sequencer) keeps order inside one process. :class:`RedisSequencer` adds per-key
leases in Redis, so that one key never runs on two instances at once: across a rebalance, a long
pause of the old owner (SIGSTOP, GC, network stall), or when one key's messages arrive on several
partitions or topics.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .leases import LeaseTable

if TYPE_CHECKING:
    from ..dispatch import Dispatcher

__all__ = ["RedisSequencer", "RedisSequencerConfig", "redact_url"]

log = logging.getLogger("keyedconsumer.redis")


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for reprs, logs and errors)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<invalid url>"
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[-1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


class RedisSequencerConfig(BaseModel):
    """Options of :class:`RedisSequencer` (a bad value raises ``pydantic.ValidationError``).

    ``lease_ttl_s`` must be above three renewal intervals, so a lease survives two lost renewals.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, hide_input_in_errors=True)

    url: str = Field(min_length=1, repr=False)
    namespace: str = Field(min_length=1, pattern=r"^[^{}:\s]+$")
    lease_ttl_s: float = Field(default=10.0, gt=0.05, le=3600)
    renew_interval_s: float | None = Field(default=None, gt=0)
    socket_timeout_s: float = Field(default=2.0, gt=0, le=60)
    require_durable: bool = True

    @model_validator(mode="after")
    def _ttl_above_three_renewals(self) -> RedisSequencerConfig:
        if self.renew_interval_s is None:
            self.renew_interval_s = self.lease_ttl_s / 4
        if not self.lease_ttl_s > 3 * self.renew_interval_s:
            raise ValueError(
                f"lease_ttl_s ({self.lease_ttl_s:g}) must be above three renew_interval_s "
                f"({self.renew_interval_s:g})"
            )
        return self


class RedisSequencer:
    """Per-key leases with fencing tokens in Redis (``KeyedConsumer(..., sequencer=...)``).

    Before a lane's head runs, this instance holds the lease of its key (``SET NX PX`` with a random
    owner token; the same Lua script ``INCR``s the key's fencing counter, exposed as
    ``Message.fencing_token`` for the handler to guard its own writes). The lease is renewed every
    ``renew_interval_s`` (compare-and-``PEXPIRE``) while the key has work, kept while the key has
    queued messages, and released (compare-and-delete) when the key runs dry. A message whose key
    is leased elsewhere waits; other keys go on. A message that ran under a lease this instance
    lost (not confirmed by Redis within ``lease_ttl_s``, or taken over) does not count: its offset
    is not stored and it runs again once the lease is back. While Redis is unreachable the consumer
    waits and retries with back-off; it does not fail.

    Fencing tokens never repeat: Redis must persist each write before it answers
    (``appendonly yes`` + ``appendfsync always``; checked at start unless ``require_durable=False``).

    Parameters
    ----------
    url:
        ``redis://`` or ``rediss://`` URL, password included if any (never shown in a repr or log).
    namespace:
        Isolates consumer groups and tenants (no braces, colons or whitespace).
    lease_ttl_s:
        Lease time to live in seconds.
    renew_interval_s:
        Seconds between renewals (default ``lease_ttl_s / 4``); ``lease_ttl_s`` must be above three
        of them.
    socket_timeout_s:
        Bound of one Redis call.
    require_durable:
        Refuse a Redis that does not fsync every write.

    Raises
    ------
    pydantic.ValidationError
        A bad option, naming the field.
    """

    def __init__(self, url: str, namespace: str, **options: Any) -> None:
        self.config = RedisSequencerConfig(url=url, namespace=namespace, **options)
        self._d: Dispatcher | None = None
        self._store: Any = None
        self._fatal: Callable[[BaseException], None] = lambda e: None
        self._checked = False
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self._backoff_s = 0.0
        self._next_try_s = 0.0
        self.acquire_calls = 0  # Redis acquire scripts sent (to measure lease reuse)

    def __repr__(self) -> str:
        c = self.config
        return f"RedisSequencer(url={redact_url(c.url)!r}, namespace={c.namespace!r}, lease_ttl_s={c.lease_ttl_s:g})"

    # -- engine side (the poll thread) ----------------------------------------------------------

    def attach(self, d: Dispatcher, fatal: Callable[[BaseException], None]) -> None:
        """Start serving ``d`` (called by the consumer before polling)."""
        from .store import LeaseStore

        c = self.config
        self._d = d
        self._fatal = fatal
        self._stop.clear()
        self._checked = False
        self._store = LeaseStore(c.url, c.namespace, c.socket_timeout_s)
        d.leases = LeaseTable(c.lease_ttl_s)
        self._renewer = threading.Thread(target=self._renew_loop, name="keyedconsumer-lease-renewer", daemon=True)
        self._renewer.start()

    def tick(self) -> float | None:
        """Acquire wanted leases and release idle ones, in one round trip each.

        Returns the longest the poll thread should wait before the next tick (seconds), or ``None``.
        """
        from .store import StoreUnavailable

        d, store = self._d, self._store
        assert d is not None and d.leases is not None
        leases = d.leases
        now = time.monotonic()
        if now < self._next_try_s:
            return self._next_try_s - now
        try:
            if not self._checked:
                if self.config.require_durable:
                    store.check_durable()
                self._checked = True
            with d.lock:
                leases.expire_unconfirmed(now)
                asks = leases.to_acquire(now)
                releases = leases.to_release()
            if releases:
                store.release(releases)
            if asks:
                asked_s = time.monotonic()
                tokens = store.acquire(asks, int(self.config.lease_ttl_s * 1000))
                self.acquire_calls += len(asks)
                now = time.monotonic()
                with d.lock:
                    added = 0
                    for (lid, owner), token in zip(asks, tokens, strict=True):
                        head = leases.acquired(lid, owner, token, asked_s, now)
                        if head is not None:
                            d.ready.append(head)
                            added += 1
                    if added:
                        d.wake(added)
        except StoreUnavailable as exc:
            self._backoff_s = min(2.0, max(0.05, self._backoff_s * 2))
            self._next_try_s = time.monotonic() + self._backoff_s
            log.warning("Redis unavailable (%s); retrying in %.2f s", exc, self._backoff_s)
            return self._backoff_s
        except RuntimeError as exc:  # Redis not durable: fencing tokens could repeat
            self._fatal(exc)
            return None
        self._backoff_s = 0.0
        return 0.01 if leases.want else None

    def detach(self) -> None:
        """Stop renewing and release every lease still held (best effort)."""
        from .store import StoreUnavailable

        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(5)
        d = self._d
        if d is not None and d.leases is not None and self._store is not None:
            with d.lock:
                held = d.leases.release_all()
            try:
                self._store.release(held)
            except StoreUnavailable as exc:
                log.warning("leases not released (they expire in %g s): %s", self.config.lease_ttl_s, exc)
            self._store.close()

    def _renew_loop(self) -> None:
        from .store import StoreUnavailable

        d = self._d
        assert d is not None and d.leases is not None
        leases = d.leases
        interval = float(self.config.renew_interval_s or self.config.lease_ttl_s / 4)
        ttl_ms = int(self.config.lease_ttl_s * 1000)
        while not self._stop.wait(interval):
            with d.lock:
                asks = leases.to_renew()
            if not asks:
                continue
            asked_s = time.monotonic()
            try:
                oks = self._store.renew(asks, ttl_ms)
            except StoreUnavailable as exc:
                log.warning("lease renewal failed: %s", exc)
                with d.lock:
                    leases.expire_unconfirmed(time.monotonic())
                continue
            with d.lock:
                for (lid, owner), ok in zip(asks, oks, strict=True):
                    leases.renewed(lid, owner, ok, asked_s)


