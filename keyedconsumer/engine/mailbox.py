"""The owner thread's mailbox: how the workers' outcomes (and other threads' posts) reach the owner.

Split from :mod:`.workers`, which hands work the other way. A worker posts quietly and rings the
owner's bell only when the units queued ahead of the workers run low (:func:`.workers.low_water`);
the owner drains the posts in bulk and tells how long it took to answer a ring
(:meth:`Mailbox.answered`), which sizes that queue (:meth:`.handout.HandOut.turn`).
"""

from __future__ import annotations

import queue
import time
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["Mailbox"]


class Mailbox:
    """The owner thread's inbox: ``post(fn, arg)`` from any thread (a worker, a lease renewer, a
    signal handler: ``deque.append`` and ``SimpleQueue.put`` are atomic and reentrant), ``fn(arg)``
    run by the owner in :meth:`drain`, in the order posted.

    A post normally wakes the owner (rings its bell). A worker posts a unit's outcomes *quietly*
    (:meth:`post_quiet`) and rings only when the units queued ahead of the workers run low (a
    quarter of the reserve or fewer left: :func:`.workers.low_water`), when it finds no unit to
    take next, or when the owner :meth:`hurry`-s (waiting for every running handler): the owner
    then drains many outcomes per wake-up instead of waking once a message (Confluent Parallel
    Consumer's control loop drains its ``workMailBox`` in bulk the same way)."""

    __slots__ = ("_posts", "_bell", "post", "eager", "_rang_at", "_answer_s")

    def __init__(self) -> None:
        self._posts: deque[tuple[Callable[[Any], None], Any]] = deque()
        self._bell: queue.SimpleQueue[None] = queue.SimpleQueue()
        self.post = self._post
        #: The owner waits for every outcome now (a revoke, a stop): workers ring on each post.
        self.eager = False
        self._rang_at = 0.0  # when the first :meth:`ring` not answered yet came (perf_counter)
        self._answer_s = 0.0  # the longest answer to a ring since :meth:`answered` (seconds)

    def _post(self, fn: Callable[[Any], None], arg: Any = None) -> None:
        self._posts.append((fn, arg))
        self._bell.put(None)

    def post_quiet(self, fn: Callable[[Any], None], arg: Any = None) -> None:
        """Post without waking the owner: it runs ``fn(arg)`` at its next drain (at the latest when
        its current wait times out, or when someone :meth:`ring`-s)."""
        self._posts.append((fn, arg))

    def ring(self) -> None:
        """Wake the owner (if it waits) to drain what was posted."""
        if not self._rang_at:
            self._rang_at = time.perf_counter()
        self._bell.put(None)

    def hurry(self, on: bool) -> None:
        """(The owner.) While on, workers ring on every post (see :attr:`eager`)."""
        self.eager = on

    def __bool__(self) -> bool:
        """The bell rang since the last drain: the owner is asked to come back at once."""
        return not self._bell.empty()

    def drain(self) -> int:
        """Run everything posted so far (owner thread). Returns how many."""
        rang_at, self._rang_at = self._rang_at, 0.0
        if rang_at:
            self._answer_s = max(self._answer_s, time.perf_counter() - rang_at)
        bell = self._bell
        while not bell.empty():  # the rings up to here are answered by this drain
            try:
                bell.get_nowait()
            except queue.Empty:
                break
        posts = self._posts
        n = 0
        while True:
            try:
                fn, arg = posts.popleft()
            except IndexError:
                return n
            fn(arg)
            n += 1

    def answered(self) -> float:
        """(The owner.) The longest time from a worker's :meth:`ring` to the owner's drain that
        answered it since the last call, in seconds (0.0: no ring came)."""
        out, self._answer_s = self._answer_s, 0.0
        return out

    def wait(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` seconds for the bell (quiet posts do not end the wait, but while
        :attr:`eager` none is waited for), then :meth:`drain`. Returns how many posts ran (0: nothing came)."""
        if timeout_s > 0 and self._bell.empty() and not (self.eager and self._posts):
            try:
                self._bell.get(timeout=timeout_s)
            except queue.Empty:
                pass
        return self.drain()
