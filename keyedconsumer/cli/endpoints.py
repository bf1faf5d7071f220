"""The HTTP endpoints of the supervisor of ``keyedconsumer run --processes N``: one health endpoint and
one metrics endpoint for all the children, served from the supervisor's own loop (it runs no thread,
so that every fork is safe), one request at a time.

**Metrics** use prometheus-client's multiprocess mode: each child writes its metric values to
memory-mapped files in ``PROMETHEUS_MULTIPROC_DIR`` and the supervisor's ``/metrics`` sums them
(``MultiProcessCollector``). :class:`MetricsDir` sets the directory up before the first fork: the one
the environment names (its ``*.db`` files removed first, as prometheus-client requires), else a new
temporary one, removed at the end. When a child ends, its live gauges' files are removed
(``mark_process_dead``); its counters and histograms stay counted, as prometheus-client documents.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from http.server import HTTPServer
from pathlib import Path
from typing import Any

from ..health import ProcessesHealth, request_handler
from .errors import CliError

__all__ = ["MetricsDir", "health_server", "metrics_server", "REQUEST_TIMEOUT_S"]

log = logging.getLogger("keyedconsumer.cli.supervisor")

#: Seconds a request to the supervisor's endpoints may take to arrive: the loop that restarts the
#: children serves them, so a slow client must not hold it longer.
REQUEST_TIMEOUT_S = 2.0

_ENV = "PROMETHEUS_MULTIPROC_DIR"


class MetricsDir:
    """The ``PROMETHEUS_MULTIPROC_DIR`` of the children (see the module documentation).

    Raises
    ------
    CliError
        (exit code 2) prometheus-client is not installed, or it was imported before the directory
        was set (its values are chosen at import: the children would keep their metrics to
        themselves).
    """

    def __init__(self) -> None:
        given = os.environ.get(_ENV)
        if not given and "prometheus_client" in sys.modules:
            raise CliError(
                f"--metrics-port with --processes: prometheus_client was imported before {_ENV} was set", 2
            )
        if given:
            self.path, self.owned = Path(given), False
            self.path.mkdir(parents=True, exist_ok=True)
            for f in self.path.glob("*.db"):  # prometheus-client: wiped before the processes start
                f.unlink()
        else:
            self.path, self.owned = Path(tempfile.mkdtemp(prefix="keyedconsumer-metrics-")), True
            os.environ[_ENV] = str(self.path)  # inherited by every fork
        try:
            from prometheus_client import multiprocess
        except ImportError:
            self.close()
            raise CliError(
                "--metrics-port needs prometheus-client: pip install 'keyedconsumer[metrics]'", 2
            ) from None
        self._multiprocess: Any = multiprocess

    def mark_dead(self, pid: int) -> None:
        """A child ended: remove its live gauges' files."""
        self._multiprocess.mark_process_dead(pid, str(self.path))

    def close(self) -> None:
        """Remove the directory if it is ours."""
        if self.owned:
            shutil.rmtree(self.path, ignore_errors=True)


def health_server(health: ProcessesHealth, port: int, addr: str) -> HTTPServer:
    """A server (bound, not serving: the loop calls ``handle_request()``) of ``/livez``, ``/readyz``
    and ``/healthz`` of every child together.

    Raises
    ------
    OSError
        The address cannot be bound.
    """
    server = HTTPServer((addr, port), request_handler(health, timeout_s=REQUEST_TIMEOUT_S))
    server.timeout = 0  # handle_request() is called when the socket is readable: never wait
    return server


def metrics_server(metrics_dir: MetricsDir, port: int, addr: str) -> HTTPServer:
    """A server (bound, not serving) of ``/metrics``: the sum of every child's metrics.

    Raises
    ------
    OSError
        The address cannot be bound.
    """
    from prometheus_client import CollectorRegistry
    from prometheus_client.exposition import MetricsHandler
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(metrics_dir.path))  # type: ignore[no-untyped-call]
    handler = type("_SupervisorMetrics", (MetricsHandler.factory(registry),), {"timeout": REQUEST_TIMEOUT_S})
    server = HTTPServer((addr, port), handler)
    server.timeout = 0
    return server
