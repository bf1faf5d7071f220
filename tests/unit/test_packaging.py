"""The public names are stable, and middleware ships only as keyedconsumer.middleware."""

from __future__ import annotations

import importlib
import subprocess
import sys

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
