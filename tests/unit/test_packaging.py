"""The public names are stable, and middleware ships only as keyedconsumer.middleware."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import keyedconsumer


def test_public_names() -> None:
    for name in ("KeyedConsumer", "Message", "Status", "ConsumerConfig", "MessageError"):
        assert name in keyedconsumer.__all__ and hasattr(keyedconsumer, name)


def test_middleware_is_a_subpackage_only() -> None:
    assert importlib.import_module("keyedconsumer.middleware")
    # a top-level `middleware` must not be importable from an installed environment (packaging note)
    out = subprocess.run(
        [sys.executable, "-c", "import middleware"], cwd="/", capture_output=True, text=True, timeout=60
    )
    assert out.returncode != 0 and "No module named 'middleware'" in out.stderr


def test_one_module_per_outside_system() -> None:
    import pathlib
    import re

    pkg = pathlib.Path(keyedconsumer.__file__).parent
    kafka = sorted(str(p.relative_to(pkg)) for p in pkg.rglob("*.py") if "confluent_kafka" in p.read_text())
    assert kafka == ["kafka.py"]
    redis = sorted(str(p.relative_to(pkg)) for p in pkg.rglob("*.py") if re.search(r"^\s*import redis|^\s*from redis", p.read_text(), re.M))
    assert redis == ["sequencing/store.py"]


def test_the_engine_imports_without_redis_installed() -> None:
    code = "import sys; sys.modules['redis'] = None; import keyedconsumer; print(keyedconsumer.RedisSequencer)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_middleware_uses_only_the_public_api() -> None:
    import pathlib
    import re

    root = pathlib.Path(keyedconsumer.__file__).parent.parent / "middleware"
    for path in root.glob("*.py"):
        text = path.read_text()
        # only `from keyedconsumer import <public names>`, never engine modules
        assert not re.search(r"from keyedconsumer\.(?!middleware)\w+ import|import keyedconsumer\.\w+", text), path
        for names in re.findall(r"from keyedconsumer import ([\w, ]+)", text):
            for name in (n.strip() for n in names.split(",")):
                assert name in keyedconsumer.__all__, f"{path.name} imports non-public {name}"
        assert "confluent_kafka" not in text, path


@pytest.mark.timeout(120)
def test_a_built_wheel_holds_every_package_of_the_source_tree(tmp_path: Path) -> None:
    # given the source tree's packages (every folder with an __init__.py under keyedconsumer/ and middleware/)
    root = Path(__file__).resolve().parents[2]
    want = {"keyedconsumer/" + str(p.parent.relative_to(root / "keyedconsumer")) for p in (root / "keyedconsumer").rglob("__init__.py")}
    want = {w.rstrip("/.") for w in want} | {"keyedconsumer/middleware"}
    # when a wheel is built from a copy of the sources (not an editable install, which would hide a
    # missing package, and not the tree itself, whose stale build/ folder could fill the gap)
    src = tmp_path / "src"
    src.mkdir()
    for name in ("keyedconsumer", "middleware"):
        shutil.copytree(root / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), str(src)],
                   check=True, capture_output=True, timeout=110)
    [whl] = list((tmp_path / "dist").glob("keyedconsumer-*.whl"))
    names = zipfile.ZipFile(whl).namelist()
    # then every package is in it, with its modules
    have = {n.rsplit("/", 1)[0] for n in names if n.endswith("/__init__.py")}
    assert want <= have, sorted(want - have)
    assert "keyedconsumer/sequencing/store.py" in names and "keyedconsumer/middleware/retry.py" in names
