"""Leases with fencing tokens, parked and scheduled messages, as Lua scripts on Redis (with
:mod:`~keyedconsumer.sequencing.connection`, the only modules that import ``redis``).

A lease follows redis-py's ``lock.py``: ``SET NX PX`` with a random owner token; renew and release
compare the token atomically. Acquiring also ``INCR``s the key's fencing counter in the same script;
the result is the fencing token. The counter must never repeat, also after a Redis restart: the
store refuses to start unless Redis persists every write before answering (``appendonly yes`` and
``appendfsync always``; Redis 7.0 has no ``WAITAOF``), unless ``require_durable=False``. On a
Redis Cluster, every pipelined script goes per master on plain connections
(:func:`~keyedconsumer.sequencing.connection.send_to_masters`), and the writes that must also
survive a failover wait for a replica: acquiring and renewing leases,
parking, scheduling and moving scheduled messages in, due times, quarantine, the scheduler's lease
and check-ins. Releases, settling finished parked messages and the parked totals do not: losing one
in a failover delays a key by a lease TTL or runs a message once more, within at-least-once.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

import redis

from . import keys
from .connection import ERRORS, StoreUnavailable, check_replicas, connect, is_cluster, send_to_masters

__all__ = ["LeaseStore", "LastError", "StoreUnavailable", "connect", "inspect_namespace"]

log = logging.getLogger("keyedconsumer.redis")


class LastError(NamedTuple):
    """The failure that parked a key (or that a parked message ran into again), as stored with it.

    ``type``: the exception's class, ``module.QualName``; ``message``: ``str(exception)``; both are
    cut by :func:`keyedconsumer.sequencing.parking.last_error` to
    :data:`~keyedconsumer.sequencing.parking.MAX_ERROR_BYTES` UTF-8 bytes. ``at``: the message,
    ``topic[partition]@offset`` (``scheduled <id>`` for a scheduled one); ``attempt``: the attempt
    that failed (1 = the first).
    """

    type: str
    message: str
    at: str
    attempt: int


def _error_args(error: LastError | None) -> list[Any]:
    """The four script arguments of an optional error (an empty class: none)."""
    return ["", "", "", 0] if error is None else [error.type, error.message, error.at, error.attempt]


# KEYS[1] lease, KEYS[2] fence, KEYS[3] park; ARGV[1] owner, ARGV[2] ttl ms -> {fencing token, or
# -(pttl ms) when another owner holds it (at most -1); length of the key's parked list}.
_ACQUIRE = """
local cur = redis.call('GET', KEYS[1])
local depth = redis.call('LLEN', KEYS[3])
if cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {tonumber(redis.call('GET', KEYS[2]) or '0'), depth}
end
if cur then
  local left = redis.call('PTTL', KEYS[1])
  if left < 1 then left = 1 end
  return {-left, depth}
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return {redis.call('INCR', KEYS[2]), depth}
"""
# KEYS[1] lease; ARGV[1] owner, ARGV[2] ttl ms -> 1 renewed, 0 not ours any more
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
# KEYS[1] lease; ARGV[1] owner -> 1 released, 0 not ours
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


# Parking (the Redis-parked retries of pgujjeti/go-distr-ep): every write checks that the caller
# still holds the key's lease.
# KEYS[1] lease, [2] park, [3] pbytes, [4] seen, [5] error; ARGV[1] owner, [2] seen retention ms,
# [3] max messages, [4] max bytes, [5] conflate (1 | 0), [6] error class ('' = no error), [7] error
# message, [8] the failed message (topic[partition]@offset), [9] its attempt, then (field, offset,
# entry) triples in order. Entries whose offset is not above the field's highest parked offset are
# already parked (a re-delivery): skipped. Entries are taken in order while the list has room (an
# empty list takes at least one). With conflate, an entry appended to a list of two or more first
# removes the entries behind the list's head (returned: conflated, replaced by a newer one). The
# error, if any, is stored with the time of the park on the Redis server's clock (TIME).
# -> {1 | 0 not the owner, length before, entries taken (appended or skipped), bytes added (may be
#     negative), appended, {entries conflated, in list order}}
_PARK = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {0, 0, 0, 0, 0, {}} end
local before = redis.call('LLEN', KEYS[2])
local n, nbytes = before, tonumber(redis.call('GET', KEYS[3]) or '0')
local maxn, maxb, conflate = tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5] == '1'
local last, taken, add, appended, gone = {}, 0, 0, 0, {}
for i = 10, #ARGV, 3 do
  local f, off, e = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2]
  if last[f] == nil then last[f] = tonumber(redis.call('HGET', KEYS[4], f) or '-1') end
  if off > last[f] then
    if conflate and n >= 2 then
      for _, old in ipairs(redis.call('LRANGE', KEYS[2], 1, -1)) do
        gone[#gone + 1] = old
        add = add - #old
        nbytes = nbytes - #old
      end
      redis.call('LTRIM', KEYS[2], 0, 0)
      n = 1
    end
    if n > 0 and (n + 1 > maxn or nbytes + #e > maxb) then break end
    redis.call('RPUSH', KEYS[2], e)
    redis.call('HSET', KEYS[4], f, off)
    last[f] = off
    n = n + 1
    nbytes = nbytes + #e
    add = add + #e
    appended = appended + 1
  end
  taken = taken + 1
end
if taken > 0 then redis.call('PEXPIRE', KEYS[4], ARGV[2]) end
if add ~= 0 then redis.call('INCRBY', KEYS[3], add) end
if taken > 0 and ARGV[6] ~= '' then
  local t = redis.call('TIME')
  redis.call('HSET', KEYS[5], 'type', ARGV[6], 'message', ARGV[7], 'at', ARGV[8], 'attempt', ARGV[9],
             'time_ms', string.format('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)))
end
return {1, before, taken, add, appended, gone}
"""
# KEYS[1] lease, [2] park, [3] pbytes; ARGV[1] owner, [2] n, [3] conflate (1 | 0) -> {1, the first
# n entries, length, {entries conflated}} | {0, {}, 0, {}}. With conflate, a list of three or more
# keeps its head and its newest entry: those between are removed and returned (conflated).
_FETCH = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {0, {}, 0, {}} end
local gone = {}
if ARGV[3] == '1' and redis.call('LLEN', KEYS[2]) > 2 then
  gone = redis.call('LRANGE', KEYS[2], 1, -2)
  local newest = redis.call('RPOP', KEYS[2])
  redis.call('LTRIM', KEYS[2], 0, 0)
  redis.call('RPUSH', KEYS[2], newest)
  local b = 0
  for _, old in ipairs(gone) do b = b + #old end
  redis.call('DECRBY', KEYS[3], b)
end
return {1, redis.call('LRANGE', KEYS[2], 0, tonumber(ARGV[2]) - 1), redis.call('LLEN', KEYS[2]), gone}
"""
# KEYS[1] lease, [2] park, [3] pbytes, [4] error; ARGV[1] owner, ARGV[2..] the entries expected at
# the head, in order -> entries removed (they are removed while they match the head), or -1: not the
# owner. An emptied list takes its byte count and its last error along.
_POP_MANY = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
local n, b = 0, 0
for i = 2, #ARGV do
  if redis.call('LINDEX', KEYS[2], 0) ~= ARGV[i] then break end
  redis.call('LPOP', KEYS[2])
  n = n + 1
  b = b + #ARGV[i]
end
if redis.call('LLEN', KEYS[2]) == 0 then redis.call('DEL', KEYS[3], KEYS[4]) elseif b > 0 then redis.call('DECRBY', KEYS[3], b) end
return n
"""
# KEYS[1] lease, [2] park, [3] pbytes, [4] error; ARGV[1] owner, [2] head entry expected, [3] its
# replacement, [4] error class ('' = none), [5] message, [6] the failed message, [7] its attempt
# -> {1, bytes added (may be negative)} | {0, 0}; the error is stored with the Redis server's time.
_REPLACE_HEAD = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {0, 0} end
if redis.call('LINDEX', KEYS[2], 0) ~= ARGV[2] then return {0, 0} end
redis.call('LSET', KEYS[2], 0, ARGV[3])
local delta = #ARGV[3] - #ARGV[2]
if delta ~= 0 then redis.call('INCRBY', KEYS[3], delta) end
if ARGV[4] ~= '' then
  local t = redis.call('TIME')
  redis.call('HSET', KEYS[4], 'type', ARGV[4], 'message', ARGV[5], 'at', ARGV[6], 'attempt', ARGV[7],
             'time_ms', string.format('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)))
end
return {1, delta}
"""
# KEYS[1] due; ARGV[1] member, [2] the score it was seen with -> 1 removed | 0 changed meanwhile
_ZREM_IF = """
local cur = redis.call('ZSCORE', KEYS[1], ARGV[1])
if cur and tonumber(cur) == tonumber(ARGV[2]) then return redis.call('ZREM', KEYS[1], ARGV[1]) end
return 0
"""
# KEYS[1] sdue, [2] entries; ARGV[1] id, [2] due ms, [3] entry -> 1
_SCHEDULE = """
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
return 1
"""
# A due scheduled message joins its key's list (no lease needed: an append never races a run,
# which needs the lease; the due set was updated first). KEYS[1] park, [2] pbytes, [3] seen;
# ARGV[1] seen field, [2] entry, [3] seen retention ms -> {1 appended | 0 already, length before}
_MOVE_IN = """
local before = redis.call('LLEN', KEYS[1])
if redis.call('HEXISTS', KEYS[3], ARGV[1]) == 1 then return {0, before} end
redis.call('RPUSH', KEYS[1], ARGV[2])
redis.call('HSET', KEYS[3], ARGV[1], 1)
redis.call('PEXPIRE', KEYS[3], ARGV[3])
redis.call('INCRBY', KEYS[2], #ARGV[2])
return {1, before}
"""
# KEYS[1] sdue, [2] entries; ARGV[1] id -> 1 removed | 0 was not scheduled
_UNSCHEDULE = """
local n = redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
return n
"""
# One clock (rq-scheduler #246: scheduled jobs run early when instances' clocks differ): every
# "is it due", "how late" and "is that instance gone" is decided on the Redis server's TIME, read by
# the script that decides, never on an instance's wall clock. Each such script touches only the
# namespace's {_sched} slot, so on a Redis Cluster the clock is that of the node holding it; with
# Redis 7 a script may write after reading TIME (its effects are replicated, not the script).
# Redis time in ms since the epoch, from TIME's {seconds, microseconds}: a Lua number (a double,
# exact to a quarter of a microsecond here), which Redis passes on to commands without losing digits.
_NOW = "local t = redis.call('TIME')\nlocal now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000\n"
# KEYS[1] any {_sched} key (routes the call to the clock's node) -> {seconds, microseconds}
_TIME = "return redis.call('TIME')"
# KEYS[1] due; ARGV[1] limit -> {seconds, microseconds, {member, score, ...} due now, earliest first}
_DUE_KEYS = (
    _NOW
    + """
return {t[1], t[2], redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'WITHSCORES', 'LIMIT', 0, tonumber(ARGV[1]))}
"""
)
# KEYS[1] sdue, [2] entries; ARGV[1] limit -> {seconds, microseconds, {id, due ms, ...} due now,
# {their entries (nil: removed meanwhile)}}
_DUE_SCHEDULED = (
    _NOW
    + """
local rows = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'WITHSCORES', 'LIMIT', 0, tonumber(ARGV[1]))
local ids = {}
for i = 1, #rows, 2 do ids[#ids + 1] = rows[i] end
local entries = {}
if #ids > 0 then entries = redis.call('HMGET', KEYS[2], unpack(ids)) end
return {t[1], t[2], rows, entries}
"""
)
# KEYS[1] instances; ARGV[1] instance, [2] timeout ms -> {seconds, microseconds, {instances gone}}:
# this instance's check-in is stamped with the server's time; those silent for the timeout are removed
_CHECK_IN = (
    _NOW
    + """
redis.call('ZADD', KEYS[1], now, ARGV[1])
local cutoff = now - tonumber(ARGV[2])
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', cutoff)
if #gone > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', cutoff) end
return {t[1], t[2], gone}
"""
)
# KEYS[1] quarantine, [2] due; ARGV[1] lease id -> 1 due now | 0 not quarantined
_RELEASE_QUARANTINE = (
    """
if redis.call('SREM', KEYS[1], ARGV[1]) == 0 then return 0 end
"""
    + _NOW
    + """
redis.call('ZADD', KEYS[2], math.floor(now) + 0.5, ARGV[1])
return 1
"""
)
# KEYS[1] park, [2] pbytes -> 1: the head entry's due time is now (Redis TIME, ms) | 0: no list.
# The entry is JSON written by parking.encode_entry; its top-level "due" is the only `"due":` in it
# outside a JSON string (inside one, the quotes are escaped), so one gsub rewrites exactly that field.
_HEAD_DUE_NOW = """
local head = redis.call('LINDEX', KEYS[1], 0)
if not head then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local new, n = string.gsub(head, '"due":[-+.%deE]+', '"due":' .. string.format('%d', now), 1)
if n == 1 and new ~= head then
  redis.call('LSET', KEYS[1], 0, new)
  if #new ~= #head then redis.call('INCRBY', KEYS[2], #new - #head) end
end
return 1
"""
# KEYS[1] quarantine, [2] due; ARGV[1] lease id -> 1: due now (and out of quarantine)
_DUE_NOW = (
    """
redis.call('SREM', KEYS[1], ARGV[1])
"""
    + _NOW
    + """
redis.call('ZADD', KEYS[2], math.floor(now) + 0.5, ARGV[1])
return 1
"""
)
# KEYS[1] lease; ARGV[1] owner, [2] ttl ms -> 1 held (acquired or renewed) | 0 held by another
_HOLD = """
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
if cur then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""


class LeaseStore:
    """Leases of one namespace on one Redis.

    Parameters
    ----------
    url:
        ``redis://`` or ``rediss://`` URL (a password in it never appears in a repr or log).
    namespace:
        Isolates consumer groups and tenants.
    socket_timeout_s:
        Bound of one Redis call, in seconds. On a Redis Cluster a write waits at most a quarter of
        it for a replica's acknowledgement (``WAIT``; at least 10 ms).
    """

    def __init__(self, url: str, namespace: str, socket_timeout_s: float = 2.0) -> None:
        self.namespace = keys.check_namespace(namespace)
        self._r: Any = connect(url, socket_timeout_s)
        self._cluster = is_cluster(self._r)
        self._wait_ms = max(10, int(socket_timeout_s * 250))
        self._acquire = self._r.register_script(_ACQUIRE)
        self._renew = self._r.register_script(_RENEW)
        self._release = self._r.register_script(_RELEASE)
        self._park = self._r.register_script(_PARK)
        self._fetch = self._r.register_script(_FETCH)
        self._pop_many = self._r.register_script(_POP_MANY)
        self._replace_head = self._r.register_script(_REPLACE_HEAD)
        self._zrem_if = self._r.register_script(_ZREM_IF)
        self._schedule = self._r.register_script(_SCHEDULE)
        self._move_in = self._r.register_script(_MOVE_IN)
        self._unschedule = self._r.register_script(_UNSCHEDULE)
        self._hold = self._r.register_script(_HOLD)
        self._time = self._r.register_script(_TIME)
        self._due_keys = self._r.register_script(_DUE_KEYS)
        self._due_scheduled = self._r.register_script(_DUE_SCHEDULED)
        self._check_in = self._r.register_script(_CHECK_IN)
        self._release_quarantine = self._r.register_script(_RELEASE_QUARANTINE)
        self._due_now = self._r.register_script(_DUE_NOW)
        self._head_due_now = self._r.register_script(_HEAD_DUE_NOW)

    def check_durable(self) -> None:
        """Raise ``RuntimeError`` unless Redis persists each write before it answers.

        Raises
        ------
        StoreUnavailable
            Redis did not answer.
        RuntimeError
            ``appendonly`` is not ``yes`` or ``appendfsync`` is not ``always``: a fencing token
            could repeat after a Redis restart. On a Redis Cluster also a master without a replica
            (:func:`~keyedconsumer.sequencing.connection.check_replicas`).
        """
        try:
            if isinstance(self._r, redis.Redis):
                found = {"": self._r.config_get("append*")}
            else:  # a Redis Cluster: every node, a replica may become the master of its slots
                found = self._r.config_get("append*", target_nodes=self._r.ALL_NODES)
                if found and "appendonly" in found:  # redis-py merges the answer of a single node
                    found = {"": found}
        except ERRORS as exc:
            raise StoreUnavailable(str(exc)) from None
        for node, conf in found.items():
            aof, fsync = conf.get("appendonly"), conf.get("appendfsync")
            if aof != "yes" or fsync != "always":
                where = f" on {node}" if node else ""
                raise RuntimeError(
                    f"Redis must run with appendonly yes and appendfsync always (has appendonly={aof}, "
                    f"appendfsync={fsync}{where}): otherwise a fencing token can repeat after a restart"
                )
        if self._cluster:
            check_replicas(self._r)

    def acquire(self, requests: Sequence[tuple[str, str]], ttl_ms: int) -> list[tuple[int, int]]:
        """Try to acquire ``[(lease id, owner token)]`` in one round trip.

        Returns, per request, ``(fencing token (> 0) or -(ms until the holder's lease ends), length of
        the key's parked list)``.
        """
        return [
            (int(x[0]), int(x[1]))
            for x in self._pipeline(self._acquire, requests, ttl_ms, fence=True, replicated=True)
        ]

    def renew(self, requests: Sequence[tuple[str, str]], ttl_ms: int) -> list[bool]:
        """Extend ``[(lease id, owner token)]``; ``False`` where the lease is no longer ours."""
        return [bool(x) for x in self._pipeline(self._renew, requests, ttl_ms, replicated=True)]

    def release(self, requests: Sequence[tuple[str, str]]) -> list[bool]:
        """Release ``[(lease id, owner token)]``; ``False`` where it was no longer ours."""
        return [bool(x) for x in self._pipeline(self._release, requests, None)]

    def _pipeline(
        self,
        script: Any,
        requests: Sequence[tuple[str, str]],
        ttl_ms: int | None,
        fence: bool = False,
        replicated: bool = False,
    ) -> list[Any]:
        """The lease scripts for ``[(lease id, owner token)]`` in one round trip (:meth:`_evalsha_many`)."""
        ns = self.namespace
        lease = keys.lease
        calls: list[tuple[tuple[str, ...], tuple[Any, ...]]]
        if fence:
            fence_k, park = keys.fence, keys.park
            calls = [
                ((lease(ns, lid), fence_k(ns, lid), park(ns, lid)), (owner, ttl_ms))
                for lid, owner in requests
            ]
        elif ttl_ms is None:
            calls = [((lease(ns, lid),), (owner,)) for lid, owner in requests]
        else:
            calls = [((lease(ns, lid),), (owner, ttl_ms)) for lid, owner in requests]
        return self._evalsha_many(script, calls, replicated)

    def _evalsha_many(
        self, script: Any, calls: Sequence[tuple[Sequence[str], Sequence[Any]]], replicated: bool = False
    ) -> list[Any]:
        """One ``EVALSHA`` of ``script`` per ``(keys, args)``, pipelined (no MULTI: each script is
        atomic on its own; on a Redis Cluster each goes to the node that holds its keys' slot, which
        is one slot per call: see :mod:`~keyedconsumer.sequencing.keys`). ``replicated``: on a Redis
        Cluster, each counts only once a replica has it (:func:`send_to_masters`).

        Plain ``EVALSHA`` commands cost about half of redis-py's ``Script`` objects in a pipeline
        (which also send ``SCRIPT EXISTS`` on each execute, and which redis-py's cluster pipeline
        refuses). A Redis that lost its script cache (a restart, a replica promoted by a failover)
        answers ``NOSCRIPT``: the script is loaded (on every master) and the pipeline sent once
        more, which is safe because a script that was not found did not run.

        Raises
        ------
        StoreUnavailable
            Redis did not answer, or lost the script again right after it was loaded.
        """
        if not calls:
            return []
        sha = script.sha
        if self._cluster:  # per master, on plain connections (replicated: and WAIT)
            cmds = [(k[0], ("EVALSHA", sha, len(k), *k, *a)) for k, a in calls]
            return send_to_masters(self._r, cmds, self._wait_ms if replicated else None, script.script)
        for attempt in (1, 2):
            try:
                pipe = self._r.pipeline(transaction=False)
                cmd = pipe.execute_command
                for k, a in calls:
                    cmd("EVALSHA", sha, len(k), *k, *a)
                return list(pipe.execute())
            except redis.exceptions.NoScriptError:
                if attempt == 2:
                    raise StoreUnavailable("Redis lost its scripts twice in a row") from None
                try:
                    self._r.script_load(script.script)
                except ERRORS as exc:
                    raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from None
            except ERRORS as exc:
                raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from None
        raise AssertionError("unreachable")

    def fencing_token(self, lid: str) -> int:
        """The current value of a lease's fencing counter (0 if never acquired)."""
        try:
            return int(self._r.get(keys.fence(self.namespace, lid)) or 0)
        except ERRORS as exc:
            raise StoreUnavailable(str(exc)) from None

    # -- parking and scheduled messages ----------------------------------------------------------

    def park(
        self,
        batches: Sequence[tuple[str, str, list[tuple[str, int, bytes]], LastError | None]],
        seen_ttl_ms: int,
        max_messages: int,
        max_bytes: int,
        conflate: bool = False,
    ) -> list[tuple[int, int, int, int, list[bytes]]]:
        """Append ``[(lease id, owner, [(seen field, offset, entry)], last error or None)]`` to the
        keys' parked lists, each batch atomically and only while ``owner`` holds the lease, in one
        round trip.

        Redis answers after the write is on disk (``appendfsync always``, checked at start).

        Entries are taken in order while the key's list stays within ``max_messages`` and
        ``max_bytes`` (an empty list takes at least one); an entry already parked (same
        topic/partition, offset not above the highest parked) is taken without being appended.
        With ``conflate``, appending to a list of two or more entries first removes those behind
        its head: the list keeps its head and the newest entry. A batch's error (the failure that
        parks the key) is stored as the key's last error, with the Redis server's time, in the same
        script.

        Returns, per batch, ``(status, length before, entries taken, bytes added, [entries
        conflated])``: status 1, or 0 when the lease is not ``owner``'s (nothing written).
        """
        ns = self.namespace
        calls = []
        for lid, owner, entries, error in batches:
            args: list[Any] = [
                owner,
                seen_ttl_ms,
                max_messages,
                max_bytes,
                1 if conflate else 0,
                *_error_args(error),
            ]
            for field, off, entry in entries:
                args += [field, off, entry]
            calls.append(
                (
                    [
                        keys.lease(ns, lid),
                        keys.park(ns, lid),
                        keys.pbytes(ns, lid),
                        keys.seen(ns, lid),
                        keys.error(ns, lid),
                    ],
                    args,
                )
            )
        out = self._evalsha_many(self._park, calls, replicated=True)
        mine = [x for x in out if int(x[0]) == 1]
        n_added = sum(int(x[4]) - len(x[5] or []) for x in mine)  # a re-delivered one is taken, not appended
        n_bytes = sum(int(x[3]) for x in mine)
        if n_added or n_bytes:
            self._count(n_added, n_bytes)
        return [(int(x[0]), int(x[1]), int(x[2]), int(x[3]), list(x[5] or [])) for x in out]

    def fetch(
        self, lid: str, owner: str, n: int = 1, conflate: bool = False
    ) -> tuple[bool, list[bytes], int, list[bytes]]:
        """The first ``n`` entries of the key's parked list: ``(still the owner, entries, length,
        entries conflated)``. With ``conflate`` a list of three or more is first cut, in the same
        script and under the lease, to its head and its newest entry; those between are returned."""
        ns = self.namespace
        r = self._call(
            self._fetch,
            [keys.lease(ns, lid), keys.park(ns, lid), keys.pbytes(ns, lid)],
            [owner, n, 1 if conflate else 0],
            replicated=conflate,
        )
        gone = list(r[3] or [])
        if gone:
            self._count(-len(gone), -sum(len(e) for e in gone))
        return bool(r[0]), list(r[1] or []), int(r[2]), gone

    def pop_many(self, lid: str, owner: str, entries: Sequence[bytes]) -> int:
        """Remove ``entries`` from the head of the key's parked list, in order, while they are its
        head and ``owner`` holds the lease (an emptied list takes its last error along). Returns how
        many were removed (-1: not the owner)."""
        ns = self.namespace
        k = [keys.lease(ns, lid), keys.park(ns, lid), keys.pbytes(ns, lid), keys.error(ns, lid)]
        n = int(self._call(self._pop_many, k, [owner, *entries]))
        if n > 0:
            self._count(-n, -sum(len(e) for e in entries[:n]))
        return n

    def _count(self, n: int, nbytes: int) -> None:
        """Adjust the namespace's parked totals (kept beside the lists, in the ``{_sched}`` slot, so
        not in the lists' scripts: a crash between the two leaves them off by that batch)."""
        try:
            pipe = self._r.pipeline(transaction=False)
            if n:
                pipe.hincrby(keys.totals(self.namespace), "n", n)
            if nbytes:
                pipe.hincrby(keys.totals(self.namespace), "bytes", nbytes)
            pipe.execute()
        except ERRORS as exc:
            log.debug("parked totals not updated: %s", exc)

    def replace_head(
        self, lid: str, owner: str, head: bytes, new: bytes, error: LastError | None = None
    ) -> bool:
        """Replace the head of the key's parked list (its attempt and due time) under the lease;
        ``error``: the failure of the attempt that ran, stored as the key's last error (with the
        Redis server's time) in the same script."""
        ns = self.namespace
        k = [keys.lease(ns, lid), keys.park(ns, lid), keys.pbytes(ns, lid), keys.error(ns, lid)]
        ok, delta = self._call(
            self._replace_head, k, [owner, head, new, *_error_args(error)], replicated=True
        )
        if int(delta):
            self._count(0, int(delta))
        return bool(int(ok))

    def set_due(self, lid: str, score_ms: float) -> None:
        """``ZADD`` the key to the due set at ``score_ms`` (ms since the epoch, a unique float)."""
        self._write(keys.due(self.namespace), "ZADD", keys.due(self.namespace), repr(score_ms), lid)

    def clear_due(self, lid: str, seen_score_ms: float) -> bool:
        """Remove the key from the due set unless its score changed since ``seen_score_ms``."""
        return bool(self._call(self._zrem_if, [keys.due(self.namespace)], [lid, repr(seen_score_ms)]))

    def time_ms(self) -> float:
        """The Redis server's time (``TIME``), ms since the epoch (microsecond precision): the one
        clock of the namespace, read from the node that holds its ``{_sched}`` keys.

        Raises
        ------
        StoreUnavailable
            Redis did not answer.
        """
        sec, usec = self._call(self._time, [keys.due(self.namespace)], [])
        return _ms(sec, usec)

    def due_keys(self, limit: int) -> tuple[float, list[tuple[str, float]]]:
        """Keys whose parked head is due now on the Redis server's clock: ``(that time in ms,
        [(lease id, score)])``, earliest first."""
        sec, usec, rows = self._call(self._due_keys, [keys.due(self.namespace)], [limit])
        return _ms(sec, usec), [(_text(rows[i]), float(rows[i + 1])) for i in range(0, len(rows), 2)]

    def totals(self) -> tuple[int, int]:
        """Messages and bytes parked in the namespace (kept beside the lists: approximate after a
        crash between a park and its count)."""
        try:
            t = self._r.hgetall(keys.totals(self.namespace))
        except ERRORS as exc:
            raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from None
        return int(t.get(b"n", 0)), int(t.get(b"bytes", 0))

    def schedule(self, sid: str, due_ms: int, entry: bytes) -> None:
        """Store a scheduled message ``entry`` under id ``sid``, due at ``due_ms`` (ms since the epoch)."""
        ns = self.namespace
        self._call(
            self._schedule,
            [keys.sched_due(ns), keys.sched_entries(ns)],
            [sid, due_ms, entry],
            replicated=True,
        )

    def due_scheduled(self, limit: int) -> tuple[float, list[tuple[str, float, bytes | None]]]:
        """Scheduled messages due now on the Redis server's clock: ``(that time in ms, [(id, due ms,
        entry or None if removed meanwhile)])``, in one round trip."""
        ns = self.namespace
        sec, usec, rows, entries = self._call(
            self._due_scheduled, [keys.sched_due(ns), keys.sched_entries(ns)], [limit]
        )
        due = [(_text(rows[i]), float(rows[i + 1])) for i in range(0, len(rows), 2)]
        return _ms(sec, usec), [(sid, sc, e) for (sid, sc), e in zip(due, entries or [], strict=True)]

    def move_in(self, lid: str, sid: str, entry: bytes, seen_ttl_ms: int) -> tuple[bool, int]:
        """Append a due scheduled message to its key's parked list, once per id (idempotent).
        Returns ``(appended, length before)``."""
        ns = self.namespace
        r = self._call(
            self._move_in,
            [keys.park(ns, lid), keys.pbytes(ns, lid), keys.seen(ns, lid)],
            [f"s.{sid}", entry, seen_ttl_ms],
            replicated=True,
        )
        if int(r[0]):
            self._count(1, len(entry))
        return bool(r[0]), int(r[1])

    def unschedule(self, sid: str) -> bool:
        """Remove a scheduled message; ``False`` if it was not scheduled (any more)."""
        ns = self.namespace
        return bool(self._call(self._unschedule, [keys.sched_due(ns), keys.sched_entries(ns)], [sid]))

    def quarantine(self, lid: str, seen_score_ms: float) -> None:
        """Take the key out of the due set and list it as quarantined (its head was dead-lettered)."""
        self.clear_due(lid, seen_score_ms)
        self._write(keys.quarantine(self.namespace), "SADD", keys.quarantine(self.namespace), lid)

    def release_quarantine(self, lid: str) -> bool:
        """Make a quarantined key due now (on the Redis server's clock), atomically; ``False`` if it
        was not quarantined."""
        ns = self.namespace
        return bool(
            self._call(self._release_quarantine, [keys.quarantine(ns), keys.due(ns)], [lid], replicated=True)
        )

    def due_now(self, lid: str) -> bool:
        """Make a parked key due now (on the Redis server's clock), taking it out of quarantine:
        its head entry's due time and the key's due-set score are set to now; ``False`` (nothing
        changed) if the key has no parked messages. A head that is running at that moment fails
        to settle (its entry changed) and runs once more, within at-least-once."""
        ns = self.namespace
        if not self._call(
            self._head_due_now, [keys.park(ns, lid), keys.pbytes(ns, lid)], [], replicated=True
        ):
            return False
        return bool(self._call(self._due_now, [keys.quarantine(ns), keys.due(ns)], [lid], replicated=True))

    def hold(self, key: str, owner: str, ttl_ms: int) -> bool:
        """Acquire or renew a plain lease (the scheduler's) for ``owner``; ``False`` when held by another."""
        return bool(self._call(self._hold, [key], [owner, ttl_ms], replicated=True))

    def release_plain(self, key: str, owner: str) -> None:
        self._call(self._release, [key], [owner])

    def check_in(self, instance: str, timeout_ms: int) -> list[str]:
        """Record this instance's heartbeat at the Redis server's time; remove and return the
        instances silent for ``timeout_ms`` on that clock."""
        _sec, _usec, gone = self._call(
            self._check_in, [keys.instances(self.namespace)], [instance, timeout_ms], replicated=True
        )
        return [_text(g) for g in gone]

    def check_out(self, instance: str) -> None:
        try:
            self._r.zrem(keys.instances(self.namespace), instance)
        except ERRORS as exc:
            log.debug("check-out failed: %s", exc)

    def _call(self, script: Any, k: list[str], args: list[Any], replicated: bool = False) -> Any:
        """One script; ``replicated``: on a Redis Cluster it counts only once a replica has it."""
        if replicated and self._cluster:
            return self._evalsha_many(script, [(k, args)], replicated=True)[0]
        try:
            return script(keys=k, args=args)
        except ERRORS as exc:
            raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from None

    def _write(self, key: str, *command: Any) -> Any:
        """One command that writes ``key``; on a Redis Cluster it counts only once a replica has it."""
        if self._cluster:
            return send_to_masters(self._r, [(key, command)], self._wait_ms)[0]
        try:
            return self._r.execute_command(*command)
        except ERRORS as exc:
            raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from None

    def close(self) -> None:
        self._r.close()

    def __repr__(self) -> str:
        return f"LeaseStore(namespace={self.namespace!r})"


def _ms(sec: Any, usec: Any) -> float:
    """``TIME``'s seconds and microseconds as ms since the epoch."""
    return int(sec) * 1000 + int(usec) / 1000


def _text(b: Any) -> str:
    return b.decode() if isinstance(b, bytes) else str(b)


def inspect_namespace(
    url: str, namespace: str, socket_timeout_s: float = 2.0, limit: int = 1000
) -> dict[str, Any]:
    """What a namespace holds in Redis now, for ``keyedconsumer inspect`` and tests.

    Returns ``{"leases": [{"key", "lid", "owner", "ttl_ms", "fencing_token"}], "parked": [{"key",
    "lid", "depth", "next_due_s", "attempt", "quarantined", "head", "last_error"}], "scheduled": int,
    "scheduled_messages": [{"id", "key", "topic", "due_s"}], "instances": [{"id", "last_seen_s"}],
    "scheduler": owner or None, "quarantined": [key], "now_s": float}``; ``key`` is the Kafka key as
    text (``repr`` of the bytes when not UTF-8) or ``partition:<topic>/<n>`` for a partition's lease,
    ``lid`` its lease id (what :func:`unpark_now` takes); ``attempt`` and ``head`` (``topic[partition]@offset``,
    or ``scheduled <id>``) describe the parked list's first message; times are seconds since the epoch
    on the Redis server's clock (``now_s``: its ``TIME`` now), the clock every due time and check-in
    is kept on. ``last_error`` is ``None`` or ``{"type", "message", "at", "attempt", "time_s"}``: the
    failure that parked the key or that a parked message last ran into (class ``module.QualName``
    and ``str()`` of the exception, each at most
    :data:`~keyedconsumer.sequencing.parking.MAX_ERROR_BYTES` UTF-8 bytes; ``at`` the failed message,
    ``topic[partition]@offset``; ``attempt`` the attempt that failed; ``time_s`` when, on the Redis
    server's clock); it is removed with the key's list. The message is the exception's text, which
    may hold what an attacker put in a record: escape it wherever it is shown.
    At most ``limit`` leases, parked keys and scheduled messages (the earliest due) are listed
    (``SCAN``, never ``KEYS``).

    Raises
    ------
    StoreUnavailable
        Redis did not answer.
    """
    ns = keys.check_namespace(namespace)
    r: Any = connect(url, socket_timeout_s)
    try:
        prefix = keys.lease_prefix(ns)
        leases: list[dict[str, Any]] = []
        parked: list[dict[str, Any]] = []
        due = {m.decode(): sc for m, sc in r.zrange(keys.due(ns), 0, -1, withscores=True)}
        for name in r.scan_iter(match=f"{prefix}*", count=500):
            n = name.decode()
            lid = n[n.find("{") + 1 : n.rfind("}")]
            if lid == keys.SCHED:
                continue
            if n.endswith("}:lease") and len(leases) < limit:
                owner, ttl, fence = r.get(n), r.pttl(n), r.get(keys.fence(ns, lid))
                if owner is not None:
                    leases.append(
                        {
                            "key": _show(lid),
                            "lid": lid,
                            "owner": owner.decode(),
                            "ttl_ms": int(ttl),
                            "fencing_token": int(fence or 0),
                        }
                    )
            elif n.endswith("}:park") and len(parked) < limit:
                sc = due.get(lid)
                parked.append(
                    {
                        "key": _show(lid),
                        "lid": lid,
                        "depth": int(r.llen(n)),
                        "next_due_s": None if sc is None else sc / 1000.0,
                        **_head(r.lindex(n, 0)),
                        "last_error": _last_error(r.hgetall(keys.error(ns, lid))),
                    }
                )
        quarantined = {m.decode() for m in r.smembers(keys.quarantine(ns))}
        for pk in parked:
            pk["quarantined"] = pk["lid"] in quarantined
        sched_owner = r.get(keys.scheduler(ns))
        rows = r.zrange(keys.sched_due(ns), 0, limit - 1, withscores=True)
        entries = r.hmget(keys.sched_entries(ns), [m for m, _ in rows]) if rows else []
        sec, usec = r.time()
        return {
            "leases": leases,
            "parked": parked,
            "scheduled": int(r.zcard(keys.sched_due(ns))),
            "scheduled_messages": [
                {"id": m.decode(), "due_s": sc / 1000.0, **_scheduled(e)}
                for (m, sc), e in zip(rows, entries, strict=True)
            ],
            "instances": [
                {"id": m.decode(), "last_seen_s": sc / 1000.0}
                for m, sc in r.zrange(keys.instances(ns), 0, -1, withscores=True)
            ],
            "scheduler": sched_owner.decode() if sched_owner else None,
            "quarantined": sorted(_show(m) for m in quarantined),
            "now_s": _ms(sec, usec) / 1000.0,
        }
    except ERRORS as exc:
        raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from None
    finally:
        r.close()


def _doc(raw: bytes | None) -> dict[str, Any]:
    """A parked or scheduled entry's JSON fields (``{}``: none or unreadable)."""
    if raw is None:
        return {}
    try:
        doc = json.loads(raw)
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def _head(raw: bytes | None) -> dict[str, Any]:
    doc = _doc(raw)
    if not doc:
        return {"attempt": None, "head": None}
    where = f"scheduled {doc['sid']}" if "sid" in doc else f"{doc.get('t')}[{doc.get('p')}]@{doc.get('o')}"
    return {"attempt": doc.get("a"), "head": where}


def _last_error(h: dict[bytes, bytes]) -> dict[str, Any] | None:
    """A parked key's stored last error (``None``: none stored)."""
    if not h or b"type" not in h:
        return None
    text = {k.decode(): v.decode("utf-8", "replace") for k, v in h.items()}
    try:
        attempt: int | None = int(text.get("attempt", ""))
        time_s: float | None = int(text.get("time_ms", "")) / 1000.0
    except ValueError:
        attempt = time_s = None
    return {
        "type": text["type"],
        "message": text.get("message", ""),
        "at": text.get("at", ""),
        "attempt": attempt,
        "time_s": time_s,
    }


def _scheduled(raw: bytes | None) -> dict[str, Any]:
    doc = _doc(raw)
    key = doc.get("k")
    try:
        lid = None if key is None else keys.lease_id(base64.b64decode(key), "", 0)
    except ValueError:
        lid = None
    return {"key": None if lid is None else _show(lid), "topic": doc.get("t")}


def _show(lid: str) -> str:
    if lid.startswith("k."):
        raw = bytes.fromhex(lid[2:])
        try:
            return raw.decode()
        except UnicodeDecodeError:
            return repr(raw)
    if lid.startswith("p."):
        _, topic_hex, part = lid.split(".", 2)
        return f"partition:{bytes.fromhex(topic_hex).decode(errors='replace')}/{part}"
    return lid
