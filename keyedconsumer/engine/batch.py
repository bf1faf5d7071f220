"""Batch handlers: one call for a batch of ready lane heads, and an outcome for each message.

A batch is what the engine's ready queue holds (:meth:`~.engine.Engine.take_batch`): up to
``handler_batch_size`` lane heads, oldest admitted first, gathered by the owner for at most
``handler_batch_linger_s``; a worker runs it (:mod:`.runner`). A lane has one head at a time, so a batch holds **at most one message
per key** (per partition with ``ordering="partition"``; any messages with ``ordering="none"``):
per-key order and one message in flight per key hold exactly as for a per-message handler, and the
next message of a key goes to a later batch once this one settled (Confluent Parallel Consumer's
``batchSize``, which batches many keys' messages the same way).

Each message of the batch then ends on its own: the handler raised :class:`~keyedconsumer.BatchFailed`
naming some messages (they end with their exception, the others as if it returned), raised anything
else (every message it did not acknowledge with ``ack_success`` / ``ack_skip`` ends with that
exception: Karafka's ``mark_as_consumed``), or returned (each as its ``ack_*`` call said; done by
default). That end goes through the *outcome middlewares* of the consumer (``Retry``,
``DeadLetter``, ``Recover``: those whose class sets ``outcome_only = True``), one message at a
time, and is settled as a per-message handler's end (:class:`~.settle.Settler`): one failed message
is retried or dead-lettered alone, its key waits, the others are done.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any

from ..errors import HandlerContractViolation, HandlerTimeoutError
from ..message import Message, Status
from ..outcomes import BatchFailed
from .delivery import Delivery
from .handler import Middleware, compose, is_async
from .outcome import Outcome, Retry
from .results import Results

#: ``settle(msg, exception_or_None) -> Outcome`` (:class:`~.settle.Settler`).
Settle = Callable[[Message, "BaseException | None"], Outcome]

__all__ = ["BatchHandler", "BatchRun", "OUTCOME_ONLY", "check_batch_middlewares", "alone"]

log = logging.getLogger("keyedconsumer")

#: ``def handle(msgs: list[Message]) -> None`` or ``async def``.
BatchHandler = Callable[[list[Message]], None] | Callable[[list[Message]], Awaitable[None]]

#: The class attribute of a middleware that acts only on a message's end (what its handler raised,
#: its ``msg.status``), never before the handler nor around its run: such a middleware can wrap
#: each message's end of a batch. ``Retry``, ``DeadLetter`` and ``Recover`` set it.
OUTCOME_ONLY = "outcome_only"

#: A message's ack before the batch handler raised keeps it done (Karafka's ``mark_as_consumed``).
_ACKED = (Status.SUCCESS, Status.SKIP, Status.DEAD_LETTERED)


def check_batch_middlewares(middlewares: Sequence[Middleware]) -> None:
    """Refuse middlewares that cannot wrap a batch's per-message ends.

    Raises
    ------
    TypeError
        One of ``middlewares`` does not set ``outcome_only = True`` (``Typed``, ``Logging``,
        ``Metrics``, ``Tracing``, ``Audit`` act before or around a message's run, which a batch
        handler's messages do not have one by one), or ``middlewares`` is not a list (as
        :func:`~.handler.compose`).
    """
    if isinstance(middlewares, (str, bytes)) or callable(middlewares) or not hasattr(middlewares, "__iter__"):
        return  # compose() says what is wrong
    for i, mw in enumerate(middlewares):
        if getattr(mw, OUTCOME_ONLY, False) is not True:
            name = mw.__name__ if isinstance(mw, type) else type(mw).__name__
            raise TypeError(
                f"middlewares[{i}] ({name}) cannot wrap a batch handler: a batch handler takes the "
                "middlewares that act on each message's end only (Retry, DeadLetter, Recover; a "
                f"middleware class with {OUTCOME_ONLY} = True); decode, log, measure or trace "
                "inside the batch handler"
            )


class BatchRun:
    """One batch's call and each of its messages' ends through the outcome middlewares.

    Parameters
    ----------
    handler:
        The batch handler (already under its time limit), plain or ``async def``.
    middlewares:
        Outcome middlewares (:func:`check_batch_middlewares`), the first given outermost; each
        message's end runs through them as if the handler had ended that message alone.
    results:
        The consumer's :class:`~.results.Results`: each message's records (``msg.produce`` in the
        batch call) are written with its end, as a per-message handler's are (dropped if it failed).
    """

    def __init__(
        self, handler: BatchHandler, middlewares: Sequence[Middleware], results: Results | None = None
    ) -> None:
        if not callable(handler):
            raise TypeError(f"batch_handler must be callable, got {type(handler).__name__}")
        check_batch_middlewares(middlewares)
        self.handler: Any = handler
        self.is_async = is_async(handler)
        # a message's exception and the traceback it was raised with, until its chain ran (one
        # exception may end every message of a batch: each raise starts from that traceback, so
        # it does not grow with every message)
        self._ends: dict[Message, tuple[BaseException, TracebackType | None]] = {}
        ends = self._ends

        if self.is_async:

            async def end_async(msg: Message) -> None:
                end = ends.pop(msg, None)
                if end is not None:
                    raise end[0].with_traceback(end[1])

            self.chain: Any = compose(
                results.wrap(end_async, drop_at_start=False) if results else end_async, middlewares
            )
        else:

            def end(msg: Message) -> None:
                found = ends.pop(msg, None)
                if found is not None:
                    raise found[0].with_traceback(found[1])

            self.chain = compose(results.wrap(end, drop_at_start=False) if results else end, middlewares)

    def ends(self, msgs: list[Message], exc: BaseException | None) -> set[Message]:
        """Record what each of ``msgs`` ended with, from the batch call's exception ``exc``.
        Returns the messages that failed together with the batch (an exception that said nothing of
        each message): their retries run alone (:func:`alone`), so one poison message cannot fail its
        batch-mates again and again into the dead-letter topic."""
        if exc is None:
            return set()
        if isinstance(exc, BatchFailed):
            batch = set(msgs)
            for msg, error in exc.errors.items():
                if msg in batch:
                    self._ends[msg] = (error, error.__traceback__)
                else:
                    log.warning("BatchFailed names %r, which is not in the batch: ignored", msg)
            return set()
        tb = exc.__traceback__
        together = set()
        for msg in msgs:
            # past the time limit, or a broken contract: every message, acknowledged or not
            if msg.status not in _ACKED or isinstance(exc, (HandlerContractViolation, HandlerTimeoutError)):
                self._ends[msg] = (exc, tb)
                together.add(msg)
        return together if len(msgs) > 1 else set()

    def settle_sync(self, started: list[Delivery], settle: Settle) -> list[tuple[Delivery, Outcome]]:
        """Each message's end through the chain, settled."""
        out: list[tuple[Delivery, Outcome]] = []
        chain = self.chain
        for dl in started:
            msg = dl.msg
            try:
                chain(msg)
            except BaseException as exc:  # this message's end only
                out.append((dl, settle(msg, exc)))
            else:
                out.append((dl, settle(msg, None)))
            finally:
                self._ends.pop(msg, None)  # a middleware that did not call the handler left it
        return out

    async def settle_async(self, started: list[Delivery], settle: Settle) -> list[tuple[Delivery, Outcome]]:
        out: list[tuple[Delivery, Outcome]] = []
        chain = self.chain
        for dl in started:
            msg = dl.msg
            try:
                await chain(msg)
            except BaseException as exc:  # this message's end only
                out.append((dl, settle(msg, exc)))
            else:
                out.append((dl, settle(msg, None)))
            finally:
                self._ends.pop(msg, None)  # a middleware that did not call the handler left it
        return out


def alone(results: list[tuple[Delivery, Outcome]], together: set[Message]) -> list[tuple[Delivery, Outcome]]:
    """``results`` with the retries of the messages that failed ``together`` with their batch made
    to run alone (``Retry(alone=True)``): the next call tells which of them fails."""
    if not together:
        return results
    return [
        (d, Retry(o.delay_s, alone=True)) if type(o) is Retry and d.msg in together else (d, o)
        for d, o in results
    ]
