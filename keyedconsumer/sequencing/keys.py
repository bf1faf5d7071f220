"""Every Redis key name the engine uses, built here and nowhere else.

Keys of one Kafka key share a Redis Cluster hash tag (the ``{...}`` part), so the multi-key Lua
scripts of that key run in one slot; different Kafka keys spread over the cluster. Namespaces
isolate consumer groups and tenants: no key of one namespace is a key of another.

==========================================  ===========================================
name                                        what
==========================================  ===========================================
``kc:<ns>:{<lease key>}:lease``             the lease: owner token, PX = lease TTL
``kc:<ns>:{<lease key>}:fence``             the fencing counter (INCR on each acquire)
==========================================  ===========================================

``<lease key>`` is ``k.<hex of the Kafka key>`` for keyed messages, ``p.<hex of topic>.<partition>``
for the null-key lane of a partition (and for ``ordering="partition"``).
"""

from __future__ import annotations

__all__ = ["lease_id", "lease", "fence", "check_namespace"]


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
