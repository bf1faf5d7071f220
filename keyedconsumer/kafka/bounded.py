"""Bounded waits on librdkafka calls that may wait on the broker longer than their caller may.

librdkafka's synchronous consumer commit and ``close()`` take no timeout, and
``send_offsets_to_transaction`` waits for its request's answer past its own timeout: a stopped
broker holds them up to ``socket.timeout.ms`` (confluent-kafka-python #1667, librdkafka #1002). A
librdkafka handle may be used from several threads, so such a call is made from a helper thread
(:class:`Pending`) and waited for only as long as the caller may; it then finishes, or not, on its
own. A :class:`Deadline` is the caller's bound, which a stop requested meanwhile may cut.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["Deadline", "Pending", "SLICE_S"]

#: Longest single wait of a bounded or resumable call (seconds): between slices the deadline is read
#: again, so a stop requested meanwhile cuts the wait within about this much.
SLICE_S = 0.5


class Deadline:
    """When a step must be over: ``timeout_s`` seconds from now, cut further whenever ``budget``
    (``budget(cap_s) -> seconds``, the engine's stop deadline) allows less; never extended."""

    def __init__(self, timeout_s: float, budget: Callable[[float], float] | None = None) -> None:
        self._end = time.monotonic() + max(0.0, timeout_s)
        self._budget = budget

    def left(self) -> float:
        """Seconds left (<= 0: over)."""
        now = time.monotonic()
        if self._budget is not None:
            self._end = min(self._end, now + self._budget(max(0.0, self._end - now)))
        return self._end - now

    def slice(self) -> float:
        """The timeout of the next slice of a resumable call (at least 10 ms: one attempt)."""
        return max(0.01, min(SLICE_S, self.left()))


class Pending:
    """``call()`` made from a daemon thread, waited for in bounded steps; its result or exception
    is kept for the caller."""

    def __init__(self, call: Callable[[], Any], name: str) -> None:
        self._outcome: tuple[bool, Any] = (False, None)
        self._done = threading.Event()

        def run() -> None:
            try:
                self._outcome = (True, call())
            except BaseException as exc:  # handed to the caller by result()
                self._outcome = (False, exc)
            finally:
                self._done.set()

        threading.Thread(target=run, name=f"keyedconsumer-{name}", daemon=True).start()

    def wait(self, deadline: Deadline) -> bool:
        """Whether the call returned before ``deadline``."""
        while not self._done.wait(max(0.0, min(SLICE_S, deadline.left()))):
            if deadline.left() <= 0:
                return False
        return True

    @property
    def error(self) -> BaseException | None:
        """What the call raised (``None``: it returned, or has not ended)."""
        ok, value = self._outcome
        return None if ok else value

    def result(self) -> Any:
        """What the call returned; raises what it raised. Only once :meth:`wait` said it ended."""
        ok, value = self._outcome
        if not ok:
            raise value
        return value
