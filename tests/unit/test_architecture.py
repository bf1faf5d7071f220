"""The engine's shape, kept: each object's state is its own, the dispatcher never asks which
sequencer it has, and the architecture picture matches its source (docs/architecture.md)."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "keyedconsumer"
#: Message's documented fields (the handler API), which the engine sets by design.
MESSAGE_API = {
    "topic",
    "partition",
    "offset",
    "key",
    "value",
    "status",
    "error",
    "attempt",
    "last_error",
    "payload",
    "fencing_token",
    "group_id",
    "headers",
    "timestamp_ms",
    "state",
}
#: Calls that change a container in place.
MUTATORS = {
    "append",
    "appendleft",
    "extend",
    "extendleft",
    "pop",
    "popleft",
    "clear",
    "remove",
    "add",
    "discard",
    "update",
    "insert",
    "setdefault",
}


def _engine_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "cli" not in p.parts and "testing" not in p.parts)


def _owners() -> dict[str, set[Path]]:
    """Attribute name -> the modules whose classes define it (``self.x = ...`` or ``__slots__``)."""
    owners: dict[str, set[Path]] = defaultdict(set)
    for path in _engine_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            for sub in ast.walk(node):
                if (
                    isinstance(sub, ast.Attribute)
                    and isinstance(sub.value, ast.Name)
                    and sub.value.id == "self"
                    and isinstance(sub.ctx, ast.Store)
                ):
                    owners[sub.attr].add(path)
            for stmt in node.body:
                if isinstance(stmt, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "__slots__" for t in stmt.targets
                ):
                    for name in ast.literal_eval(stmt.value):
                        owners[name].add(path)
    return owners


def _foreign(node: ast.AST, path: Path, owners: dict[str, set[Path]]) -> bool:
    """``node`` is ``obj.attr`` with ``obj`` not ``self``, and ``attr`` belongs to other modules."""
    if not isinstance(node, ast.Attribute):
        return False
    if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
        return False
    attr = node.attr
    if attr in MESSAGE_API or attr.startswith("__"):
        return False
    return attr in owners and path not in owners[attr]


def test_no_module_writes_another_modules_objects_fields() -> None:
    # given every engine module and the attributes each one's classes define
    owners = _owners()
    found = []
    for path in _engine_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[ast.AST] = []
            if isinstance(node, ast.Assign):
                targets = list(node.targets)
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            for t in targets:
                changed = t.value if isinstance(t, ast.Subscript) else t
                if _foreign(changed, path, owners):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(t)}")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in MUTATORS
            ):
                if _foreign(node.func.value, path, owners):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node.func)}(...)")
    # then none assigns, or changes in place, a field that another module's class owns
    assert found == []


def test_the_engine_never_asks_which_sequencer_it_has() -> None:
    source = (PACKAGE / "engine" / "engine.py").read_text()
    for word in ("RedisSequencer", "leases", "parking", "parked_part", "quarantine"):
        assert word not in source, word
    tree = ast.parse(source)
    checks = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Name)
        and n.func.id in ("isinstance", "type")
        and "seq" in ast.unparse(n)
    ]
    assert checks == []


def test_the_architecture_picture_matches_its_source() -> None:
    if shutil.which("dot") is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("Graphviz's dot is missing: scripts/install-deps installs it", pytrace=False)
        pytest.skip("Graphviz's dot is not installed")
    result = subprocess.run(
        [str(ROOT / "scripts" / "gen-architecture"), "--check"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
