"""The only module that imports ``redis``: leases with fencing tokens, as Lua scripts.

A lease follows redis-py's ``lock.py``: ``SET NX PX`` with a random owner token; renew and release
compare the token atomically. Acquiring also ``INCR``s the key's fencing counter in the same script;
the result is the fencing token. The counter must never repeat, also after a Redis restart: the
store refuses to start unless Redis persists every write before answering (``appendonly yes`` and
``appendfsync always``; Redis 7.0 has no ``WAITAOF``), unless ``require_durable=False``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import redis

from . import keys

__all__ = ["LeaseStore", "StoreUnavailable"]

log = logging.getLogger("keyedconsumer.redis")

# KEYS[1] lease, KEYS[2] fence; ARGV[1] owner, ARGV[2] ttl ms -> fencing token, or -(pttl ms) when
# another owner holds it (at least -1).
_ACQUIRE = """
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return tonumber(redis.call('GET', KEYS[2]) or '0')
end
if cur then
  local left = redis.call('PTTL', KEYS[1])
  if left < 1 then left = 1 end
  return -left
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return redis.call('INCR', KEYS[2])
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


class StoreUnavailable(Exception):
    """Redis did not answer (connection refused, timeout, loading); try again later."""


class LeaseStore:
    """Leases of one namespace on one Redis.

    Parameters
    ----------
    url:
        ``redis://`` or ``rediss://`` URL (a password in it never appears in a repr or log).
    namespace:
        Isolates consumer groups and tenants.
    socket_timeout_s:
        Bound of one Redis call, in seconds.
    """

    def __init__(self, url: str, namespace: str, socket_timeout_s: float = 2.0) -> None:
        self.namespace = keys.check_namespace(namespace)
        self._r = redis.Redis.from_url(url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s)
        self._acquire = self._r.register_script(_ACQUIRE)
        self._renew = self._r.register_script(_RENEW)
        self._release = self._r.register_script(_RELEASE)

    def check_durable(self) -> None:
        """Raise ``RuntimeError`` unless Redis persists each write before it answers.

        Raises
        ------
        StoreUnavailable
            Redis did not answer.
        RuntimeError
            ``appendonly`` is not ``yes`` or ``appendfsync`` is not ``always``: a fencing token
            could repeat after a Redis restart.
        """
        try:
            aof = self._r.config_get("appendonly").get("appendonly")
            fsync = self._r.config_get("appendfsync").get("appendfsync")
        except redis.RedisError as exc:
            raise StoreUnavailable(str(exc)) from None
        if aof != "yes" or fsync != "always":
            raise RuntimeError(
                f"Redis must run with appendonly yes and appendfsync always (has appendonly={aof}, "
                f"appendfsync={fsync}): otherwise a fencing token can repeat after a restart"
            )

    def acquire(self, requests: Sequence[tuple[str, str]], ttl_ms: int) -> list[int]:
        """Try to acquire ``[(lease id, owner token)]`` in one round trip.

        Returns, per request, the fencing token (> 0) or ``-(ms until the holder's lease ends)``.
        """
        return [int(x) for x in self._pipeline(self._acquire, requests, ttl_ms, fence=True)]

    def renew(self, requests: Sequence[tuple[str, str]], ttl_ms: int) -> list[bool]:
        """Extend ``[(lease id, owner token)]``; ``False`` where the lease is no longer ours."""
        return [bool(x) for x in self._pipeline(self._renew, requests, ttl_ms)]

    def release(self, requests: Sequence[tuple[str, str]]) -> list[bool]:
        """Release ``[(lease id, owner token)]``; ``False`` where it was no longer ours."""
        return [bool(x) for x in self._pipeline(self._release, requests, None)]

    def _pipeline(self, script: Any, requests: Sequence[tuple[str, str]], ttl_ms: int | None, fence: bool = False) -> list[Any]:
        if not requests:
            return []
        ns = self.namespace
        try:
            pipe = self._r.pipeline(transaction=False)
            for lid, owner in requests:
                k = [keys.lease(ns, lid), keys.fence(ns, lid)] if fence else [keys.lease(ns, lid)]
                args = [owner] if ttl_ms is None else [owner, ttl_ms]
                script(keys=k, args=args, client=pipe)
            return list(pipe.execute())
        except redis.RedisError as exc:
            raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from None

    def fencing_token(self, lid: str) -> int:
        """The current value of a lease's fencing counter (0 if never acquired)."""
        try:
            return int(self._r.get(keys.fence(self.namespace, lid)) or 0)
        except redis.RedisError as exc:
            raise StoreUnavailable(str(exc)) from None

    def close(self) -> None:
        self._r.close()

    def __repr__(self) -> str:
        return f"LeaseStore(namespace={self.namespace!r})"
