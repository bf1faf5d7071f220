"""Leases with fencing tokens, parked and scheduled messages, on Redis (with
:mod:`~keyedconsumer.sequencing.connection`, the only modules that import ``redis``; the Lua
scripts are in :mod:`~keyedconsumer.sequencing.scripts`).

A lease follows redis-py's ``lock.py``: ``SET NX PX`` with a random owner token; renew and release
compare the token atomically. Acquiring also draws the lease's fencing token from the counter of
its key's hash slot (:func:`~keyedconsumer.sequencing.keys.slot_fence`), in the same script, and
keeps it beside the lease, with the lease's TTL: nothing of a key outlives its lease, its parked
list and its markers. A slot's tokens never repeat or go down: after a Redis restart (the store
refuses to start unless Redis persists every write before answering, ``appendonly yes`` and
``appendfsync always``, unless ``require_durable=False``), and after a failover to a replica that
lagged (the counter jumps past the old master's range: see :mod:`~keyedconsumer.sequencing.scripts`).

On a Redis Cluster, every pipelined script goes per master on plain connections
(:func:`~keyedconsumer.sequencing.connection.send_to_masters`), followed by ``WAIT 1``. What a
``WAIT`` that times out means depends on the write (docs/guarantees.md): an acquire counts only once
a replica has it (until then it is asked again by the same owner, which gets the same lease and
token back); a renewal, the scheduler's lease and a check-in count on the master's answer (a
failover that loses them is covered by the new master's quiet time); parking, scheduling and
moving scheduled messages in, due times and quarantine count only once a replica has them (else
:class:`StoreUnavailable`, and the caller sends them again). Releases, settling finished parked
messages and the parked totals do not wait: losing one in a failover delays a key by a lease TTL or
runs a message once more, within at-least-once.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

import redis

from . import keys, scripts
from .connection import (
    ERRORS,
    Sent,
    StoreUnavailable,
    check_replicas,
    connect,
    group_by_master,
    is_cluster,
    send_to_masters,
    unavailable,
)
from .inspect import inspect_namespace

__all__ = ["LeaseStore", "LastError", "StoreUnavailable", "connect", "inspect_namespace"]

log = logging.getLogger("keyedconsumer.redis")

#: Reading a setting with ``CONFIG GET``: Redis did not answer or refused, or the answer lacks it.
_CONFIG_ERRORS: tuple[type[Exception], ...] = (*ERRORS, KeyError, ValueError)


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

    #: Leases acquired by one script call (one node's batch is cut into calls of this many).
    ACQUIRE_BATCH = 256
    #: Leases renewed or released by one script call (one node's batch is cut into calls of this many).
    LEASE_BATCH = 512
    #: ``cluster-node-timeout`` assumed when ``CONFIG GET`` is refused (Redis's default, ms).
    DEFAULT_NODE_TIMEOUT_MS = 15_000

    def __init__(self, url: str, namespace: str, socket_timeout_s: float = 2.0) -> None:
        self.namespace = keys.check_namespace(namespace)
        self._r: Any = connect(url, socket_timeout_s)
        self._cluster = is_cluster(self._r)
        self._wait_ms = max(10, int(socket_timeout_s * 250))
        self._node_timeout_ms: int | None = None if self._cluster else 0
        #: ``False`` from a call Redis did not answer (or answered READONLY, or with a slot moved)
        #: until the next call it answers; a write that a replica did not acknowledge in time counts
        #: as answered (see :attr:`available`).
        self._answered = True
        register = self._r.register_script
        self._acquire = register(scripts.ACQUIRE)
        self._renew_many = register(scripts.RENEW_MANY)
        self._release = register(scripts.RELEASE)
        self._release_many = register(scripts.RELEASE_MANY)
        self._park = register(scripts.PARK)
        self._fetch = register(scripts.FETCH)
        self._pop_many = register(scripts.POP_MANY)
        self._replace_head = register(scripts.REPLACE_HEAD)
        self._zrem_if = register(scripts.ZREM_IF)
        self._schedule = register(scripts.SCHEDULE)
        self._move_in = register(scripts.MOVE_IN)
        self._unschedule = register(scripts.UNSCHEDULE)
        self._hold = register(scripts.HOLD)
        self._time = register(scripts.TIME)
        self._due_keys = register(scripts.DUE_KEYS)
        self._due_scheduled = register(scripts.DUE_SCHEDULED)
        self._check_in = register(scripts.CHECK_IN)
        self._release_quarantine = register(scripts.RELEASE_QUARANTINE)
        self._due_now = register(scripts.DUE_NOW)
        self._head_due_now = register(scripts.HEAD_DUE_NOW)

    @property
    def available(self) -> bool:
        """Whether Redis answered the last call: ``False`` while it does not answer, answers
        ``READONLY`` (a failover behind one address) or, on a cluster, a slot moved; a write that no
        replica acknowledged in time was answered (the replica is slow, Redis is up)."""
        return self._answered

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
            raise self._unavailable(exc) from None
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

    # -- leases ----------------------------------------------------------------------------------

    def acquire(self, requests: Sequence[tuple[str, str]], ttl_ms: int) -> list[tuple[int, int]]:
        """Try to acquire ``[(lease id, owner token)]`` in one round trip per Redis node.

        The token is drawn from the counter of the key's hash slot (see
        :mod:`~keyedconsumer.sequencing.scripts`): above every token issued for the key before, also
        across a failover to a replica that lagged. An owner that asks again for a lease it holds
        gets its lease extended and the same token (a reply lost on the way is harmless when the
        same owner asks again).

        Returns, per request, ``(token, length of the key's parked list)``: ``token`` > 0, the lease
        is held with that fencing token; < 0, ``-(ms)`` before it is worth asking again (another
        owner's lease has that long left, or the slot's new master grants no lease yet: its quiet
        time after a failover); 0, on a Redis Cluster, the lease is held on its master but no
        replica acknowledged it within the ``WAIT``: it does not count yet, ask again (with the same
        owner: the same token comes back, and counts once a replica has it).

        Raises
        ------
        StoreUnavailable
            A Redis node did not answer (what the others granted is returned to the same owners
            when they ask again).
        """
        if not requests:
            return []
        ns, ttl = self.namespace, int(ttl_ms)
        quiet = ttl + self._quiet_margin_ms()
        args = [
            (keys.lease(ns, lid), keys.fence(ns, lid), keys.park(ns, lid), keys.slot_fence(ns, lid), owner)
            for lid, owner in requests
        ]
        chunks = self._batches([a[0] for a in args], self.ACQUIRE_BATCH)
        calls = [
            ((), (ttl, quiet, 1 if self._cluster else 0, *(x for i in c for x in args[i]))) for c in chunks
        ]
        sent = self._send(self._acquire, calls, wait=True, route=[args[c[0]][0] for c in chunks])
        out: list[tuple[int, int]] = [(0, 0)] * len(requests)
        for c, reply, acked in zip(chunks, sent.replies, sent.acked, strict=True):
            if isinstance(reply, StoreUnavailable):
                raise reply
            for i, (token, depth) in zip(c, reply, strict=True):
                token = int(token)
                out[i] = (token if token < 0 or acked else 0, int(depth))
        return out

    def renew(self, requests: Sequence[tuple[str, str]], ttl_ms: int) -> list[bool | None]:
        """Extend ``[(lease id, owner token)]`` by ``ttl_ms``; per request ``True`` (extended from
        the time of the call), ``False`` (no longer ours) or ``None`` (its Redis node did not
        answer: unknown, the lease stays valid until its last confirmed renewal's TTL runs out).
        One script call per :data:`LEASE_BATCH` leases of one node (``RENEW_MANY``).

        A renewal counts on its master's answer alone (no ``WAIT``): if a failover loses it, the new
        master grants no lease of the slot until this one has ended (its quiet time).

        Raises
        ------
        StoreUnavailable
            No Redis node answered.
        """
        chunks, sent = self._send_leases(self._renew_many, requests, (int(ttl_ms),))
        if sent.replies and all(isinstance(x, StoreUnavailable) for x in sent.replies):
            raise sent.replies[0]
        out: list[bool | None] = [None] * len(requests)
        for c, reply in zip(chunks, sent.replies, strict=True):
            if not isinstance(reply, StoreUnavailable):
                for i, ok in zip(c, reply, strict=True):
                    out[i] = bool(ok)
        return out

    def release(self, requests: Sequence[tuple[str, str]]) -> list[bool]:
        """Release ``[(lease id, owner token)]`` (the lease and its token); ``False`` where it was no
        longer ours. One script call per :data:`LEASE_BATCH` leases of one node (``RELEASE_MANY``).

        Raises
        ------
        StoreUnavailable
            A Redis node did not answer.
        """
        chunks, sent = self._send_leases(self._release_many, requests, ())
        out = [False] * len(requests)
        for c, reply in zip(chunks, sent.strict(), strict=True):
            for i, ok in zip(c, reply, strict=True):
                out[i] = bool(ok)
        return out

    def _send_leases(
        self, script: Any, requests: Sequence[tuple[str, str]], head: tuple[Any, ...]
    ) -> tuple[list[list[int]], Sent]:
        """``script`` (``RENEW_MANY`` or ``RELEASE_MANY``) over ``[(lease id, owner token)]``: the
        requests grouped by the node of their lease's slot (a Redis Cluster) and cut into calls of
        :data:`LEASE_BATCH`, each call's ARGV ``head`` then (lease key, fence key, owner) per lease.
        Returns the requests' indexes per call and what :meth:`_send` got per call."""
        if not requests:
            return [], Sent([], [])
        ns = self.namespace
        args = [(keys.lease(ns, lid), keys.fence(ns, lid), owner) for lid, owner in requests]
        chunks = self._batches([a[0] for a in args], self.LEASE_BATCH)
        calls = [((), (*head, *(x for i in c for x in args[i]))) for c in chunks]
        return chunks, self._send(script, calls, wait=False, route=[args[c[0]][0] for c in chunks])

    def _batches(self, lease_keys: Sequence[str], size: int) -> list[list[int]]:
        """The indexes of ``lease_keys`` in calls of at most ``size``, each call's keys on one node
        (on a Redis Cluster grouped by the master of each key's slot; one Redis: one group).

        Raises
        ------
        StoreUnavailable
            The cluster's slot map could not be read.
        """
        n = len(lease_keys)
        groups = group_by_master(self._r, lease_keys) if self._cluster else [list(range(n))]
        return [g[i : i + size] for g in groups for i in range(0, len(g), size)]

    def fencing_token(self, lid: str) -> int:
        """The fencing token of the key's lease while it is held (0: not held)."""
        try:
            return int(self._r.get(keys.fence(self.namespace, lid)) or 0)
        except ERRORS as exc:
            raise self._unavailable(exc) from None

    def _quiet_margin_ms(self) -> int:
        """How long after a failover an old master may still take writes, in ms, added to the lease
        TTL for a new master's quiet time: on a Redis Cluster its ``cluster-node-timeout`` (a master
        cut off from the majority stops taking writes after it), read once (the largest of the
        nodes'); on a single Redis 0 (the switch that promotes a replica must stop the old master
        first, docs/guarantees.md)."""
        if self._node_timeout_ms is None:
            try:
                found = self._r.config_get("cluster-node-timeout", target_nodes=self._r.ALL_NODES)
                values = found.values() if "cluster-node-timeout" not in found else [found]
                self._node_timeout_ms = max(int(v["cluster-node-timeout"]) for v in values)
            except _CONFIG_ERRORS as exc:  # CONFIG renamed or refused (a managed Redis)
                log.info(
                    "cluster-node-timeout not readable (%s): assuming %d ms",
                    exc,
                    self.DEFAULT_NODE_TIMEOUT_MS,
                )
                self._node_timeout_ms = self.DEFAULT_NODE_TIMEOUT_MS
        return self._node_timeout_ms

    def _send(
        self,
        script: Any,
        calls: Sequence[tuple[Sequence[str], Sequence[Any]]],
        wait: bool,
        route: Sequence[str] | None = None,
    ) -> Sent:
        """One ``EVALSHA`` of ``script`` per ``(keys, args)``, pipelined (no MULTI: each script is
        atomic on its own; on a Redis Cluster each goes to the node that serves its first key's
        slot, or ``route``'s: one slot per call, see :mod:`~keyedconsumer.sequencing.keys`, or
        several slots of one node for the acquire script). ``wait``: on a Redis Cluster each
        master's calls are followed by ``WAIT`` (:func:`send_to_masters`).

        Plain ``EVALSHA`` commands cost about half of redis-py's ``Script`` objects in a pipeline
        (which also send ``SCRIPT EXISTS`` on each execute, and which redis-py's cluster pipeline
        refuses). A Redis that lost its script cache (a restart, a replica promoted by a failover)
        answers ``NOSCRIPT``: the script is loaded and the calls that answered ``NOSCRIPT`` (they
        did not run) are sent once more.

        Raises
        ------
        StoreUnavailable
            A single Redis did not answer, answered an error, or lost the script again right after
            it was loaded (on a cluster a failing master's calls get a :class:`StoreUnavailable` as
            their reply instead).
        """
        if not calls:
            return Sent([], [])
        sha = script.sha
        if self._cluster:  # per master, on plain connections (and WAIT)
            keys_of = route or [k[0] for k, _a in calls]
            cmds = [(rk, ("EVALSHA", sha, len(k), *k, *a)) for rk, (k, a) in zip(keys_of, calls, strict=True)]
            sent = send_to_masters(self._r, cmds, self._wait_ms if wait else None, script.script)
            self._answered = not any(isinstance(x, StoreUnavailable) for x in sent.replies)
            return sent
        replies: list[Any] = [None] * len(calls)
        todo = list(range(len(calls)))
        for attempt in (1, 2):
            try:
                pipe = self._r.pipeline(transaction=False)
                for i in todo:
                    k, a = calls[i]
                    pipe.execute_command("EVALSHA", sha, len(k), *k, *a)
                got = pipe.execute(raise_on_error=False)
            except ERRORS as exc:
                raise self._unavailable(exc) from None
            for i, reply in zip(todo, got, strict=True):
                replies[i] = reply
            todo = [i for i in todo if isinstance(replies[i], redis.exceptions.NoScriptError)]
            if not todo:
                break
            if attempt == 2:
                raise self._unavailable(StoreUnavailable("Redis lost its scripts twice in a row"))
            try:
                self._r.script_load(script.script)
            except ERRORS as exc:
                raise self._unavailable(exc) from None
        for reply in replies:
            if isinstance(reply, Exception):
                raise self._unavailable(reply)
        self._answered = True
        return Sent(replies, [True] * len(replies))

    def _evalsha_many(
        self, script: Any, calls: Sequence[tuple[Sequence[str], Sequence[Any]]], replicated: bool = False
    ) -> list[Any]:
        """:meth:`_send`, every call ran and, with ``replicated`` on a Redis Cluster, was
        acknowledged by a replica.

        Raises
        ------
        StoreUnavailable
            Redis did not answer, or (``unacknowledged``) a replica did not acknowledge in time: the
            write is on its master but does not count; the caller sends it again.
        """
        return self._send(script, calls, wait=replicated).strict()

    def _unavailable(self, exc: BaseException) -> StoreUnavailable:
        """Redis did not answer (or answered an error): marked unavailable, and a connection that
        answered ``READONLY`` is dropped (:func:`~keyedconsumer.sequencing.connection.unavailable`)."""
        self._answered = False
        return exc if isinstance(exc, StoreUnavailable) else unavailable(self._r, exc)

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

        Redis answers after the write is on disk (``appendfsync always``, checked at start). The
        key's "already parked" markers live while its list holds anything, and ``seen_ttl_ms`` after
        it empties (:meth:`pop_many`).

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
        head and ``owner`` holds the lease (an emptied list takes its last error along, and its
        "already parked" markers start their retention). Returns how many were removed (-1: not the
        owner)."""
        ns = self.namespace
        k = [
            keys.lease(ns, lid),
            keys.park(ns, lid),
            keys.pbytes(ns, lid),
            keys.error(ns, lid),
            keys.seen(ns, lid),
        ]
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
            raise self._unavailable(exc) from None
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
        return bool(self._call(self._hold, [key], [owner, ttl_ms]))

    def release_plain(self, key: str, owner: str) -> None:
        """Release a plain lease (the scheduler's) if ``owner`` holds it."""
        self._call(self._release, [key], [owner])

    def check_in(self, instance: str, timeout_ms: int) -> list[str]:
        """Record this instance's heartbeat at the Redis server's time; remove and return the
        instances silent for ``timeout_ms`` on that clock."""
        _sec, _usec, gone = self._call(
            self._check_in, [keys.instances(self.namespace)], [instance, timeout_ms]
        )
        return [_text(g) for g in gone]

    def check_out(self, instance: str) -> None:
        try:
            self._r.zrem(keys.instances(self.namespace), instance)
        except ERRORS as exc:
            log.debug("check-out failed: %s", exc)

    def _call(self, script: Any, k: list[str], args: list[Any], replicated: bool = False) -> Any:
        """One script (:meth:`_evalsha_many`); ``replicated``: on a Redis Cluster it counts only
        once a replica has it."""
        return self._evalsha_many(script, [(k, args)], replicated)[0]

    def _write(self, key: str, *command: Any) -> Any:
        """One command that writes ``key``; on a Redis Cluster it counts only once a replica has it."""
        if self._cluster:
            sent = send_to_masters(self._r, [(key, command)], self._wait_ms)
            self._answered = not isinstance(sent.replies[0], StoreUnavailable)
            return sent.strict()[0]
        try:
            reply = self._r.execute_command(*command)
        except ERRORS as exc:
            raise self._unavailable(exc) from None
        self._answered = True
        return reply

    def close(self) -> None:
        self._r.close()

    def __repr__(self) -> str:
        return f"LeaseStore(namespace={self.namespace!r})"


def _ms(sec: Any, usec: Any) -> float:
    """``TIME``'s seconds and microseconds as ms since the epoch."""
    return int(sec) * 1000 + int(usec) / 1000


def _text(b: Any) -> str:
    return b.decode() if isinstance(b, bytes) else str(b)
