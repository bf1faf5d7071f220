"""The records handlers produce (``msg.produce``): written before their message counts done.

Each attempt starts with no records (an earlier attempt's are dropped) and an attempt that raises,
or calls ``ack_fail``, writes none. When the handler returns normally:

- without ``transactional``, :meth:`Results.wrap`'s wrapper writes the attempt's records and waits
  for the broker's acknowledgement before the handler chain returns, so the message counts done
  only after that; a record not acknowledged fails the attempt with ``PublishError``, which
  ``Retry`` and ``DeadLetter`` (outside the wrapper) handle like any failure;
- with ``transactional``, the settler hands the records of a message settled done to
  :meth:`Results.finished` *before* the dispatcher marks it done, and the poll thread's
  transaction (:mod:`.transactions`) takes them with :meth:`Results.take_finished` *after* it read
  the offsets to commit: every message those offsets cover has its records taken by then.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ..errors import PublishError
from ..message import Message, Record, Status
from .handler import is_async

if TYPE_CHECKING:
    from ..kafka import BatchPublisher
    from .partitions import Partition

__all__ = ["Results", "Finished"]

#: The records of one message settled done: ``(its partition's assignment, its offset, records)``.
Finished = tuple["Partition | None", int, list[Record]]


class Results:
    """The produced records of one consumer (see the module docstring).

    Parameters
    ----------
    transactional:
        ``ConsumerConfig.transactional``.
    produce_timeout_s:
        ``ConsumerConfig.produce_timeout_s``: how long a record is tried (without ``transactional``).
    concurrency:
        ``ConsumerConfig.concurrency``: the threads an ``async def`` handler's waits for
        acknowledgements take (a pool of its own, not the event loop's default executor).
    """

    def __init__(self, transactional: bool, produce_timeout_s: float, concurrency: int = 1) -> None:
        self._transactional = transactional
        self._timeout_s = produce_timeout_s
        self._concurrency = concurrency
        self._waiters: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._make_publisher: Callable[[float], BatchPublisher] | None = None
        self._publisher: BatchPublisher | None = None
        self._finished: deque[Finished] = deque()
        #: Records written (acknowledged) without ``transactional``, over every run.
        self.published = 0

    # -- a run ------------------------------------------------------------------------------------

    def attach(self, make_publisher: Callable[[float], BatchPublisher]) -> None:
        """A run starts: ``make_publisher(delivery_timeout_s)`` builds the publisher on first use
        (the run's Kafka client's :meth:`~keyedconsumer.kafka.KafkaClient.publisher`)."""
        with self._lock:
            self._make_publisher = make_publisher
            self._finished.clear()

    def detach(self) -> None:
        """The run ended: release the publisher (its records were all answered already)."""
        with self._lock:
            publisher, self._publisher, self._make_publisher = self._publisher, None, None
            waiters, self._waiters = self._waiters, None
        if waiters is not None:
            waiters.shutdown(wait=False)
        if publisher is not None:
            publisher.close(1.0)

    # -- the handler wrapper (innermost but for the time limit) -----------------------------------

    def wrap(self, handler: Any, drop_at_start: bool = True) -> Any:
        """``handler`` (plain or ``async def``) with the attempt's records dropped at its start and
        when it fails, and, without ``transactional``, written when it returns.

        ``drop_at_start=False`` keeps the records present at the start: a batch handler's message
        ends in a call of its own after the batch call produced them (``engine/batch.py``)."""
        if not callable(handler):
            return handler  # the handler contract's check refuses it (TypeError)
        transactional = self._transactional
        if is_async(handler):

            async def producing_async(msg: Message) -> Any:
                if drop_at_start:
                    msg.take_produced()
                try:
                    result = await handler(msg)
                except BaseException:
                    msg.take_produced()
                    raise
                if msg.status is Status.FAIL:
                    msg.take_produced()
                elif not transactional and msg._produced:
                    records = msg.take_produced()
                    await asyncio.get_running_loop().run_in_executor(
                        self._waiter_pool(), self._publish, msg, records
                    )
                return result

            return producing_async

        def producing(msg: Message) -> Any:
            if drop_at_start:
                msg.take_produced()
            try:
                result = handler(msg)
            except BaseException:
                msg.take_produced()
                raise
            if msg.status is Status.FAIL or (result is not None and inspect.isawaitable(result)):
                msg.take_produced()  # failed, or the handler contract is broken (the engine stops)
            elif not transactional and msg._produced:
                self._publish(msg, msg.take_produced())
            return result

        return producing

    def _waiter_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._waiters is None:
                self._waiters = ThreadPoolExecutor(
                    self._concurrency, thread_name_prefix="keyedconsumer-produce"
                )
            return self._waiters

    def _publisher_now(self) -> BatchPublisher:
        with self._lock:
            if self._publisher is None:
                if self._make_publisher is None:
                    raise PublishError(
                        "msg.produce() outside a consumer's run: nothing can write the records"
                    )
                self._publisher = self._make_publisher(self._timeout_s)
            return self._publisher

    def _publish(self, msg: Message, records: list[Record]) -> None:
        """Write ``records`` and wait for each one's acknowledgement.

        Raises
        ------
        PublishError
            A record was not acknowledged (the first such error, naming the message); the others
            may have been written: the attempt's retry writes them all again (at-least-once).
        """
        results = self._publisher_now().publish_many(records)
        failed = [r for r in results if isinstance(r, PublishError)]
        if failed:
            raise PublishError(
                f"{len(failed)} of {len(records)} record(s) produced by {msg.topic}[{msg.partition}]@{msg.offset} "
                f"not acknowledged: {failed[0]}"
            )
        with self._lock:
            self.published += len(records)

    # -- transactional: from the settler to the poll thread's transaction -------------------------

    def finished(self, msg: Message) -> None:
        """``msg`` settled done (a worker, before the dispatcher marks it done): with
        ``transactional``, queue its records for the next transaction."""
        if not self._transactional or not msg._produced:
            return
        records = msg.take_produced()
        delivery = msg._delivery() if msg._delivery is not None else None  # the engine's record of it
        part = delivery.part if delivery is not None else None
        self._finished.append((part, msg.offset, records))

    def take_finished(self) -> list[Finished]:
        """The queued records of messages settled done, oldest first (the poll thread)."""
        q = self._finished
        out: list[Finished] = []
        while q:
            try:
                out.append(q.popleft())
            except IndexError:
                break
        return out
