"""Handing out work: what the owner gives its workers, and what comes back.

The owner (:mod:`.run`) keeps the workers busy: each worker gets one unit and, with several
workers, a reserve of ``concurrency`` to 3 x ``concurrency`` more wait on their shared queue, sized
to how long the owner takes to answer a ring (:meth:`HandOut.turn`), so none waits for a hand-over
and the owner wakes once for many outcomes, not once a message (:class:`~.mailbox.Mailbox`;
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
#: The queue ahead of several workers holds from ``concurrency`` units up to this many times it.
RESERVE_MAX = 3
#: The window over which :meth:`HandOut.turn` measures the units ended a second (seconds).
WINDOW_S = 0.1


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
        self._reserve = workers.concurrency  # units queued ahead of the workers (see turn)
        self._ended = 0  # units reported in the current window (see turn)
        self._window_at = 0.0  # when the current window started (perf_counter; 0.0: none yet)
        self._answer_s = 0.0  # the longest answer to a ring in the current window (seconds)
        self._lag_s = 0.0  # the owner's answer to a ring, smoothed over windows (seconds)

    def turn(self, answer_s: float, now: float) -> None:
        """(The owner, once a turn of its loop.) Size the queue ahead of several workers so that
        none waits for the owner. ``answer_s`` is the longest time the owner took to answer a
        worker's ring since the last turn (:meth:`~.mailbox.Mailbox.answered`, seconds), ``now``
        is ``time.perf_counter()``.

        A worker rings when a quarter of the reserve is left (:func:`~.workers.low_water`), and
        that quarter must last until the owner answers: the reserve is 4 x (units ended a second)
        x (the owner's answer, smoothed), from ``concurrency`` to :data:`RESERVE_MAX` times it,
        measured over windows of :data:`WINDOW_S`. The answer grows with the threads that want
        the GIL beside the owner, not with a setting (bench/README.md, "W2 c256 sync")."""
        self._answer_s = max(self._answer_s, answer_s)
        if not self._window_at:
            self._window_at = now
        elapsed_s = now - self._window_at
        if elapsed_s < WINDOW_S:
            return
        self._lag_s = (self._lag_s + self._answer_s) / 2
        rate = self._ended / elapsed_s
        self._window_at, self._ended, self._answer_s = now, 0, 0.0
        n = self._workers.concurrency
        reserve = min(RESERVE_MAX * n, max(n, int(4 * rate * self._lag_s)))
        if reserve != self._reserve:
            self._reserve = reserve
            self._workers.set_reserve(reserve)

    def dispatch(self) -> None:
        """Hand ready heads to the workers, up to what they can take without waiting for the owner:
        one unit a worker and, with several workers, the reserve queued ahead (:meth:`turn`; a batch
        handler: one batch a worker). One worker gets one unit at a time, so it runs everything in
        admission order (at ``concurrency=1`` each partition's offsets start in offset order)."""
        engine, workers = self._engine, self._workers
        if not engine.ready_count():
            self.linger_until = None
            return
        if self._batch_size:
            units = self._batches(workers.concurrency - self.outstanding)
        else:
            n = workers.concurrency
            units = engine.take((n + self._reserve if n > 1 else 1) - self.outstanding)
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
        self._ended += 1
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
