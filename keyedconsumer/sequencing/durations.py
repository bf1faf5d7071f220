"""Seconds to the milliseconds Redis is given: every duration that reaches Redis goes through here.

``PEXPIRE key 0`` deletes the key (redis-py #4279) and ``SET ... PX 0`` is an error, while
``int(s * 1000)`` truncates 0.0009 s to 0, and any lease TTL to less than the seconds this process
counts the lease valid for. So a duration (``PX``, ``PEXPIRE``, a timeout compared against check-in
times) is rounded **up** and is at least 1 ms. Rounding up may add a millisecond where float
arithmetic lands a hair above a whole one (2.007 s is 2008 ms): that errs on the safe side. The
options' validation bounds (:class:`~keyedconsumer.sequencing.RedisSequencerConfig`) make the
smallest accepted value meaningful on top of that.
"""

from __future__ import annotations

import math

__all__ = ["redis_ms"]


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
