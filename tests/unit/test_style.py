"""The repository's style is enforced, not advised: ``ruff format --check`` and ``ruff check``
(their settings: ``[tool.ruff]`` in pyproject.toml) pass on the whole tree."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def ruff(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.mark.timeout(150)
def test_every_file_is_formatted_by_ruff_format() -> None:
    # given the repository, when `ruff format --check .` runs, then it would reformat nothing
    result = ruff("format", "--check", ".")
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]


@pytest.mark.timeout(150)
def test_ruff_check_finds_nothing() -> None:
    # given the repository, when `ruff check .` runs (the rules of [tool.ruff.lint]), then it passes
    result = ruff("check", ".")
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
