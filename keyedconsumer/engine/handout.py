"""Handing out work: what the owner gives its workers, and what comes back.

The owner (:mod:`.run`) keeps the workers busy: each worker gets one unit and, with several
workers, ``concurrency`` more wait on their shared queue, so none waits for a hand-over and the
owner wakes once for many outcomes, not once a message (:class:`~.workers.Mailbox`;
:meth:`HandOut.dispatch`). A revoke or a stop takes the queued units back (:meth:`HandOut.rescue`). One worker gets one unit at a time:
it runs everything in admission order, each partition in offset order (work handed out ahead of
it, or taken back from it, could otherwise pass a message queued behind a head not finished yet).
A batch handler's partial batch waits while the last poll was full (more records are at hand) and
up to ``handler_batch_linger_s``. A worker stuck in a slow handler gets the unstarted rest of its
chunk taken back (:meth:`HandOut.rescue`).
"""

from __future__ import annotations

import time

from .engine import Engine
from .workers import Results, Unit, Workers

__all__ = ["HandOut", "RESCUE_EVERY_S"]

#: How often the owner looks for a worker stuck in a slow handler (seconds).
RESCUE_EVERY_S = 0.005


class HandOut:
    """The units handed to the workers of one run and not reported yet (owner thread only).

    Parameters
    ----------
    engine, workers:
        The run's engine and worker pool.
    batch_size, linger_s:
        ``handler_batch_size`` and ``handler_batch_linger_s`` for a batch handler (``batch_size``
        0: a per-message handler).
    """

    def __init__(self, engine: Engine, workers: Workers, batch_size: int = 0, linger_s: float = 0.0) -> None:
        self._engine = engine
        self._workers = workers
        self._batch_size = batch_size
        self._linger_s = linger_s
        self.outstanding = 0  # units handed out whose outcomes were not reported yet
        #: When a partial batch stops waiting for more ready heads (monotonic seconds), or ``None``.
        self.linger_until: float | None = None
        #: Batch handlers: the last poll was full, more records are at hand.
        self.more = False
        self.next_rescue = 0.0

    def dispatch(self) -> None:
        """Hand ready heads to the workers, up to what they can take without waiting for the owner:
        one unit a worker and, with several workers, as many again queued ahead (a batch handler:
        one batch a worker). One worker gets one unit at a time, so it runs everything in admission
        order (at ``concurrency=1`` each partition's offsets start in offset order)."""
        engine, workers = self._engine, self._workers
        if not engine.ready_count():
            self.linger_until = None
            return
        if self._batch_size:
            units = self._batches(workers.concurrency - self.outstanding)
        else:
            n = workers.concurrency
            units = engine.take((2 * n if n > 1 else 1) - self.outstanding)
        if units:
            self.outstanding += len(units)
            workers.submit(units)

    def _batches(self, room: int) -> list[Unit]:
        engine, size = self._engine, self._batch_size
        out = []
        while room > 0 and engine.ready_count():
            if engine.ready_count() < size and not (engine.halted or engine.stopping):
                if self.more:
                    break
                now = time.monotonic()
                if self.linger_until is None:
                    self.linger_until = now + self._linger_s
                if now < self.linger_until:
                    break
            out.append(engine.take_batch(size))
            room -= 1
        if not engine.ready_count():
            self.linger_until = None
        return out

    def polled(self, got: int, asked: int) -> None:
        """A poll returned ``got`` of the ``asked`` records: a batch handler's partial batch is not
        cut while records are at hand (the poll was full)."""
        self.more = bool(self._batch_size) and got >= asked

    def report(self, outcome: tuple[Results, float]) -> None:
        """A worker ended a unit (run by the mailbox, in the owner thread)."""
        self.outstanding -= 1
        results, elapsed_s = outcome
        if results:
            self._engine.finish(results, elapsed_s)

    def rescue(self, force: bool) -> None:
        """Take back from a worker stuck in one handler for more than
        :data:`~.workers.RESCUE_AFTER_S` (or from every worker with ``force``) the messages of its
        chunk it has not started, and settle the outcomes it has not reported yet. With ``force``
        the chunks queued ahead of the workers and not taken yet come back as well (a batch
        handler's batches are not queued ahead: see :meth:`dispatch`)."""
        now = time.monotonic()
        self.next_rescue = now + RESCUE_EVERY_S
        engine = self._engine
        if force and not self._batch_size:  # the chunks no worker has taken yet come back too
            queued = self._workers.take_queued()
            self.outstanding -= len(queued)
            for unit in queued:
                engine.give_back(reversed(unit))
        for slot in self._workers.slots:
            rest, results = slot.take_back(force, now)
            if rest:  # first: a message taken along behind one of the results goes back to its lane
                engine.give_back(reversed(rest))
            if results:
                engine.finish(results)
