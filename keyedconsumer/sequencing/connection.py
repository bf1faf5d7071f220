"""Connecting to one Redis or to a Redis Cluster, the cluster's writes sent per master with
``WAIT``, and what a connection that answers ``READONLY`` needs (a failover behind one address).

A Redis Cluster replicates asynchronously: a master answers a write before any replica has it, and
a replica promoted after the master died has only what reached it. So on a cluster every write the
sequencer relies on (see :mod:`~keyedconsumer.sequencing.store`) is sent on one connection to the
master of its slot followed by ``WAIT 1 <timeout>`` (Redis documents ``WAIT`` in
https://redis.io/docs/latest/commands/wait/; Redis 7.0 has no ``WAITAOF``), and
:func:`send_to_masters` reports, per command, whether a replica acknowledged it. A ``WAIT`` that
times out does not undo the write: it means only that the write is on the master and may not
survive a failover. What each write does then (counts anyway, is asked again, or is given up) is
the store's decision, in docs/guarantees.md ("What a WAIT that times out means").

A single Redis reached through one address (a DNS name, a proxy, a Sentinel-style switch) may turn
into a replica under connections that stay open: they answer ``READONLY``. :func:`unavailable`
then drops every pooled connection, so the next call connects to whatever the address leads to now.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, NamedTuple
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
    "Sent",
    "send_to_masters",
    "group_by_master",
    "check_replicas",
    "unavailable",
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
    Redis Cluster no replica acknowledged a write in time; try again later.

    ``unacknowledged`` is ``True`` for the latter: Redis answered, the write is on its master, and
    only its replication is not confirmed (no sign that Redis is down)."""

    def __init__(self, message: str, *, unacknowledged: bool = False) -> None:
        super().__init__(message)
        self.unacknowledged = unacknowledged


def unavailable(r: Any, exc: BaseException) -> StoreUnavailable:
    """The :class:`StoreUnavailable` for a redis-py error of client ``r``.

    A ``READONLY`` answer on a single Redis means the address now leads elsewhere (a failover
    behind a proxy or a DNS name) while this connection still reaches the old master, now a
    replica: every pooled connection is dropped, so the next call connects anew. On a Redis
    Cluster the slot map is re-read instead (a failover moved the slot).
    """
    if isinstance(exc, redis.exceptions.ReadOnlyError):
        if is_cluster(r):
            _refresh(r)
        else:
            r.connection_pool.disconnect()
            log.warning("Redis answered READONLY (a failover): reconnecting")
    return StoreUnavailable(f"{type(exc).__name__}: {exc}")


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


class Sent(NamedTuple):
    """What :func:`send_to_masters` got, per command in the order sent.

    ``replies``: the command's reply, or a :class:`StoreUnavailable` when its master did not answer,
    no longer serves its slot, or answered an error. ``acked``: a replica acknowledged it (``WAIT``);
    always ``True`` when no ``WAIT`` was asked for.
    """

    replies: list[Any]
    acked: list[bool]

    def strict(self) -> list[Any]:
        """The replies, if every command ran and (when asked) was acknowledged by a replica.

        Raises
        ------
        StoreUnavailable
            The first failure; ``unacknowledged`` when every command ran but one was not acknowledged.
        """
        for reply in self.replies:
            if isinstance(reply, StoreUnavailable):
                raise reply
        if not all(self.acked):
            raise StoreUnavailable(
                "no replica acknowledged the write in time: it could be lost in a failover, so it does not count",
                unacknowledged=True,
            )
        return self.replies


def group_by_master(r: Any, keys: Sequence[str]) -> list[list[int]]:
    """The indexes of ``keys`` grouped by the master that serves each key's slot (the client's slot
    map), in order of first appearance.

    Raises
    ------
    StoreUnavailable
        The slot map could not be read (it is refreshed for the next call).
    """
    groups: dict[str, list[int]] = {}
    try:
        for i, key in enumerate(keys):
            groups.setdefault(r.get_node_from_key(key).name, []).append(i)
    except ERRORS as exc:
        _refresh(r)
        raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from None
    return list(groups.values())


def send_to_masters(
    r: Any, commands: Sequence[tuple[str, Sequence[Any]]], wait_ms: int | None, script: str | None = None
) -> Sent:
    """Run ``[(routing key, command)]`` on a Redis Cluster, one pipeline per master; with ``wait_ms``
    each master's commands are followed by ``WAIT 1 wait_ms``.

    The commands are grouped by the master of their routing key's slot; each master gets its
    commands (and, with ``wait_ms``, then ``WAIT``: it counts the replicas that acknowledged every
    earlier write of its connection) in one pipeline on one connection, a plain client's pipeline:
    redis-py's cluster pipeline asks the server ``COMMAND GETKEYS`` for every ``EVALSHA``, one more
    round trip each. The masters are asked one after the other; one that fails fails only its own
    commands. A command may run on its master and yet be reported failed (its reply lost with the
    connection): every command sent here must be safe to send again (docs/guarantees.md, "A reply
    lost after the command ran").

    Parameters
    ----------
    r:
        The cluster client (:func:`connect`).
    commands:
        ``(key whose slot routes the command, command and arguments)``, e.g.
        ``("kc:{k.61}:lease", ("EVALSHA", sha, 3, ...))``.
    wait_ms:
        ``WAIT``'s timeout, milliseconds; ``None``: no ``WAIT``.
    script:
        The Lua source of the ``EVALSHA`` commands: a master that answers ``NOSCRIPT`` (a replica
        promoted by a failover has an empty script cache) gets it loaded, and the commands that
        answered ``NOSCRIPT`` (those did not run) are sent once more.

    Returns
    -------
    Sent
        Per command, its reply (or the failure of its master) and whether a replica acknowledged it.

    Raises
    ------
    StoreUnavailable
        The slot map could not be read (nothing was sent).
    """
    out = Sent([None] * len(commands), [wait_ms is None] * len(commands))
    for idx in group_by_master(r, [key for key, _cmd in commands]):
        node = r.get_node_from_key(commands[idx[0]][0])
        try:
            replies, acked = _send_to_master(r, node, [commands[i][1] for i in idx], wait_ms, script)
        except StoreUnavailable as exc:
            replies, acked = [exc] * len(idx), False
        for i, reply in zip(idx, replies, strict=True):
            out.replies[i] = reply
            out.acked[i] = acked
    return out


def _send_to_master(
    r: Any, node: Any, cmds: list[Sequence[Any]], wait_ms: int | None, script: str | None
) -> tuple[list[Any], bool]:
    """``(replies, acknowledged by a replica)`` of ``cmds`` on ``node``'s connection."""
    client: Any = r.get_redis_connection(node)
    replies: list[Any] = [None] * len(cmds)
    todo = list(range(len(cmds)))
    acked = wait_ms is None
    for attempt in (1, 2):
        try:
            pipe = client.pipeline(transaction=False)
            for i in todo:
                pipe.execute_command(*cmds[i])
            if wait_ms is not None:
                pipe.execute_command("WAIT", REPLICA_ACKS, wait_ms)
            got = pipe.execute(raise_on_error=False)
        except ERRORS as exc:  # the master is gone or unreachable
            _refresh(r)
            raise StoreUnavailable(f"{type(exc).__name__} from {node.name}: {exc}") from None
        if wait_ms is not None:
            wait = got.pop()
            acked = not isinstance(wait, Exception) and int(wait) >= REPLICA_ACKS
        for i, reply in zip(todo, got, strict=True):
            replies[i] = reply
        lost = [i for i in todo if isinstance(replies[i], redis.exceptions.NoScriptError)]
        if lost and script is not None and attempt == 1:
            try:
                client.script_load(script)
            except ERRORS as exc:
                raise unavailable(client, exc) from None
            todo = lost
            continue
        errors = [x for x in replies if isinstance(x, Exception)]
        if errors:  # MOVED / CLUSTERDOWN / READONLY after a failover, or a script error
            _refresh(r)
            raise StoreUnavailable(f"{type(errors[0]).__name__} from {node.name}: {errors[0]}")
        if not acked:
            log.debug("no replica of %s acknowledged within %d ms", node.name, wait_ms)
        return replies, acked
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
