"""The Lua scripts of the Redis store (:mod:`~keyedconsumer.sequencing.store` sends them).

Each script is atomic on its Redis (or on the node of its hash slot) and safe to send again after a
reply was lost (docs/guarantees.md, "A reply lost after the command ran"): a lease asked again by
the same owner returns the same lease and token; an entry parked again is taken, not added; a head
removed or replaced again no longer matches and changes nothing.
"""

from __future__ import annotations

__all__ = [
    "ACQUIRE",
    "RENEW_MANY",
    "RELEASE",
    "RELEASE_MANY",
    "PARK",
    "FETCH",
    "POP_MANY",
    "REPLACE_HEAD",
    "ZREM_IF",
    "SCHEDULE",
    "MOVE_IN",
    "UNSCHEDULE",
    "TIME",
    "DUE_KEYS",
    "DUE_SCHEDULED",
    "CHECK_IN",
    "RELEASE_QUARANTINE",
    "HEAD_DUE_NOW",
    "DUE_NOW",
    "HOLD",
    "TOKEN_SPAN",
]

#: Fencing tokens of one hash slot issued under one master (one config epoch of a Redis Cluster,
#: one replication id of a single Redis) stay below the next master's first token as long as fewer
#: than this many are issued in the slot between two master changes. Tokens stay below 2**53.
TOKEN_SPAN = 2**32

# Leases (redis-py's lock.py: SET NX PX with a random owner, compare-and-PEXPIRE, compare-and-DEL)
# with fencing tokens drawn from the counter of the key's hash slot (keys.slot_fence), so nothing of
# a key outlives its lease. One script per node acquires a batch of leases: the keys are passed in
# ARGV (allow-cross-slot-keys: each lease key and its slot's counter share a slot, but the batch
# spans slots of one node) and the node's identity is read once per batch.
#
# The node's identity: on a Redis Cluster its config epoch (CLUSTER INFO cluster_my_epoch), which a
# replica promoted by a failover (a forced TAKEOVER too) or a node receiving a slot raises above
# that of every master before it; on a single Redis its replication id (INFO replication), which
# changes when a replica is promoted (REPLICAOF NO ONE), when Redis restarts and when a first
# replica attaches. A slot counter records the identity it last issued under (field m). When it
# changes, the counter jumps: on a cluster to at least epoch * TOKEN_SPAN, on a single Redis by
# TOKEN_SPAN, above every token the previous master could have issued in the slot, even those it
# answered and then lost in the failover (a replica that lagged). And a promoted master (a cluster
# epoch that rose over a counter it already had; a single Redis whose replication id was shifted by
# a promotion: second_repl_offset set) grants no new lease in the slot for ARGV[2] ms (q): a lease
# the old master granted or renewed and lost has ended at its holder by then, since a holder never
# counts its lease past the time it asked + the TTL.
#
# A key's token is also kept above what its fence key holds (a lease being replaced, or a per-key
# counter left by an earlier version of this store), so a key's tokens never go down across either.
#
# ARGV[1] ttl ms, [2] quiet ms, [3] '1' on a Redis Cluster, then per request (lease key, fence key,
# park key, slot counter key, owner) -> per request {token > 0, or -(ms until it may be asked again:
# another owner's lease, at least 1, or the slot's quiet time), length of the key's parked list}.
ACQUIRE = """#!lua flags=allow-cross-slot-keys
local ttl, quiet, span = ARGV[1], tonumber(ARGV[2]), 4294967296
local epoch, rid, promoted = nil, nil, false
if ARGV[3] == '1' then
  epoch = tonumber(string.match(redis.call('CLUSTER', 'INFO'), 'cluster_my_epoch:(%d+)'))
else
  local info = redis.call('INFO', 'replication')
  rid = string.match(info, 'master_replid:(%x+)')
  promoted = string.match(info, 'second_repl_offset:(%-?%d+)') ~= '-1'
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function issue(lease, fence, slot, owner)
  local s = redis.call('HMGET', slot, 'm', 'n', 'q')
  local n, q = tonumber(s[2] or '0'), tonumber(s[3] or '0')
  if epoch then
    if s[1] == false or tonumber(s[1]) < epoch then
      if s[1] and quiet > 0 then q = math.max(q, now + quiet) end
      n = math.max(n, epoch * span)
      redis.call('HSET', slot, 'm', string.format('%d', epoch), 'n', string.format('%d', n), 'q', string.format('%d', q))
    end
  elseif s[1] ~= rid then
    if s[1] then
      n = n + span
      if promoted and quiet > 0 then q = math.max(q, now + quiet) end
    end
    redis.call('HSET', slot, 'm', rid, 'n', string.format('%d', n), 'q', string.format('%d', q))
  end
  if now < q then return -(q - now) end
  n = math.max(n, tonumber(redis.call('GET', fence) or '0')) + 1
  redis.call('HSET', slot, 'n', string.format('%d', n))
  redis.call('SET', lease, owner, 'PX', ttl)
  redis.call('SET', fence, string.format('%d', n), 'PX', ttl)
  return n
end
local out = {}
for i = 4, #ARGV, 5 do
  local lease, fence, park, slot, owner = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4]
  local depth = redis.call('LLEN', park)
  local cur = redis.call('GET', lease)
  local token
  if cur == owner then
    token = tonumber(redis.call('GET', fence) or '0')
    if token > 0 then
      redis.call('PEXPIRE', lease, ttl)
      redis.call('PEXPIRE', fence, ttl)
    else
      token = issue(lease, fence, slot, owner)
    end
  elseif cur then
    token = -math.max(1, redis.call('PTTL', lease))
  else
    token = issue(lease, fence, slot, owner)
  end
  out[#out + 1] = {token, depth}
end
return out
"""
# KEYS[1] lease, [2] its fence (or none: a plain lease); ARGV[1] owner -> 1 released, 0 not ours
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', unpack(KEYS))
  return 1
end
return 0
"""
# Renewing and releasing key leases, a batch of one node in one script call (as ACQUIRE: the keys
# are in ARGV, allow-cross-slot-keys; each lease key and its fence share a slot, the batch spans
# slots of one node). One EVALSHA per lease cost the client more than the leases' Redis work
# (bench/README.md, "Why the goals are still missed: profiles of b257e29").
# RENEW_MANY: ARGV[1] ttl ms, then per lease (lease key, fence key, owner) -> per lease 1 renewed
# (both keys' TTL set again), 0 not ours any more. RELEASE_MANY: per lease (lease key, fence key,
# owner) -> per lease 1 released (both keys deleted), 0 not ours.
RENEW_MANY = """#!lua flags=allow-cross-slot-keys
local ttl, out = ARGV[1], {}
for i = 2, #ARGV, 3 do
  if redis.call('GET', ARGV[i]) == ARGV[i + 2] then
    redis.call('PEXPIRE', ARGV[i + 1], ttl)
    out[#out + 1] = redis.call('PEXPIRE', ARGV[i], ttl)
  else
    out[#out + 1] = 0
  end
end
return out
"""
RELEASE_MANY = """#!lua flags=allow-cross-slot-keys
local out = {}
for i = 1, #ARGV, 3 do
  if redis.call('GET', ARGV[i]) == ARGV[i + 2] then
    redis.call('DEL', ARGV[i], ARGV[i + 1])
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
"""


# Parking (the Redis-parked retries of pgujjeti/go-distr-ep): every write checks that the caller
# still holds the key's lease.
# The "already parked" markers (seen) live while the key's list holds anything, and for the seen
# retention (kept in the hash's ttl field) after it empties: a message parked, then delivered again
# by Kafka (its offset was not committed yet: a crash, a rebalance) is recognised however long its
# key stays parked (a long back-off, a quarantine).
# KEYS[1] lease, [2] park, [3] pbytes, [4] seen, [5] error; ARGV[1] owner, [2] seen retention ms,
# [3] max messages, [4] max bytes, [5] conflate (1 | 0), [6] error class ('' = no error), [7] error
# message, [8] the failed message (topic[partition]@offset), [9] its attempt, then (field, offset,
# entry) triples in order. Entries whose offset is not above the field's highest parked offset are
# already parked (a re-delivery): skipped. Entries are taken in order while the list has room (an
# empty list takes at least one). With conflate, an entry appended to a list of two or more first
# removes the entries behind the list's head (returned: conflated, replaced by a newer one). The
# error, if any, is stored with the time of the park on the Redis server's clock (TIME), while the
# list holds anything (a re-delivery of a key drained meanwhile parks nothing and leaves no error).
# -> {1 | 0 not the owner, length before, entries taken (appended or skipped), bytes added (may be
#     negative), appended, {entries conflated, in list order}}
PARK = """
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
if taken > 0 then
  redis.call('HSET', KEYS[4], 'ttl', ARGV[2])
  if n > 0 then redis.call('PERSIST', KEYS[4]) else redis.call('PEXPIRE', KEYS[4], ARGV[2]) end
end
if add ~= 0 then redis.call('INCRBY', KEYS[3], add) end
if n > 0 and ARGV[6] ~= '' then
  local t = redis.call('TIME')
  redis.call('HSET', KEYS[5], 'type', ARGV[6], 'message', ARGV[7], 'at', ARGV[8], 'attempt', ARGV[9],
             'time_ms', string.format('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)))
end
return {1, before, taken, add, appended, gone}
"""
# KEYS[1] lease, [2] park, [3] pbytes; ARGV[1] owner, [2] n, [3] conflate (1 | 0) -> {1, the first
# n entries, length, {entries conflated}} | {0, {}, 0, {}}. With conflate, a list of three or more
# keeps its head and its newest entry: those between are removed and returned (conflated).
FETCH = """
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
# KEYS[1] lease, [2] park, [3] pbytes, [4] error, [5] seen; ARGV[1] owner, ARGV[2..] the entries
# expected at the head, in order -> entries removed (they are removed while they match the head), or
# -1: not the owner. An emptied list takes its byte count and its last error along, and its markers
# start their retention.
POP_MANY = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
local n, b = 0, 0
for i = 2, #ARGV do
  if redis.call('LINDEX', KEYS[2], 0) ~= ARGV[i] then break end
  redis.call('LPOP', KEYS[2])
  n = n + 1
  b = b + #ARGV[i]
end
if redis.call('LLEN', KEYS[2]) == 0 then
  redis.call('DEL', KEYS[3], KEYS[4])
  local ttl = redis.call('HGET', KEYS[5], 'ttl')
  if ttl then redis.call('PEXPIRE', KEYS[5], ttl) end
elseif b > 0 then
  redis.call('DECRBY', KEYS[3], b)
end
return n
"""
# KEYS[1] lease, [2] park, [3] pbytes, [4] error; ARGV[1] owner, [2] head entry expected, [3] its
# replacement, [4] error class ('' = none), [5] message, [6] the failed message, [7] its attempt
# -> {1, bytes added (may be negative)} | {0, 0}; the error is stored with the Redis server's time.
REPLACE_HEAD = """
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
ZREM_IF = """
local cur = redis.call('ZSCORE', KEYS[1], ARGV[1])
if cur and tonumber(cur) == tonumber(ARGV[2]) then return redis.call('ZREM', KEYS[1], ARGV[1]) end
return 0
"""
# KEYS[1] sdue, [2] entries; ARGV[1] id, [2] due ms, [3] entry -> 1
SCHEDULE = """
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
return 1
"""
# A due scheduled message joins its key's list (no lease needed: an append never races a run,
# which needs the lease; the due set was updated first). KEYS[1] park, [2] pbytes, [3] seen;
# ARGV[1] seen field, [2] entry, [3] seen retention ms (after the list empties)
# -> {1 appended | 0 already, length before}
MOVE_IN = """
local before = redis.call('LLEN', KEYS[1])
if redis.call('HEXISTS', KEYS[3], ARGV[1]) == 1 then return {0, before} end
redis.call('RPUSH', KEYS[1], ARGV[2])
redis.call('HSET', KEYS[3], ARGV[1], 1, 'ttl', ARGV[3])
redis.call('PERSIST', KEYS[3])
redis.call('INCRBY', KEYS[2], #ARGV[2])
return {1, before}
"""
# KEYS[1] sdue, [2] entries; ARGV[1] id -> 1 removed | 0 was not scheduled
UNSCHEDULE = """
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
TIME = "return redis.call('TIME')"
# KEYS[1] due; ARGV[1] limit -> {seconds, microseconds, {member, score, ...} due now, earliest first}
DUE_KEYS = (
    _NOW
    + """
return {t[1], t[2], redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'WITHSCORES', 'LIMIT', 0, tonumber(ARGV[1]))}
"""
)
# KEYS[1] sdue, [2] entries; ARGV[1] limit -> {seconds, microseconds, {id, due ms, ...} due now,
# {their entries (nil: removed meanwhile)}}
DUE_SCHEDULED = (
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
CHECK_IN = (
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
RELEASE_QUARANTINE = (
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
HEAD_DUE_NOW = """
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
DUE_NOW = (
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
HOLD = """
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
if cur then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
