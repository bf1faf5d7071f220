"""``keyedconsumer docs module:app`` writes an AsyncAPI 3.0 document that the official AsyncAPI
parser (``@asyncapi/parser``, run with Node.js) accepts.

The validator is installed by ``scripts/install-deps`` into ``tests/asyncapi/node_modules``; without
it (or without ``node``) these tests fail under ``CI=true`` and are skipped otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]
from typer.testing import CliRunner

from keyedconsumer.cli import app as cli

ROOT = Path(__file__).resolve().parents[2]
VALIDATOR = ROOT / "tests" / "asyncapi" / "validate.mjs"
PARSER = ROOT / "tests" / "asyncapi" / "node_modules" / "@asyncapi" / "parser"
#: The one warning allowed: the parser recommends its newest spec version (3.1.0); we write 3.0.0,
#: the version the AsyncAPI tools read widely.
ALLOWED_WARNINGS = {"asyncapi-latest-version"}

pytestmark = pytest.mark.timeout(120)

SERVICE = '''
"""The shop: orders in, accepted orders out."""
from pydantic import BaseModel

from keyedconsumer import KeyedApp, Message
from keyedconsumer.middleware import Audit, DeadLetter, Retry, Text, Typed


class Address(BaseModel):
    city: str


class Order(BaseModel):
    id: str
    cents: int
    ship_to: Address | None = None


class Accepted(BaseModel):
    id: str


app = KeyedApp(brokers=["kafka-1:9092", "kafka-2:9092"], group_id="shop")
app.use(Audit(topic="shop.audit"))


@app.handler(
    "orders",
    concurrency=16,
    middlewares=[DeadLetter(), Retry(max_attempts=3), Typed(Order, key=Text())],
    produces={"orders.accepted": Accepted},
)
def order(msg: Message[Order]) -> None: ...


@app.handler("refunds", group_id="refunds", middlewares=[DeadLetter(topic="{topic}.dead")], produces=["refunds.done"])
async def refund(msg: Message) -> None: ...

not_an_app = 42
'''


def _validator() -> list[str]:
    node = shutil.which("node")
    if node is None or not PARSER.is_dir():
        msg = "the AsyncAPI validator is not installed: run scripts/install-deps (needs node and npm)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)
    return [node, str(VALIDATOR)]


def validate(path: Path) -> dict[str, Any]:
    out = subprocess.run([*_validator(), str(path)], capture_output=True, text=True, timeout=90)
    assert out.stdout.strip(), out.stderr
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    result["exit_code"] = out.returncode
    return result


@pytest.fixture
def service(tmp_path: Path) -> Path:
    (tmp_path / "shop_service.py").write_text(textwrap.dedent(SERVICE))
    yield tmp_path
    sys.modules.pop("shop_service", None)


def docs(service: Path, *args: str) -> Any:
    return CliRunner().invoke(cli, ["docs", "shop_service:app", "--app-dir", str(service), *args])


def test_the_document_of_an_app_is_valid_asyncapi_3(service: Path) -> None:
    # given a service with typed payloads, dead letters, an audit trail and declared results
    out_file = service / "asyncapi.json"
    # when `keyedconsumer docs` writes its document
    result = docs(service, "--out", str(out_file), "--app-version", "1.2.0")
    assert result.exit_code == 0, result.output
    # then the official AsyncAPI parser accepts it, with no error
    report = validate(out_file)
    assert report["exit_code"] == 0 and report["errors"] == [], report
    assert {w["code"] for w in report["warnings"]} <= ALLOWED_WARNINGS, report["warnings"]
    assert report["version"] == "3.0.0"
    doc = json.loads(out_file.read_text())
    assert doc["info"] == {
        "title": "shop_service:app",
        "version": "1.2.0",
        "description": doc["info"]["description"],
    }
    assert "orders in, accepted orders out" in doc["info"]["description"]
    assert [s["host"] for s in doc["servers"].values()] == ["kafka-1:9092", "kafka-2:9092"]
    # the topics: consumed, dead letters (the template resolved per topic), audit and results
    assert set(doc["channels"]) == {
        "orders",
        "orders.dlq",
        "shop.audit",
        "orders.accepted",
        "refunds",
        "refunds.dead",
        "refunds.done",
    }
    ops = doc["operations"]
    assert {k: (v["action"], v["channel"]["$ref"]) for k, v in ops.items()} == {
        "order": ("receive", "#/channels/orders"),
        "order.dead-letter": ("send", "#/channels/orders.dlq"),
        "order.audit": ("send", "#/channels/shop.audit"),
        "order.produces.orders.accepted": ("send", "#/channels/orders.accepted"),
        "refund": ("receive", "#/channels/refunds"),
        "refund.dead-letter": ("send", "#/channels/refunds.dead"),
        "refund.audit": ("send", "#/channels/shop.audit"),
        "refund.produces.refunds.done": ("send", "#/channels/refunds.done"),
    }
    # the consumer groups
    assert ops["order"]["bindings"]["kafka"]["groupId"] == {"type": "string", "enum": ["shop"]}
    assert ops["refund"]["bindings"]["kafka"]["groupId"] == {"type": "string", "enum": ["refunds"]}
    # the payload schemas are pydantic's JSON schemas of the Typed models, nested models included
    from pydantic.json_schema import models_json_schema

    module = sys.modules["shop_service"]
    _, expected = models_json_schema(
        [(module.Order, "validation"), (module.Accepted, "validation")],
        ref_template="#/components/schemas/{model}",
    )
    assert doc["components"]["schemas"] == expected["$defs"]
    consumed = doc["components"]["messages"]["order.Order"]
    assert consumed["payload"] == {"$ref": "#/components/schemas/Order"}
    assert consumed["bindings"]["kafka"]["key"] == {"type": "string"}  # Typed(..., key=Text())
    dead = doc["components"]["messages"]["DeadLetter"]["headers"]["properties"]
    assert "kafka_dlt-original-offset" in dead and "kafka_dlt-exception-fqcn" in dead


def test_the_validator_rejects_a_broken_document(service: Path) -> None:
    # given the valid document with an operation pointing at a channel that does not exist
    out_file = service / "asyncapi.json"
    assert docs(service, "--out", str(out_file)).exit_code == 0
    doc = json.loads(out_file.read_text())
    doc["operations"]["order"]["channel"] = {"$ref": "#/channels/no-such-topic"}
    broken = service / "broken.json"
    broken.write_text(json.dumps(doc))
    # then the validator says so (the test above can fail)
    report = validate(broken)
    assert report["exit_code"] == 1 and any(e["code"] == "invalid-ref" for e in report["errors"]), report


def test_yaml_is_the_same_document(service: Path) -> None:
    as_json = docs(service)
    as_yaml = docs(service, "--format", "yaml")
    assert as_json.exit_code == 0 and as_yaml.exit_code == 0
    assert yaml.safe_load(as_yaml.output) == json.loads(as_json.output)


def test_what_is_not_an_app_is_refused_with_exit_code_2(service: Path) -> None:
    result = CliRunner().invoke(cli, ["docs", "shop_service:not_an_app", "--app-dir", str(service)])
    assert result.exit_code == 2
    assert "is not a KeyedApp" in result.output or "not callable" in result.output
