"""The control-flow vocabulary a handler (or a middleware) raises to steer its message.

Anything else a handler raises fails the message. These three are not failures of the engine:

- :class:`RetryLater`: run this message again after ``delay_s`` seconds. Only its lane (its key)
  waits; other keys go on; no thread waits and polling goes on; the partition's offset stays at the
  message until it is done. ``Message.attempt`` is increased before the next attempt.
- :class:`SkipMessage`: end the message ``SKIP`` (done), like ``msg.ack_skip()``.
- :class:`PermanentError`: a failure that must not be retried (retry middleware gives up at once);
  for the engine it is a failure like any other.

A batch handler (``KeyedConsumer(batch_handler=...)``) raises :class:`BatchFailed` to fail some
messages of its batch and not the others.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from .message import Message

__all__ = ["RetryLater", "SkipMessage", "PermanentError", "BatchFailed"]


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


class BatchFailed(Exception):
    """Raised by a batch handler: the messages named in ``errors`` ended with their exception, each
    on its own (a ``RetryLater`` retries that message, ``SkipMessage`` skips it, any other exception
    fails it: ``Retry`` / ``DeadLetter`` middleware and ``error_handler`` see it as that message's
    failure); every other message of the batch ended as it would have had the handler returned
    (done, or what its ``ack_*`` call said).

    Spring Kafka's ``BatchListenerFailedException`` names one record by its index and Spring then
    re-runs every record after it; here each message is named, and only those named fail.

    Parameters
    ----------
    errors:
        ``{message: exception}`` for messages of the batch the handler was given; a message of
        another batch is logged and ignored.

    Raises
    ------
    TypeError
        ``errors`` is not a mapping of messages to exceptions.
    """

    def __init__(self, errors: Mapping[Message, BaseException], reason: str = "") -> None:
        if not isinstance(errors, Mapping):
            raise TypeError(
                f"BatchFailed takes a mapping {{message: exception}}, got a {type(errors).__name__}"
            )
        for msg, exc in errors.items():
            if not isinstance(msg, Message) or not isinstance(exc, BaseException):
                raise TypeError(
                    "BatchFailed takes a mapping {message: exception}, got an entry "
                    f"{type(msg).__name__}: {type(exc).__name__}"
                )
        self.errors: dict[Message, BaseException] = dict(errors)
        super().__init__(reason or f"{len(self.errors)} message(s) of the batch failed")
