"""Parking and scheduled messages: the poll thread's side of ordered non-blocking retries in Redis.

The ideas are the Redis scheduler seed's (``shared/seeds/002``) and go-distr-ep's ScheduleEvent
(``000``), on top of the per-key leases:

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
- **Schedule.** ``schedule()`` stores a message with its due time; when due, the scheduler appends
  it to its key's list, so it runs in the key's order, under the key's lease.
- **One clock.** Every due time is on the Redis server's clock: a delay is added to its ``TIME``
  (read just before), and the scripts that find due keys and due scheduled messages read ``TIME``
  themselves. No instance's wall clock is read, so instances whose clocks differ neither run a
  parked retry or a scheduled message early nor very late (rq-scheduler #246).

Every method runs in the poll thread; Redis calls are made without the dispatcher's lock.
"""

from __future__ import annotations

import base64
import itertools
import json
import logging
import time
import uuid
from collections import deque
from typing import TYPE_CHECKING, Any

from ..message import Message
from .durations import due_ms, redis_ms
from .keys import key_of, lease_id

if TYPE_CHECKING:
    from ..dispatch import Dispatcher
    from .store import LeaseStore

__all__ = ["Parker", "encode_entry", "decode_entry", "new_schedule_id"]

log = logging.getLogger("keyedconsumer.redis")

#: Seconds a lane whose key's parked list is full waits before it tries again.
CAPPED_RETRY_S = 0.5
#: Parked messages fetched at once for one key; one worker runs them one after the other.
DRAIN_BATCH = 64


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
        doc["t"], doc["p"], doc["o"], _unb64(doc["k"]), _unb64(doc["v"]),
        [(n, _unb64(v)) for n, v in doc["h"]] or None, doc["ts"],
    )
    msg.attempt = int(doc["a"])
    return msg, doc


class Parker:
    """Parks keys, drains due keys and moves due scheduled messages (owned by ``RedisSequencer``).

    Parameters
    ----------
    d, store:
        The dispatcher and the Redis store.
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
        d: Dispatcher,
        store: LeaseStore,
        *,
        max_parked_per_key: int,
        max_parked_bytes_per_key: int,
        max_parked_total: int,
        max_parked_bytes_total: int,
        seen_retention_s: float,
        quarantine_on_dead_letter: bool,
        max_drains: int,
    ) -> None:
        self.d = d
        self.store = store
        self.max_key = max_parked_per_key
        self.max_key_bytes = max_parked_bytes_per_key
        self.max_total = max_parked_total
        self.max_total_bytes = max_parked_bytes_total
        self.seen_ttl_ms = redis_ms(seen_retention_s)
        self.quarantine = quarantine_on_dead_letter
        self.max_drains = max_drains
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

    # -- parking (the poll thread) --------------------------------------------------------------

    def park_pending(self) -> None:
        """Send the lanes waiting to be parked to Redis, one pipelined round trip."""
        d, store = self.d, self.store
        leases = d.leases
        assert leases is not None
        now = time.monotonic()
        if not d.to_park or now < self._blocked_until:
            return
        if now - self._totals_at > 1.0:
            n, nbytes = store.totals()
            self._totals_at = now
            self._over_total = n >= self.max_total or nbytes >= self.max_total_bytes
        with d.lock:
            work = d.to_park
            d.to_park = []
            batches: list[tuple[str, str, list[Message], float]] = []
            for head, delay_s in work:
                lid = d.lid(head)
                lease = leases.by_id.get(lid)
                if lease is None or not lease.held:
                    # lost meanwhile: it waits, first in line, for the lease again (the lease
                    # table only marks a lost lease wanted; its active head must be put back)
                    leases.requeue(head, lid)
                    continue
                msgs = [head]
                q = head._lanes.get(head._lk) if head._lanes is not None else None
                if q:
                    msgs.extend(q)
                    q.clear()
                batches.append((lid, lease.owner, msgs, delay_s))
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
        for lid, owner, msgs, delay_s in batches:
            entries = []
            for i, m in enumerate(msgs):
                due = due_ms(now_ms, delay_s) if i == 0 else 0
                field = f"{m.topic.encode().hex()}.{m.partition}"
                entries.append((field, m._off, encode_entry(m, due)))
            calls.append((lid, owner, entries))
        try:
            for lid, _owner, _msgs, delay_s in batches:
                if not leases.is_parked(lid):  # the list may be empty: the due set first (invariant)
                    store.set_due(lid, self.score(due_ms(now_ms, delay_s)))
            results = store.park(calls, self.seen_ttl_ms, self.max_key, self.max_key_bytes)
        except Exception as exc:  # StoreUnavailable: keep them, try again
            self._put_back(batches, f"Redis unavailable: {exc}")
            return
        with d.lock:
            for (lid, _owner, msgs, _delay), (status, _before, taken, _bytes) in zip(batches, results, strict=True):
                if status == 0:
                    d.lease_lost(msgs, lid)
                    continue
                leases.set_parked(lid, True)
                self.parked += taken
                for m in msgs[:taken]:
                    d.done_parked(m)
                head = msgs[0]
                q = head._lanes.get(head._lk) if head._lanes is not None else None
                rest = msgs[taken:]
                if rest:  # the key's list is full: the rest waits in memory, unfinished
                    if q is None:
                        q = head._lanes[head._lk] = deque[Message]()
                    q.extendleft(reversed(rest[1:]))
                    self._yield_capped(head, rest[0], lid, now)
                elif q:  # arrived meanwhile: parked next, as the lane's head under the lease
                    nxt = q.popleft()
                    leases.handover(head, nxt, lid)
                    d.to_park.append((nxt, 0.0))
                else:
                    d.lane_end(head, lid)

    def _yield_capped(self, done_head: Message, head: Message, lid: str, now: float) -> None:
        """The key's list is at its cap: ``head`` (the first message not parked) waits, and the
        lease goes to whoever else waits for it (the drain that makes room) (lock held)."""
        d = self.d
        leases = d.leases
        assert leases is not None
        lease = leases.by_id.get(lid)
        if lease is None:
            return
        head.fencing_token = lease.fence
        lease.active = None
        if lease.waiting:  # a drain job (or another lane) goes first
            other = lease.waiting.popleft()
            lease.active = other
            other.fencing_token = lease.fence
            d.route(other)
        lease.waiting.append(head)
        self.capped[lid] = now + CAPPED_RETRY_S
        if done_head is not head:
            log.info("key %s: parked list at its cap; later messages wait in memory", lid)

    def retry_capped(self) -> None:
        """Lanes that waited for room in their key's list try again when their lease is free."""
        d = self.d
        leases = d.leases
        assert leases is not None
        now = time.monotonic()
        with d.lock:
            for lid, due in list(self.capped.items()):
                if due > now:
                    continue
                lease = leases.by_id.get(lid)
                if lease is None or not lease.waiting:
                    del self.capped[lid]
                    continue
                if lease.active is None and lease.held:
                    del self.capped[lid]
                    head = lease.waiting.popleft()
                    lease.active = head
                    head.fencing_token = lease.fence
                    d.route(head)

    def _put_back(self, batches: list[tuple[str, str, list[Message], float]], why: str) -> None:
        d = self.d
        with d.lock:
            for _lid, _owner, msgs, delay_s in batches:
                head = msgs[0]
                q = head._lanes.get(head._lk) if head._lanes is not None else None
                if q is not None:
                    q.extendleft(reversed(msgs[1:]))
                elif len(msgs) > 1 and head._lanes is not None:
                    head._lanes[head._lk] = deque(msgs[1:])
                d.to_park.append((head, delay_s))
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
                    log.warning("scheduled message %s delivered %.1f s after its due time (misfire)", sid, late_s)

    def take_due_keys(self) -> None:
        """Start draining due keys (each waits for its key's lease)."""
        d, store = self.d, self.store
        room = self.max_drains - len(self.draining)
        if room <= 0:
            return
        leases = d.leases
        assert leases is not None
        self.redis_now_ms, rows = store.due_keys(room + len(self.draining))
        for lid, score in rows:
            if lid in self.draining:
                continue
            if room <= 0:
                break
            room -= 1
            self.draining[lid] = score
            job = Message("", -1, -1, key_of(lid))
            job._part = d.parked_part
            job._lk = lid
            with d.lock:
                if leases.admit_head(job, lid):
                    d.route(job)

    # -- draining (whoever holds the key's lease runs its list) ---------------------------------

    def drain(self) -> None:
        """Fetch the next parked messages of each drain job that holds its lease, and settle the
        results of parked messages that ran."""
        from .store import StoreUnavailable

        d = self.d
        with d.lock:
            jobs, d.drains = d.drains, []
            results, d.parked_results = d.parked_results, []
        i = 0
        try:
            for i, job in enumerate(jobs):  # noqa: B007 (i is read after an error)
                self._next(job, job._lk)
            i = len(jobs)
        except StoreUnavailable:
            with d.lock:  # Redis is down: the rest waits for the next tick, nothing is lost
                d.drains[:0] = jobs[i:]
                d.parked_results[:0] = results
            raise
        i = 0
        while i < len(results):
            msg, outcome, last = results[i]
            # successes of one batch that are not its last: removed from Redis together
            j = i
            while j < len(results) and not results[j][2] and results[j][1] is True and results[j][0]._lk == msg._lk:
                j += 1
            group = results[i:j] if j > i else [results[i]]
            raws = [self.heads.get(id(m)) for m, _, _ in group]
            try:
                if j > i:
                    self._settle_done(group)
                else:
                    self._settle(msg, outcome, last)
            except StoreUnavailable:
                for (m, _, _), raw in zip(group, raws, strict=True):
                    if raw is not None:
                        self.heads[id(m)] = raw
                with d.lock:
                    d.parked_results[:0] = results[i:]
                raise
            i = j if j > i else i + 1

    def _owner(self, lid: str) -> str | None:
        leases = self.d.leases
        assert leases is not None
        lease = leases.by_id.get(lid)
        return lease.owner if lease is not None and lease.held else None

    def _next(self, current: Message, lid: str) -> None:
        """Run the list's next due messages (up to ``DRAIN_BATCH``, one after the other, by one
        worker) under the lease ``current`` holds, or end the drain."""
        store, d = self.store, self.d
        owner = self._owner(lid)
        if owner is None:
            self._end(current, lid, lost=True)
            return
        if d.halted or d.stopping:  # stopping: start nothing new (the list stays for the next drain)
            self._end(current, lid)
            return
        ok, entries, _depth = store.fetch(lid, owner, DRAIN_BATCH)
        if not ok:
            self._end(current, lid, lost=True)
            return
        if not entries:  # the list is empty: the key is no longer parked
            store.clear_due(lid, self.draining.get(lid, -1.0))
            with d.lock:
                d.leases.set_parked(lid, False)  # type: ignore[union-attr]
            self._end(current, lid)
            return
        _, head_doc = decode_entry(entries[0])
        if head_doc.get("q"):  # a quarantined head, released: it was dead-lettered, so it is removed
            if store.pop_many(lid, owner, [entries[0]]) != 1:
                self._end(current, lid, lost=True)
                return
            self._next(current, lid)
            return
        now = self.redis_now_ms  # a Redis time that has passed
        if head_doc["due"] > now:
            now = self.redis_now_ms = store.time_ms()
        if head_doc["due"] > now:  # not due yet on the Redis server's clock (a retry's back-off)
            self._reschedule_end(current, lid, head_doc["due"])
            return
        msgs: list[Message] = []
        for raw in entries:
            msg, doc = decode_entry(raw)
            if doc.get("q") or doc["due"] > now:
                break
            msg._part = d.parked_part
            msg._lk = lid
            self.heads[id(msg)] = raw
            msgs.append(msg)
        with d.lock:
            lease = d.leases.by_id.get(lid)  # type: ignore[union-attr]
            if lease is None or not lease.held or (lease.active is not current and lease.active is not None):
                for m in msgs:
                    self.heads.pop(id(m), None)
                self._end_locked(current, lid)
                return
            lease.active = msgs[0]
            msgs[0].fencing_token = lease.fence
            for m in msgs:
                d.buffered += 1
                d.buffered_bytes += m._size
            if len(msgs) > 1:
                d.parked_lanes[lid] = deque(msgs[1:])
            d.ready.append(msgs[0])
            d.wake(1)

    def _settle_done(self, group: list[tuple[Message, bool | float, bool]]) -> None:
        """Remove from Redis the successes of a drained batch that did not end it (one round trip)."""
        lid = group[0][0]._lk
        raws = [self.heads.pop(id(m)) for m, _, _ in group]
        owner = self._owner(lid)
        removed = self.store.pop_many(lid, owner, raws) if owner is not None else -1
        if removed < len(raws):  # lost the lease: what was not removed runs again, under a new lease
            self._end(group[-1][0], lid, lost=True)
            return
        self.drained += removed

    def _settle(self, msg: Message, outcome: bool | float, last: bool) -> None:
        """Settle in Redis a parked message that ran; ``last``: its drained batch ends with it."""
        store, d = self.store, self.d
        lid = msg._lk
        raw = self.heads.pop(id(msg))
        leases = d.leases
        assert leases is not None
        with d.lock:
            valid = leases.still_valid(msg, lid) or (not last and outcome is True)
        owner = self._owner(lid)
        if not valid or owner is None:
            self._end(msg, lid, lost=True)  # the entry stays: whoever holds the lease runs it again
            return
        if outcome is False:
            self._end(msg, lid)  # the consumer stops; the entry stays
            return
        if isinstance(outcome, float) and outcome is not True:
            _, doc = decode_entry(raw)
            doc["a"] = msg.attempt + 1
            doc["due"] = due_ms(store.time_ms(), float(outcome))  # on the Redis server's clock
            new = json.dumps(doc, separators=(",", ":")).encode()
            if store.replace_head(lid, owner, raw, new):
                d.retries += 1
                self._reschedule_end(msg, lid, doc["due"])
            else:
                self._end(msg, lid, lost=True)
            return
        if self.quarantine and msg.state.get("dead_lettered"):
            _, doc = decode_entry(raw)
            doc["q"] = 1
            if store.replace_head(lid, owner, raw, json.dumps(doc, separators=(",", ":")).encode()):
                store.quarantine(lid, self.draining.get(lid, -1.0))
                log.warning("key %s quarantined after a dead-lettered message", lid)
            self._end(msg, lid)
            return
        if store.pop_many(lid, owner, [raw]) != 1:
            self._end(msg, lid, lost=True)
            return
        self.drained += 1
        if last:
            self._next(msg, lid)  # the next batch, or the list is empty: clear and end

    def _reschedule_end(self, current: Message, lid: str, due_ms: float) -> None:
        score = self.score(due_ms)
        self.store.set_due(lid, score)
        self._end(current, lid)

    def _end(self, current: Message, lid: str, lost: bool = False) -> None:
        with self.d.lock:
            self._end_locked(current, lid)

    def _end_locked(self, current: Message, lid: str) -> None:
        d = self.d
        self.draining.pop(lid, None)
        other = d.leases.lane_dry(current, lid)  # type: ignore[union-attr]
        if other is not None:
            d.route(other)


def new_schedule_id() -> str:
    """A unique id for a scheduled message."""
    return uuid.uuid4().hex

