"""The Redis sequencer: per-key leases with fencing tokens, parking and scheduled messages.

One key never runs on two instances at once: across a rebalance, a long pause of the old owner
(SIGSTOP, GC, network stall), or when one key's messages arrive on several partitions or topics.
It implements :class:`~keyedconsumer.engine.sequencer.Sequencer` on :mod:`.leases` (the instance's
view of its leases), :mod:`.parking` (ordered non-blocking retries and scheduled messages) and
:mod:`.store` (the Lua scripts).
"""

from __future__ import annotations

import logging
import math
import os
import queue
import re
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..engine.delivery import Delivery
from ..engine.outcome import Outcome
from ..engine.sequencer import GroupTiming
from ..message import Message
from . import keys
from .config import RedisSequencerConfig
from .durations import at_ms, due_ms, redis_ms
from .keys import lease_id
from .leases import LeaseTable
from .parking import DrainJob, Parker, encode_entry, last_error, new_schedule_id

if TYPE_CHECKING:
    from ..engine.sequencer import LanePort

__all__ = ["RedisSequencer", "inspect_redis", "unpark_now", "cancel_scheduled"]

log = logging.getLogger("keyedconsumer.redis")

#: How often the scheduler looks in Redis for due scheduled messages and parked keys whose retry
#: is due (seconds; two round trips each time, whatever the owner's turns): such work starts up
#: to this late, never early (docs/redis.md).
SCHEDULER_SCAN_S = 0.05


def inspect_redis(url: str, namespace: str, socket_timeout_s: float = 2.0) -> dict[str, Any]:
    """What a namespace holds in Redis now: leases, parked keys and their depth, scheduled
    messages, live instances, the scheduler and quarantined keys.

    Returns ``{"leases": [{"key", "owner", "ttl_ms", "fencing_token"}], "parked": [{"key", "depth",
    "next_due_s", "last_error"}], "scheduled": int, "instances": [{"id", "last_seen_s"}], "scheduler":
    str | None, "quarantined": [str], "now_s": float}`` (times in seconds since the epoch on the Redis
    server's clock; ``now_s`` is its time now); every field, and ``last_error``'s (the failure that
    parked the key, cut to :data:`~keyedconsumer.sequencing.parking.MAX_ERROR_BYTES`), in
    :func:`~keyedconsumer.sequencing.store.inspect_namespace`.

    Raises
    ------
    keyedconsumer.sequencing.store.StoreUnavailable
        Redis did not answer.
    """
    from .store import inspect_namespace

    return inspect_namespace(url, namespace, socket_timeout_s)


_LID = re.compile(r"k\.(?:[0-9a-f]{2})*|p\.(?:[0-9a-f]{2})+\.\d+")


def unpark_now(url: str, namespace: str, lid: str, socket_timeout_s: float = 2.0) -> bool:
    """Make a parked key due now on the Redis server's clock (out of quarantine if it was): the
    scheduler runs its parked messages next, in order, under the key's lease. ``lid`` is the lease id
    :func:`inspect_redis` lists. Returns ``False`` if the key has no parked messages.

    Raises
    ------
    ValueError
        ``lid`` is not a lease id, or the namespace is not valid.
    keyedconsumer.sequencing.store.StoreUnavailable
        Redis did not answer.
    """
    if not _LID.fullmatch(lid):
        raise ValueError(f"not a lease id: {lid!r}")
    return _with_store(url, namespace, socket_timeout_s, lambda store: store.due_now(lid))


def cancel_scheduled(url: str, namespace: str, sid: str, socket_timeout_s: float = 2.0) -> bool:
    """Remove a scheduled message before it is due; ``False`` if it was not scheduled (any more: it
    may have been delivered). A message the scheduler is moving to its key's list at that very
    moment is still delivered.

    Raises
    ------
    ValueError
        ``sid`` is not a scheduled message's id.
    keyedconsumer.sequencing.store.StoreUnavailable
        Redis did not answer.
    """
    if not re.fullmatch(r"[0-9a-f]{32}", sid):
        raise ValueError(f"not a scheduled message id: {sid!r}")
    return _with_store(url, namespace, socket_timeout_s, lambda store: store.unschedule(sid))


def _with_store(url: str, namespace: str, socket_timeout_s: float, act: Callable[[Any], bool]) -> bool:
    """``act(store)`` on a short-lived :class:`~.store.LeaseStore` of the namespace."""
    from .store import LeaseStore

    store = LeaseStore(url, namespace, socket_timeout_s)
    try:
        return act(store)
    finally:
        store.close()


class RedisSequencer:
    """Per-key leases with fencing tokens in Redis (``KeyedConsumer(..., sequencer=...)``).

    (Engine threads: every method of the sequencer protocol and :meth:`tick` run in the engine's
    owner thread, which owns the lease table and the parker. Two threads of its own only talk to
    Redis and post what it answered to the owner: the renewer (check-ins, renewals) and the lease
    I/O thread (the acquires and releases the owner chose, in order).)

    Before a lane's head runs, this instance holds the lease of its key (``SET NX PX`` with a random
    owner token; the same Lua script issues the lease's fencing token, above the key's last one and
    above every token its hash slot's counter issued, exposed as ``Message.fencing_token`` for the
    handler to guard its own writes). The lease is renewed every ``renew_interval_s``
    (compare-and-``PEXPIRE``) while the key has work, kept while the key has queued messages, and
    released (compare-and-delete) once the key has been dry for ``lease_linger_s``. A message whose key
    is leased elsewhere waits; other keys go on. A message starts only while at least half the TTL
    is left since the last renewal Redis confirmed, else it waits for a renewal asked for at once
    (a run begun just before its lease lapsed would run on beside the key's next holder).
    A message that ran under a lease this instance
    lost (not confirmed by Redis within ``lease_ttl_s``, or taken over) does not count: its offset
    is not stored and it runs again once the lease is back. While Redis is unreachable the consumer
    waits and retries with back-off; it does not fail.

    Fencing tokens never repeat: Redis must persist each write before it answers
    (``appendonly yes`` + ``appendfsync always``; checked at start unless ``require_durable=False``).

    Parameters
    ----------
    url:
        ``redis://`` or ``rediss://`` URL, or ``redis+cluster://host:port[,host:port...]``
        (``rediss+cluster://``) for a Redis Cluster (:func:`~keyedconsumer.sequencing.store.connect`),
        password included if any. Kept as a :class:`RedisUrl`:
        a repr, dump, JSON, log line or validation error (``errors()`` and ``json()`` included)
        shows it with the password replaced by ``***``; redis-py gets the real URL.
    namespace:
        Isolates consumer groups and tenants (no braces, colons or whitespace).
    lease_ttl_s:
        Lease time to live in seconds (also the scheduler lease's), sent to Redis as whole
        milliseconds rounded up, so Redis never drops a lease this instance still counts valid.
        A message starts only with half of it left: keep it above twice the longest run.
    renew_interval_s:
        Seconds between renewals and check-ins (default ``lease_ttl_s / 4``; each is a Redis round
        trip); ``lease_ttl_s`` must be above three of them.
    lease_linger_s:
        Seconds an idle lease (its key ran dry here) is kept before it is released, so a key that
        comes back soon pays no Redis round trip. The linger used is at most ``lease_ttl_s / 2``: a
        larger value counts as ``lease_ttl_s / 2`` (not refused, so shortening the TTL alone stays
        valid). Idle leases past it are released together, one round trip per tenth of it, so
        another instance waits up to 1.1 times this long for such a key.
    socket_timeout_s:
        Bound of one Redis call.
    require_durable:
        Refuse a Redis that does not fsync every write.
    max_parked_per_key, max_parked_bytes_per_key, max_parked_total, max_parked_bytes_total:
        Caps of parked messages (count; bytes of stored entries) per key and in the namespace. At a
        cap nothing is dropped: the messages wait in memory, unfinished, and fetching pauses at
        ``max_in_flight``.
    seen_retention_s:
        Seconds the "already parked" markers live after a key's parked list empties (while it holds
        anything they do not expire): a message Kafka delivers again within it is not parked twice.
        At least ``lease_ttl_s`` + the group's session timeout + the commit interval is used,
        whatever is given (:meth:`RedisSequencerConfig.seen_retention_for`).
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
        self._port: LanePort | None = None
        self._renew_set: list[
            tuple[str, str]
        ] = []  # the held leases the renewer renews (published by the owner)
        self._renew_published_s = 0.0
        self._leases = LeaseTable(self.config.lease_ttl_s)
        self._key_lanes = True  # lanes by key (ordering="key"), else by partition
        self._store: Any = None
        self._fatal: Callable[[BaseException], None] = lambda e: None
        self._checked = False
        self._stop = threading.Event()
        self._wake = threading.Event()  # renew now: a head waits for its lease's renewal
        self._renewer: threading.Thread | None = None
        #: Acquires and releases for the lease I/O thread, in the order the owner chose them (a
        #: key's release goes before its next acquire): ``(kind, [(lease id, owner)], chosen at
        #: (monotonic seconds), stalls then)``; a callable is the detach's last job (:meth:`detach`):
        #: the thread runs it and ends.
        self._lease_io: queue.SimpleQueue[
            tuple[str, list[tuple[str, str]], float, int] | Callable[[], None]
        ] = queue.SimpleQueue()
        self._lease_io_thread: threading.Thread | None = None
        self._lease_io_stop = threading.Event()  # this attach's I/O thread sends no more acquires
        self._lease_io_closed = threading.Event()  # this attach's store is closed: the thread ends
        self._ask_backoff_s = 0.0  # after failed acquires, no acquire is sent for this long
        self._asks_from_s = 0.0  # ... until then (monotonic seconds)
        self._backoff_s = 0.0
        self._next_try_s = 0.0
        self._next_release_s = 0.0  # idle leases go to Redis in one batch no sooner than this
        self._replica_slow = False  # the last tick found a replica slow (WAIT timed out): logged once
        self.acquire_calls = 0  # Redis acquire scripts sent (to measure lease reuse)
        self.parker: Parker | None = None  # the Parker while attached
        self.instance_id = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.is_scheduler = False  # holds the scheduler lease now
        self._sched_check_s = 0.0
        self._next_scan_s = 0.0
        self.gone_instances: list[str] = []  # instances this one saw time out
        self._confirm: Callable[[], bool] = lambda: True
        self._stall_s = self.config.lease_ttl_s / 2
        self._last_tick_s = 0.0
        self._lost_seen = 0
        self._suspect = False  # a stall or a lost lease: no lease is acquired until confirmed
        self._next_confirm_s = 0.0
        self.stalls = 0  # stalls or lease losses that needed an ownership check

    #: Parked messages are settled in Redis, outside a Kafka transaction: ``transactional=True``
    #: refuses this sequencer.
    settles_outside_kafka = True

    @property
    def available(self) -> bool:
        """``False`` while Redis does not answer this instance (down, unreachable, answering
        ``READONLY`` during a failover): the consumer is then not ready (:mod:`keyedconsumer.health`).
        A write a slow replica did not acknowledge in time does not count as unavailable."""
        return self._store is None or bool(self._store.available)

    def __repr__(self) -> str:
        c = self.config
        return f"RedisSequencer(url={str(c.url)!r}, namespace={c.namespace!r}, lease_ttl_s={c.lease_ttl_s:g})"

    # -- the Sequencer protocol (under the engine's lock) -------------------------------------------

    def lane_id(self, topic: str, partition: int, lane: object) -> str | None:
        """The lease id of a lane: its Kafka key, or its partition (null keys, ``ordering="partition"``)."""
        key = lane if self._key_lanes and isinstance(lane, bytes) else None  # NULL_KEY, 0: the partition
        return lease_id(key, topic, partition)

    def on_head(self, d: Delivery) -> bool:
        """A lane got a head: ready now if this instance holds its key's lease and the lease is
        free (then a parked key's head goes to Redis behind its list instead); else it waits."""
        lid = d.lease_id or ""
        if not self._leases.admit_head(d, lid):
            return False  # waits for its key's lease
        if self._leases.is_parked(lid):
            assert self.parker is not None
            self.parker.park(d, 0.0)  # behind the key's parked messages, in order
            return False
        return True

    def may_start(self, d: Delivery) -> bool:
        """(A worker, read only.) Its key's lease is this instance's with at least half its TTL left."""
        return self._leases.may_start(d, d.lease_id or "")

    def not_started(self, d: Delivery) -> bool:
        """``d`` did not start: ready again at once when its lease now has the time left; else it
        waits for the lease's renewal, asked for now (or for the lease again, when it is lost)."""
        lid = d.lease_id or ""
        if self._leases.may_start(d, lid):
            return True
        self._leases.await_renewal(d, lid)
        self._renew_now()
        return False

    def accepts(self, d: Delivery) -> bool:
        """It ran under a lease this instance lost (expired, taken over, Redis down): its result
        does not count; it waits, first of its lane, to run again under a new lease."""
        lid = d.lease_id or ""
        if self._leases.still_valid(d, lid):
            return True
        self._leases.requeue(d, lid)
        return False

    def owns(self, d: Delivery) -> bool:
        return self._leases.still_valid(d, d.lease_id or "")

    def on_next(self, d: Delivery, nxt: Delivery) -> None:
        self._leases.handover(d, nxt, d.lease_id or "")

    def on_lane_end(self, d: Delivery) -> Delivery | None:
        """The lease goes to another local lane head of the key (or a drain), or idles."""
        return self._route(self._leases.lane_dry(d, d.lease_id or ""))

    def park(self, d: Delivery, delay_s: float) -> bool:
        """``d``'s key goes to Redis, due again after ``delay_s``; the failure that parks it (the
        handler's, ``Message.last_error``) is stored with the key, in the script that parks it."""
        assert self.parker is not None
        self.parker.park(d, delay_s, last_error(d.msg))
        return True

    def on_drop(self, d: Delivery) -> None:
        self._leases.drop(d, d.lease_id or "")

    def drop(self, keep: Callable[[Delivery], bool]) -> list[Delivery]:
        out = self.parker.drop(keep) if self.parker is not None else []
        out += self._leases.drop_waiting(lambda h: isinstance(h, Delivery) and not keep(h))
        return out

    def on_external_end(self, d: Delivery, outcome: Outcome) -> Delivery | None:
        assert self.parker is not None
        return self.parker.on_external_end(d, outcome)

    def busy(self) -> bool:
        leases = self._leases
        return (
            bool(leases.want) or leases.renewals_awaited() or (self.parker is not None and self.parker.busy)
        )

    def _route(self, holder: Any) -> Delivery | None:
        """A lease holder that now holds its key's lease goes where it must: a drain job to its
        drain, a head of a parked key to Redis behind the key's list; a head to run is returned."""
        if holder is None:
            return None
        assert self.parker is not None
        if isinstance(holder, DrainJob):
            self.parker.add_drain(holder)
            return None
        if self._leases.is_parked(holder.lease_id or ""):
            self.parker.park(holder, 0.0)
            return None
        head: Delivery = holder
        return head

    # -- engine side (the poll thread) ----------------------------------------------------------

    def attach(
        self,
        port: LanePort,
        fatal: Callable[[BaseException], None],
        confirm: Callable[[], bool] | None = None,
        timing: GroupTiming | None = None,
    ) -> None:
        """Start serving the engine's lanes behind ``port`` (called by the consumer before polling;
        see :class:`~keyedconsumer.engine.sequencer.Sequencer`).

        ``confirm()`` tells whether this instance still owns its partitions in the consumer group
        (see :meth:`tick`); ``timing``: the group's session timeout, heartbeat and commit
        intervals (librdkafka's defaults when ``None``). A stall of this process past
        ``timing.membership_stall_s`` (not known, with KIP-848: half the shorter of ``lease_ttl_s``
        and 45 s) may have cost its partitions; the session timeout and commit interval, with the
        lease TTL, bound how long the "already parked" markers must outlive a parked list
        (:meth:`RedisSequencerConfig.seen_retention_for`).
        """
        from .store import LeaseStore

        c = self.config
        self._port = port
        self._renew_set = []
        self._renew_published_s = 0.0
        self._fatal = fatal
        self._confirm = confirm or (lambda: True)
        # a process stalled this long may have lost its partitions (a lost lease is noticed apart)
        timing = timing or GroupTiming()
        stall_s = timing.membership_stall_s
        self._stall_s = stall_s if stall_s is not None else min(c.lease_ttl_s, 45.0) / 2
        self._last_tick_s = 0.0
        self._lost_seen = 0
        self._suspect = False
        self._stop.clear()
        self._wake.clear()
        self._checked = False

        self._store = LeaseStore(c.url.get_secret_value(), c.namespace, c.socket_timeout_s)
        self._leases = LeaseTable(c.lease_ttl_s, min(c.lease_linger_s, c.lease_ttl_s / 2))
        self._key_lanes = port.ordering == "key"
        self.parker = Parker(
            port,
            self._leases,
            self._store,
            self._route,
            max_parked_per_key=c.max_parked_per_key,
            max_parked_bytes_per_key=c.max_parked_bytes_per_key,
            max_parked_total=c.max_parked_total,
            max_parked_bytes_total=c.max_parked_bytes_total,
            seen_retention_s=c.seen_retention_for(timing.session_timeout_s, timing.commit_interval_s),
            quarantine_on_dead_letter=c.quarantine_on_dead_letter,
            max_drains=c.max_drains,
        )
        self.is_scheduler = False
        self._sched_check_s = 0.0
        self._next_scan_s = 0.0  # the scheduler's next look for due messages and keys
        self._renewer = threading.Thread(
            target=self._renew_loop, name="keyedconsumer-lease-renewer", daemon=True
        )
        self._renewer.start()
        self._lease_io = queue.SimpleQueue()
        self._lease_io_stop = threading.Event()
        self._lease_io_closed = threading.Event()
        self._ask_backoff_s = self._asks_from_s = 0.0
        self._lease_io_thread = threading.Thread(
            target=self._lease_io_loop, name="keyedconsumer-lease-io", daemon=True
        )
        self._lease_io_thread.start()

    def tick(self) -> float | None:
        """Choose the wanted leases to acquire and the idle ones to release, and hand them to the
        lease I/O thread (one round trip each; the owner does not wait for Redis's answer, which
        comes back through the engine's mailbox: :meth:`_acquired`).

        After a stall long enough to have cost the group membership (no tick for the
        ``membership_stall_s`` given to :meth:`attach`: a SIGSTOP, a VM pause; by default half of
        ``session.timeout.ms`` less ``heartbeat.interval.ms``) or a lost lease, no lease is acquired
        until the consumer's ownership check passes: a stopped process may have lost its partitions
        without knowing yet, and a fresh lease (a new, higher fencing token) would let it re-run
        messages the partition's new owner already ran and committed, behind its commit, out of its
        key's order. A shorter stall (a busy machine) asks nothing of the broker; the check itself
        goes to the broker at most once per rebalance while its answer is no.

        Returns the longest the poll thread should wait before the next tick (seconds), or ``None``.
        """
        from .store import StoreUnavailable

        port, store = self._port, self._store
        if port is None:
            return None
        leases = self._leases
        now = time.monotonic()
        if self._last_tick_s and now - self._last_tick_s > self._stall_s:
            log.warning(
                "no tick for %.1f s (a stall): checking partition ownership before acquiring leases",
                now - self._last_tick_s,
            )
            self._suspected()
        self._last_tick_s = now
        if self._suspect and now >= self._next_confirm_s:
            if self._confirm():
                self._suspect = False
            else:
                self._next_confirm_s = time.monotonic() + 0.2
            self._last_tick_s = now = time.monotonic()
        # leases granted meanwhile (answers come through the mailbox) get renewed while backing off
        self._publish_renewals(now)
        if now < self._next_try_s:
            return self._next_try_s - now
        try:
            if not self._checked:
                if self.config.require_durable:
                    store.check_durable()
                self._checked = True
            leases.expire_unconfirmed(now)
            self._lost_noticed()
            asks = [] if self._suspect or now < self._asks_from_s else leases.to_acquire(now)
            # idle leases past their linger go in one round trip per tenth of the linger, not one
            # per tick: the owner thread waits for it while handlers wait for their next message
            releases = leases.to_release(now) if now >= self._next_release_s else []
            if releases:
                self._lease_io.put(("release", releases, now, self.stalls))
                self._next_release_s = now + leases.linger_s / 10
            if asks:  # chosen at the tick's start: the I/O thread judges a stall from then
                self._lease_io.put(("acquire", asks, self._last_tick_s, self.stalls))
            self._publish_renewals(time.monotonic())
            busy = self._parking_tick()
        except StoreUnavailable as exc:
            return self._unavailable(exc)
        except RuntimeError as exc:  # Redis not durable: fencing tokens could repeat
            self._fatal(exc)
            return None
        self._backoff_s = 0.0  # (the owner's own calls; failed acquires wait apart: _ask_failed)
        self._replica_slow = False
        if leases.want or busy:
            return 0.01
        return SCHEDULER_SCAN_S if self.is_scheduler else None

    def _unavailable(self, exc: Exception) -> float:
        """(Owner.) Redis did not answer (``exc``, a ``StoreUnavailable``): the next tick waits a
        back-off doubling from 0.05 s to 2 s. Returns the wait (seconds)."""
        if getattr(exc, "unacknowledged", False):  # Redis answered; a slow replica paced it (WAIT)
            if not self._replica_slow:
                log.warning("a Redis replica is slow (%s): parking waits for it, leases go on", exc)
            self._replica_slow = True
            return 0.05
        self._backoff_s = min(2.0, max(0.05, self._backoff_s * 2))
        self._next_try_s = time.monotonic() + self._backoff_s
        log.warning("Redis unavailable (%s); retrying in %.2f s", exc, self._backoff_s)
        return self._backoff_s

    # -- acquires and releases: the owner chooses them, the lease I/O thread sends them ----------

    def _lease_io_loop(self) -> None:
        """The lease I/O thread: sends the acquires and releases the owner queued, in order, and
        posts what Redis answered to the owner (it never touches the lease table).

        An acquire chosen more than the stall bound before it could be sent (the process was
        stopped between choosing and asking: a SIGSTOP, a VM pause) is not sent: it may have lost
        its partitions meanwhile, and a fresh lease would let it re-run what their new owner ran.
        Nor is one chosen before the owner began to doubt its ownership (a stall or a lost lease
        seen since: :attr:`stalls` moved on); it is asked for again once the check passes.
        """
        from .store import StoreUnavailable

        # this attach's: a thread still in a Redis call when detach() gave up waiting ends with them
        port, store, jobs, stop = self._port, self._store, self._lease_io, self._lease_io_stop
        closed = self._lease_io_closed
        assert port is not None
        ttl_ms = redis_ms(self.config.lease_ttl_s)
        try:
            while not closed.is_set():  # (the owner closed the store when its wait ended first)
                job = jobs.get()
                if callable(job):  # detached: the last releases, the check-out, the store closed
                    job()
                    return
                kind, leases, chosen_s, stalls = job
                try:
                    if kind == "release":
                        store.release(leases)
                        continue
                    if stop.is_set():  # detached: what it would grant, nobody would release
                        continue
                    # a stall: no tick of the owner since the ask was chosen, for longer than the
                    # bound (a stall before the owner's last tick, that tick saw: stalls moved on)
                    last_tick_s = self._last_tick_s  # (read before stalls: the owner writes it after)
                    asked_s = time.monotonic()
                    if asked_s - max(chosen_s, last_tick_s) > self._stall_s:
                        port.post(self._ask_stalled, (leases, asked_s - chosen_s))
                        continue
                    if stalls != self.stalls:  # the owner doubts its partitions since it chose them
                        port.post(self._ask_failed, (leases, None))
                        continue
                    port.post(self._acquired, (leases, store.acquire(leases, ttl_ms), asked_s, stalls))
                except StoreUnavailable as exc:
                    if kind == "release":
                        log.warning(
                            "leases not released (they expire in %g s): %s", self.config.lease_ttl_s, exc
                        )
                    else:
                        port.post(self._ask_failed, (leases, exc))
        except Exception as exc:  # noqa: BLE001 - a bug: the consumer stops with it
            log.exception("the lease I/O thread failed")
            port.post(self._fatal, exc)

    def _acquired(self, answer: tuple[list[tuple[str, str]], list[tuple[int, int]], float, int]) -> None:
        """(Owner, posted by the lease I/O thread.) Redis answered acquires sent at ``asked_s``,
        chosen at the owner's doubt generation ``stalls``: the heads of the leases granted are
        routed (made ready, or a parked key's drain first). If the owner began to doubt its
        partitions while they were on their way (a stall or a lost lease seen since), what Redis
        granted is released, not used, and asked for again once the ownership check passes: a lease
        granted after the doubt began is one acquired before the check."""
        asks, tokens, asked_s, stalls = answer
        leases, port = self._leases, self._port
        self.acquire_calls += len(asks)
        self._ask_backoff_s = 0.0
        if stalls != self.stalls:
            # token 0: held on its master, no replica acknowledged it; below 0: not granted
            granted = [ask for ask, (token, _depth) in zip(asks, tokens, strict=True) if token >= 0]
            if granted:
                self._lease_io.put(("release", granted, time.monotonic(), self.stalls))
            leases.unanswered(asks)
            return
        now = time.monotonic()
        for (lid, owner), (token, depth) in zip(asks, tokens, strict=True):
            head = leases.acquired(lid, owner, token, asked_s, now, depth)
            if head is not None and port is not None:
                ready = self._route(head)
                if ready is not None:
                    port.make_ready(ready)

    def _ask_stalled(self, answer: tuple[list[tuple[str, str]], float]) -> None:
        """(Owner, posted by the lease I/O thread.) Acquires were not sent: a stall of this many
        seconds came between choosing and sending them."""
        asks, stall_s = answer
        self._leases.unanswered(asks)
        log.warning(
            "a stall of %.1f s before leases were asked for: checking partition ownership before acquiring leases",
            stall_s,
        )
        self._suspected()

    def _ask_failed(self, answer: tuple[list[tuple[str, str]], Exception | None]) -> None:
        """(Owner, posted by the lease I/O thread.) Acquires got no answer (``exc``, a
        ``StoreUnavailable``: no acquire is sent for a back-off doubling from 0.05 s to 2 s, which
        an answer resets), or were not sent (``None``: an ownership check came first)."""
        asks, exc = answer
        if exc is None:
            self._leases.unanswered(asks)
            return
        self._ask_backoff_s = min(2.0, max(0.05, self._ask_backoff_s * 2))
        self._asks_from_s = time.monotonic() + self._ask_backoff_s
        log.warning("Redis unavailable for lease acquires (%s); retrying in %.2f s", exc, self._ask_backoff_s)
        self._leases.unanswered(asks, self._asks_from_s, maybe_run=True)

    def _suspected(self) -> None:
        if not self._suspect:
            self._suspect = True
            self.stalls += 1
            self._next_confirm_s = 0.0

    def _parking_tick(self) -> bool:
        """Park, drain and (as the scheduler) move due work; ``True`` while anything is under way."""
        p, port = self.parker, self._port
        assert p is not None and port is not None
        now = time.monotonic()
        if self.config.scheduler and now >= self._sched_check_s:
            self._sched_check_s = now + float(self.config.renew_interval_s or 1.0)
            ttl_ms = redis_ms(self.config.lease_ttl_s)
            was = self.is_scheduler
            self.is_scheduler = self._store.hold(
                keys.scheduler(self.config.namespace), self.instance_id, ttl_ms
            )
            if self.is_scheduler and not was:
                log.info("this instance (%s) is the scheduler", self.instance_id)
        if p.capped:
            p.retry_capped()
        if p.busy:
            p.park_pending()
        if self.is_scheduler and not port.halted and now >= self._next_scan_s:
            self._next_scan_s = now + SCHEDULER_SCAN_S
            p.move_scheduled()
            p.take_due_keys()
        p.drain()
        return bool(p.has_work)

    def settle_pending(self) -> None:
        """Settle in Redis the parked messages that finished (after a graceful stop's wait), so a
        graceful stop re-runs none of them."""
        from .store import StoreUnavailable

        if self.parker is None or self._port is None:
            return
        try:
            self.parker.drain()
        except StoreUnavailable as exc:
            log.warning("finished parked messages not settled (they run again): %s", exc)

    def detach(self) -> None:
        """Stop renewing and release every lease held or asked for (best effort), waiting up to
        5 s for the renewer and 5 s for the lease I/O thread.

        The last releases go through the lease I/O thread, after the jobs it has in hand (its
        queued acquires are not sent): an acquire already on its way to Redis is answered first, so
        what it may be granted is released too (its lease is still in the table, asked for). When
        that wait ends first (Redis slow: the thread still in an earlier call) or the thread is
        gone, the owner does the last work itself; either way it is done, once, before this
        returns (a lease granted to a call still on its way then expires after ``lease_ttl_s``).
        A second call does nothing more."""
        self._stop.set()
        self._wake.set()
        if self._renewer is not None:
            self._renewer.join(5)
        io, self._lease_io_thread = self._lease_io_thread, None
        self._lease_io_stop.set()  # this attach's thread sends no more acquires
        if self._port is None or self._store is None:
            return
        scheduler, self.is_scheduler = self.is_scheduler, False
        store, held, closed, once = (
            self._store,
            self._leases.release_all(),
            self._lease_io_closed,
            threading.Lock(),
        )

        def last() -> None:  # the I/O thread's last job, or the owner's: whoever comes first
            with once:
                if not closed.is_set():
                    closed.set()
                    self._close_store(store, held, scheduler)

        if io is not None and io.is_alive():
            self._lease_io.put(last)
            io.join(5)
        last()  # (done already, unless the wait ended first or the thread failed)

    def _close_store(self, store: Any, held: list[tuple[str, str]], scheduler: bool) -> None:
        """(The lease I/O thread's last job, or the owner's.) Release ``held`` (``[(lease id,
        owner)]``) and, if it was the scheduler, the scheduler's lease; check out; close ``store``."""
        from .store import StoreUnavailable

        try:
            store.release(held)
            if scheduler:
                store.release_plain(keys.scheduler(self.config.namespace), self.instance_id)
            store.check_out(self.instance_id)
        except StoreUnavailable as exc:
            log.warning("leases not released (they expire in %g s): %s", self.config.lease_ttl_s, exc)
        except Exception:  # noqa: BLE001 - a bug; the detach goes on (the run's own error stands)
            log.exception("leases not released at detach (they expire in %g s)", self.config.lease_ttl_s)
        finally:
            store.close()

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
        from .store import LeaseStore

        if (delay_s is None) == (at is None):
            raise ValueError("schedule() needs exactly one of delay_s and at")
        if isinstance(delay_s, bool) or isinstance(at, bool):
            raise ValueError("schedule() delay_s and at are numbers of seconds, not booleans")
        if delay_s is not None and not (math.isfinite(float(delay_s)) and float(delay_s) >= 0):
            raise ValueError(f"schedule() delay_s must be finite and >= 0 seconds: {delay_s!r}")
        due_at = at_ms(float(at)) if at is not None else None  # ValueError: NaN, infinite, negative, too far
        sid = new_schedule_id()
        store = (
            self._store
            if self._store is not None
            else LeaseStore(
                self.config.url.get_secret_value(), self.config.namespace, self.config.socket_timeout_s
            )
        )
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
        from .store import LeaseStore

        store = LeaseStore(
            self.config.url.get_secret_value(), self.config.namespace, self.config.socket_timeout_s
        )
        try:
            return store.release_quarantine(lease_id(key, "", 0))  # due now on the Redis server's clock
        finally:
            store.close()

    def inspect(self) -> dict[str, Any]:
        """What this namespace holds in Redis now (see :func:`inspect_redis`)."""
        return inspect_redis(
            self.config.url.get_secret_value(), self.config.namespace, self.config.socket_timeout_s
        )

    # -- renewals: the owner publishes what to renew, the renewer thread renews it ---------------

    def _publish_renewals(self, now: float) -> None:
        """(Owner.) Give the renewer the leases held now, at most every quarter renew interval, so
        the renewer never reads the lease table itself; a lease acquired meanwhile is renewed from
        the next publication on, well within its TTL (which is above three renew intervals)."""
        interval = float(self.config.renew_interval_s or self.config.lease_ttl_s / 4)
        if now - self._renew_published_s >= interval / 4:
            self._renew_published_s = now
            self._renew_set = self._leases.to_renew()  # a new list: the renewer reads the reference

    def _renewed(self, answer: tuple[list[tuple[str, str]], list[bool | None], float]) -> None:
        """(Owner, posted by the renewer.) Redis answered renewals sent at ``asked_s``: heads that
        waited for their lease's renewal may start. ``None``: the lease's Redis node did not answer
        (the lease expires unconfirmed)."""
        asks, oks, asked_s = answer
        leases, port = self._leases, self._port
        for (lid, owner), ok in zip(asks, oks, strict=True):
            if ok is None:
                continue
            for head in leases.renewed(lid, owner, ok, asked_s):
                if port is not None:
                    port.make_ready(head)
        self._lost_noticed()  # a renewal refused: the lease was taken over

    def _renew_now(self) -> None:
        """(Owner.) A head waits for its lease's renewal: publish the leases held and wake the
        renewer, which renews at once instead of at its next interval."""
        self._renew_published_s = 0.0
        self._publish_renewals(time.monotonic())
        self._wake.set()

    def _renewal_failed(self, now: float) -> None:
        """(Owner, posted by the renewer.) Redis did not answer: leases unconfirmed for a TTL are lost."""
        self._leases.expire_unconfirmed(now)
        self._lost_noticed()

    def _lost_noticed(self) -> None:
        """(Owner.) A lease lost since the last look (expired unconfirmed, taken over) makes the
        owner doubt its partitions at once: acquires on their way are then not used (:meth:`_acquired`)."""
        leases = self._leases
        if leases.lost != self._lost_seen:  # lost, not released: a stall or Redis trouble
            self._lost_seen = leases.lost
            self._suspected()

    def _renew_loop(self) -> None:
        """The renewer thread: checks in and renews the published leases every ``renew_interval_s``,
        and posts what Redis answered to the owner (it never touches the lease table)."""
        from .store import StoreUnavailable

        port = self._port
        assert port is not None
        interval = float(self.config.renew_interval_s or self.config.lease_ttl_s / 4)
        ttl_ms = redis_ms(self.config.lease_ttl_s)
        timeout_ms = redis_ms(float(self.config.instance_timeout_s or 3 * self.config.lease_ttl_s))
        first = True
        while first or not self._stop.is_set():
            if not first:
                self._wake.wait(interval)  # the interval, or sooner when a head waits for a renewal
                self._wake.clear()
                if self._stop.is_set():
                    return
            first = False
            try:  # stamped and judged on the Redis server's clock: instances' clocks may differ
                gone = self._store.check_in(self.instance_id, timeout_ms)
                for g in gone:
                    log.warning("instance %s is gone (no check-in for %g s)", g, timeout_ms / 1000)
                self.gone_instances.extend(gone)
            except StoreUnavailable as exc:
                log.warning("check-in failed: %s", exc)
            asks = self._renew_set
            if not asks:
                continue
            asked_s = time.monotonic()
            try:
                oks = self._store.renew(asks, ttl_ms)
            except StoreUnavailable as exc:
                log.warning("lease renewal failed: %s", exc)
                port.post(self._renewal_failed, time.monotonic())
                continue
            port.post(self._renewed, (asks, oks, asked_s))
