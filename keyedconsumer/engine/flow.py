"""In-flight accounting and the back-pressure question.

Buffered messages (admitted and not finished or dropped), running ones (taken by a worker), their
key + value bytes, and, from these: how many records to ask of the next poll, whether to pause
fetching, and whether to resume. Pure data: the dispatcher's lock guards the counts.
"""

from __future__ import annotations

__all__ = ["InFlight"]


class InFlight:
    """Counts of messages in the engine's hands, and the back-pressure decisions on them.

    Parameters
    ----------
    max_messages, max_bytes:
        The bounds (``max_in_flight``, ``max_in_flight_bytes``): at either, fetching pauses; it
        resumes below half of both.
    """

    __slots__ = ("max_messages", "max_bytes", "buffered", "buffered_bytes", "running", "avg_size", "peak")

    def __init__(self, max_messages: int = 1 << 62, max_bytes: int = 1 << 62) -> None:
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self.buffered = 0
        self.buffered_bytes = 0
        self.running = 0
        self.avg_size: float | None = None  # key + value bytes per message (None: none seen yet)
        self.peak = 0  # highest number of buffered messages seen

    def admit(self, n: int, nbytes: int) -> None:
        """``n`` messages of ``nbytes`` key + value bytes in all were admitted."""
        self.buffered += n
        self.buffered_bytes += nbytes

    def started(self, n: int = 1) -> None:
        """``n`` messages were taken by a worker."""
        self.running += n

    def ended(self, n: int = 1) -> None:
        """``n`` taken messages ended or were given back."""
        self.running -= n

    def finished(self, n: int, nbytes: int) -> None:
        """``n`` taken messages of ``nbytes`` key + value bytes in all ended and are forgotten."""
        self.running -= n
        self.buffered -= n
        self.buffered_bytes -= nbytes

    def forget(self, size: int) -> None:
        """A buffered message finished or was dropped."""
        self.buffered -= 1
        self.buffered_bytes -= size

    def observe_batch(self, n: int, nbytes: int) -> None:
        """A poll returned ``n`` records, of which those admitted hold ``nbytes`` bytes: the average
        grows at once with bigger messages and shrinks slowly, so the byte bound errs on the safe side."""
        if n:
            batch_avg = max(1.0, nbytes / n)
            avg = self.avg_size
            self.avg_size = batch_avg if avg is None else max(batch_avg, avg * 0.8 + batch_avg * 0.2)
        if self.buffered > self.peak:
            self.peak = self.buffered

    def poll_size(self, batch: int) -> int:
        """How many records to ask of the next poll: at most ``batch`` and the room left under
        both bounds (the byte room divided by the average size; one while sizes are unknown)."""
        room = self.max_messages - self.buffered
        n = batch if room >= batch else max(1, room)
        avg = self.avg_size
        if avg is None:
            return 1
        room_bytes = self.max_bytes - self.buffered_bytes
        if room_bytes < n * avg:
            n = max(1, int(room_bytes // avg))
        return n

    def short_of_room(self, batch: int) -> bool:
        """Whether the next poll should wait for running messages to end first: some are in the
        engine's hands and there is room for fewer than ``batch`` records (nor half the bound).
        Waiting keeps the bound without pausing, which would drop librdkafka's prefetched queue."""
        return self.buffered > 0 and self.poll_size(batch) < min(batch, max(1, self.max_messages // 2))

    def over(self) -> bool:
        """At either bound: pause fetching."""
        return self.buffered >= self.max_messages or self.buffered_bytes >= self.max_bytes

    def under_half(self) -> bool:
        """Below half of both bounds: resume fetching."""
        return self.buffered <= self.max_messages // 2 and self.buffered_bytes <= self.max_bytes // 2
