"""The README is a short path that works: at most 300 lines, every docs/ page reachable from it, and
its first service's test passes exactly as printed, on the in-memory broker, with no network.

The same service on the real broker: ``tests/integration/test_readme_service.py``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.readme import README, blocks, commands, write_first_service

ROOT = README.parent
pytestmark = pytest.mark.timeout(120)


def test_the_readme_is_at_most_300_lines() -> None:
    assert len(README.read_text().splitlines()) <= 300


def test_every_docs_page_is_reachable_from_the_readme() -> None:
    linked = {m for m in re.findall(r"\]\(docs/([\w.-]+\.md)(?:#[\w-]+)?\)", README.read_text())}
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages - linked == set(), f"docs pages the README does not link: {sorted(pages - linked)}"


def test_every_link_of_the_readme_resolves() -> None:
    for target in re.findall(r"\]\(([^)\s]+)\)", README.read_text()):
        if re.match(r"\w+://", target):
            continue
        path = ROOT / target.partition("#")[0]
        assert path.exists(), f"README links to {target}: no such file"


def test_the_readme_keeps_its_two_commands() -> None:
    # the opening: one command runs the main job on real data, one the tests, which CI runs too
    two = [lang for lang, code in blocks()[:1]]
    assert two == ["bash"]
    first = blocks()[0][1].splitlines()
    assert [line.split()[0] for line in first] == ["scripts/demo", "scripts/test"]
    assert "scripts/test" in (ROOT / ".ci" / "run").read_text()
    # and the first service is run the way the README says
    assert commands("keyedconsumer run") == ["keyedconsumer run orders:app"]
    assert commands("pytest") == ["pytest test_orders.py"]


def _no_network() -> list[str]:
    """A prefix that runs a command in a network namespace of its own (no interface up: nothing
    is reachable, not even loopback), when this process may make one (root, util-linux unshare)."""
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        return []
    probe = subprocess.run([unshare, "--net", "true"], capture_output=True, timeout=30)
    return [unshare, "--net"] if probe.returncode == 0 else []


def test_the_first_service_s_test_passes_as_printed_without_a_network(tmp_path: Path) -> None:
    # given the README's first service and its test, written exactly as printed
    write_first_service(tmp_path)
    prefix = _no_network()
    if not prefix and os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail("CI runs as root: `unshare --net` must work to prove the test needs no network")
    # when pytest runs it as the README says (`pytest test_orders.py`), with no network at all
    out = subprocess.run(
        [*prefix, sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "test_orders.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=100,
        env={k: v for k, v in os.environ.items() if not k.startswith(("KEYEDCONSUMER_", "PYTEST_"))},
    )
    # then it passes
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout + out.stderr


def test_the_first_service_s_test_fails_when_the_service_is_wrong(tmp_path: Path) -> None:
    # the test above can fail: the same test against a service that accepts every order
    write_first_service(tmp_path)
    service = (tmp_path / "orders.py").read_text()
    broken = service.replace("if order.cents <= 0:", "if False:")
    assert broken != service
    (tmp_path / "orders.py").write_text(broken)
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "test_orders.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert out.returncode == 1 and "1 failed" in out.stdout, out.stdout + out.stderr
