"""Settling a run: what a message's handler ended with becomes an engine :mod:`.outcome`.

The handler raised (``exc``) or returned (``None``, its ``msg.status`` set by ``ack_*``). Control
flow (:class:`~keyedconsumer.RetryLater`, :class:`~keyedconsumer.SkipMessage`) becomes a retry, a
park or done; a failure goes to ``error_handler`` (handled: done) or stops the consumer
(``MessageError``); a broken handler contract always stops it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import HandlerContractViolation, MessageError
from ..message import Message, Status
from ..outcomes import RetryLater, SkipMessage
from .outcome import DEAD_LETTERED, DONE, HALT, Outcome, Park, Retry

if TYPE_CHECKING:
    from .engine import Engine
    from .handler import Contract

__all__ = ["Settler"]

_PENDING = Status.PENDING
_SUCCESS = Status.SUCCESS


class Settler:
    """``settler(msg, exc) -> Outcome`` for the runs of one dispatcher (one run of a consumer).

    Parameters
    ----------
    engine:
        The run's engine: once it is closed, a late end changes nothing (``Halt``).
    error_handler:
        ``error_handler(error, message)``; returning normally marks a failure handled.
    fail:
        ``fail(error)`` stops the consumer with ``error`` (``run()`` raises it).
    contract:
        The handler contract's record of broken runs.
    finished:
        ``finished(msg)`` for a message settled done with ``SUCCESS`` or ``SKIP``, before the
        engine marks it done (``Results.finished``: its produced records, with ``transactional``).
    """

    __slots__ = ("_d", "_error_handler", "_fail", "_contract", "_finished")

    def __init__(
        self,
        engine: Engine,
        error_handler: Callable[[BaseException, Message | None], Any] | None,
        fail: Callable[[BaseException], None],
        contract: Contract,
        finished: Callable[[Message], None] | None = None,
    ) -> None:
        self._d = engine
        self._error_handler = error_handler
        self._fail = fail
        self._contract = contract
        self._finished = finished

    def __call__(self, msg: Message, exc: BaseException | None) -> Outcome:
        if exc is None and msg.status is _PENDING and not self._contract.any and not self._d.closed:
            msg.status = _SUCCESS  # the common case, first: returned normally, no contract broken
            if self._finished is not None:
                self._finished(msg)
            return DONE
        if self._d.closed:
            return HALT  # the run is over: nothing of it counts any more
        broken = self._contract.broken(msg)
        if broken is None and isinstance(exc, HandlerContractViolation):
            broken = exc.error
        if broken is not None:  # a programming error: not retried, not dead-lettered, not handled
            msg.status = Status.FAIL
            msg.error = broken
            self._fail(broken)
            return HALT
        if exc is None:
            status = msg.status
            if status is Status.PENDING:
                msg.status = Status.SUCCESS
                if self._finished is not None:
                    self._finished(msg)
                return DONE
            if status is Status.DEAD_LETTERED:
                return DEAD_LETTERED
            if status is not Status.FAIL:
                if self._finished is not None:
                    self._finished(msg)
                return DONE
            exc = msg.error if msg.error is not None else RuntimeError("ack_fail() without an error")
        elif isinstance(exc, RetryLater):
            msg.status = Status.PENDING
            msg.last_error = exc.__cause__ if exc.__cause__ is not None else exc
            return Park(exc.delay_s) if exc.park else Retry(exc.delay_s)
        elif isinstance(exc, SkipMessage):
            msg.status = Status.SKIP
            return DONE
        msg.status = Status.FAIL
        msg.error = exc
        if self._error_handler is not None:
            try:
                self._error_handler(exc, msg)
                return DONE
            except BaseException as handler_exc:
                exc = handler_exc
        failure = MessageError(msg.topic, msg.partition, msg.offset, exc)
        failure.__cause__ = exc
        self._fail(failure)
        return HALT
