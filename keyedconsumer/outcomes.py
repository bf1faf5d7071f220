"""The control-flow vocabulary a handler (or a middleware) raises to steer its message.

Anything else a handler raises fails the message. These three are not failures of the engine:

- :class:`RetryLater`: run this message again after ``delay_s`` seconds. Only its lane (its key)
  waits; other keys go on; no thread waits and polling goes on; the partition's offset stays at the
  message until it is done. ``Message.attempt`` is increased before the next attempt.
- :class:`SkipMessage`: end the message ``SKIP`` (done), like ``msg.ack_skip()``.
- :class:`PermanentError`: a failure that must not be retried (retry middleware gives up at once);
  for the engine it is a failure like any other.
"""

from __future__ import annotations

import math

__all__ = ["RetryLater", "SkipMessage", "PermanentError"]


class RetryLater(Exception):
    """Run the message again after ``delay_s`` seconds (>= 0, finite).

    Raise it ``from`` the error that caused it (``raise RetryLater(2.0) from exc``); the engine keeps
    that error in ``Message.last_error``.

    With ``park=True`` and a :class:`~keyedconsumer.RedisSequencer` the message's key is *parked*:
    the message and every later message of its key go to the key's list in Redis, their offsets
    count done once Redis acknowledged the write, and the partition moves on (per-key event lists in
    Redis, as in go-distr-ep: github.com/pgujjeti/go-distr-ep).
    Without a Redis sequencer ``park`` is ignored and the message waits in memory.

    Raises
    ------
    ValueError
        ``delay_s`` is negative, NaN or infinite.
    """

    def __init__(self, delay_s: float, reason: str = "", *, park: bool = False) -> None:
        if isinstance(delay_s, bool):
            raise ValueError("RetryLater delay_s must be a number of seconds, got a boolean")
        delay_s = float(delay_s)
        if not math.isfinite(delay_s) or delay_s < 0:
            raise ValueError(f"RetryLater delay_s must be finite and >= 0, got {delay_s!r}")
        self.delay_s = delay_s
        self.park = bool(park)
        super().__init__(reason or f"retry in {delay_s:g} s")


class SkipMessage(Exception):
    """End the message ``SKIP``: it is done and its offset may be stored."""


class PermanentError(Exception):
    """A failure that retrying cannot fix (bad input, a rejected request): do not retry."""
