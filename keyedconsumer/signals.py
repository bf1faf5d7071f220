"""One owner of SIGINT and SIGTERM for every consumer of the process.

Each consumer registers here while it runs (``run()`` and ``run_async()``, in any thread). One
handler for SIGINT and SIGTERM calls ``stop()`` on every registered consumer, so one signal stops
all the consumers of a process, however they run. Python lets only the main thread install signal
handlers: the handler is installed when a consumer registers from the main thread (``run()`` there,
or ``run_async()`` on the main thread's event loop), and the handlers it replaced are put back when
the last consumer unregisters. A consumer running in another thread registers too, and is stopped
by the handler whenever one is installed; with no consumer of the main thread (now or earlier),
none is, and the signals keep their previous handlers.

When the last consumer unregisters from another thread (which may not touch signal handlers), the
handler stays installed until the main thread registers or unregisters a consumer again; if a
signal comes first, the handler puts the previous handlers back and passes the signal on to the one
it replaced (``SIG_DFL``: the signal is raised again; ``SIG_IGN``: nothing), as if it had been
removed in time.

:func:`guard` holds the signals for a whole block of the main thread whose job is to run consumers
(``keyedconsumer run``, ``KeyedApp.run()``), also while none is registered: a signal before the
first consumer registers is remembered and stops each consumer that registers later in the block,
at once (``stop()`` before ``run()``); one after the last consumer ended changes nothing (the
block is ending). So a signal at any moment of the block stops it cleanly, once, never by the
default action (which kills the process; and which the kernel drops for PID 1 of a PID namespace,
a container's entry point: there a SIGTERM during start-up would be lost and the consumer would
run on).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any, Protocol

__all__ = ["SIGNALS", "register", "unregister", "registered", "guard"]

#: The signals that stop every registered consumer.
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stoppable(Protocol):
    def stop(self) -> None: ...


_lock = threading.RLock()  # re-entrant: the handler runs in the main thread, which may hold it
_running: list[Stoppable] = []  # the registered consumers (a consumer may run twice: once per entry)
_replaced: dict[int, Any] | None = None  # the handlers ours replaced, while ours is installed
_guards = 0  # guard() blocks of the main thread now open
_stop_requested = False  # a signal came within the open guard() blocks: consumers registering stop


def register(consumer: Stoppable) -> None:
    """Register a running consumer; from the main thread, install the handler if it is not."""
    with _lock:
        _running.append(consumer)
        if threading.current_thread() is threading.main_thread():
            _install()
        if _stop_requested:
            consumer.stop()  # a signal came before it registered, within a guard() block


def unregister(consumer: Stoppable) -> None:
    """Unregister a consumer whose run ended; from the main thread, when it was the last one, put
    back the handlers ours replaced (from another thread that waits: see the module docstring)."""
    with _lock:
        try:
            _running.remove(consumer)
        except ValueError:
            pass
        if not _running and not _guards and threading.current_thread() is threading.main_thread():
            _restore()


def registered() -> list[Stoppable]:
    """The consumers registered now, in registration order."""
    return list(_running)


@contextlib.contextmanager
def guard() -> Iterator[None]:
    """Hold SIGINT and SIGTERM for the block (see the module's docs): installed on entry, put back
    on exit (unless a consumer still runs then). Usable as a decorator. In another thread than the
    main one it does nothing (only the main thread may install signal handlers). Blocks may nest."""
    global _guards, _stop_requested
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    with _lock:
        _guards += 1
        _install()
    try:
        yield
    finally:
        with _lock:
            _guards -= 1
            if not _guards:
                _stop_requested = False
                if not _running:
                    _restore()


def _install() -> None:
    global _replaced
    if _replaced is None:
        _replaced = {}
    for sig in SIGNALS:
        current = signal.getsignal(sig)
        if current is not _on_signal:  # not ours yet, or replaced by someone since: ours again
            _replaced[sig] = current
            signal.signal(sig, _on_signal)


def _restore() -> None:
    global _replaced
    if _replaced is None:
        return
    for sig, previous in _replaced.items():
        if signal.getsignal(sig) is _on_signal:  # replaced by someone since: theirs stays
            # None: a handler not installed from Python; the default is the closest Python can set
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
    _replaced = None


def _on_signal(signum: int, frame: FrameType | None) -> None:
    global _stop_requested
    consumers = list(_running)
    if _guards:
        _stop_requested = True  # every consumer registering later in the block stops at once
    if consumers:
        for consumer in consumers:
            consumer.stop()  # returns at once: safe in a signal handler
        return
    if _guards:
        return  # before the first consumer, or after the last, of a guard() block
    # No consumer runs: the last one ended in another thread, which could not restore the handlers.
    with _lock:
        previous = (_replaced or {}).get(signum)
        _restore()
        if signal.getsignal(signum) is _on_signal:  # nothing to put back: never loop on ourselves
            signal.signal(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:  # SIG_DFL (or unknown): the default action, now restored
        signal.raise_signal(signum)
