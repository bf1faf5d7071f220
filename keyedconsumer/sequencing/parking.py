"""Parking and scheduled messages: the poll thread's side of ordered non-blocking retries in Redis.

The ideas are those of Redis job schedulers (delayed jobs in a sorted set scored by their due
time, moved when due) and of go-distr-ep's per-key event lists and ScheduleEvent
(github.com/pgujjeti/go-distr-ep), on top of the per-key leases:

- **Park.** A message whose handler asks to retry later with ``park=True`` is appended to its key's
  list in Redis (``keys.park``) with its due time, and the key goes into the due set. Every later
  message of the key that arrives from Kafka, here or on another instance, is appended behind it
  (the key's lease tells whether its list is non-empty). Each append is one Lua script that checks
  the lease owner and is idempotent per (topic, partition, offset). Only after Redis acknowledged it
  (on disk: ``appendfsync always``) do the messages' offsets count done, so the partition moves on.
- **Drain.** One instance at a time holds the scheduler lease. It takes due keys from the due set
  and, holding each key's lease, runs the list's messages in order through the handler: a success
  removes the head; a retry rewrites its attempt and due time; a dead-lettered message is removed
  (or, with ``quarantine_on_dead_letter``, keeps its key parked until released).
- **Conflate.** With ``conflate=True`` (only the newest waiting message of a key runs), a parked
  key's list keeps its head (the message being retried) and its newest message: appending a newer
  one removes those between, in the script that appends (``store.park``), and a drain first cuts a
  longer list (one written before, or scheduled messages moved in) the same way (``store.fetch``).
  Those removed are *conflated*: their offsets counted done when they were parked, and they are
  counted and reported as the lanes' conflated messages are (``KeyedConsumer.conflated``,
  ``on_conflated``).
- **Last error.** The failure that parks a key, and each failure of a parked message run again, is
  stored with the key (``keys.error``: class, message, which message, attempt, the Redis server's
  time) by the same script that parks it or rewrites its head, and removed with the list
  (``keyedconsumer inspect --redis``, the dashboard's keys view).
- **Schedule.** ``schedule()`` stores a message with its due time; when due, the scheduler appends
  it to its key's list, so it runs in the key's order, under the key's lease.
- **One clock.** Every due time is on the Redis server's clock: a delay is added to its ``TIME``
  (read just before), and the scripts that find due keys and due scheduled messages read ``TIME``
  themselves. No instance's wall clock is read, so instances whose clocks differ neither run a
  parked retry or a scheduled message early nor very late (rq-scheduler #246).

Every method runs in the engine's owner thread (the poll thread), which owns this state too.
"""

from __future__ import annotations

import base64
import itertools
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..engine.delivery import Delivery
from ..engine.outcome import Done, Outcome, Park, Retry
from ..message import Message
from .durations import due_ms, redis_ms
from .keys import lease_id
from .leases import LeaseTable

if TYPE_CHECKING:
    from ..engine.sequencer import LanePort
    from .store import LastError, LeaseStore

__all__ = [
    "Parker",
    "DrainJob",
    "encode_entry",
    "decode_entry",
    "new_schedule_id",
    "last_error",
    "MAX_ERROR_BYTES",
]

log = logging.getLogger("keyedconsumer.redis")

#: Seconds a lane whose key's parked list is full waits before it tries again.
CAPPED_RETRY_S = 0.5
#: Parked messages fetched at once for one key; one worker runs them one after the other.
DRAIN_BATCH = 64
#: Bytes (UTF-8) kept of a parked key's last error: its exception class name and its message are
#: each cut to this many bytes (at a character boundary) before they are stored in Redis.
MAX_ERROR_BYTES = 1024


def _cut(text: str, max_bytes: int = MAX_ERROR_BYTES) -> str:
    """``text`` cut to at most ``max_bytes`` UTF-8 bytes, never inside a character."""
    raw = text.encode("utf-8", "replace")
    return text if len(raw) <= max_bytes else raw[:max_bytes].decode("utf-8", "ignore")


def last_error(msg: Message, where: str | None = None) -> LastError | None:
    """The failure of ``msg``'s attempt that just ended (``msg.last_error``, set when a handler asks
    to retry; ``None`` if none), as stored with its parked key: the exception's class
    (``module.QualName``) and ``str()``, each cut to :data:`MAX_ERROR_BYTES`; ``where``: the message
    (default ``topic[partition]@offset``); its attempt (``msg.attempt``, the one that failed)."""
    from .store import LastError

    exc = msg.last_error
    if exc is None:
        return None
    name = f"{type(exc).__module__}.{type(exc).__qualname__}"
    return LastError(
        _cut(name), _cut(str(exc)), where or f"{msg.topic}[{msg.partition}]@{msg.offset}", msg.attempt
    )


def _b64(b: bytes | None) -> str | None:
    return None if b is None else base64.b64encode(b).decode()


def _unb64(s: str | None) -> bytes | None:
    return None if s is None else base64.b64decode(s)


def encode_entry(msg: Message, due_ms: int, sid: str | None = None) -> bytes:
    """A parked message as JSON bytes (keys, values and headers base64)."""
    doc: dict[str, Any] = {
        "t": msg.topic,
        "p": msg.partition,
        "o": msg.offset,
        "k": _b64(msg.key),
        "v": _b64(msg.value),
        "h": [[n, _b64(v)] for n, v in (msg._headers or [])],
        "ts": msg.timestamp_ms,
        "a": msg.attempt,
        "due": due_ms,
    }
    if sid is not None:
        doc["sid"] = sid
    return json.dumps(doc, separators=(",", ":")).encode()


def decode_entry(raw: bytes) -> tuple[Message, dict[str, Any]]:
    """A :class:`Message` from a parked entry, and the entry's fields."""
    doc = json.loads(raw)
    msg = Message(
        doc["t"],
        doc["p"],
        doc["o"],
        _unb64(doc["k"]),
        _unb64(doc["v"]),
        [(n, _unb64(v)) for n, v in doc["h"]] or None,
        doc["ts"],
    )
    msg.attempt = int(doc["a"])
    return msg, doc


#: Heads to park in one round trip: (lease id, owner, the lane's messages, delay s, failure).
_Batch = tuple[str, str, list[Delivery], float, "LastError | None"]


class DrainJob:
    """A drain of one parked key: waits for the key's lease like a lane head, then runs the key's
    list (:meth:`Parker.drain`)."""

    __slots__ = ("lid", "fencing_token")

    def __init__(self, lid: str) -> None:
        self.lid = lid
        self.fencing_token: int | None = None

    def __repr__(self) -> str:
        return f"DrainJob({self.lid})"


class Parker:
    """Parks keys, drains due keys and moves due scheduled messages (owned by ``RedisSequencer``).

    Its in-memory state (the heads waiting to be parked, the drain jobs holding their lease, the
    drained batches running, their results) is the owner thread's, like every call to it: the
    sequencer's protocol methods and its tick (the Redis round trips) run there.

    Parameters
    ----------
    port:
        The engine's lanes as a sequencer sees them (:class:`~keyedconsumer.engine.sequencer.LanePort`:
        lanes, offsets counted done, messages made ready).
    leases:
        The instance's lease table (the sequencer's).
    store:
        The Redis store.
    route:
        ``route(holder)``: a lease holder that may go on now goes where it must (a drain job to
        :meth:`add_drain`, a head of a parked key to :meth:`park`); returns a head to make ready.
    max_parked_per_key, max_parked_bytes_per_key:
        Caps of one key's list (messages, bytes of entries). At a cap nothing is parked: the
        messages wait in memory (their offsets stay unfinished) and fetching pauses at
        ``max_in_flight``; nothing is dropped. A park into an empty list is always accepted.
    max_parked_total, max_parked_bytes_total:
        The same caps for the whole namespace (checked against counters read once a second).
    seen_retention_s:
        How long the per-(topic, partition) "highest offset parked" markers are kept after the last
        park of the key: a re-delivery within it is recognised and not parked twice.
    quarantine_on_dead_letter:
        A dead-lettered parked message keeps its key parked (no later message of the key runs)
        until :meth:`RedisSequencer.release_quarantine`; by default the key's next message goes on.
    max_drains:
        Keys drained at once by this instance.
    """

    def __init__(
        self,
        port: LanePort,
        leases: LeaseTable,
        store: LeaseStore,
        route: Callable[[Any], Delivery | None],
        *,
        max_parked_per_key: int,
        max_parked_bytes_per_key: int,
        max_parked_total: int,
        max_parked_bytes_total: int,
        seen_retention_s: float,
        quarantine_on_dead_letter: bool,
        max_drains: int,
    ) -> None:
        self.port = port
        self.leases = leases
        self.store = store
        self._route = route
        self.max_key = max_parked_per_key
        self.max_key_bytes = max_parked_bytes_per_key
        self.max_total = max_parked_total
        self.max_total_bytes = max_parked_bytes_total
        self.seen_ttl_ms = redis_ms(seen_retention_s)
        self.quarantine = quarantine_on_dead_letter
        self.max_drains = max_drains
        self._to_park: list[
            tuple[Delivery, float, LastError | None]
        ] = []  # heads whose key goes to Redis: delay, failure
        self._drains: list[DrainJob] = []  # drain jobs that got their key's lease
        self._results: list[
            tuple[Delivery, Outcome, bool]
        ] = []  # (run from a list, outcome, last of its batch)
        self._batches: dict[str, deque[Delivery]] = {}  # lease id -> the drained batch's messages not started
        self.draining: dict[str, float] = {}  # lease id -> its due-set score when taken
        self.heads: dict[int, bytes] = {}  # id(message run from a list) -> its entry as read
        self.capped: dict[str, float] = {}  # lease id -> when its lane tries to park again
        self._uniq = itertools.count()
        self._blocked_until = 0.0  # parking waits (cap, Redis down) until this monotonic time
        self._totals_at = 0.0
        self._over_total = False
        self.parked = 0  # messages parked by this instance
        self.drained = 0  # parked messages finished (done) by this instance
        self.moved = 0  # scheduled messages moved to their key's list
        self.misfires = 0  # scheduled messages moved later than due + ``MISFIRE_S`` (Redis time)
        self.redis_now_ms = 0.0  # the Redis server's time as last read (ms): it has passed

    MISFIRE_S = 1.0

    def score(self, due_ms: float) -> float:
        """A unique due-set score at ``due_ms``: a compare-and-remove never mistakes a newer ZADD."""
        return float(int(due_ms)) + (next(self._uniq) % 1000 + 1) / 1024.0

    # -- the engine's side ------------------------------------------------------------

    def park(self, head: Delivery, delay_s: float, error: LastError | None = None) -> None:
        """``head`` (and its lane's queued messages) go to its key's list; ``error``:
        the failure that parks it, stored as the key's last error."""
        self._to_park.append((head, delay_s, error))

    def add_drain(self, job: DrainJob) -> None:
        """A drain job holds its key's lease now."""
        self._drains.append(job)

    def on_external_end(self, d: Delivery, outcome: Outcome) -> Delivery | None:
        """A message run from a parked list ended. Returns the next of its batch, to
        run under the same lease, when it succeeded; else the batch ends here (what did not start
        is read again later) and its end is settled in Redis at the next tick."""
        lid = d.lease_id or ""
        batch = self._batches.get(lid)
        dead = self.quarantine and isinstance(outcome, Done) and outcome.dead_lettered
        if batch and isinstance(outcome, Done) and not dead and not self.port.halted:
            self._results.append((d, outcome, False))
            nxt = batch.popleft()
            if not batch:
                del self._batches[lid]
            self.leases.handover(d, nxt, lid)
            return nxt
        if batch is not None:
            self.port.forget(self._batches.pop(lid))
        self._results.append((d, outcome, True))
        return None

    def drop(self, keep: Callable[[Delivery], bool]) -> list[Delivery]:
        """Drop the heads waiting to be parked that ``keep`` refuses, and (when ``keep`` refuses
        messages run from lists) the drained batches' messages not started."""
        out: list[Delivery] = []
        stay: list[tuple[Delivery, float, LastError | None]] = []
        for head, delay_s, error in self._to_park:
            if keep(head):
                stay.append((head, delay_s, error))
            else:
                self.leases.drop(head, head.lease_id or "")
                out.append(head)
        self._to_park = stay
        for lid in list(self._batches):
            batch = self._batches[lid]
            if batch and not keep(batch[0]):
                out.extend(self._batches.pop(lid))
        return out

    @property
    def busy(self) -> bool:
        """Heads wait to be parked ."""
        return bool(self._to_park)

    @property
    def has_work(self) -> bool:
        """Anything under way: parking, drains, results to settle, keys draining or capped."""
        return bool(self._to_park or self._drains or self._results or self.draining or self.capped)

    def _make_ready(self, holder: Any) -> None:
        """Route a lease holder that may go on."""
        if holder is not None:
            d = self._route(holder)
            if d is not None:
                self.port.make_ready(d)

    # -- parking (the poll thread) --------------------------------------------------------------

    def park_pending(self) -> None:
        """Send the lanes waiting to be parked to Redis, one pipelined round trip."""
        port, store, leases = self.port, self.store, self.leases
        now = time.monotonic()
        if not self._to_park or now < self._blocked_until:
            return
        if now - self._totals_at > 1.0:
            n, nbytes = store.totals()
            self._totals_at = now
            self._over_total = n >= self.max_total or nbytes >= self.max_total_bytes
        work, self._to_park = self._to_park, []
        batches: list[_Batch] = []
        for head, delay_s, error in work:
            lid = head.lease_id or ""
            owner = leases.owner(lid)
            if owner is None:
                # lost meanwhile: it waits, first in line, for the lease again (the lease
                # table only marks a lost lease wanted; its active head must be put back)
                leases.requeue(head, lid)
                continue
            batches.append((lid, owner, [head, *port.lane_rest(head)], delay_s, error))
        if not batches:
            return
        if self._over_total and any(not leases.is_parked(lid) for lid, *_ in batches):
            self._put_back(batches, "the namespace's parked caps are reached")
            return
        try:
            now_ms = self.redis_now_ms = store.time_ms()  # delays count from the Redis server's time
        except Exception as exc:  # StoreUnavailable: keep them, try again
            self._put_back(batches, f"Redis unavailable: {exc}")
            return
        calls = []
        for lid, owner, ds, delay_s, error in batches:
            entries = []
            for i, d in enumerate(ds):
                due = due_ms(now_ms, delay_s) if i == 0 else 0
                field = f"{d.msg.topic.encode().hex()}.{d.msg.partition}"
                entries.append((field, d.offset, encode_entry(d.msg, due)))
            calls.append((lid, owner, entries, error))
        try:
            for lid, _owner, _ds, delay_s, _error in batches:
                if not leases.is_parked(lid):  # the list may be empty: the due set first (invariant)
                    store.set_due(lid, self.score(due_ms(now_ms, delay_s)))
            results = store.park(calls, self.seen_ttl_ms, self.max_key, self.max_key_bytes, port.conflate)
        except Exception as exc:  # StoreUnavailable: keep them, try again
            self._put_back(batches, f"Redis unavailable: {exc}")
            return
        for (lid, _owner, ds, _delay, _error), (status, _before, taken, _bytes, gone) in zip(
            batches, results, strict=True
        ):
            head = ds[0]
            if gone:  # replaced by a newer message of the key: conflated (their offsets count done)
                self._conflated(gone, ds)
            if status == 0:  # Redis refused: the lease is not ours; they wait for it again
                port.lane_put_back(head, ds[1:])
                leases.requeue(head, lid)
                continue
            leases.set_parked(lid, True)
            self.parked += taken
            port.parked(ds[:taken])
            rest = ds[taken:]
            if rest:  # the key's list is full: the rest waits in memory, unfinished
                port.lane_put_back(head, rest[1:])
                self._make_ready(leases.step_aside(lid, rest[0]))
                self.capped[lid] = now + CAPPED_RETRY_S
                if rest[0] is not head:
                    log.info("key %s: parked list at its cap; later messages wait in memory", lid)
                continue
            nxt = port.lane_advance(head)  # arrived meanwhile: parked next, under the lease
            if nxt is not None:
                leases.handover(head, nxt, lid)
                self._to_park.append((nxt, 0.0, None))

    def _conflated(self, entries: list[bytes], ds: list[Delivery] | None = None) -> None:
        """Parked entries removed by a newer one of their key: counted and reported as
        conflated; ``ds``: the messages just parked, whose own :class:`Message` is reported."""
        mine = {(d.msg.topic, d.msg.partition, d.msg.offset): d.msg for d in ds or [] if d.msg.offset >= 0}
        msgs = []
        for raw in entries:
            msg, doc = decode_entry(raw)
            msgs.append(mine.get((msg.topic, msg.partition, msg.offset), msg) if "sid" not in doc else msg)
        self.port.conflated(msgs)

    def retry_capped(self) -> None:
        """Lanes that waited for room in their key's list try again when their lease is free."""
        now = time.monotonic()
        leases = self.leases
        for lid, due in list(self.capped.items()):
            if due > now:
                continue
            if not leases.has_waiting(lid):
                del self.capped[lid]
                continue
            head = leases.take_free(lid)
            if head is not None:
                del self.capped[lid]
                self._make_ready(head)

    def _put_back(self, batches: list[_Batch], why: str) -> None:
        for _lid, _owner, ds, delay_s, error in batches:
            self.port.lane_put_back(ds[0], ds[1:])
            self._to_park.append((ds[0], delay_s, error))
        self._blocked_until = time.monotonic() + 1.0
        log.warning("parking waits 1 s: %s", why)

    # -- the scheduler (only while this instance holds the scheduler lease) ---------------------

    def move_scheduled(self) -> None:
        """Append due scheduled messages to their keys' lists (due and late on the Redis server's clock)."""
        store = self.store
        now, rows = store.due_scheduled(100)
        self.redis_now_ms = now
        for sid, due, raw in rows:
            if raw is None:  # removed meanwhile
                store.unschedule(sid)
                continue
            msg, _doc = decode_entry(raw)
            lid = lease_id(msg.key, msg.topic, msg.partition)
            store.set_due(lid, self.score(now))  # the due set first (see park_pending)
            moved, _before = store.move_in(lid, sid, raw, self.seen_ttl_ms)
            store.unschedule(sid)
            if moved:
                self.moved += 1
                late_s = (now - due) / 1000.0
                if late_s > self.MISFIRE_S:
                    self.misfires += 1
                    log.warning(
                        "scheduled message %s delivered %.1f s after its due time (misfire)", sid, late_s
                    )

    def take_due_keys(self) -> None:
        """Start draining due keys (each waits for its key's lease)."""
        room = self.max_drains - len(self.draining)
        if room <= 0:
            return
        self.redis_now_ms, rows = self.store.due_keys(room + len(self.draining))
        for lid, score in rows:
            if lid in self.draining:
                continue
            if room <= 0:
                break
            room -= 1
            self.draining[lid] = score
            job = DrainJob(lid)
            if self.leases.admit_head(job, lid):
                self._make_ready(job)

    # -- draining (whoever holds the key's lease runs its list) ---------------------------------

    def drain(self) -> None:
        """Fetch the next parked messages of each drain job that holds its lease, and settle the
        results of parked messages that ran."""
        from .store import StoreUnavailable

        jobs, self._drains = self._drains, []
        results, self._results = self._results, []
        i = 0
        try:
            for i, job in enumerate(jobs):  # noqa: B007 (i is read after an error)
                self._next(job, job.lid)
            i = len(jobs)
        except StoreUnavailable:
            self._drains[:0] = jobs[i:]
            self._results[:0] = results
            raise
        i = 0
        while i < len(results):
            d, outcome, last = results[i]
            # successes of one batch that are not its last: removed from Redis together
            j = i
            while (
                j < len(results)
                and not results[j][2]
                and isinstance(results[j][1], Done)
                and results[j][0].lease_id == d.lease_id
            ):
                j += 1
            group = results[i:j] if j > i else [results[i]]
            raws = [self.heads.get(id(r)) for r, _, _ in group]
            try:
                if j > i:
                    self._settle_done(group)
                else:
                    self._settle(d, outcome, last)
            except StoreUnavailable:
                for (r, _, _), raw in zip(group, raws, strict=True):
                    if raw is not None:
                        self.heads[id(r)] = raw
                self._results[:0] = results[i:]
                raise
            i = j if j > i else i + 1

    def _next(self, current: Any, lid: str) -> None:
        """Run the list's next due messages (up to ``DRAIN_BATCH``, one after the other, by one
        worker) under the lease ``current`` holds, or end the drain."""
        store, port = self.store, self.port
        owner = self.leases.owner(lid)
        if owner is None:
            self._end(current, lid)
            return
        if port.halted or port.stopping:  # stopping: start nothing new (the list stays for the next drain)
            self._end(current, lid)
            return
        ok, entries, _depth, gone = store.fetch(lid, owner, DRAIN_BATCH, port.conflate)
        if gone:  # conflated: the list keeps its head and its newest message
            self._conflated(gone)
        if not ok:
            self._end(current, lid)
            return
        if not entries:  # the list is empty: the key is no longer parked
            store.clear_due(lid, self.draining.get(lid, -1.0))
            self.leases.set_parked(lid, False)
            self._end(current, lid)
            return
        _, head_doc = decode_entry(entries[0])
        if head_doc.get("q"):  # a quarantined head, released: it was dead-lettered, so it is removed
            if store.pop_many(lid, owner, [entries[0]]) != 1:
                self._end(current, lid)
                return
            self._next(current, lid)
            return
        now = self.redis_now_ms  # a Redis time that has passed
        if head_doc["due"] > now:
            now = self.redis_now_ms = store.time_ms()
        if head_doc["due"] > now:  # not due yet on the Redis server's clock (a retry's back-off)
            self._reschedule_end(current, lid, head_doc["due"])
            return
        batch: list[Delivery] = []
        for raw in entries:
            msg, doc = decode_entry(raw)
            if doc.get("q") or doc["due"] > now:
                break
            size = (len(msg.key) if msg.key else 0) + (len(msg.value) if msg.value else 0)
            d = Delivery(msg, None, None, lid, size)
            self.heads[id(d)] = raw
            batch.append(d)
        if not self.leases.activate(lid, current, batch[0]):
            for d in batch:
                self.heads.pop(id(d), None)
            self._end_now(current, lid)
            return
        if len(batch) > 1:
            self._batches[lid] = deque(batch[1:])
        port.admit_external(batch)

    def _settle_done(self, group: list[tuple[Delivery, Outcome, bool]]) -> None:
        """Remove from Redis the successes of a drained batch that did not end it (one round trip)."""
        lid = group[0][0].lease_id or ""
        raws = [self.heads.pop(id(d)) for d, _, _ in group]
        owner = self.leases.owner(lid)
        removed = self.store.pop_many(lid, owner, raws) if owner is not None else -1
        if removed < len(raws):  # lost the lease: what was not removed runs again, under a new lease
            self._end(group[-1][0], lid)
            return
        self.drained += removed

    def _settle(self, d: Delivery, outcome: Outcome, last: bool) -> None:
        """Settle in Redis a parked message that ran; ``last``: its drained batch ends with it."""
        store, leases = self.store, self.leases
        lid = d.lease_id or ""
        raw = self.heads.pop(id(d))
        valid = leases.still_valid(d, lid) or (not last and isinstance(outcome, Done))
        owner = leases.owner(lid)
        if not valid or owner is None:
            self._end(d, lid)  # the entry stays: whoever holds the lease runs it again
            return
        match outcome:
            case Retry(delay_s) | Park(delay_s):
                _, doc = decode_entry(raw)
                doc["a"] = d.msg.attempt + 1
                doc["due"] = due_ms(store.time_ms(), delay_s)  # on the Redis server's clock
                new = json.dumps(doc, separators=(",", ":")).encode()
                error = last_error(d.msg, f"scheduled {doc['sid']}" if "sid" in doc else None)
                if store.replace_head(lid, owner, raw, new, error):
                    self.port.count_retry()
                    self._reschedule_end(d, lid, doc["due"])
                else:
                    self._end(d, lid)
            case Done(dead_lettered=True) if self.quarantine:
                _, doc = decode_entry(raw)
                doc["q"] = 1
                if store.replace_head(lid, owner, raw, json.dumps(doc, separators=(",", ":")).encode()):
                    store.quarantine(lid, self.draining.get(lid, -1.0))
                    log.warning("key %s quarantined after a dead-lettered message", lid)
                self._end(d, lid)
            case Done():
                if store.pop_many(lid, owner, [raw]) != 1:
                    self._end(d, lid)
                    return
                self.drained += 1
                if last:
                    self._next(d, lid)  # the next batch, or the list is empty: clear and end
            case _:  # not started, or the consumer stops: the entry stays
                self._end(d, lid)

    def _reschedule_end(self, current: Any, lid: str, due_ms: float) -> None:
        score = self.score(due_ms)
        self.store.set_due(lid, score)
        self._end(current, lid)

    def _end(self, current: Any, lid: str) -> None:
        self._end_now(current, lid)

    def _end_now(self, current: Any, lid: str) -> None:
        self.draining.pop(lid, None)
        self._make_ready(self.leases.lane_dry(current, lid))


def new_schedule_id() -> str:
    """A unique id for a scheduled message."""
    return uuid.uuid4().hex
