"""Every Redis key name the engine uses, built here and nowhere else.

Keys of one Kafka key share a Redis Cluster hash tag (the ``{...}`` part), so the multi-key Lua
scripts of that key run in one slot; different Kafka keys spread over the cluster. Namespaces
isolate consumer groups and tenants: no key of one namespace is a key of another.

==========================================  ===========================================
name                                        what
==========================================  ===========================================
``kc:<ns>:{<lease key>}:lease``             the lease: owner token, PX = lease TTL
``kc:<ns>:{<lease key>}:fence``             the lease's fencing token (PX = the lease's: it
                                            lives and dies with the lease)
``kc:<ns>:{_f<slot>.<bits>}:fence``         HASH the fencing counter of one Redis Cluster hash
                                            slot, shared by every lease key of that slot:
                                            ``n`` last token issued, ``m`` the master that
                                            issued it (its config epoch on a cluster, its
                                            replication id on a single Redis), ``q`` no new
                                            lease before this time (ms, Redis ``TIME``)
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

A slot's fencing counter sits in the same hash slot as the lease keys it serves (its tag,
:func:`slot_tag`, is chosen to hash there), so it is on the node that serves them, moves with them
when the slot moves, and is read and written by the same Lua script. There are at most 16,384 of
them per namespace, whatever the number of distinct Kafka keys: nothing of a key outlives its lease,
its parked list, its scheduled messages and its ``seen`` markers' retention.

``<lease key>`` is ``k.<hex of the Kafka key>`` for keyed messages, ``p.<hex of topic>.<partition>``
for the null-key lane of a partition (and for ``ordering="partition"``).
"""

from __future__ import annotations

import binascii
from functools import lru_cache

__all__ = [
    "SLOTS",
    "lease_id",
    "lease",
    "fence",
    "slot_of",
    "slot_tag",
    "slot_fence",
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

#: Hash slots of a Redis Cluster (the key space is cut into this many; ``CLUSTER KEYSLOT``).
SLOTS = 16384


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
    """The fencing token of the lease ``lid`` while it is held (expires with the lease)."""
    return f"kc:{ns}:{{{lid}}}:fence"


def slot_of(lid: str) -> int:
    """The Redis Cluster hash slot of every key of lease id ``lid``: CRC16 (XMODEM) of the hash tag,
    modulo :data:`SLOTS` (as ``CLUSTER KEYSLOT`` computes it)."""
    return binascii.crc_hqx(lid.encode(), 0) % SLOTS


#: The bit characters of a slot tag ('0' and '1' differ in one bit): the tag ends with this many.
_TAG_BITS = 16


@lru_cache(maxsize=1)
def _tag_basis() -> list[tuple[int, int]]:
    """``[(slot bit pivot, positions mask)]``: which of the tag's last :data:`_TAG_BITS` characters
    to turn from '0' to '1' to flip one bit of the slot, in row-echelon form.

    CRC16 with initial value 0 is linear over GF(2) for messages of one length, and leading zero
    bytes do not change it, so flipping the character ``i`` places from the end changes the CRC by
    a fixed vector whatever comes before it.
    """
    rows: list[tuple[int, int]] = []  # (vector, positions mask), reduced
    for i in range(_TAG_BITS):
        v = binascii.crc_hqx(b"\x01" + b"\x00" * i, 0) % SLOTS
        mask = 1 << i
        for pv, pm in rows:
            if v ^ pv < v:
                v, mask = v ^ pv, mask ^ pm
        if v:
            rows.append((v, mask))
            rows.sort(reverse=True)
    return rows


@lru_cache(maxsize=SLOTS)
def slot_tag(slot: int) -> str:
    """A hash tag that hashes to ``slot``: ``_f<slot>.`` then 16 characters '0' or '1', solved for
    (no search), so ``CLUSTER KEYSLOT`` of ``{<tag>}`` is ``slot``.

    Raises
    ------
    ValueError
        ``slot`` is not in ``0..16383``.
    """
    if not 0 <= slot < SLOTS:
        raise ValueError(f"a hash slot is in 0..{SLOTS - 1}, got {slot!r}")
    head = f"_f{slot}."
    base = (head + "0" * _TAG_BITS).encode()
    want = (binascii.crc_hqx(base, 0) % SLOTS) ^ slot
    flip = 0
    for v, mask in _tag_basis():
        if want ^ v < want:
            want, flip = want ^ v, flip ^ mask
    if want:  # the basis spans every 14-bit vector (checked by the tests): unreachable
        raise AssertionError(f"no tag for slot {slot}")
    return head + "".join("1" if flip >> i & 1 else "0" for i in reversed(range(_TAG_BITS)))


def slot_fence(ns: str, lid: str) -> str:
    """The fencing counter of the hash slot of lease id ``lid`` (see the module's table)."""
    return f"kc:{ns}:{{{slot_tag(slot_of(lid))}}}:fence"


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
