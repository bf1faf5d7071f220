"""Fixtures of the end-to-end tests: headless Chromium (Debian's ``chromium`` and ``chromium-driver``,
driven by Selenium through ``/usr/bin/chromedriver``) and the dashboard as a process of its own."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = os.environ.get("KC_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("KC_CHROMEDRIVER", "/usr/bin/chromedriver")
APT_HINT = "install Debian's browser and driver: apt-get install -y chromium chromium-driver"
#: Names the browser resolves to the loopback address, as a DNS-rebinding attacker's name would be
#: after the rebind (``rebind.test``), and as a proxy's name would be (``dash.test``, ``toml.test``).
REBOUND_NAMES = ("rebind.test", "dash.test", "toml.test")


def _unavailable(what: str) -> None:
    """Fails under ``CI=true`` (a CI run never skips these tests), skips otherwise."""
    from ..conftest import _unavailable as unavailable

    unavailable(what, APT_HINT)


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    """A headless Chromium (one for the session; each test opens its own pages)."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _unavailable("selenium (the test extra)")
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        _unavailable("Chromium")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1280,900",
        "--disable-extensions",
        "--no-first-run",
        "--password-store=basic",
        "--host-resolver-rules=" + ", ".join(f"MAP {name} 127.0.0.1" for name in REBOUND_NAMES),
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Dashboard:
    """``keyedconsumer web`` in a subprocess; ``url`` is where it answers."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed in stop)
        base = {k: v for k, v in os.environ.items() if not k.upper().startswith("KEYEDCONSUMER_")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "keyedconsumer", "web", "--port", str(self.port), *args],
            env={**base, **env},
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the dashboard exited {self.proc.returncode}: {self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/groups", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"the dashboard did not answer within 30 s: {self.log()}")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


def screenshot_dir() -> Path | None:
    """Where the tests save screenshots of each page: ``KC_WEB_SCREENSHOTS`` (e.g. ``docs/images``)."""
    target = os.environ.get("KC_WEB_SCREENSHOTS")
    return Path(target) if target else None
