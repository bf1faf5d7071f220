"""A one-way flag between threads, read on the hot path without a lock."""

from __future__ import annotations

__all__ = ["Latch"]


class Latch:
    """Set from any thread (``stop()``, a signal handler, a worker's failure), read by the owner and
    the workers before each message: ``on`` becomes ``True`` once and stays so until the run that
    owns it is over (:meth:`clear`). An attribute store and load are each atomic in CPython, so no
    lock is needed; a reader sees the change at its next check (``threading.Event.is_set`` costs a
    Python call per check, this an attribute load)."""

    __slots__ = ("on",)

    def __init__(self) -> None:
        self.on = False

    def set(self) -> None:
        self.on = True

    def clear(self) -> None:
        self.on = False
