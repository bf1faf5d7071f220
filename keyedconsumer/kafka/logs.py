"""librdkafka's log and the Kafka clients' errors in Python logging, each repeat counted, not logged.

**librdkafka's log.** Every client the package makes (the engine's consumer, :class:`~keyedconsumer.Publisher`
and so ``DeadLetter``'s and the audit trail's producers, the transactional producer) passes
:data:`librdkafka_log` as confluent-kafka's ``logger`` property, unless ``config`` gives a
``logger`` of its own: librdkafka's lines then go to the Python logger ``keyedconsumer.kafka.librdkafka``
(syslog level 3 as ``ERROR``, 4 as ``WARNING``, 5 and 6 as ``INFO``, 7 as ``DEBUG``; the message is
``FACILITY [client name] text``) and take the application's logging setup (``--log-format json``),
instead of librdkafka printing them to stderr itself. confluent-kafka hands them over when the
client is polled. The command line's admin clients log to ``keyedconsumer.kafka.tools``
(:mod:`keyedconsumer.kafka.admin`).

**Repeats.** A broker that is down makes librdkafka report the same failure at every connection
attempt: measured here with ``127.0.0.1:1``, about 20 a second while a client waits for metadata,
once as its ``FAIL`` log line and once to ``error_cb``. :class:`Repeats` lets the first of each kind
through, counts the others, and after :data:`REPEAT_EVERY_S` lets the next one through with the
count; :func:`flush` logs the counts not yet told (a client calls it when it closes). Only warnings
and errors are collapsed: librdkafka's ``debug`` output (``DEBUG``) is logged whole. A kind is the
text without librdkafka's timing (``(after 0ms in state CONNECT)``), the client's name and the
broker thread's name: two clients failing on one broker are one kind.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

__all__ = [
    "REPEAT_EVERY_S",
    "COLLAPSED_FROM",
    "MAX_KINDS",
    "Repeats",
    "RepeatCollapsingLog",
    "librdkafka_log",
    "client_errors",
    "flush",
    "kind_of",
]

#: Seconds after a kind was last logged before its next repeat is logged, with the count.
REPEAT_EVERY_S = 60.0
#: The lowest level collapsed: warnings and errors; ``INFO`` and ``DEBUG`` lines (librdkafka's
#: ``debug`` output) are all logged.
COLLAPSED_FROM = logging.WARNING
#: The kinds :class:`Repeats` remembers (the least recent is forgotten, its count logged first):
#: the bound of its memory, whatever texts the clients produce.
MAX_KINDS = 256

#: librdkafka's timing and suppression note, e.g. ``(after 0ms in state CONNECT, 1 identical error(s)
#: suppressed)``, and a broker thread's name, ``[thrd:127.0.0.1:1/bootstrap]: ``.
_NOISE = re.compile(
    r"\s*\(after \d+ms in state \w+(?:, \d+ identical error\(s\) suppressed)?\)|\[thrd:[^\]]*\]:\s*"
)


def kind_of(text: str) -> str:
    """The kind of a message: ``text`` without librdkafka's timing and broker thread name."""
    return _NOISE.sub("", text).strip()


class Repeats:
    """Counts the repeats of each kind of message (any hashable key). Thread-safe.

    Parameters
    ----------
    every_s:
        Seconds after a kind was last let through before its next repeat is.
    clock:
        Monotonic seconds (tests pass a fake one).
    max_kinds:
        Kinds remembered; past it the one let through least recently is forgotten, and its count
        not told yet is handed to ``on_forget(sample, count, seconds)``.
    """

    def __init__(
        self,
        *,
        every_s: float = REPEAT_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
        max_kinds: int = MAX_KINDS,
        on_forget: Callable[[Any, int, float], None] | None = None,
    ) -> None:
        self.every_s = every_s
        self._clock = clock
        self._max = max_kinds
        self._on_forget = on_forget
        self._lock = threading.Lock()
        #: kind -> [when last let through (monotonic s), repeats counted since, the latest sample]
        self._seen: OrderedDict[Hashable, list[Any]] = OrderedDict()

    def admit(self, kind: Hashable, sample: Any = None) -> tuple[int, float] | None:
        """``None``: a repeat, counted (do not log it); ``sample`` (what to show of it) is kept.
        Else ``(count, seconds)``: log it, with ``count`` repeats not logged in the last
        ``seconds`` (``(0, 0.0)`` for the first)."""
        forgotten: list[tuple[Any, int, float]] = []
        now = self._clock()
        with self._lock:
            seen = self._seen.get(kind)
            if seen is not None and now - seen[0] < self.every_s:
                seen[1] += 1
                seen[2] = sample
                return None
            out = (0, 0.0) if seen is None else (int(seen[1]), now - seen[0])
            self._seen[kind] = [now, 0, sample]
            self._seen.move_to_end(kind)
            while len(self._seen) > self._max:
                _, (at, count, old) = self._seen.popitem(last=False)
                if count:
                    forgotten.append((old, count, now - at))
        if self._on_forget is not None:
            for old, count, seconds in forgotten:
                self._on_forget(old, count, seconds)
        return out

    def untold(self) -> list[tuple[Any, int, float]]:
        """``[(sample, count, seconds)]``: each kind's repeats not told yet (its latest sample, their
        count, the seconds since it was last let through), which count as told from now."""
        now = self._clock()
        out: list[tuple[Any, int, float]] = []
        with self._lock:
            for seen in self._seen.values():
                if seen[1]:
                    out.append((seen[2], int(seen[1]), now - seen[0]))
                    seen[0], seen[1] = now, 0
        return out


class RepeatCollapsingLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """A logger that logs the first of each kind of warning or error, counts its repeats, and logs
    the next one after :data:`REPEAT_EVERY_S` with ``(N more like it in the last S s)``;
    :meth:`flush` logs the counts not told yet. Lower levels are logged as they come.

    A kind is the level and :func:`kind_of` the message, its arguments at ``ignore_args`` left out
    (confluent-kafka calls ``logger.log(level, "%s [%s] %s", facility, client name, text)``: the
    client name, argument 1, is left out).
    """

    def __init__(self, logger: logging.Logger, *, ignore_args: tuple[int, ...] = ()) -> None:
        super().__init__(logger, {})
        self._ignore = ignore_args
        self.repeats = Repeats(on_forget=self._tell)

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        if not self.isEnabledFor(level):
            return
        if level < COLLAPSED_FROM:  # librdkafka's debug output (the debug property) stays whole
            self.logger.log(level, msg, *args, **kwargs)
            return
        told = self.repeats.admit((level, self._kind(msg, args)), (level, msg, args))
        if told is None:
            return
        count, seconds = told
        if count:
            msg, args = f"{msg} (%d more like it in the last %.0f s)", (*args, count, seconds)
        self.logger.log(level, msg, *args, **kwargs)

    def _kind(self, msg: Any, args: tuple[Any, ...]) -> str:
        kept = tuple("" if i in self._ignore else a for i, a in enumerate(args))
        try:
            text = str(msg) % kept if kept else str(msg)
        except (TypeError, ValueError):  # not a %-format of these arguments
            text = f"{msg} {kept}"
        return kind_of(text)

    def _tell(self, sample: Any, count: int, seconds: float) -> None:
        level, msg, args = sample
        self.logger.log(level, f"{msg} (%d more like it in the last %.0f s)", *args, count, seconds)

    def flush(self) -> None:
        """Log the count of each kind's repeats not told yet, with the latest of them."""
        for sample, count, seconds in self.repeats.untold():
            self._tell(sample, count, seconds)


#: The ``logger`` every client of the package gives confluent-kafka (see the module docstring).
librdkafka_log = RepeatCollapsingLog(logging.getLogger("keyedconsumer.kafka.librdkafka"), ignore_args=(1,))
#: The engine's warnings of client errors no ``error_handler`` took (``KafkaClientError`` texts),
#: logged to ``keyedconsumer``.
client_errors = RepeatCollapsingLog(logging.getLogger("keyedconsumer"))


def flush() -> None:
    """Log the counts of the repeats not told yet, librdkafka's and the client errors'."""
    librdkafka_log.flush()
    client_errors.flush()
