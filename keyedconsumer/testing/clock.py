"""A fake monotonic clock for unit tests: time moves only when told to."""

from __future__ import annotations

import math
import threading

__all__ = ["FakeClock"]


class FakeClock:
    """A monotonic clock in seconds that moves only when told to; callable like ``time.monotonic``.

    Parameters
    ----------
    start_s:
        The first reading, in seconds.
    """

    def __init__(self, start_s: float = 0.0) -> None:
        self._now = float(start_s)
        self._lock = threading.Lock()

    def __call__(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        """Move the clock forward by ``seconds`` (>= 0, finite). Thread-safe.

        Returns
        -------
        The new reading, in seconds.

        Raises
        ------
        ValueError
            ``seconds`` is negative, NaN or infinite (a monotonic clock never goes back).
        """
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"FakeClock.advance needs a finite number of seconds >= 0, got {seconds!r}")
        with self._lock:
            self._now += seconds
            return self._now

    def __repr__(self) -> str:
        return f"FakeClock({self._now:g} s)"
