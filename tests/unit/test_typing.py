"""``Message`` is generic in its payload: handlers declared ``Message[Order]`` type-check under
mypy --strict behind ``Typed``, and mistakes in them are reported (tests/typing/)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import keyedconsumer

ROOT = Path(__file__).resolve().parents[2]
TYPING = ROOT / "tests" / "typing"


def _site(tmp: Path) -> Path:
    """A folder where ``keyedconsumer`` and ``keyedconsumer.middleware`` are the source tree, as
    installed (mypy cannot follow the editable install's import hook): a folder of symlinks."""
    pkg = tmp / "site" / "keyedconsumer"
    pkg.mkdir(parents=True)
    src = Path(keyedconsumer.__file__).resolve().parent
    for entry in src.iterdir():
        if entry.name != "middleware":
            (pkg / entry.name).symlink_to(entry)
    (pkg / "middleware").symlink_to(src.parent / "middleware")
    return pkg.parent


def _mypy(tmp: Path, *files: Path) -> tuple[int, list[str]]:
    env = {**os.environ, "MYPYPATH": str(_site(tmp))}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--python-version",
            "3.10",
            "--no-error-summary",
            "--show-error-codes",
            "--cache-dir",
            str(tmp / "cache"),
            *map(str, files),
        ],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in out.stdout.splitlines() if ": error: " in line]
    return out.returncode, lines


@pytest.mark.timeout(900)
def test_typed_handlers_type_check_and_mistakes_are_reported(tmp_path: Path) -> None:
    # given handlers declared Message[Order] behind Typed (and the schema-registry decoders), and a
    # file of mistakes, each marked with the error mypy must report on its line
    ok, bad = TYPING / "typed_handlers.py", TYPING / "typed_handlers_errors.py"
    example = ROOT / "examples" / "schema_registry.py"
    expected = {
        (bad.name, n): mark.group(1)
        for n, line in enumerate(bad.read_text().splitlines(), start=1)
        if (mark := re.search(r"# E: (.+)$", line))
    }
    assert len(expected) == 5
    # when mypy --strict checks them and the schema-registry example (one run: the imported package
    # is analysed once)
    code, errors = _mypy(tmp_path, ok, bad, example)
    # then the handlers' file and the example have no error, and the mistakes' file has exactly
    # the marked ones
    got: dict[tuple[str, int], list[str]] = {}
    for line in errors:
        path, lineno, _ = line.split(":", 2)
        got.setdefault((Path(path).name, int(lineno)), []).append(line)
    assert not [e for (name, _), es in got.items() if name != bad.name for e in es], errors
    assert set(got) == set(expected), errors
    for where, part in expected.items():
        assert any(part in e for e in got[where]), (where, part, got[where])
    assert code == 1
