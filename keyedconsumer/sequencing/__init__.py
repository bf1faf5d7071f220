"""Sequencers: who may run a lane's head.

The default (no sequencer) keeps order inside one process. :class:`RedisSequencer` adds per-key
leases in Redis, so that one key never runs on two instances at once: across a rebalance, a long
pause of the old owner (SIGSTOP, GC, network stall), or when one key's messages arrive on several
partitions or topics.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    Secret,
    field_validator,
    model_validator,
)

from ..config import hide_secrets
from .durations import at_ms, due_ms, redis_ms
from .leases import LeaseTable

if TYPE_CHECKING:
    from ..dispatch import Dispatcher

__all__ = ["RedisSequencer", "RedisSequencerConfig", "RedisUrl", "redact_url", "inspect_redis"]

log = logging.getLogger("keyedconsumer.redis")


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for reprs, logs and errors)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<invalid url>"
    if parts.query:  # redis-py also reads ?password=... from the query string
        query = re.sub(r"(?i)(^|&)([^=&]*(?:pass|pwd|secret|token)[^=&]*)=[^&]*", r"\1\2=***", parts.query)
        parts = parts._replace(query=query)
    if parts.password is None:
        return urlunsplit(parts)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


class RedisUrl(Secret[str]):
    """A Redis URL that shows only with its password replaced by ``***`` (:func:`redact_url`): in a
    repr, ``str()``, ``model_dump_json()`` and validation errors. ``get_secret_value()`` is the URL
    itself, what redis-py gets."""

    def _display(self) -> str:
        return redact_url(self.get_secret_value())


def inspect_redis(url: str, namespace: str, socket_timeout_s: float = 2.0) -> dict[str, Any]:
    """What a namespace holds in Redis now: leases, parked keys and their depth, scheduled
    messages, live instances, the scheduler and quarantined keys.

    Returns ``{"leases": [{"key", "owner", "ttl_ms", "fencing_token"}], "parked": [{"key", "depth",
    "next_due_s"}], "scheduled": int, "instances": [{"id", "last_seen_s"}], "scheduler": str | None,
    "quarantined": [str], "now_s": float}`` (times in seconds since the epoch on the Redis server's
    clock; ``now_s`` is its time now).

    Raises
    ------
    keyedconsumer.sequencing.store.StoreUnavailable
        Redis did not answer.
    """
    from .store import inspect_namespace

    return inspect_namespace(url, namespace, socket_timeout_s)


class RedisSequencerConfig(BaseModel):
    """Options of :class:`RedisSequencer` (a bad value raises ``pydantic.ValidationError``).

    ``lease_ttl_s`` must be above three renewal intervals, so a lease survives two lost renewals;
    ``instance_timeout_s`` too, so an instance survives two lost check-ins. Durations that reach
    Redis as milliseconds are rounded up and at least 1 ms (``PEXPIRE key 0`` would delete the key:
    redis-py #4279); the bounds keep the smallest accepted value meaningful.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, hide_input_in_errors=True)

    url: RedisUrl = Field(repr=False)
    namespace: str = Field(min_length=1, pattern=r"^[^{}:\s]+$")
    lease_ttl_s: float = Field(default=10.0, gt=0.05, le=3600)
    renew_interval_s: float | None = Field(default=None, ge=0.01)
    lease_linger_s: float = Field(default=1.0, ge=0)
    socket_timeout_s: float = Field(default=2.0, gt=0, le=60)
    require_durable: bool = True
    max_parked_per_key: int = Field(default=10_000, ge=1, strict=True)
    max_parked_bytes_per_key: int = Field(default=64 * 1024 * 1024, ge=1, strict=True)
    max_parked_total: int = Field(default=1_000_000, ge=1, strict=True)
    max_parked_bytes_total: int = Field(default=1024 * 1024 * 1024, ge=1, strict=True)
    seen_retention_s: float = Field(default=7 * 24 * 3600.0, ge=1.0)
    quarantine_on_dead_letter: bool = False
    max_drains: int = Field(default=64, ge=1, strict=True)
    instance_timeout_s: float | None = Field(default=None, gt=0)
    scheduler: bool = True

    @field_validator("url")
    @classmethod
    def _url_not_empty(cls, value: RedisUrl) -> RedisUrl:
        if not value.get_secret_value():
            raise ValueError("the Redis URL is empty")
        return value

    @field_validator(
        "lease_ttl_s", "renew_interval_s", "lease_linger_s", "socket_timeout_s", "seen_retention_s", "instance_timeout_s",
        mode="before",
    )
    @classmethod
    def _no_bool_for_number(cls, value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError("expected a number, got a boolean")
        return value

    @field_validator("require_durable", "quarantine_on_dead_letter", "scheduler", mode="before")
    @classmethod
    def _no_number_for_bool(cls, value: Any) -> Any:
        if not isinstance(value, bool):
            raise ValueError("expected a boolean")
        return value

    @model_validator(mode="after")
    def _ttl_above_three_renewals(self) -> RedisSequencerConfig:
        if self.renew_interval_s is None:
            self.renew_interval_s = self.lease_ttl_s / 4
        if not self.lease_ttl_s > 3 * self.renew_interval_s:
            raise ValueError(
                f"lease_ttl_s ({self.lease_ttl_s:g}) must be above three renew_interval_s "
                f"({self.renew_interval_s:g})"
            )
        if self.instance_timeout_s is None:
            self.instance_timeout_s = 3 * self.lease_ttl_s
        if not self.instance_timeout_s > 3 * self.renew_interval_s:
            raise ValueError(
                f"instance_timeout_s ({self.instance_timeout_s:g}) must be above three renew_interval_s "
                f"({self.renew_interval_s:g}): an instance checks in once per renewal"
            )
        return self

    @model_validator(mode="wrap")
    @classmethod
    def _secrets_hidden(
        cls, data: Any, handler: ModelWrapValidatorHandler[RedisSequencerConfig]
    ) -> RedisSequencerConfig:
        # Defined last, so it runs first (outermost): the URL is wrapped before any validation, and
        # no error's input (errors(), json()) can show it.
        if isinstance(data, dict) and isinstance(data.get("url"), str):
            data = {**data, "url": RedisUrl(data["url"])}
        return handler(hide_secrets(data))


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
        ``redis://`` or ``rediss://`` URL, password included if any. Kept as a :class:`RedisUrl`:
        a repr, dump, JSON, log line or validation error (``errors()`` and ``json()`` included)
        shows it with the password replaced by ``***``; redis-py gets the real URL.
    namespace:
        Isolates consumer groups and tenants (no braces, colons or whitespace).
    lease_ttl_s:
        Lease time to live in seconds (also the scheduler lease's), sent to Redis as whole
        milliseconds rounded up, so Redis never drops a lease this instance still counts valid.
    renew_interval_s:
        Seconds between renewals and check-ins (default ``lease_ttl_s / 4``; each is a Redis round
        trip); ``lease_ttl_s`` must be above three of them.
    lease_linger_s:
        Seconds an idle lease (its key ran dry here) is kept before it is released, so a key that
        comes back soon pays no Redis round trip (at most ``lease_ttl_s / 2``). Another instance
        waits up to this long for such a key.
    socket_timeout_s:
        Bound of one Redis call.
    require_durable:
        Refuse a Redis that does not fsync every write.
    max_parked_per_key, max_parked_bytes_per_key, max_parked_total, max_parked_bytes_total:
        Caps of parked messages (count; bytes of stored entries) per key and in the namespace. At a
        cap nothing is dropped: the messages wait in memory, unfinished, and fetching pauses at
        ``max_in_flight``.
    seen_retention_s:
        Seconds the "already parked" markers live after a key's last park (a re-delivered message
        within it is not parked twice).
    quarantine_on_dead_letter:
        When a parked message is dead-lettered, keep its key parked (its later messages wait in
        Redis) until :meth:`release_quarantine`; default ``False``: the key's next message goes on.
    max_drains:
        Parked keys this instance drains at once.
    instance_timeout_s:
        An instance silent this long (no check-in), on the Redis server's clock, is gone (default
        three lease TTLs); must be above three ``renew_interval_s``, so an instance survives two lost
        check-ins.
    scheduler:
        Take part in the scheduler election (drain parked keys, deliver scheduled messages).

    Parking, scheduled messages and recovery
    ----------------------------------------
    ``Retry(park=True)`` (or ``raise RetryLater(delay_s, park=True)``) parks a failing key: see
    :mod:`keyedconsumer.sequencing.parking`. :meth:`schedule` stores a message delivered to the
    handler at its due time, in its key's order. Each instance checks in to a sorted set every
    ``renew_interval_s``; one instance at a time holds the scheduler lease. When an instance dies,
    its leases expire after ``lease_ttl_s`` and the keys it was draining stay in the due set, so the
    scheduler (another instance's, once the dead one's scheduler lease expired) takes them over.

    One clock: due times of scheduled messages and parked retries, which keys and messages are due,
    misfires and check-ins are all kept on the Redis server's clock (``TIME``), read in the Lua
    scripts that decide, never on an instance's wall clock, so instances whose clocks differ
    neither fire early or late nor see each other as gone (rq-scheduler #246). Durations are sent
    to Redis as whole milliseconds rounded up, at least 1.

    Raises
    ------
    pydantic.ValidationError
        A bad option, naming the field.
    """

    def __init__(self, url: str, namespace: str, **options: Any) -> None:
        self.config = RedisSequencerConfig.model_validate({"url": url, "namespace": namespace, **options})
        self._d: Dispatcher | None = None
        self._store: Any = None
        self._fatal: Callable[[BaseException], None] = lambda e: None
        self._checked = False
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self._backoff_s = 0.0
        self._next_try_s = 0.0
        self.acquire_calls = 0  # Redis acquire scripts sent (to measure lease reuse)
        self.parker: Any = None  # the Parker while attached
        self.instance_id = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.is_scheduler = False  # holds the scheduler lease now
        self._sched_check_s = 0.0
        self.gone_instances: list[str] = []  # instances this one saw time out
        self._confirm: Callable[[], bool] = lambda: True
        self._stall_s = self.config.lease_ttl_s / 2
        self._last_tick_s = 0.0
        self._lost_seen = 0
        self._suspect = False  # a stall or a lost lease: no lease is acquired until confirmed
        self._next_confirm_s = 0.0
        self.stalls = 0  # stalls or lease losses that needed an ownership check

    def __repr__(self) -> str:
        c = self.config
        return f"RedisSequencer(url={str(c.url)!r}, namespace={c.namespace!r}, lease_ttl_s={c.lease_ttl_s:g})"

    # -- engine side (the poll thread) ----------------------------------------------------------

    def attach(
        self,
        d: Dispatcher,
        fatal: Callable[[BaseException], None],
        confirm: Callable[[], bool] | None = None,
        session_timeout_s: float | None = None,
    ) -> None:
        """Start serving ``d`` (called by the consumer before polling).

        ``confirm()`` tells whether this instance still owns its partitions in the consumer group
        (see :meth:`tick`); ``session_timeout_s`` is the group session timeout (seconds).
        """
        from .store import LeaseStore

        c = self.config
        self._d = d
        self._fatal = fatal
        self._confirm = confirm or (lambda: True)
        # a poll thread silent this long may have lost partitions or leases (half the shorter bound)
        self._stall_s = min(c.lease_ttl_s, session_timeout_s or c.lease_ttl_s) / 2
        self._last_tick_s = 0.0
        self._lost_seen = 0
        self._suspect = False
        self._stop.clear()
        self._checked = False
        from .parking import Parker

        self._store = LeaseStore(c.url.get_secret_value(), c.namespace, c.socket_timeout_s)
        d.leases = LeaseTable(c.lease_ttl_s, min(c.lease_linger_s, c.lease_ttl_s / 2))
        d.parking = True
        d.quarantine = c.quarantine_on_dead_letter
        self.parker = Parker(
            d,
            self._store,
            max_parked_per_key=c.max_parked_per_key,
            max_parked_bytes_per_key=c.max_parked_bytes_per_key,
            max_parked_total=c.max_parked_total,
            max_parked_bytes_total=c.max_parked_bytes_total,
            seen_retention_s=c.seen_retention_s,
            quarantine_on_dead_letter=c.quarantine_on_dead_letter,
            max_drains=c.max_drains,
        )
        self.is_scheduler = False
        self._sched_check_s = 0.0
        self._renewer = threading.Thread(target=self._renew_loop, name="keyedconsumer-lease-renewer", daemon=True)
        self._renewer.start()

    def tick(self) -> float | None:
        """Acquire wanted leases and release idle ones, in one round trip each.

        After a stall (no tick for half the shorter of ``lease_ttl_s`` and the group session
        timeout: SIGSTOP, a VM or GC pause) or a lost lease, no lease is acquired until the
        consumer's ownership check passes: a stopped process may have lost its partitions without
        knowing yet, and a fresh lease (a new, higher fencing token) would let it re-run messages
        the partition's new owner already ran and committed (fault harness, check 4).

        Returns the longest the poll thread should wait before the next tick (seconds), or ``None``.
        """
        from .store import StoreUnavailable

        d, store = self._d, self._store
        assert d is not None and d.leases is not None
        leases = d.leases
        now = time.monotonic()
        if self._last_tick_s and now - self._last_tick_s > self._stall_s:
            log.warning("no tick for %.1f s (a stall): checking partition ownership before acquiring leases",
                        now - self._last_tick_s)
            self._suspected()
        self._last_tick_s = now
        if self._suspect and now >= self._next_confirm_s:
            if self._confirm():
                self._suspect = False
            else:
                self._next_confirm_s = time.monotonic() + 0.2
            self._last_tick_s = now = time.monotonic()
        if now < self._next_try_s:
            return self._next_try_s - now
        try:
            if not self._checked:
                if self.config.require_durable:
                    store.check_durable()
                self._checked = True
            with d.lock:
                leases.expire_unconfirmed(now)
                if leases.lost != self._lost_seen:  # lost, not released: a stall or Redis trouble
                    self._lost_seen = leases.lost
                    self._suspected()
                asks = [] if self._suspect else leases.to_acquire(now)
                releases = leases.to_release(now)
            if releases:
                store.release(releases)
            if asks:
                asked_s = time.monotonic()
                tokens = store.acquire(asks, redis_ms(self.config.lease_ttl_s))
                self.acquire_calls += len(asks)
                now = time.monotonic()
                with d.lock:
                    for (lid, owner), (token, depth) in zip(asks, tokens, strict=True):
                        head = leases.acquired(lid, owner, token, asked_s, now, depth)
                        if head is not None:
                            d.route(head)
            busy = self._parking_tick()
        except StoreUnavailable as exc:
            self._backoff_s = min(2.0, max(0.05, self._backoff_s * 2))
            self._next_try_s = time.monotonic() + self._backoff_s
            log.warning("Redis unavailable (%s); retrying in %.2f s", exc, self._backoff_s)
            return self._backoff_s
        except RuntimeError as exc:  # Redis not durable: fencing tokens could repeat
            self._fatal(exc)
            return None
        self._backoff_s = 0.0
        if leases.want or busy:
            return 0.01
        return 0.05 if self.is_scheduler else None

    def _suspected(self) -> None:
        if not self._suspect:
            self._suspect = True
            self.stalls += 1
            self._next_confirm_s = 0.0

    def _parking_tick(self) -> bool:
        """Park, drain and (as the scheduler) move due work; ``True`` while anything is under way."""
        p, d = self.parker, self._d
        assert p is not None and d is not None
        now = time.monotonic()
        if self.config.scheduler and now >= self._sched_check_s:
            self._sched_check_s = now + float(self.config.renew_interval_s or 1.0)
            ttl_ms = redis_ms(self.config.lease_ttl_s)
            from . import keys

            was = self.is_scheduler
            self.is_scheduler = self._store.hold(keys.scheduler(self.config.namespace), self.instance_id, ttl_ms)
            if self.is_scheduler and not was:
                log.info("this instance (%s) is the scheduler", self.instance_id)
        if p.capped:
            p.retry_capped()
        if d.to_park:
            p.park_pending()
        if self.is_scheduler and not d.halted:
            p.move_scheduled()
            p.take_due_keys()
        if d.drains or d.parked_results:
            p.drain()
        return bool(d.to_park or d.drains or d.parked_results or p.draining or p.capped)

    def settle_pending(self) -> None:
        """Settle in Redis the parked messages that finished (after a graceful stop's wait), so a
        graceful stop re-runs none of them."""
        from .store import StoreUnavailable

        if self.parker is None or self._d is None:
            return
        try:
            self.parker.drain()
        except StoreUnavailable as exc:
            log.warning("finished parked messages not settled (they run again): %s", exc)

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
                from . import keys

                if self.is_scheduler:
                    self._store.release_plain(keys.scheduler(self.config.namespace), self.instance_id)
                self._store.check_out(self.instance_id)
            except StoreUnavailable as exc:
                log.warning("leases not released (they expire in %g s): %s", self.config.lease_ttl_s, exc)
            self.is_scheduler = False
            self._store.close()

    # -- public -------------------------------------------------------------------------------

    def schedule(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: list[tuple[str, bytes | None]] | None = None,
        *,
        delay_s: float | None = None,
        at: float | None = None,
    ) -> str:
        """Store a message delivered to the handler at its due time, in its key's order.

        It is delivered at least once, by whichever instance is the scheduler then, even if this
        one has died; a message due while no instance ran is delivered at start-up and counted as
        a misfire (delivered more than 1 s after its due time). The handler sees it with
        ``partition == -1`` and ``offset == -1``, and ``timestamp_ms`` the time it was scheduled.

        Due times are kept on the Redis server's clock (``TIME``), not this machine's: the message
        is delivered no earlier than its due time on that clock, whatever the clocks of the
        instances, and typically within 50-100 ms after it while a scheduler runs.

        Parameters
        ----------
        topic:
            The topic the handler sees (scheduled messages are not written to Kafka).
        key, value, headers:
            As a Kafka record's. A null key is sequenced with the null keys of partition -1.
        delay_s:
            Due this many seconds (>= 0) after the Redis server's time when this is called; or
            give ``at``.
        at:
            Due at this absolute time, seconds since the epoch, read on the Redis server's clock (a
            time in the past is due at once, and counted as a misfire if more than 1 s ago).

        Returns
        -------
        The scheduled message's id.

        Raises
        ------
        ValueError
            Neither or both of ``delay_s`` and ``at``, a negative ``delay_s``, or a NaN, infinite,
            negative or too far (after year 2248) time.
        StoreUnavailable
            Redis did not answer (nothing was stored).
        """
        import math

        from ..message import Message
        from .parking import encode_entry, new_schedule_id
        from .store import LeaseStore

        if (delay_s is None) == (at is None):
            raise ValueError("schedule() needs exactly one of delay_s and at")
        if isinstance(delay_s, bool) or isinstance(at, bool):
            raise ValueError("schedule() delay_s and at are numbers of seconds, not booleans")
        if delay_s is not None and not (math.isfinite(float(delay_s)) and float(delay_s) >= 0):
            raise ValueError(f"schedule() delay_s must be finite and >= 0 seconds: {delay_s!r}")
        due_at = at_ms(float(at)) if at is not None else None  # ValueError: NaN, infinite, negative, too far
        sid = new_schedule_id()
        store = self._store if self._store is not None else LeaseStore(self.config.url.get_secret_value(), self.config.namespace, self.config.socket_timeout_s)
        try:
            now_ms = store.time_ms()  # the one clock: the Redis server's, never this machine's
            due = due_at if due_at is not None else due_ms(now_ms, float(delay_s))  # type: ignore[arg-type]
            msg = Message(topic, -1, -1, key, value, list(headers) if headers else None, int(now_ms))
            store.schedule(sid, due, encode_entry(msg, due, sid))
        finally:
            if store is not self._store:
                store.close()
        return sid

    def release_quarantine(self, key: bytes) -> bool:
        """Let a quarantined key go on: its dead-lettered head is removed and its next parked
        message runs. Returns ``False`` if the key was not quarantined.

        Raises
        ------
        StoreUnavailable
            Redis did not answer.
        """
        from .keys import lease_id
        from .store import LeaseStore

        store = LeaseStore(self.config.url.get_secret_value(), self.config.namespace, self.config.socket_timeout_s)
        try:
            return store.release_quarantine(lease_id(key, "", 0))  # due now on the Redis server's clock
        finally:
            store.close()

    def inspect(self) -> dict[str, Any]:
        """What this namespace holds in Redis now (see :func:`inspect_redis`)."""
        return inspect_redis(self.config.url.get_secret_value(), self.config.namespace, self.config.socket_timeout_s)

    def _renew_loop(self) -> None:
        from .store import StoreUnavailable

        d = self._d
        assert d is not None and d.leases is not None
        leases = d.leases
        interval = float(self.config.renew_interval_s or self.config.lease_ttl_s / 4)
        ttl_ms = redis_ms(self.config.lease_ttl_s)
        timeout_ms = redis_ms(float(self.config.instance_timeout_s or 3 * self.config.lease_ttl_s))
        first = True
        while first or not self._stop.wait(interval):
            first = False
            try:  # stamped and judged on the Redis server's clock: instances' clocks may differ
                gone = self._store.check_in(self.instance_id, timeout_ms)
                for g in gone:
                    log.warning("instance %s is gone (no check-in for %g s)", g, timeout_ms / 1000)
                self.gone_instances.extend(gone)
            except StoreUnavailable as exc:
                log.warning("check-in failed: %s", exc)
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


