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
        missing = [
            name for name, f in model.model_fields.items() if not (f.description or described.get(name))
        ]
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


#: Internal tracker ids that mean nothing to a user: a case number ("case C8", "(C10)"), a source
#: document of the project ("seed 003", "shared/seeds/..."), an issue of this project's tracker
#: ("issue 6"; a public one is cited with its repository: "gojekfarm/xtools issue #25").
TRACKER_IDS = re.compile(
    r"\bcase C\d+\b|\(C\d+\)|\bseeds?,? \d{3}\b|shared/seeds|\bissue \d+\b", re.IGNORECASE
)


def test_the_package_cites_public_sources_not_tracker_ids() -> None:
    # given every module of the package and of the middleware
    found = []
    for path in sorted([*(ROOT / "keyedconsumer").rglob("*.py"), *(ROOT / "middleware").rglob("*.py")]):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if TRACKER_IDS.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    # then none cites an internal tracker id (cite the KIP, librdkafka property or issue, peer project)
    assert found == []
