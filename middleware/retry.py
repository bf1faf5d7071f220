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
from collections.abc import Callable
from typing import Any

from tenacity import RetryCallState
from tenacity.wait import wait_exponential_jitter

from keyedconsumer import Message, PermanentError, RetryLater

from ._kind import around, failure_of
from .unavailable import failed_attempts

__all__ = ["Retry", "Wait"]

#: A back-off policy: tenacity's wait strategy protocol, ``(RetryCallState) -> seconds``. Any
#: ``tenacity.wait_*`` object (or a sum of them) fits; :class:`Retry` reads only the delay it returns
#: for ``retry_state.attempt_number`` = the attempt that failed (>= 1).
Wait = Callable[[RetryCallState], float]


def _state(attempt: int) -> RetryCallState:
    """The tenacity call state a wait strategy reads: ``attempt_number`` is the failed attempt. The
    engine, not tenacity, runs the retries (``RetryLater``), so there is no retrying object."""
    state = RetryCallState(retry_object=None, fn=None, args=(), kwargs={})  # type: ignore[arg-type]
    state.attempt_number = attempt
    return state


def _check(name: str, value: float, low: float, high: float = math.inf) -> float:
    if isinstance(value, bool):
        raise ValueError(f"Retry {name} must be a number, got a boolean")
    value = float(value)
    if not (math.isfinite(value) and low <= value <= high):
        raise ValueError(f"Retry {name} must be finite and in [{low}, {high}], got {value!r}")
    return value


class Retry:
    """Retry a failing handler with exponential back-off and jitter.

    Defaults follow BigBen's (github.com/walmartlabs/bigben): 3 attempts, 1 s initial delay,
    multiplier 2. The delays are tenacity's ``wait_exponential_jitter`` (Google Cloud's retry
    strategy, https://cloud.google.com/storage/docs/retry-strategy): after failed attempt ``n``
    (>= 1), ``min(max_delay_s, initial_delay_s * multiplier ** (n - 1) + uniform(0, jitter))``
    seconds (``max_delay_s`` when the power overflows).

    Parameters
    ----------
    max_attempts:
        Attempts in all, first included (>= 1); ``None`` retries without end. An attempt that ended
        waiting for a service (:class:`~keyedconsumer.middleware.unavailable.Unavailable`, e.g. a
        schema registry that does not answer) is not a failed attempt and does not count.
    initial_delay_s, multiplier, max_delay_s:
        Seconds after the first failed attempt; the factor between two delays (>= 1); the longest
        delay in seconds, jitter included.
    jitter:
        Seconds (>= 0) of random delay added to each delay, uniform in ``[0, jitter]``
        (tenacity's ``jitter``); ``0`` gives exact delays. It was a fraction of the delay before
        tenacity computed the delays (CHANGELOG); tenacity has no proportional jitter (its issue
        #397).
    retry_on:
        Exception types that are retried.
    give_up_on:
        Exception types never retried, even if they match ``retry_on``
        (default: :class:`~keyedconsumer.PermanentError`).
    wait:
        The back-off policy itself, replacing the four parameters above: any tenacity wait
        strategy (:data:`Wait`), e.g. ``tenacity.wait_fixed(2)`` or
        ``tenacity.wait_random_exponential(multiplier=1, max=60)`` (AWS's full jitter); tests pass
        a deterministic one. Its delay is refused when negative, NaN or infinite
        (``ValueError`` from ``RetryLater``).
    park:
        With a :class:`~keyedconsumer.RedisSequencer`, park the failing key in Redis while it waits
        (``RetryLater(park=True)``): its partition's offset moves on and other keys flow; the key's
        later messages wait behind it, in order, in Redis. Without one, the message waits in memory.

    Raises
    ------
    ValueError
        A negative, NaN or infinite delay or jitter, a multiplier below 1, or ``max_attempts``
        below 1.
    """

    #: It acts on a message's end only, so it can wrap each message of a batch handler's batch.
    outcome_only = True

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
        wait: Wait | None = None,
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
        self.jitter = _check("jitter", jitter, 0.0)
        self.retry_on = tuple(retry_on)
        self.give_up_on = tuple(give_up_on)
        self.wait: Wait = wait or wait_exponential_jitter(
            multiplier=self.initial_delay_s,
            exp_base=self.multiplier,
            max=self.max_delay_s,
            jitter=self.jitter,
        )
        self.park = bool(park)

    def delay_s(self, attempt: int) -> float:
        """The back-off in seconds after failed attempt ``attempt`` (>= 1): what :attr:`wait` says."""
        return float(self.wait(_state(attempt)))

    def _after(self, msg: Message, exc: BaseException | None) -> None:
        """Turn a failure into ``RetryLater`` when the policy allows; otherwise let it through."""
        exc = failure_of(msg, exc)
        if exc is None:
            return
        if isinstance(exc, self.give_up_on) or not isinstance(exc, self.retry_on):
            raise exc
        failed = failed_attempts(msg)  # attempts that waited for a service do not count
        if self.max_attempts is not None and failed >= self.max_attempts:
            raise exc
        raise RetryLater(self.delay_s(failed), park=self.park) from exc

    def __call__(self, handler: Any) -> Any:
        return around(handler, None, lambda msg, exc, _state: self._after(msg, exc))

    def __repr__(self) -> str:
        return (
            f"Retry(max_attempts={self.max_attempts}, initial_delay_s={self.initial_delay_s}, "
            f"multiplier={self.multiplier}, max_delay_s={self.max_delay_s}, jitter={self.jitter}, wait={self.wait!r}, "
            f"park={self.park})"
        )
