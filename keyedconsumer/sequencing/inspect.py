"""What a namespace holds in Redis now, for ``keyedconsumer inspect``, the dashboard and tests
(read only: ``SCAN``, never ``KEYS``)."""

from __future__ import annotations

import base64
import json
from typing import Any

from . import keys
from .connection import ERRORS, StoreUnavailable, connect

__all__ = ["inspect_namespace"]


def _ms(sec: Any, usec: Any) -> float:
    """``TIME``'s seconds and microseconds as ms since the epoch."""
    return int(sec) * 1000 + int(usec) / 1000


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
