"""Every Redis key name the engine uses, built here and nowhere else.

Keys of one Kafka key share a Redis Cluster hash tag (the ``{...}`` part), so the multi-key Lua
scripts of that key run in one slot; different Kafka keys spread over the cluster. Namespaces
isolate consumer groups and tenants: no key of one namespace is a key of another.

==========================================  ===========================================
name                                        what
==========================================  ===========================================
``kc:<ns>:{<lease key>}:lease``             the lease: owner token, PX = lease TTL
``kc:<ns>:{<lease key>}:fence``             the fencing counter (INCR on each acquire)
``kc:<ns>:{<lease key>}:park``              LIST of the key's parked messages, in order
``kc:<ns>:{<lease key>}:pbytes``            bytes in that list (deleted with the list)
``kc:<ns>:{<lease key>}:error``             HASH the parked key's last error: ``type``,
                                            ``message``, ``at``, ``attempt``, ``time_ms``
                                            (deleted with the list)
``kc:<ns>:{<lease key>}:seen``              HASH ``<topic hex>.<partition>`` -> highest offset
                                            parked, and ``s.<id>`` for scheduled messages
                                            moved in: appends are idempotent (PX retention)
``kc:<ns>:{_sched}:due``                    ZSET lease key -> when its list's head is due (ms)
``kc:<ns>:{_sched}:sdue``                   ZSET scheduled id -> due time (ms since epoch)
``kc:<ns>:{_sched}:entries``                HASH scheduled id -> the message (JSON)
``kc:<ns>:{_sched}:totals``                 HASH ``n`` / ``bytes`` parked in the namespace
``kc:<ns>:{_sched}:lease``                  the scheduler's lease (one instance at a time)
``kc:<ns>:{_sched}:instances``              ZSET instance id -> last check-in (ms since epoch)
``kc:<ns>:{_sched}:quarantine``             SET of quarantined lease keys
==========================================  ===========================================

The namespace-wide keys share the ``{_sched}`` tag, so their scripts run in one slot too. A lease
key never starts with ``_``, so it cannot collide with them.

``<lease key>`` is ``k.<hex of the Kafka key>`` for keyed messages, ``p.<hex of topic>.<partition>``
for the null-key lane of a partition (and for ``ordering="partition"``).
"""

from __future__ import annotations

__all__ = [
    "lease_id",
    "lease",
    "fence",
    "park",
    "pbytes",
    "error",
    "seen",
    "due",
    "sched_due",
    "sched_entries",
    "totals",
    "scheduler",
    "instances",
    "quarantine",
    "lease_prefix",
    "key_of",
    "check_namespace",
]

SCHED = "_sched"


def check_namespace(ns: str) -> str:
    """Return ``ns`` if it can be part of key names (non-empty, no braces or whitespace).

    Raises
    ------
    ValueError
        The namespace is empty or holds ``{``, ``}``, ``:`` or whitespace.
    """
    if not ns or any(c in ns for c in "{}: \t\r\n"):
        raise ValueError(f"namespace must be non-empty without braces, colons or whitespace: {ns!r}")
    return ns


def lease_id(key: bytes | None, topic: str, partition: int) -> str:
    """The lease identity of a lane: its Kafka key, or its partition for null keys."""
    if key is None:
        return f"p.{topic.encode().hex()}.{partition}"
    return f"k.{key.hex()}"


def lease(ns: str, lid: str) -> str:
    return f"kc:{ns}:{{{lid}}}:lease"


def fence(ns: str, lid: str) -> str:
    return f"kc:{ns}:{{{lid}}}:fence"


def park(ns: str, lid: str) -> str:
    return f"kc:{ns}:{{{lid}}}:park"


def pbytes(ns: str, lid: str) -> str:
    return f"kc:{ns}:{{{lid}}}:pbytes"


def error(ns: str, lid: str) -> str:
    return f"kc:{ns}:{{{lid}}}:error"


def seen(ns: str, lid: str) -> str:
    return f"kc:{ns}:{{{lid}}}:seen"


def due(ns: str) -> str:
    return f"kc:{ns}:{{{SCHED}}}:due"


def sched_due(ns: str) -> str:
    return f"kc:{ns}:{{{SCHED}}}:sdue"


def sched_entries(ns: str) -> str:
    return f"kc:{ns}:{{{SCHED}}}:entries"


def totals(ns: str) -> str:
    return f"kc:{ns}:{{{SCHED}}}:totals"


def scheduler(ns: str) -> str:
    return lease(ns, SCHED)


def instances(ns: str) -> str:
    return f"kc:{ns}:{{{SCHED}}}:instances"


def quarantine(ns: str) -> str:
    return f"kc:{ns}:{{{SCHED}}}:quarantine"


def lease_prefix(ns: str) -> str:
    """The prefix of every key of namespace ``ns`` (for ``SCAN MATCH <prefix>*``)."""
    return f"kc:{ns}:"


def key_of(lid: str) -> bytes | None:
    """The Kafka key of a lease id (``None`` for a partition's lease id)."""
    return bytes.fromhex(lid[2:]) if lid.startswith("k.") else None
