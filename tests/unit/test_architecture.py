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


# -- Engine v2's rules (one owner of the engine's state; layers that lean one way) -------------------

ENGINE = PACKAGE / "engine"
#: Third-party libraries a module may import inside a function: optional extras, or libraries whose
#: import starts threads or loads native code (librdkafka), kept out of the processes that do not
#: use them (the `run --processes` supervisor, the CLI's help, a test with the in-memory broker).
HEAVY = {
    "confluent_kafka",
    "redis",
    "starlette",
    "uvicorn",
    "uvloop",
    "opentelemetry",
    "prometheus_client",
    "jinja2",
    "yaml",
}
LOCK_NAMES = {"Lock", "RLock", "Condition", "Semaphore", "BoundedSemaphore"}


def _module_name(path: Path) -> str:
    """The dotted name of a package module; a package's ``__init__`` ends with ``.__init__``, so
    relative imports resolve from the package itself."""
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "middleware":  # installed as keyedconsumer.middleware
        parts = ["keyedconsumer", *parts]
    return ".".join(parts)


def engine_lock_uses(source: str) -> list[str]:
    """Places in ``source`` that take or name a lock of the engine: ``with <engine>.lock``,
    ``<engine>._lock``, a ``*_locked`` call."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in ("lock", "_lock"):
            owner = ast.unparse(node.value)
            if any(w in owner for w in ("engine", "dispatcher", "_d", "port")) or owner == "d":
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr.endswith("_locked")
            and ast.unparse(node.func.value) not in ("self", "cls")
        ):
            found.append(f"{node.lineno}: {ast.unparse(node.func)}(...)")
    return found


def module_locks(source: str) -> list[str]:
    """Locks ``source`` creates (``threading.Lock()``, ``Condition()``, ...)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in LOCK_NAMES:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def imports_of(source: str, module: str) -> list[tuple[int, str]]:
    """Every module ``source`` (the module ``module``) imports, anywhere: ``[(line, name)]``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: -node.level]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            out.append((node.lineno, target))
            out.extend((node.lineno, f"{target}.{a.name}") for a in node.names)
    return out


def _package_sources() -> list[tuple[Path, str]]:
    paths = sorted(PACKAGE.rglob("*.py")) + sorted((ROOT / "middleware").rglob("*.py"))
    return [(p, _module_name(p)) for p in paths]


def test_no_module_but_the_engines_takes_a_lock_of_the_engine() -> None:
    # given every module of the package
    found = []
    for path, _ in _package_sources():
        found += [f"{path.relative_to(ROOT)}:{x}" for x in engine_lock_uses(path.read_text())]
    # then none takes or names a lock of the engine, and the engine's state has none at all
    assert found == []
    for name in ("engine.py", "port.py", "handout.py", "partitions.py", "lanes.py", "ready.py", "flow.py"):
        assert module_locks((ENGINE / name).read_text()) == [], name


def test_the_lock_rule_catches_a_planted_violation() -> None:
    assert engine_lock_uses("with d.lock:\n    pass\n") and engine_lock_uses("port.make_ready_locked(x)\n")
    assert engine_lock_uses("with self.engine.lock:\n    pass\n")
    assert module_locks("import threading\nx = threading.Lock()\n")


def engine_imports_sequencing(source: str, module: str) -> list[str]:
    return [
        f"{line}: {name}"
        for line, name in imports_of(source, module)
        if name.startswith("keyedconsumer.sequencing")
    ]


def test_no_engine_module_imports_sequencing() -> None:
    # the sequencer protocol and the in-memory sequencer live in the engine; sequencing/ sits above
    found = []
    for path in sorted(ENGINE.glob("*.py")):
        mod = _module_name(path)
        found += [f"{path.name}:{x}" for x in engine_imports_sequencing(path.read_text(), mod)]
    assert found == []
    assert engine_imports_sequencing("from ..sequencing import RedisSequencer\n", "keyedconsumer.engine.run")


def client_imports(source: str, module: str) -> list[str]:
    return [
        f"{line}: {name}"
        for line, name in imports_of(source, module)
        if name.startswith("keyedconsumer.kafka.client")
    ]


def test_config_imports_no_client() -> None:
    # the vocabulary (settings) sits below the Kafka client, which reads it
    assert client_imports((PACKAGE / "config.py").read_text(), "keyedconsumer.config") == []
    assert client_imports("from .kafka.client import check_config\n", "keyedconsumer.config")


def test_no_engine_module_is_over_500_lines() -> None:
    long = {p.name: n for p in ENGINE.glob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert long == {}


def lazy_imports(source: str, module: str, heavy_modules: set[str]) -> list[str]:
    """Imports made inside a function of ``source`` (the module ``module``) that bring in neither a
    :data:`HEAVY` library nor a package module that imports one at its top: such an import only
    dodges an import circle (or nothing at all)."""
    out = []
    tree = ast.parse(source)
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            names = [n for _, n in imports_of(ast.unparse(node), module)]
            first = names[0]
            if first.split(".")[0] in HEAVY:
                continue
            # importing a.b.c runs a/__init__ and a/b/__init__ too: a heavy package makes it heavy
            parents = {".".join(n.split(".")[:i]) for n in names for i in range(1, n.count(".") + 2)}
            if parents & heavy_modules:
                continue
            out.append(f"{node.lineno}: {ast.unparse(node)}")
    return out


def _heavy_modules() -> set[str]:
    """The package's modules that load a :data:`HEAVY` library when imported: by a top-level
    import of their own, or of a package module that does (transitively)."""
    top: dict[str, set[str]] = {}
    for path, mod in _package_sources():
        names: set[str] = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update(n for _, n in imports_of(ast.unparse(node), mod))
        top[mod.removesuffix(".__init__")] = names
    heavy = {m for m, names in top.items() if any(n.split(".")[0] in HEAVY for n in names)}
    while True:
        more = {m for m, names in top.items() if m not in heavy and names & heavy}
        if not more:
            return heavy
        heavy |= more


def test_no_import_inside_a_function_only_dodges_a_circle() -> None:
    # given the package's modules that load a heavy or optional library at import
    heavy = _heavy_modules()
    found = []
    for path, mod in _package_sources():
        found += [f"{path.relative_to(ROOT)}:{x}" for x in lazy_imports(path.read_text(), mod, heavy)]
    # then every import made inside a function defers one of those, and nothing else
    assert found == []
    planted = "def f() -> None:\n    from .config import ConsumerConfig\n"
    assert lazy_imports(planted, "keyedconsumer.app", heavy)
    assert not lazy_imports("def f() -> None:\n    import uvloop\n", "keyedconsumer.app", heavy)


# -- layers: the faces (cli/, web/) are built on library modules, never the library on them, nor web/
# on cli/ --------------------------------------------------------------------------------------------

#: The faces: the command line and the dashboard.
FACES = ("keyedconsumer.cli", "keyedconsumer.web")


def _face_module_name(path: Path) -> str:
    parts = ["keyedconsumer", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(name: str, is_package: bool, source: str) -> list[tuple[int, str]]:
    """``(line, module)`` of every import statement of a module, anywhere in it (functions too),
    relative imports resolved; ``from m import x`` names ``m.x`` (``x`` may be a submodule)."""
    package = name if is_package else name.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            out += [(node.lineno, f"{base}.{alias.name}" if base else alias.name) for alias in node.names]
    return out


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def layer_violations(sources: dict[str, tuple[bool, str]]) -> list[str]:
    """Each import that breaks the layers, in ``{module name: (is a package, source)}``: a module of
    ``web/`` importing ``cli/``, or a library module (neither face, nor ``__main__``) importing a face."""
    found = []
    for name, (is_package, source) in sorted(sources.items()):
        if name == "keyedconsumer.__main__":  # the console script: the command line's entry point
            continue
        face = next((f for f in FACES if _within(name, f)), None)
        for line, imported in _imports(name, is_package, source):
            if face == "keyedconsumer.web" and _within(imported, "keyedconsumer.cli"):
                found.append(f"{name}:{line}: the dashboard imports the command line: {imported}")
            if face is None and any(_within(imported, f) for f in FACES):
                found.append(f"{name}:{line}: library code imports a face: {imported}")
    return found


def _face_sources() -> dict[str, tuple[bool, str]]:
    return {_face_module_name(p): (p.name == "__init__.py", p.read_text()) for p in PACKAGE.rglob("*.py")}


def test_the_dashboard_never_imports_the_command_line_nor_the_library_a_face() -> None:
    # given every module of the package
    sources = _face_sources()
    assert "keyedconsumer.web.app" in sources and "keyedconsumer.deadletters.replay" in sources
    # then no import crosses the layers (web/ on cli/, the library on cli/ or web/)
    assert layer_violations(sources) == []


def test_a_planted_layer_violation_is_caught() -> None:
    # given the package with planted imports that cross the layers, each form of import once
    sources = _face_sources()
    planted = {
        "keyedconsumer.web.planted_a": "from ..cli.replay import parse_since\n",
        "keyedconsumer.web.planted_b": "def f():\n    import keyedconsumer.cli.output\n",
        "keyedconsumer.web.planted_c": "from keyedconsumer.cli import app\n",
        "keyedconsumer.web.planted_d": "from .. import cli\n",
        "keyedconsumer.deadletters.planted_e": "from ..web.hosts import allowed_hosts\n",
        "keyedconsumer.planted_f": "from .cli.errors import CliError\n",
    }
    sources.update({name: (False, text) for name, text in planted.items()})
    # when the layers are checked, then each planted import is named, and nothing else
    found = layer_violations(sources)
    assert sorted(f.split(":")[0] for f in found) == sorted(planted), found
    # and the command line may build on the library and launch the dashboard
    ok = {
        "keyedconsumer.cli.planted": (
            False,
            "from ..deadletters import replay_selected\nfrom ..web import create_app\n",
        )
    }
    assert layer_violations(ok) == []
