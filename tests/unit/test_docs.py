"""The docs stay true: configuration.md matches the models, and every test or link they cite exists."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import pathlib
import re
from types import ModuleType

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

pytestmark = [pytest.mark.timeout(60)]


def gen_config_docs() -> ModuleType:
    path = ROOT / "scripts" / "gen-config-docs"
    loader = importlib.machinery.SourceFileLoader("gen_config_docs", str(path))
    spec = importlib.util.spec_from_loader("gen_config_docs", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_configuration_md_is_generated_from_the_current_models() -> None:
    expected = gen_config_docs().render()
    actual = (DOCS / "configuration.md").read_text()
    assert actual == expected, "docs/configuration.md is stale: run scripts/gen-config-docs"


def test_every_option_has_a_description() -> None:
    from keyedconsumer import ConsumerConfig, RedisSequencer, RedisSequencerConfig

    gen = gen_config_docs()
    for model, extra in ((ConsumerConfig, ()), (RedisSequencerConfig, (RedisSequencer,))):
        described = gen.parameters(model, *extra)
        missing = [name for name, f in model.model_fields.items() if not (f.description or described.get(name))]
        assert not missing, f"{model.__name__}: document {missing} in the class docstring's Parameters"


def doc_files() -> list[pathlib.Path]:
    files = sorted(DOCS.glob("*.md"))
    assert {"guarantees.md", "ordering.md", "failure-handling.md", "operations.md", "configuration.md"} <= {
        f.name for f in files
    }
    return files


def test_every_cited_test_exists() -> None:
    cited = 0
    for doc in doc_files():
        for path, name in re.findall(r"(tests/[\w/]+\.py)(?:::(\w+))?", doc.read_text()):
            target = ROOT / path
            assert target.is_file(), f"{doc.name} cites {path}, which does not exist"
            if name:
                assert re.search(rf"^(async )?def {name}\(", target.read_text(), re.M), (
                    f"{doc.name} cites {path}::{name}, which does not exist"
                )
                cited += 1
    assert cited >= 20  # guarantees.md names the test behind each promise


def slug(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_every_relative_link_and_anchor_resolves() -> None:
    for doc in doc_files():
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"\w+://", target):
                continue
            file, _, anchor = target.partition("#")
            path = (doc.parent / file) if file else doc
            assert path.is_file(), f"{doc.name} links to {target}: no such file"
            if anchor:
                headings = [slug(h) for h in re.findall(r"^#+ (.+)$", path.read_text(), re.M)]
                assert anchor in headings, f"{doc.name} links to {target}: no such heading"

