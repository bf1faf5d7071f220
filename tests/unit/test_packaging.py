"""The public names are stable, and middleware ships only as keyedconsumer.middleware."""

from __future__ import annotations

import ast
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
    # Kafka: three modules of keyedconsumer/kafka/, checked on the syntax tree below
    redis = sorted(
        str(p.relative_to(pkg))
        for p in pkg.rglob("*.py")
        if re.search(r"^\s*import redis|^\s*from redis", p.read_text(), re.M)
    )
    assert redis == ["sequencing/connection.py", "sequencing/store.py"]


# -- confluent_kafka only behind the seam, checked on each module's syntax tree ------------------------

ROOT = Path(keyedconsumer.__file__).resolve().parent.parent
CONFLUENT_MODULES = {
    "keyedconsumer.kafka.client",
    "keyedconsumer.kafka.publisher",
    "keyedconsumer.kafka.transactional",
    "keyedconsumer.kafka.admin",
    "keyedconsumer.kafka.properties",
}
#: The Schema Registry's seam (another outside system, whose client ships in confluent-kafka): the one
#: middleware module that imports confluent_kafka, and only its schema_registry and serialization parts.
REGISTRY_MODULE = "keyedconsumer.middleware.schema_registry"
REGISTRY_IMPORTS = ("confluent_kafka.schema_registry", "confluent_kafka.serialization")


def _modules() -> dict[str, Path]:
    """``{dotted name: file}`` of every module under keyedconsumer/ and middleware/ (installed as
    keyedconsumer.middleware)."""
    out: dict[str, Path] = {}
    for folder, package in (
        (ROOT / "keyedconsumer", "keyedconsumer"),
        (ROOT / "middleware", "keyedconsumer.middleware"),
    ):
        for path in folder.rglob("*.py"):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imported(name: str, path: Path) -> set[str]:
    """Every module an import statement of the module names, anywhere in it (functions and
    ``TYPE_CHECKING`` blocks too), relative imports resolved; ``from m import x`` counts ``m`` and
    ``m.x`` (``x`` may be a submodule)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return out


def _imports_confluent(imported: set[str]) -> bool:
    return any(m == "confluent_kafka" or m.startswith("confluent_kafka.") for m in imported)


def test_only_the_kafka_implementation_modules_import_confluent_kafka() -> None:
    # given every module of the engine and the middleware
    modules = _modules()
    assert "keyedconsumer.kafka" in modules and "keyedconsumer.middleware.dead_letter" in modules
    # when their import statements are read
    importers = {name for name, path in modules.items() if _imports_confluent(_imported(name, path))}
    # then only the client, the publishers and the admin tools import confluent_kafka (and the
    # Schema Registry's decoders, its registry client only: never the Kafka client)
    assert importers == CONFLUENT_MODULES | {REGISTRY_MODULE}
    registry = {
        m for m in _imported(REGISTRY_MODULE, modules[REGISTRY_MODULE]) if m.startswith("confluent_kafka")
    }
    assert registry and all(m.startswith(REGISTRY_IMPORTS) for m in registry), sorted(registry)


def test_the_kafka_seam_module_loads_nothing_that_imports_confluent_kafka() -> None:
    # given keyedconsumer/kafka/__init__.py (TP and the protocols, which the engine core imports)
    modules = _modules()
    graph = {name: _imported(name, path) for name, path in modules.items()}
    # when every in-tree module it imports is followed, transitively (a package's own __init__, which
    # Python runs first, is a separate concern: the claim is about what this module pulls in)
    seen, todo = set(), ["keyedconsumer.kafka"]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(m for m in graph[name] if m in modules)
    # then none of them imports confluent_kafka
    assert not {name for name in seen if _imports_confluent(graph[name])}, sorted(seen)
    assert seen >= {"keyedconsumer.errors", "keyedconsumer.message"}  # the walk did follow imports


def test_the_engine_imports_without_redis_installed() -> None:
    code = (
        "import sys; sys.modules['redis'] = None; import keyedconsumer; print(keyedconsumer.RedisSequencer)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_middleware_uses_only_the_public_api() -> None:
    import pathlib
    import re

    root = pathlib.Path(keyedconsumer.__file__).parent.parent / "middleware"
    for path in root.glob("*.py"):
        text = path.read_text()
        # only `from keyedconsumer import <public names>`, never engine modules
        assert not re.search(
            r"from keyedconsumer\.(?!middleware)\w+ import|import keyedconsumer\.\w+", text
        ), path
        for names in re.findall(r"from keyedconsumer import ([\w, ]+)", text):
            for name in (n.strip() for n in names.split(",")):
                assert name in keyedconsumer.__all__, f"{path.name} imports non-public {name}"
        if path.name != "schema_registry.py":  # the Schema Registry's seam (see REGISTRY_MODULE)
            assert "confluent_kafka" not in text, path


@pytest.mark.timeout(120)
def test_a_built_wheel_holds_every_package_of_the_source_tree(tmp_path: Path) -> None:
    # given the source tree's packages (every folder with an __init__.py under keyedconsumer/ and middleware/)
    root = Path(__file__).resolve().parents[2]
    want = {
        "keyedconsumer/" + str(p.parent.relative_to(root / "keyedconsumer"))
        for p in (root / "keyedconsumer").rglob("__init__.py")
    }
    want = {w.rstrip("/.") for w in want} | {"keyedconsumer/middleware"}
    # when a wheel is built from a copy of the sources (not an editable install, which would hide a
    # missing package, and not the tree itself, whose stale build/ folder could fill the gap)
    src = tmp_path / "src"
    src.mkdir()
    for name in ("keyedconsumer", "middleware"):
        shutil.copytree(root / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, src / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), str(src)],
        check=True,
        capture_output=True,
        timeout=110,
    )
    [whl] = list((tmp_path / "dist").glob("keyedconsumer-*.whl"))
    names = zipfile.ZipFile(whl).namelist()
    # then every package is in it, with its modules
    have = {n.rsplit("/", 1)[0] for n in names if n.endswith("/__init__.py")}
    assert want <= have, sorted(want - have)
    assert "keyedconsumer/sequencing/store.py" in names and "keyedconsumer/middleware/retry.py" in names


@pytest.mark.timeout(10)
def test_setup_installs_every_extra_of_the_package() -> None:
    # the README's first-hour step ("scripts/setup: the same, every extra") holds when an extra is added
    import re

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    found = re.search(r"^\s*extras=([\w,-]+)", (ROOT / "scripts" / "setup").read_text(), re.MULTILINE)
    assert found is not None, "scripts/setup names its extras in one extras=... line"
    assert set(found.group(1).split(",")) == extras
