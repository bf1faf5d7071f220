"""Seconds to the milliseconds Redis is given: every duration and due time that reaches Redis goes
through here.

``PEXPIRE key 0`` deletes the key (redis-py #4279) and ``SET ... PX 0`` is an error, while
``int(s * 1000)`` truncates 0.0009 s to 0, and any lease TTL to less than the seconds this process
counts the lease valid for. So a duration (``PX``, ``PEXPIRE``, a timeout compared against check-in
times) is rounded **up** and is at least 1 ms; a due time (now + a delay, or an absolute time) is
rounded up too, so nothing is due earlier than asked. Rounding up may add a millisecond where float
arithmetic lands a hair above a whole one (2.007 s is 2008 ms): that errs on the safe side. The
options' validation bounds (:class:`~keyedconsumer.sequencing.RedisSequencerConfig`) make the
smallest accepted value meaningful on top of that.
"""

from __future__ import annotations

import math

__all__ = ["MAX_DUE_MS", "redis_ms", "due_ms", "at_ms"]

#: The latest due time (ms since the epoch: 2248-09-26). Due-set scores keep their unique 1/1024
#: fractions exactly up to here; a later due time means "never" in practice.
MAX_DUE_MS = 2**43


def redis_ms(seconds: float) -> int:
    """A duration for Redis (``PX``, ``PEXPIRE``, a timeout in ms): ``seconds`` rounded up to whole
    milliseconds, at least 1 (``PEXPIRE key 0`` would delete the key).

    Raises
    ------
    ValueError
        ``seconds`` is negative, NaN or infinite.
    """
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"a duration must be finite and >= 0 seconds, got {seconds!r}")
    return max(1, math.ceil(seconds * 1000.0))


def due_ms(now_ms: float, delay_s: float) -> int:
    """The due time ``delay_s`` (>= 0) after ``now_ms`` (the Redis server's time), rounded up to whole
    milliseconds (never earlier than asked) and capped at :data:`MAX_DUE_MS`.

    Raises
    ------
    ValueError
        ``delay_s`` is negative or NaN.
    """
    if math.isnan(delay_s) or delay_s < 0:
        raise ValueError(f"a delay must be >= 0 seconds, got {delay_s!r}")
    when = now_ms + delay_s * 1000.0
    if not when < MAX_DUE_MS:  # also an infinite delay
        return MAX_DUE_MS
    return math.ceil(when)


def at_ms(at_s: float) -> int:
    """An absolute due time, ``at_s`` seconds since the epoch (on the Redis server's clock), in whole
    milliseconds rounded up.

    Raises
    ------
    ValueError
        ``at_s`` is NaN, infinite, negative or after :data:`MAX_DUE_MS`.
    """
    if not math.isfinite(at_s) or at_s < 0 or at_s * 1000.0 > MAX_DUE_MS:
        raise ValueError(
            f"a due time must be finite, >= 0 and before {MAX_DUE_MS} ms since the epoch, got {at_s!r}"
        )
    return math.ceil(at_s * 1000.0)
