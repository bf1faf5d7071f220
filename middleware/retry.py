"""Retry with exponential back-off, without a waiting thread.

A failed attempt becomes ``RetryLater(delay)``: the engine runs the message again after the delay.
While it waits only its key waits, other keys go on, polling goes on, and the partition's offset
stays at the message (it is not done). ``Message.attempt`` is increased by the engine before each
attempt; the error that caused the retry is ``Message.last_error``.

``max.poll.interval.ms``: the back-off never blocks the poll loop, so it is not bounded by
``max.poll.interval.ms`` (the member stays in the group however long the delays are). What bounds it
is the partition: while a message waits, the partition's committed offset stays at it, and a revoke
or a stop drops the waiting message (it is delivered again, from Kafka, to the next owner, with the
attempt count starting again at 1; the Redis sequencer keeps the count across owners). Keep the
total back-off well under the time you accept a partition's offset to stand still.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

from keyedconsumer import Message, PermanentError, RetryLater

from ._kind import around, failure_of

__all__ = ["Retry", "backoff_delay_s"]


def backoff_delay_s(
    attempt: int,
    *,
    initial_delay_s: float,
    multiplier: float,
    max_delay_s: float,
    jitter: float,
    rand: float,
) -> float:
    """The delay in seconds before attempt ``attempt + 1``, after attempt ``attempt`` (>= 1) failed.

    ``min(max_delay_s, initial_delay_s * multiplier ** (attempt - 1))``, spread by ``jitter``
    (a fraction in [0, 1]): multiplied by ``1 + jitter * (2 * rand - 1)`` where ``rand`` is in
    [0, 1), then capped at ``max_delay_s``. Pure: the caller passes the random number.
    """
    try:
        base = initial_delay_s * multiplier ** max(0, attempt - 1)
    except OverflowError:
        base = max_delay_s
    base = min(base, max_delay_s)
    return max(0.0, min(max_delay_s, base * (1.0 + jitter * (2.0 * rand - 1.0))))


def _check(name: str, value: float, low: float, high: float = math.inf) -> float:
    if isinstance(value, bool):
        raise ValueError(f"Retry {name} must be a number, got a boolean")
    value = float(value)
    if not (math.isfinite(value) and low <= value <= high):
        raise ValueError(f"Retry {name} must be finite and in [{low}, {high}], got {value!r}")
    return value


class Retry:
    """Retry a failing handler with exponential back-off.

    Defaults follow BigBen's (github.com/walmartlabs/bigben): 3 attempts, 1 s initial delay, multiplier 2.

    Parameters
    ----------
    max_attempts:
        Attempts in all, first included (>= 1); ``None`` retries without end.
    initial_delay_s, multiplier, max_delay_s:
        Delay after attempt ``n`` is ``min(max_delay_s, initial_delay_s * multiplier ** (n - 1))``
        seconds.
    jitter:
        Fraction in [0, 1] by which each delay is spread at random (0 = exact delays).
    retry_on:
        Exception types that are retried.
    give_up_on:
        Exception types never retried, even if they match ``retry_on``
        (default: :class:`~keyedconsumer.PermanentError`).
    rand:
        The random source, ``() -> float`` in [0, 1) (pass a fixed one in tests).
    park:
        With a :class:`~keyedconsumer.RedisSequencer`, park the failing key in Redis while it waits
        (``RetryLater(park=True)``): its partition's offset moves on and other keys flow; the key's
        later messages wait behind it, in order, in Redis. Without one, the message waits in memory.

    Raises
    ------
    ValueError
        A negative, NaN or infinite delay, a multiplier below 1, a jitter outside [0, 1], or
        ``max_attempts`` below 1.
    """

    def __init__(
        self,
        *,
        max_attempts: int | None = 3,
        initial_delay_s: float = 1.0,
        multiplier: float = 2.0,
        max_delay_s: float = 60.0,
        jitter: float = 0.1,
        retry_on: tuple[type[BaseException], ...] = (Exception,),
        give_up_on: tuple[type[BaseException], ...] = (PermanentError,),
        rand: Callable[[], float] = random.random,
        park: bool = False,
    ) -> None:
        if max_attempts is not None and (
            isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1
        ):
            raise ValueError(f"Retry max_attempts must be >= 1 or None, got {max_attempts!r}")
        self.max_attempts = None if max_attempts is None else int(max_attempts)
        self.initial_delay_s = _check("initial_delay_s", initial_delay_s, 0.0)
        self.multiplier = _check("multiplier", multiplier, 1.0)
        self.max_delay_s = _check("max_delay_s", max_delay_s, 0.0)
        self.jitter = _check("jitter", jitter, 0.0, 1.0)
        self.retry_on = tuple(retry_on)
        self.give_up_on = tuple(give_up_on)
        self._rand = rand
        self.park = bool(park)

    def delay_s(self, attempt: int) -> float:
        """The back-off after failed attempt ``attempt``, in seconds."""
        return backoff_delay_s(
            attempt,
            initial_delay_s=self.initial_delay_s,
            multiplier=self.multiplier,
            max_delay_s=self.max_delay_s,
            jitter=self.jitter,
            rand=self._rand(),
        )

    def _after(self, msg: Message, exc: BaseException | None) -> None:
        """Turn a failure into ``RetryLater`` when the policy allows; otherwise let it through."""
        exc = failure_of(msg, exc)
        if exc is None:
            return
        if isinstance(exc, self.give_up_on) or not isinstance(exc, self.retry_on):
            raise exc
        if self.max_attempts is not None and msg.attempt >= self.max_attempts:
            raise exc
        raise RetryLater(self.delay_s(msg.attempt), park=self.park) from exc

    def __call__(self, handler: Any) -> Any:
        return around(handler, None, lambda msg, exc, _state: self._after(msg, exc))

    def __repr__(self) -> str:
        return (
            f"Retry(max_attempts={self.max_attempts}, initial_delay_s={self.initial_delay_s}, "
            f"multiplier={self.multiplier}, max_delay_s={self.max_delay_s}, jitter={self.jitter}, park={self.park})"
        )
