"""Confluent Schema Registry payloads for :class:`~keyedconsumer.middleware.Typed`: Avro, Protobuf
and JSON Schema in the Confluent wire format, decoded by ``confluent_kafka.schema_registry``.

Needs the extra ``keyedconsumer[schema-registry]`` (``confluent-kafka[avro,json,protobuf,
schemaregistry]``: fastavro, protobuf, jsonschema and the registry client); importing this module
without it raises ``ImportError``. Each decoder is a
:class:`~keyedconsumer.middleware.decoders.Decoder`::

    from keyedconsumer.middleware import Typed
    from keyedconsumer.middleware.schema_registry import Avro, registry_client

    registry = registry_client("http://127.0.0.1:8081")
    Typed(Avro(registry, model=Order), key=Avro(registry))   # msg.payload: Order, msg.key_payload: dict

A record reaches the handler decoded; the writer's schema is fetched by the id in the record (the
magic byte 0, a 4-byte big-endian schema id, then the payload; Protobuf adds its message indexes;
a schema id in the ``__value_schema_id`` / ``__key_schema_id`` header is read too) and cached by
the client. What makes a record undecodable raises
:class:`~keyedconsumer.middleware.decoders.UndecodableError`, which ``Typed`` turns into a
:class:`~keyedconsumer.middleware.DecodeError` (never retried; dead-lettered, or the consumer stops
naming topic, partition and offset): not the wire format (bad magic byte, too short), a schema id
the registry does not know (HTTP 404), bytes that do not match the writer's schema, a JSON document
that violates its JSON Schema, and a decoded object that ``model`` rejects.

**A registry outage is not the record's fault.** When the registry does not answer (connection
refused or reset, a request timed out) or answers with another HTTP error (5xx, 401, 403, 429), the
record *waits*: the decoder raises :class:`~keyedconsumer.middleware.unavailable.Unavailable` (a
``RetryLater`` that is not a failure: ``Retry`` does not count it, ``DeadLetter`` never sees it),
so the message stays its key's next one and its partition's offset stays at it, until the registry
answers. Records whose writer schema the client has cached decode meanwhile. The requests are
bounded: each by the client's ``timeout`` (:data:`REQUEST_TIMEOUT_S` for a client this module
builds; confluent-kafka's own default is no timeout at all), and while the registry is out at most
one request is in flight, spaced by a back-off from 0.5 s doubling to 5 s (every other record
waits without asking; :class:`~keyedconsumer.middleware.unavailable.Availability`). Meanwhile
``unavailable()`` names the registry, which makes :class:`~keyedconsumer.health.Health` not ready
(``Health(consumer, dependencies=[typed])``; a ``KeyedApp`` reports its routes' by itself).
"""

from __future__ import annotations

import logging
import struct
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload
from urllib.parse import urlsplit

from confluent_kafka.schema_registry import SchemaRegistryClient, SchemaRegistryError
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.schema_registry.json_schema import JSONDeserializer
from confluent_kafka.schema_registry.protobuf import ProtobufDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext, SerializationError
from pydantic import BaseModel, ValidationError

from keyedconsumer import Message

from .decoders import Field, UndecodableError, first_error, validation_errors
from .unavailable import Availability, wait_on

__all__ = ["Avro", "JsonSchema", "Protobuf", "registry_client", "Registry", "REQUEST_TIMEOUT_S"]

log = logging.getLogger("keyedconsumer.middleware.schema_registry")

M = TypeVar("M", bound=BaseModel)
#: a generated Protobuf message class's instances (google.protobuf ships no type information)
PM = TypeVar("PM")
if TYPE_CHECKING:
    from typing_extensions import TypeVar as _TypeVar

    T = _TypeVar("T", default=Any)
else:
    T = TypeVar("T")

#: What names a registry: its URL, a ``SchemaRegistryClient`` configuration (``{"url": ...,
#: "basic.auth.user.info": ...}``) or a client (share one between decoders: it caches schemas).
Registry = str | Mapping[str, Any] | SchemaRegistryClient

#: modules whose exceptions mean "the registry could not be asked" (HTTP transport, time-outs)
_TRANSPORT_MODULES = frozenset({"httpx", "httpx2", "httpcore", "httpcore2", "h11", "anyio", "ssl", "socket"})


#: Seconds a request to the registry may take, in a client :func:`registry_client` builds (its
#: ``timeout``; confluent-kafka sets none, so a registry that accepts a connection and never answers
#: would hold the decoding worker for good). A record waits that long at most before it waits
#: without a thread (see the module's docs).
REQUEST_TIMEOUT_S = 5.0

#: What a client :func:`registry_client` builds is given unless its configuration says otherwise:
#: the request timeout, and no retries of its own (``max.retries``: confluent-kafka's retries sleep
#: in the decoding worker; a record whose registry does not answer waits without a thread instead).
CLIENT_DEFAULTS: dict[str, Any] = {"timeout": REQUEST_TIMEOUT_S, "max.retries": 0}


def registry_client(registry: Registry) -> SchemaRegistryClient:
    """A ``SchemaRegistryClient`` for ``registry`` (returned as is when it is one). One built here
    from a URL or a configuration gets :data:`CLIENT_DEFAULTS` under the configuration's own values.

    Raises
    ------
    TypeError
        ``registry`` is none of a URL, a configuration mapping or a client.
    """
    if isinstance(registry, SchemaRegistryClient):
        return registry
    if isinstance(registry, str):
        return SchemaRegistryClient({**CLIENT_DEFAULTS, "url": registry})
    if isinstance(registry, Mapping):
        return SchemaRegistryClient({**CLIENT_DEFAULTS, **registry})
    raise TypeError(
        f"registry must be a URL, a configuration dict or a SchemaRegistryClient, got {registry!r}"
    )


class _Refused(Exception):
    """Raised before a request while the registry is out and another request probes it."""

    def __init__(self, delay_s: float) -> None:
        super().__init__(f"not asked: the registry is unavailable (next request in {delay_s:.2f} s)")
        self.delay_s = delay_s


_availability_lock = threading.Lock()
_availabilities: weakref.WeakKeyDictionary[SchemaRegistryClient, Availability] = weakref.WeakKeyDictionary()


def availability(client: SchemaRegistryClient) -> Availability:
    """The :class:`~keyedconsumer.middleware.unavailable.Availability` of ``client``'s registry,
    shared by every decoder of that client; made on first use, when its requests are gated.

    The gate is a pair of httpx event hooks (httpx's public ``Client.event_hooks``) on the HTTP
    session confluent-kafka's client keeps (``_rest_client.session``, an ``httpx.Client``): before a
    request, :meth:`~keyedconsumer.middleware.unavailable.Availability.admit` (a request not let
    through raises :class:`_Refused` and is not sent); on a response, ``answered`` unless 5xx or
    429. A client without that session (another confluent-kafka version) is not gated: its
    requests are still bounded by its ``timeout``, and a warning says so.
    """
    with _availability_lock:
        found = _availabilities.get(client)
        if found is not None:
            return found
        conf: Mapping[str, Any] = client.config()  # type: ignore[no-untyped-call]
        url = str(conf.get("url", "?"))
        parts = [urlsplit(u.strip()) for u in url.split(",")]
        shown = ",".join(f"{p.scheme}://{p.hostname}{f':{p.port}' if p.port else ''}" for p in parts)
        avail = _availabilities[client] = Availability(f"schema registry {shown}")
        _gate(client, avail)
        return avail


def _gate(client: SchemaRegistryClient, avail: Availability) -> None:
    session: Any = getattr(getattr(client, "_rest_client", None), "session", None)
    hooks = getattr(session, "event_hooks", None)
    if not isinstance(hooks, dict):
        log.warning("%s: requests not gated (no httpx session found in the client)", avail.name)
        return

    def before(_request: Any) -> None:
        delay_s = avail.admit()
        if delay_s is not None:
            raise _Refused(delay_s)

    def after(response: Any) -> None:
        status = int(getattr(response, "status_code", 0))
        if status < 500 and status != 429:
            avail.answered()

    session.event_hooks = {
        "request": [*hooks.get("request", []), before],
        "response": [*hooks.get("response", []), after],
    }


def _is_transient(exc: BaseException) -> bool:
    """The registry could not answer for this record now: not a property of the record."""
    if isinstance(exc, SchemaRegistryError):
        return exc.http_status_code != 404
    if isinstance(exc, (OSError, TimeoutError)):
        return True
    return type(exc).__module__.split(".")[0] in _TRANSPORT_MODULES


def _has_schema_id_header(headers: list[tuple[str, Any]]) -> bool:
    """The schema id travels in a header (``__value_schema_id`` / ``__key_schema_id``), not in
    front of the payload."""
    return any(name in ("__value_schema_id", "__key_schema_id") for name, _ in headers)


def _framing_problem(data: bytes) -> str | None:
    """What is wrong with the frame in front of the payload: magic byte 0 and a 4-byte big-endian
    schema id, or magic byte 1 and a 16-byte schema GUID; ``None`` when the frame is well formed."""
    if not data:
        return "empty"
    magic = data[0]
    if magic not in (0, 1):
        return f"magic byte {magic:#04x} (expected 0x00, a schema id, or 0x01, a schema GUID)"
    if len(data) < (5 if magic == 0 else 17):
        return f"{len(data)} bytes, too short for magic byte {magic:#04x} and its schema {'id' if magic == 0 else 'GUID'}"
    return None


def _schema_ref(data: bytes) -> str:
    """``id 42`` or ``guid …`` from a well-formed frame; ``(in a header)`` otherwise."""
    if len(data) >= 5 and data[0] == 0:
        return f"id {struct.unpack('>I', data[1:5])[0]}"
    if len(data) >= 17 and data[0] == 1:
        return f"guid {data[1:17].hex()}"
    return "(id in a header)"


class _RegistryDecoder(Generic[T]):
    """A ``confluent_kafka`` deserializer as a :class:`~keyedconsumer.middleware.decoders.Decoder`."""

    def __init__(
        self,
        name: str,
        deserializer: Callable[[bytes, SerializationContext], Any],
        model: type[BaseModel] | None,
        client: SchemaRegistryClient,
    ) -> None:
        self.name = model.__name__ if model is not None else name
        self.format = name
        self.model = model
        self.client = client
        self._deserializer = deserializer
        #: the availability of the client's registry (shared by the decoders of one client)
        self.availability = availability(client)

    def unavailable(self) -> list[str]:
        """``[reason]`` while records wait for the registry (see the module's docs), else ``[]``."""
        reason = self.availability.unavailable()
        return [] if reason is None else [reason]

    def decode(self, data: bytes, *, msg: Message, field: Field) -> T:
        """Decode Confluent wire-format ``data``.

        Raises
        ------
        UndecodableError
            The record is not decodable (see the module's docs).
        Unavailable
            The registry could not be asked (not the record's fault): the message waits.
        """
        kind = MessageField.KEY if field == "key" else MessageField.VALUE
        headers: list[tuple[str, str | bytes | None]] = list(msg.headers)
        ctx = SerializationContext(msg.topic, kind, headers)
        avail = self.availability
        try:
            obj = self._deserializer(data, ctx)
        except _Refused as exc:
            raise wait_on(msg, exc.delay_s, f"{avail.name} unavailable") from exc
        except Exception as exc:
            if _is_transient(exc):
                reason = f"{type(exc).__name__}: {exc}"
                raise wait_on(msg, avail.failed(reason), f"{avail.name} unavailable: {reason}") from exc
            raise self._undecodable(exc, data, headers) from exc
        finally:
            avail.release()
        if self.model is None:
            return obj  # type: ignore[no-any-return]
        try:
            return self.model.model_validate(obj)  # type: ignore[return-value]
        except ValidationError as exc:
            errors = validation_errors(exc)
            raise UndecodableError(first_error(errors), errors) from exc

    def _undecodable(self, exc: Exception, data: bytes, headers: list[tuple[str, Any]]) -> UndecodableError:
        framing = None if _has_schema_id_header(headers) else _framing_problem(data)
        if framing is not None:
            reason, kind = f"not Confluent wire format: {framing}", "wire_format"
        elif isinstance(exc, SchemaRegistryError):  # 404: the id is not in the registry
            reason, kind = (
                f"schema {_schema_ref(data)} is unknown to the registry ({exc})",
                "unknown_schema_id",
            )
        else:
            detail = str(exc) if isinstance(exc, SerializationError) else f"{type(exc).__name__}: {exc}"
            reason = f"does not match its writer schema {_schema_ref(data)} ({self.format}): {detail}"
            kind = "schema_mismatch"
        return UndecodableError(reason, [{"loc": [], "msg": reason, "type": kind}])


class Avro(_RegistryDecoder[T]):
    """Avro records (``AvroDeserializer``): a ``dict``, or a ``model`` instance.

    Parameters
    ----------
    registry:
        A URL, a client configuration or a ``SchemaRegistryClient`` (see :data:`Registry`).
    model:
        A pydantic model the decoded ``dict`` is validated into (``model.model_validate``);
        ``None`` (the default) hands the ``dict`` on.
    reader_schema:
        An Avro schema (JSON text) to read with (schema resolution from the writer's schema);
        ``None`` (the default) reads with the writer's schema.
    conf:
        ``AvroDeserializer`` configuration (``use.latest.version``, ``subject.name.strategy``, ...).
    """

    @overload
    def __init__(
        self: Avro[dict[str, Any]],
        registry: Registry,
        *,
        reader_schema: str | None = None,
        conf: Mapping[str, Any] | None = None,
    ) -> None: ...

    @overload
    def __init__(
        self: Avro[M],
        registry: Registry,
        *,
        model: type[M],
        reader_schema: str | None = None,
        conf: Mapping[str, Any] | None = None,
    ) -> None: ...

    def __init__(
        self,
        registry: Registry,
        *,
        model: type[BaseModel] | None = None,
        reader_schema: str | None = None,
        conf: Mapping[str, Any] | None = None,
    ) -> None:
        client = registry_client(registry)
        deserializer = AvroDeserializer(client, reader_schema, conf=dict(conf) if conf else None)
        super().__init__("avro", deserializer, model, client)


class JsonSchema(_RegistryDecoder[T]):
    """JSON Schema records (``JSONDeserializer``, which validates against the writer's schema):
    the decoded JSON (a ``dict`` for an object), or a ``model`` instance.

    Parameters
    ----------
    registry:
        A URL, a client configuration or a ``SchemaRegistryClient`` (see :data:`Registry`).
    model:
        A pydantic model the decoded document is validated into; ``None`` (the default) hands it on.
    schema:
        A JSON Schema (JSON text) to validate with instead of the writer's; ``None`` (the default)
        validates with the writer's schema.
    conf:
        ``JSONDeserializer`` configuration.
    """

    @overload
    def __init__(
        self: JsonSchema[Any],
        registry: Registry,
        *,
        schema: str | None = None,
        conf: Mapping[str, Any] | None = None,
    ) -> None: ...

    @overload
    def __init__(
        self: JsonSchema[M],
        registry: Registry,
        *,
        model: type[M],
        schema: str | None = None,
        conf: Mapping[str, Any] | None = None,
    ) -> None: ...

    def __init__(
        self,
        registry: Registry,
        *,
        model: type[BaseModel] | None = None,
        schema: str | None = None,
        conf: Mapping[str, Any] | None = None,
    ) -> None:
        client = registry_client(registry)
        deserializer = JSONDeserializer(
            schema, schema_registry_client=client, conf=dict(conf) if conf else None
        )
        super().__init__("json-schema", deserializer, model, client)


class Protobuf(_RegistryDecoder[PM]):
    """Protobuf records (``ProtobufDeserializer``): an instance of ``message_type``.

    The writer's schema is fetched from the registry, so a schema id it does not know makes the
    record undecodable, like the other formats.

    Parameters
    ----------
    message_type:
        The generated message class (``order_pb2.Order``).
    registry:
        A URL, a client configuration or a ``SchemaRegistryClient`` (see :data:`Registry`).
    conf:
        ``ProtobufDeserializer`` configuration.

    Raises
    ------
    TypeError
        ``message_type`` is not a generated message class.
    """

    def __init__(
        self, message_type: type[PM], registry: Registry, *, conf: Mapping[str, Any] | None = None
    ) -> None:
        if not hasattr(message_type, "DESCRIPTOR"):
            raise TypeError(
                f"Protobuf needs a generated message class (with DESCRIPTOR), got {message_type!r}"
            )
        client = registry_client(registry)
        deserializer = ProtobufDeserializer(
            message_type, dict(conf) if conf else None, schema_registry_client=client
        )
        super().__init__("protobuf", deserializer, None, client)
        self.name = getattr(message_type, "__name__", "protobuf")
