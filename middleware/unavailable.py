"""A service a message needs does not answer: the message waits; it has not failed.

A decoder whose schema registry is down cannot say anything about the record, so the record must
neither be dead-lettered nor count a failed attempt. :func:`wait_on` makes the
:class:`Unavailable` to raise: a :class:`~keyedconsumer.RetryLater`, so the message stays its key's
next message and its partition's offset stays at it (other keys go on), and the wait is noted on
the message, so :class:`~keyedconsumer.middleware.Retry` does not count it against
``max_attempts`` (:func:`failed_attempts`) and ``DeadLetter`` never sees it.

:class:`Availability` is what the callers of one service learnt of it: up, or down since when and
why, with the time of the next request allowed through (a probe). While it is down, at most one
request is in flight, and the probes are spaced by a back-off that doubles from ``first_probe_s``
to ``max_probe_s``; every other caller waits without asking. ``max_probe_s`` bounds how long after
the service is back the waiting messages run again.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

from keyedconsumer import Message, RetryLater

__all__ = ["Unavailable", "wait_on", "failed_attempts", "Availability"]

log = logging.getLogger("keyedconsumer.middleware.unavailable")

#: ``Message.state`` key: attempts of the message that ended waiting for a service (not failed).
WAITS = "keyedconsumer.waits"


class Unavailable(RetryLater):
    """The message needs a service that does not answer now; it runs again after ``delay_s``
    seconds. Raise it with :func:`wait_on` (which notes the wait on the message), ``from`` the
    error that showed the service unavailable."""


def wait_on(msg: Message, delay_s: float, reason: str) -> Unavailable:
    """The :class:`Unavailable` to raise for ``msg``, which waits ``delay_s`` seconds (>= 0) for a
    service; the wait is noted on the message (``Message.state``), so it is not a failed attempt."""
    msg.state[WAITS] = int(msg.state.get(WAITS, 0)) + 1
    return Unavailable(delay_s, reason)


def failed_attempts(msg: Message) -> int:
    """Attempts of ``msg`` so far, this one included, that did not end waiting for a service:
    ``msg.attempt`` minus the waits :func:`wait_on` noted. The notes live on the message object; a
    message made again elsewhere (another owner, a parked message drained from Redis) starts
    without them, so its waits then count as attempts (it gives up sooner, never later)."""
    return max(1, msg.attempt - int(msg.state.get(WAITS, 0)))


class Availability:
    """Whether a service answers, as its callers found it. Safe from any thread.

    Parameters
    ----------
    name:
        What the reasons call the service (``schema registry http://...``).
    first_probe_s, max_probe_s:
        Seconds from a failed request to the next request let through; the interval doubles after
        each failed probe, up to ``max_probe_s``.
    clock:
        Monotonic seconds (tests pass a fake one).

    Raises
    ------
    ValueError
        A bound that is not positive and finite, or ``max_probe_s`` below ``first_probe_s``.
    """

    def __init__(
        self,
        name: str,
        *,
        first_probe_s: float = 0.5,
        max_probe_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not (0 < first_probe_s <= max_probe_s and math.isfinite(max_probe_s)):
            raise ValueError(f"need 0 < first_probe_s <= max_probe_s, got {first_probe_s!r}, {max_probe_s!r}")
        self.name = name
        self.first_probe_s = float(first_probe_s)
        self.max_probe_s = float(max_probe_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._reason = ""
        self._interval_s = self.first_probe_s
        self._next_probe = 0.0
        self._prober: int | None = None  # the thread whose request is the probe in flight
        self._asked_at = -math.inf  # when a caller last asked for the service while it was down

    def admit(self) -> float | None:
        """Before a request: ``None`` when it may go (up, or this is the probe: the calling thread
        made it, its retries included), else the seconds to wait before asking again (down, or
        another caller's probe in flight)."""
        with self._lock:
            if self._down_since is None:
                return None
            now = self._clock()
            self._asked_at = now
            me = threading.get_ident()
            if self._prober == me or (self._prober is None and now >= self._next_probe):
                self._prober = me
                return None
            return max(0.01, self._next_probe - now) if self._prober is None else self._interval_s

    def release(self) -> None:
        """The calling thread is done with its requests: if it made the probe and nothing said how
        it went (:meth:`answered`, :meth:`failed`), the next caller may probe."""
        with self._lock:
            if self._prober == threading.get_ident():
                self._prober = None

    def answered(self) -> None:
        """A request got an answer that says the service works (any answer but 5xx or 429)."""
        with self._lock:
            if self._down_since is not None:
                log.info("%s answers again, after %.1f s", self.name, self._clock() - self._down_since)
            self._down_since = None
            self._prober = None
            self._interval_s = self.first_probe_s

    def failed(self, reason: str) -> float:
        """A request found the service unavailable (``reason``, one line). Returns the seconds to
        wait before asking again."""
        with self._lock:
            now = self._clock()
            self._asked_at = now
            if self._down_since is None:
                self._down_since, self._interval_s = now, self.first_probe_s
                log.warning("%s unavailable (%s): what needs it waits", self.name, reason)
            elif self._prober == threading.get_ident():  # the probe failed: back off further
                self._interval_s = min(self.max_probe_s, self._interval_s * 2)
            else:  # a request that left while it was up, failing late: the back-off stands
                return max(0.01, self._next_probe - now)
            self._prober = None
            self._reason = reason
            self._next_probe = now + self._interval_s
            return self._interval_s

    def unavailable(self) -> str | None:
        """Why messages wait for the service now, or ``None``: down, and a caller asked for it within
        the last ``2 * max_probe_s`` seconds (waiting messages ask again at least that often; when
        none needs the service any more, nothing is waiting for it)."""
        with self._lock:
            if self._down_since is None:
                return None
            now = self._clock()
            if now - self._asked_at > 2 * self.max_probe_s:
                return None
            return f"{self.name}: unavailable for {now - self._down_since:.1f} s ({self._reason})"

    def __repr__(self) -> str:
        return f"Availability({self.name!r}, down={self._down_since is not None})"
