"""A Kafka broker of one test: its own run dir, its own ports below the ephemeral range, broker
properties of the test's choice, and the test may stall it (SIGSTOP) or stop it, or reach it
through a :class:`~.kafka_proxy.KafkaProxy` that stalls its clients' traffic at an exact request.
The shared broker is never touched. Started with ``scripts/services`` (see
:mod:`tests.faults.services`)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

from tests.faults.services import REPO, pick_ports, run_services, services_env, stable_free_port

from .kafka_proxy import PROBE_CLIENT_ID, KafkaProxy


class OwnKafka:
    """One single-node broker (KRaft) with ``properties`` added to its ``server.properties``;
    ``proxied``: its clients reach it through :attr:`proxy` (the port it advertises)."""

    def __init__(
        self, properties: Mapping[str, str] | None = None, preferred_port: int = 25292, proxied: bool = False
    ) -> None:
        self.run_dir = Path(tempfile.mkdtemp(prefix="kc-own-kafka-"))
        # the third port is Redis's in pick_ports: unused here, only checked free
        self.port, controller, _ = pick_ports((preferred_port, preferred_port + 1, preferred_port + 2))
        props = dict(properties or {})
        self.proxy: KafkaProxy | None = None
        if proxied:
            self.proxy = KafkaProxy(stable_free_port(), self.port)
            props["advertised.listeners"] = f"PLAINTEXT://127.0.0.1:{self.proxy.port}"
        extra = "\n".join(f"{k}={v}" for k, v in props.items())
        self.env = services_env(
            self.run_dir,
            KAFKA_PORT=self.port,
            KAFKA_CONTROLLER_PORT=controller,
            KC_KAFKA_EXTRA_PROPERTIES=extra,
        )
        self.log_path = self.run_dir / "services.out"

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.proxy.port if self.proxy is not None else self.port}"

    def start(self) -> None:
        run_services(self.env, self.log_path, "kafka-start", timeout_s=180)

    def down(self) -> None:
        """Resume it if it is stalled, then stop it (SIGKILL when SIGTERM does not do), and remove
        its run dir."""
        self.resume()
        if self.proxy is not None:
            self.proxy.release()
        try:
            run_services(self.env, self.log_path, "kafka-stop", timeout_s=60)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
            run_services(self.env, self.log_path, "kafka-kill", timeout_s=60)
        if self.proxy is not None:
            self.proxy.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def pid(self) -> int:
        return int((self.run_dir / "kafka" / "kafka.pid").read_text().split()[0])

    def stall(self) -> None:
        """SIGSTOP the broker: it answers nothing, its clock runs on."""
        os.kill(self.pid(), signal.SIGSTOP)

    def resume(self) -> None:
        with contextlib.suppress(OSError, ValueError, IndexError):
            os.kill(self.pid(), signal.SIGCONT)

    def transactional_ids(self) -> set[str]:
        """The transactional ids the transaction coordinator knows now."""
        return {line.split()[0] for line in self._transactions("list").splitlines()[1:] if line.strip()}

    def transaction_state(self, transactional_id: str) -> str:
        """The coordinator's state of ``transactional_id``'s transaction (``Ongoing``,
        ``CompleteAbort``, ...)."""
        lines = self._transactions("describe", "--transactional-id", transactional_id).splitlines()
        header, row = lines[0].split(), lines[1].split()
        return row[header.index("TransactionState")]

    def _transactions(self, *command: str) -> str:
        """Kafka's ``kafka-transactions.sh`` (no confluent-kafka API lists transactions), over the
        broker's own port, with a client id the proxy lets through while it freezes clients."""
        libs = subprocess.run(
            [str(REPO / "scripts" / "install-deps"), "--print-libs"],
            env=self.env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        config = self.run_dir / "tools.properties"
        config.write_text(f"client.id={PROBE_CLIENT_ID}\n")
        return subprocess.run(
            [
                "java",
                "-Xmx128m",
                f"-Dlog4j2.configurationFile={self.run_dir / 'kafka' / 'tools-log4j2.properties'}",
                "-cp",
                f"{libs}/*",
                "org.apache.kafka.tools.TransactionsCommand",
                "--bootstrap-server",
                self.bootstrap,
                "--command-config",
                str(config),
                *command,
            ],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout


@contextlib.contextmanager
def own_kafka(properties: Mapping[str, str] | None = None, proxied: bool = False) -> Iterator[OwnKafka]:
    """A started :class:`OwnKafka`, stopped (and resumed first, if stalled) at the end."""
    broker = OwnKafka(properties, proxied=proxied)
    broker.start()
    try:
        yield broker
    finally:
        broker.down()
