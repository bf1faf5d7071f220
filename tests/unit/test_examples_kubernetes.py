"""The Kubernetes example's numbers and paths agree with the code: the grace period covers the
stop bound, and the probes ask the endpoints that `keyedconsumer run --health-port` serves."""

from __future__ import annotations

from pathlib import Path

import yaml

from keyedconsumer.consumer import SHUTDOWN_MARGIN_S

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "kubernetes" / "deployment.yaml"


def test_the_grace_period_covers_a_graceful_stop_and_the_probes_use_the_health_endpoints() -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    pod = doc["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    shutdown_s = float(env["KEYEDCONSUMER_SHUTDOWN_TIMEOUT_S"])
    # run() returns within max(shutdown_timeout_s, 5) + SHUTDOWN_MARGIN_S of SIGTERM
    assert pod["terminationGracePeriodSeconds"] >= max(shutdown_s, 5.0) + SHUTDOWN_MARGIN_S
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    args = container["args"]
    assert args[:3] == ["keyedconsumer", "run", "payments:app"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert str(ports["health"]) == args[args.index("--health-port") + 1]
    assert str(ports["metrics"]) == args[args.index("--metrics-port") + 1]
