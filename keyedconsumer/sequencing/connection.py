"""Connecting to one Redis or to a Redis Cluster, and the cluster's writes that must survive a failover.

A Redis Cluster replicates asynchronously: a master answers a write before any replica has it, and
a replica promoted after the master died has only what reached it. A fencing token issued by the
old master and lost that way would be issued a second time; a parked message lost that way would
be gone although its offset counted done. So on a cluster, every write the sequencer relies on
(see :mod:`~keyedconsumer.sequencing.store`) is sent on one connection to
the master of its slot followed by ``WAIT 1 <timeout>``, and it counts only when at least one
replica acknowledged it (Redis documents ``WAIT`` in https://redis.io/docs/latest/commands/wait/;
Redis 7.0 has no ``WAITAOF``). Otherwise the call raises :class:`StoreUnavailable`, the caller
tries again later, and whatever the unacknowledged write did is never used: a token not returned
was never issued, a message not acknowledged as parked is still held by the consumer.

What this promises and what it does not is in docs/redis.md ("Redis Cluster"): one replica
per master is assumed, so a promoted replica is the one that acknowledged; with more replicas per
master, Redis may promote one that did not.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote

import redis
from redis.cluster import ClusterNode, RedisCluster

from .. import hermetic
from .config import CLUSTER_SCHEMES

__all__ = [
    "CLUSTER_SCHEMES",
    "ERRORS",
    "StoreUnavailable",
    "connect",
    "is_cluster",
    "send_to_masters",
    "check_replicas",
]

log = logging.getLogger("keyedconsumer.redis")


#: Replicas that must acknowledge a write on a cluster before it counts (``WAIT``'s first argument).
REPLICA_ACKS = 1

#: What redis-py raises when Redis does not answer or refuses: its ``RedisError`` family, and the
#: cluster client's ``RedisClusterException`` (not a ``RedisError``: raised e.g. when no startup
#: node answers while the client refreshes its slot map, as when this host is cut off).
ERRORS: tuple[type[Exception], ...] = (redis.RedisError, redis.exceptions.RedisClusterException)


class StoreUnavailable(Exception):
    """Redis did not answer (connection refused, timeout, loading, a failover under way), or on a
    Redis Cluster no replica acknowledged a write in time; try again later."""


def connect(url: str, socket_timeout_s: float) -> Any:
    """A redis-py client for ``url``: ``redis.Redis`` for ``redis://`` / ``rediss://`` /
    ``unix://``, ``redis.cluster.RedisCluster`` for the :data:`CLUSTER_SCHEMES`.

    Raises
    ------
    ValueError
        A cluster URL without a host, with a port that is not a number, or naming a database
        other than 0 (a Redis Cluster has only database 0).
    """
    scheme, sep, rest = url.partition("://")
    hermetic.check(
        "a Redis client (RedisSequencer)", f"{scheme}://{rest.partition('/')[0].rpartition('@')[2]}"
    )
    if not sep or scheme not in CLUSTER_SCHEMES:
        return redis.Redis.from_url(
            url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s
        )
    netloc, _, path = rest.partition("/")
    path = path.split("?", 1)[0]
    if path not in ("", "0"):
        raise ValueError(f"a Redis Cluster has only database 0, the URL names {path!r}")
    creds, _, hosts = netloc.rpartition("@")
    username, _, password = creds.partition(
        ":"
    )  # "user@", ":password@" or "user:password@", as redis-py reads them
    nodes = []
    for hp in hosts.split(","):
        host, _, port = hp.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"a Redis Cluster URL lists host:port startup nodes, got {hp!r}")
        nodes.append(ClusterNode(host.strip("[]"), int(port)))  # type: ignore[no-untyped-call]
    return RedisCluster(
        startup_nodes=nodes,
        username=unquote(username) or None,
        password=unquote(password) or None,
        ssl=scheme == "rediss+cluster",
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=socket_timeout_s,
    )


def is_cluster(r: Any) -> bool:
    """``True`` for a client of :func:`connect` that talks to a Redis Cluster."""
    return isinstance(r, RedisCluster)


def send_to_masters(
    r: Any, commands: Sequence[tuple[str, Sequence[Any]]], wait_ms: int | None, script: str | None = None
) -> list[Any]:
    """Run ``[(routing key, command)]`` on a Redis Cluster, one pipeline per master; with ``wait_ms``
    each counts only once a replica has it.

    The commands are grouped by the master of their routing key's slot; each master gets its
    commands (and, with ``wait_ms``, then ``WAIT 1 wait_ms``: it counts the replicas that
    acknowledged every earlier write of its connection) in one pipeline on one connection, a plain
    client's pipeline: redis-py's cluster pipeline asks the server ``COMMAND GETKEYS`` for every
    ``EVALSHA``, one more round trip each. The masters are asked one after the other. A command must be safe to send again (every lease and parking script is: an
    owner that asks again gets the same lease and token, an entry parked again is taken, not added).

    Parameters
    ----------
    r:
        The cluster client (:func:`connect`).
    commands:
        ``(key whose slot routes the command, command and arguments)``, e.g.
        ``("kc:{k.61}:lease", ("EVALSHA", sha, 3, ...))``.
    wait_ms:
        ``WAIT``'s timeout, milliseconds; ``None``: no ``WAIT`` (a write that may be lost in a failover).
    script:
        The Lua source of the ``EVALSHA`` commands, loaded on a master that answers ``NOSCRIPT``
        (a replica promoted by a failover has an empty script cache) before its commands are sent
        once more.

    Returns
    -------
    list
        The replies, in the order of ``commands``.

    Raises
    ------
    StoreUnavailable
        A master did not answer or no longer serves the slot (a failover: the client's slot map is
        refreshed for the next call), a reply was an error, or fewer than :data:`REPLICA_ACKS`
        replicas acknowledged within ``wait_ms``. The commands of masters asked earlier in the call
        ran and are replicated; the caller sends them all again.
    """
    groups: dict[str, tuple[Any, list[int]]] = {}
    try:
        for i, (key, _cmd) in enumerate(commands):
            node = r.get_node_from_key(key)
            groups.setdefault(node.name, (node, []))[1].append(i)
    except ERRORS as exc:
        _refresh(r)
        raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from None
    out: list[Any] = [None] * len(commands)
    for node, idx in groups.values():
        replies = _send_to_master(r, node, [commands[i][1] for i in idx], wait_ms, script)
        for i, reply in zip(idx, replies, strict=True):
            out[i] = reply
    return out


def _send_to_master(
    r: Any, node: Any, cmds: list[Sequence[Any]], wait_ms: int | None, script: str | None
) -> list[Any]:
    client: Any = r.get_redis_connection(node)
    for attempt in (1, 2):
        try:
            pipe = client.pipeline(transaction=False)
            for cmd in cmds:
                pipe.execute_command(*cmd)
            if wait_ms is not None:
                pipe.execute_command("WAIT", REPLICA_ACKS, wait_ms)
            replies = pipe.execute(raise_on_error=False)
        except ERRORS as exc:  # the master is gone or unreachable
            _refresh(r)
            raise StoreUnavailable(f"{type(exc).__name__} from {node.name}: {exc}") from None
        errors = [x for x in replies if isinstance(x, Exception)]
        if (
            errors
            and script is not None
            and attempt == 1
            and all(isinstance(x, redis.exceptions.NoScriptError) for x in errors)
        ):
            try:
                client.script_load(script)
            except ERRORS as exc:
                raise StoreUnavailable(f"{type(exc).__name__} from {node.name}: {exc}") from None
            continue
        if errors:  # MOVED / CLUSTERDOWN / READONLY after a failover, or a script error
            _refresh(r)
            raise StoreUnavailable(f"{type(errors[0]).__name__} from {node.name}: {errors[0]}")
        if wait_ms is None:
            return list(replies)
        acked = int(replies[-1])
        if acked < REPLICA_ACKS:
            raise StoreUnavailable(
                f"no replica of {node.name} acknowledged the write within {wait_ms} ms ({acked} of {REPLICA_ACKS}): "
                "it could be lost in a failover, so it does not count"
            )
        return list(replies[:-1])
    raise StoreUnavailable(f"{node.name} lost its scripts twice in a row")


def _refresh(r: Any) -> None:
    """Re-read the slot map (``CLUSTER SLOTS``) after a failover or a slot move; best effort."""
    try:
        r.nodes_manager.initialize()
    except ERRORS as exc:
        log.debug("Redis Cluster slot map not refreshed: %s", exc)


def check_replicas(r: Any) -> None:
    """Raise ``RuntimeError`` when a master that serves slots has no replica in the cluster's
    configuration: no write to it could ever be acknowledged by a replica.

    A replica that is down or still syncing does not count against the cluster here (that is a
    passing state: writes to its master wait, and fail with :class:`StoreUnavailable`, until it is back).
    Nor does a failover under way: while any node is flagged failing (``fail``, ``pfail``) or a
    node serves no slot and follows no master (a killed master restarting, not yet its successor's
    replica), a master without a replica raises :class:`StoreUnavailable` (try again), not
    ``RuntimeError``.

    Raises
    ------
    StoreUnavailable
        The cluster did not answer, or a master has no replica while a failover is under way.
    RuntimeError
        A master without any replica in a settled cluster, named in the message.
    """
    try:
        nodes: dict[str, dict[str, Any]] = r.cluster_nodes()
    except ERRORS as exc:
        raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from None
    replicas_of: dict[str, int] = {}
    settling = False
    for detail in nodes.values():
        flags = str(detail.get("flags", ""))
        follows = detail.get("master_id") not in (None, "", "-")
        if follows:
            replicas_of[detail["master_id"]] = replicas_of.get(detail["master_id"], 0) + 1
        if (
            "fail" in flags
            or "handshake" in flags
            or "noaddr" in flags
            or ("master" in flags and not follows and not detail.get("slots"))
        ):
            settling = True  # a failover under way, or a node rejoining: its role is not settled yet
    for addr, detail in nodes.items():
        flags = detail.get("flags", "")
        if (
            "master" in flags
            and "fail" not in flags
            and detail.get("slots")
            and not replicas_of.get(detail.get("node_id", ""))
        ):
            if settling:
                raise StoreUnavailable(
                    f"the Redis Cluster master {addr} has no replica while a failover is under way"
                )
            raise RuntimeError(
                f"the Redis Cluster master {addr} has no replica: a write it acknowledged alone (a fencing "
                f"token, a parked message) would be lost in a failover; give every master a replica"
            )
