"""An AsyncAPI 3.0 document of a :class:`~keyedconsumer.KeyedApp`'s routes (``keyedconsumer docs``).

What the app itself says, and nothing else (https://www.asyncapi.com/docs/reference/specification/v3.0.0):

- ``servers``: the routes' ``brokers`` (one server per bootstrap address, protocol ``kafka``);
- a ``receive`` operation per route and topic, with the Kafka operation binding's ``groupId``
  (the route's consumer group, ``bindingVersion`` 0.5.0) and the route's ordering and concurrency in
  its description;
- its message: the payload schema of the route's ``Typed(Model)`` (pydantic's JSON schema of the
  model; a ``Typed`` key model or ``Text`` key goes in the message binding's ``key``), or no schema
  (raw bytes) without ``Typed``;
- a ``send`` operation per dead-letter topic (``DeadLetter(topic="{topic}.dlq")`` resolved per
  topic; the message lists the ``kafka_dlt-*`` failure headers), per audit topic (``Audit``, with
  the schema of an audit record), and per topic declared with ``@app.handler(..., produces=...)``;
- ``components``: the messages, and every model schema once (nested models too), referenced as
  ``#/components/schemas/<Model>``.

Channel ids are the topic names (Kafka topic names use only ``[A-Za-z0-9._-]``); a ``^regex``
subscription gets a channel whose address is the pattern.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from ..app import KeyedApp, Route
from .audit import OUTCOMES

__all__ = ["document", "ASYNCAPI_VERSION", "BINDING_VERSION"]

ASYNCAPI_VERSION = "3.0.0"
#: The Kafka bindings' version (https://github.com/asyncapi/bindings/tree/master/kafka).
BINDING_VERSION = "0.5.0"
_ID = re.compile(r"[^A-Za-z0-9._-]")


def _id(text: str) -> str:
    return _ID.sub("_", text) or "_"


class _Builder:
    """Collects channels, operations, messages and schemas; one per document."""

    def __init__(self, middleware: Any) -> None:
        self.mw = middleware  # the keyedconsumer.middleware module
        self.channels: dict[str, dict[str, Any]] = {}
        self.operations: dict[str, dict[str, Any]] = {}
        self.messages: dict[str, dict[str, Any]] = {}
        self.models: list[type[BaseModel]] = []

    # -- pieces ---------------------------------------------------------------------------------

    def model_ref(self, model: type[BaseModel]) -> dict[str, str]:
        if model not in self.models:
            self.models.append(model)
        return {"$ref": f"#/components/schemas/{model.__name__}"}

    def channel(self, topic: str) -> str:
        cid = _id(topic)
        if cid not in self.channels:
            entry: dict[str, Any] = {"address": topic, "messages": {}}
            if topic.startswith("^"):
                entry["description"] = (
                    f"The topics matching the regular expression {topic} (a subscription pattern)."
                )
            else:
                entry["bindings"] = {"kafka": {"topic": topic, "bindingVersion": BINDING_VERSION}}
            self.channels[cid] = entry
        return cid

    def message(self, cid: str, mid: str, body: dict[str, Any]) -> dict[str, str]:
        """Put message ``mid`` in components (once) and in channel ``cid``; a reference for an operation."""
        self.messages.setdefault(mid, body)
        self.channels[cid]["messages"][mid] = {"$ref": f"#/components/messages/{mid}"}
        return {"$ref": f"#/channels/{cid}/messages/{mid}"}

    def operation(
        self, oid: str, action: str, cid: str, messages: list[dict[str, str]], **extra: Any
    ) -> None:
        base, n = oid, 2
        while oid in self.operations:
            oid, n = f"{base}-{n}", n + 1
        self.operations[oid] = {
            "action": action,
            "channel": {"$ref": f"#/channels/{cid}"},
            "messages": messages,
            **extra,
        }

    # -- a route --------------------------------------------------------------------------------

    def route(self, route: Route, app_middlewares: Iterable[Any]) -> None:
        chain = [*app_middlewares, *route.middlewares]
        typed = next((m for m in chain if isinstance(m, self.mw.Typed)), None)
        s = route.settings
        name = _id(s.name)
        many = len(s.topics) > 1
        for topic in s.topics:
            cid = self.channel(topic)
            ref = self.message(cid, *self.consumed_message(route, typed))
            self.operation(
                f"{name}.{cid}" if many else name,
                "receive",
                cid,
                [ref],
                summary=f"Route {s.name!r} (consumer group {s.group!r})",
                description=(
                    f"Handled by {getattr(route.handler, '__qualname__', route.handler)!r}"
                    f"{' in batches' if route.batch else ''}: ordering {s.ordering!r}, concurrency "
                    f"{s.concurrency}; an offset is committed only once every message before it finished."
                ),
                bindings={
                    "kafka": {
                        "groupId": {"type": "string", "enum": [s.group]},
                        "bindingVersion": BINDING_VERSION,
                    }
                },
            )
            for mw in chain:
                if isinstance(mw, self.mw.DeadLetter):
                    dlq = self.channel(mw.topic.replace("{topic}", topic))
                    ref = self.message(dlq, "DeadLetter", self.dead_letter_message())
                    self.operation(
                        f"{name}.dead-letter.{cid}" if many else f"{name}.dead-letter",
                        "send",
                        dlq,
                        [ref],
                        summary=f"Route {s.name!r}: records of {topic} whose handling finally failed",
                    )
        for mw in chain:
            if isinstance(mw, self.mw.Audit):
                cid = self.channel(mw.topic)
                ref = self.message(cid, "AuditRecord", self.audit_message())
                self.operation(
                    f"{name}.audit", "send", cid, [ref], summary=f"Route {s.name!r}: one record per attempt"
                )
        for topic, model in route.produces.items():
            cid = self.channel(topic)
            body: dict[str, Any] = {"name": f"{s.name}.result"}
            mid = f"{name}.result"
            if isinstance(model, type) and issubclass(model, BaseModel):
                body = {
                    "name": model.__name__,
                    "contentType": "application/json",
                    "payload": self.model_ref(model),
                }
                mid = model.__name__
            ref = self.message(cid, mid, body)
            self.operation(
                f"{name}.produces.{cid}",
                "send",
                cid,
                [ref],
                summary=f"Route {s.name!r}: msg.produce({topic!r}, ...)",
            )

    def consumed_message(self, route: Route, typed: Any) -> tuple[str, dict[str, Any]]:
        model = getattr(typed, "model", None) if typed is not None else None
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            model = getattr(getattr(typed, "decoder", None), "model", None)
        body: dict[str, Any]
        if isinstance(model, type) and issubclass(model, BaseModel):
            mid = model.__name__
            body = {"name": mid, "contentType": "application/json", "payload": self.model_ref(model)}
        else:
            mid = f"{_id(route.settings.name)}.record"
            body = {
                "name": mid,
                "description": "The record's value as bytes (the route has no Typed middleware).",
            }
        key = getattr(typed, "key_decoder", None) if typed is not None else None
        if key is not None:  # a message of its own: the same model may be consumed without a key schema
            key_model = getattr(key, "model", None)
            if isinstance(key_model, type) and issubclass(key_model, BaseModel):
                schema: dict[str, Any] = self.model_ref(key_model)
            else:
                schema = {"type": "string"} if isinstance(key, self.mw.Text) else {}
            body["bindings"] = {"kafka": {"key": schema, "bindingVersion": BINDING_VERSION}}
            mid = body["name"] = f"{_id(route.settings.name)}.{mid}"
        return mid, body

    def dead_letter_message(self) -> dict[str, Any]:
        headers = {h: {"type": "string"} for h in self.mw.DEAD_LETTER_HEADERS}
        return {
            "name": "DeadLetter",
            "summary": "A record whose handling finally failed: its key, value and headers unchanged",
            "description": (
                "The original record's key, value and headers, as consumed (the value may be one that "
                "could not be decoded), plus the failure headers, UTF-8 text, named as Spring Kafka's."
            ),
            "headers": {"type": "object", "properties": headers},
        }

    def audit_message(self) -> dict[str, Any]:
        fields: dict[str, Any] = {
            f: {} for f in importlib.import_module("keyedconsumer.middleware.audit").FIELDS
        }
        fields.update(
            {
                "v": {"type": "integer", "const": 1},
                "time_ms": {"type": "integer", "description": "when the attempt ended, ms since the epoch"},
                "group": {"type": "string"},
                "topic": {"type": "string"},
                "partition": {"type": "integer"},
                "offset": {"type": "integer"},
                "key": {"type": ["string", "null"]},
                "key_b64": {"type": "string"},
                "attempt": {"type": "integer"},
                "outcome": {"type": "string", "enum": list(OUTCOMES)},
                "duration_ms": {"type": "number"},
                "error_type": {"type": "string"},
                "error": {"type": "string"},
                "retry_in_s": {"type": "number"},
                "fencing_token": {"type": "integer"},
                "instance": {"type": "string", "description": "host:pid"},
            }
        )
        return {
            "name": "AuditRecord",
            "summary": "One attempt of one message (keyedconsumer audit reads them back)",
            "contentType": "application/json",
            "payload": {"type": "object", "properties": fields, "required": ["v", "time_ms", "outcome"]},
        }

    def schemas(self) -> dict[str, Any]:
        if not self.models:
            return {}
        _, top = models_json_schema(
            [(m, "validation") for m in self.models], ref_template="#/components/schemas/{model}"
        )
        return dict(top.get("$defs", {}))


def document(app: KeyedApp, *, title: str, version: str, description: str | None = None) -> dict[str, Any]:
    """The AsyncAPI 3.0 document of ``app``'s routes, as a JSON-ready ``dict`` (see the module
    docstring).

    Raises
    ------
    ValueError
        The app has no route.
    """
    if not app.routes:
        raise ValueError("the app has no route: register a handler with @app.handler(topic)")
    middleware = importlib.import_module("keyedconsumer.middleware")  # installed from ./middleware
    b = _Builder(middleware)
    for route in app.routes:
        b.route(route, app.middlewares)
    brokers = list(dict.fromkeys(addr for r in app.routes for addr in r.settings.brokers))
    servers = {
        f"broker-{i}": {"host": addr, "protocol": "kafka", "description": "A bootstrap server of the routes"}
        for i, addr in enumerate(brokers)
    }
    info: dict[str, Any] = {"title": title, "version": version}
    if description:
        info["description"] = description
    components: dict[str, Any] = {"messages": b.messages}
    schemas = b.schemas()
    if schemas:
        components["schemas"] = schemas
    return {
        "asyncapi": ASYNCAPI_VERSION,
        "info": info,
        "servers": servers,
        "defaultContentType": "application/json",
        "channels": b.channels,
        "operations": b.operations,
        "components": components,
    }
