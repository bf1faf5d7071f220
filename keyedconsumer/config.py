"""Validated consumer options (pydantic-settings).

Every option can also come from an environment variable ``KEYEDCONSUMER_<FIELD>`` (for example
``KEYEDCONSUMER_CONCURRENCY=16``; lists as JSON or comma-separated). Keyword arguments win over the
environment. A bad value raises :class:`pydantic.ValidationError` naming the field, and so does a
``KEYEDCONSUMER_*`` variable the package does not read (a typo): :data:`ENVIRONMENT_VARIABLES`
lists every one it reads.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    ModelWrapValidatorHandler,
    PlainSerializer,
    PlainValidator,
    PrivateAttr,
    SecretStr,
    SerializerFunctionWrapHandler,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_serializer,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

__all__ = [
    "ConsumerConfig",
    "Ordering",
    "SECRET_WORDS",
    "is_secret",
    "redact",
    "reveal",
    "hide_secrets",
    "ENV_PREFIX",
    "CLI_SETTINGS",
    "ENVIRONMENT_VARIABLES",
    "SEQUENCER_ENV_PREFIX",
    "CALLBACK_PROPERTIES",
    "CONNECTION_PROPERTIES",
    "CONNECTION_PREFIXES",
    "is_connection_property",
    "Callback",
    "ConfigValue",
]

#: Prefix of every environment variable the package reads.
ENV_PREFIX = "KEYEDCONSUMER_"

#: Settings of the ``keyedconsumer`` command line that are not :class:`ConsumerConfig` fields, also
#: read from ``KEYEDCONSUMER_<NAME>``: the fields of ``keyedconsumer.cli.RunOptions``,
#: ``config_file`` (``KEYEDCONSUMER_CONFIG_FILE``, the ``--config`` flag), the dashboard's
#: ``web_token``, ``web_audit_topic`` and ``web_allowed_hosts``, and ``sequencer``: the
#: Redis sequencer's options, one variable each, ``KEYEDCONSUMER_SEQUENCER__<OPTION>`` (a
#: :class:`~keyedconsumer.sequencing.RedisSequencerConfig` field but ``url`` and ``namespace``), or
#: all of them as one JSON object in ``KEYEDCONSUMER_SEQUENCER``.
CLI_SETTINGS = (
    "handler",
    "group",
    "redis",
    "namespace",
    "dead_letter_topic",
    "retry_attempts",
    "park",
    "processes",
    "config_file",
    "web_token",
    "web_audit_topic",
    "web_allowed_hosts",
    "sequencer",
)
#: The prefix of the Redis sequencer's option variables (see :data:`CLI_SETTINGS`).
SEQUENCER_ENV_PREFIX = ENV_PREFIX + "SEQUENCER__"

Ordering = Literal["key", "partition", "none"]

#: librdkafka properties the engine owns. ``enable.auto.offset.store`` is always false: offsets are
#: stored only for finished messages (the xkafka proposal, gojekfarm/xtools issue #25).
_OWNED = {
    "bootstrap.servers": "brokers",
    "group.id": "group_id",
    "enable.auto.offset.store": None,
    "enable.auto.commit": "manual_commit",
    "on_commit": None,
}

#: Substrings that mark a configuration key as secret: its value never appears in a repr, a log
#: line or an error.
SECRET_WORDS = (
    "password",
    "secret",
    "token",
    "key.pem",
    "private",
    "credential",
    "jaas",
    "oauthbearer.config",
)


#: The librdkafka callback properties ``config`` accepts, as confluent-kafka names them: each takes a
#: callable (``logger``: a :class:`logging.Logger` or :class:`logging.LoggerAdapter`, whose ``log``
#: method confluent-kafka calls). ``oauth_cb(sasl_oauthbearer_config: str) -> (token, expiry_epoch_s)``
#: (or ``(token, expiry, principal, extensions)``) is librdkafka's ``oauthbearer_token_refresh_cb``:
#: called once before each client (consumer, producers, admin) is built, and then by librdkafka's
#: background thread at 80% of each token's lifetime, for idle clients too; its result is checked
#: and a raise retried (:mod:`keyedconsumer.kafka.oauth`). ``error_cb(KafkaError)``;
#: ``stats_cb(json: str)`` every ``statistics.interval.ms``; ``throttle_cb(ThrottleEvent)``: these
#: run in the poll thread, inside librdkafka's poll call. Keep them all short. Every other property
#: is refused a callable.
CALLBACK_PROPERTIES = ("oauth_cb", "error_cb", "stats_cb", "throttle_cb", "logger")

#: Properties another client of the same cluster shares with the consumer (see
#: :meth:`ConsumerConfig.connection_properties`), besides every name starting with one of
#: :data:`CONNECTION_PREFIXES`.
CONNECTION_PROPERTIES = frozenset(
    {
        "security.protocol",
        "enable.ssl.certificate.verification",
        "enable.sasl.oauthbearer.unsecure.jwt",
        "oauth_cb",
        "broker.address.family",
        "client.dns.lookup",
        "logger",
    }
)
#: Name prefixes of the connection properties: TLS (``ssl.*``, ``ssl_*``), SASL (``sasl.*``) and the
#: HTTPS settings of the OAUTHBEARER/OIDC token endpoint (``https.*``).
CONNECTION_PREFIXES = ("ssl.", "ssl_", "sasl.", "https.")


def is_connection_property(name: str) -> bool:
    """True when the librdkafka property ``name`` tells how to reach and authenticate with the brokers
    (the rule of :meth:`ConsumerConfig.connection_properties`)."""
    return name in CONNECTION_PROPERTIES or name.startswith(CONNECTION_PREFIXES)


def _is_callback(value: Any) -> bool:
    """True for what a callback property may hold: a callable, or a logger (``logger``)."""
    return callable(value) or isinstance(value, (logging.Logger, logging.LoggerAdapter))


def _callback_text(value: Any) -> str:
    """How a callback shows in a repr, a dump or JSON: its kind and qualified name, never its repr
    (a bound method's repr shows its object, which may hold a secret)."""
    if isinstance(value, (logging.Logger, logging.LoggerAdapter)):
        return f"<logger {value.name}>"
    name = getattr(value, "__qualname__", None) or type(value).__qualname__
    return f"<callable {name}>"


def _check_callback(value: Any) -> Any:
    if not _is_callback(value):
        raise ValueError("expected a callable (or a logging.Logger for 'logger')")
    return value


#: A callback property's value (:data:`CALLBACK_PROPERTIES`): kept as it is, shown and dumped as
#: ``"<callable name>"`` / ``"<logger name>"`` (never serialized, never in JSON).
Callback = Annotated[
    Callable[..., Any] | logging.Logger | logging.LoggerAdapter,  # type: ignore[type-arg]
    PlainValidator(_check_callback),
    PlainSerializer(_callback_text, return_type=str),
    WithJsonSchema({"type": "string", "description": "a callable (callback properties only)"}),
]
#: A value of ``ConsumerConfig.config``.
ConfigValue = str | int | float | bool | SecretStr | Callback


def is_secret(name: str) -> bool:
    """True when a property or option named ``name`` holds a secret (it holds one of :data:`SECRET_WORDS`)."""
    lower = name.lower()
    return any(w in lower for w in SECRET_WORDS)


def redact(config: Mapping[str, Any]) -> dict[str, Any]:
    """Return a copy of a librdkafka property dict with secret values replaced by ``'***'`` and
    callbacks by ``'<callable name>'`` (printable, JSON-serializable)."""
    return {
        k: (
            "***" if is_secret(k) or isinstance(v, SecretStr) else _callback_text(v) if _is_callback(v) else v
        )
        for k, v in config.items()
    }


def reveal(config: Mapping[str, Any]) -> dict[str, Any]:
    """Return a copy of a librdkafka property dict with each :class:`~pydantic.SecretStr` replaced by
    its value (what librdkafka must get)."""
    return {k: (v.get_secret_value() if isinstance(v, SecretStr) else v) for k, v in config.items()}


def hide_secrets(data: Any) -> Any:
    """The input ``data`` of a settings model with every secret value wrapped in
    :class:`~pydantic.SecretStr` before pydantic sees it, so that no validation error's ``input``
    (``errors()``, ``json()``) can show it: the secret-named properties of a ``config`` mapping, a
    ``config`` given as a string, and any other secret-named key."""
    if not isinstance(data, dict):
        return data
    out = dict(data)
    for key, value in data.items():
        if isinstance(value, SecretStr) or value is None:
            continue
        if key == "config":
            if isinstance(value, Mapping):
                # a callable is left as it is, to be refused by name when its property takes none
                out[key] = {
                    k: (
                        SecretStr(str(v))
                        if is_secret(str(k)) and not isinstance(v, SecretStr) and not _is_callback(v)
                        else v
                    )
                    for k, v in value.items()
                }
            elif isinstance(value, str):  # not a mapping: refused, and shown as '**********'
                out[key] = SecretStr(value)
        elif is_secret(str(key)):
            out[key] = SecretStr(str(value))
    return out


#: A Kafka topic name (Kafka's own rule: these characters, at most 249 of them).
_TOPIC = re.compile(r"[A-Za-z0-9._-]{1,249}")


def _check_broker(entry: str) -> None:
    """Raise ``ValueError`` unless ``entry`` is ``host``, ``host:port`` or ``[ipv6]:port``, optionally
    with a ``protocol://`` prefix, and any port is in 1..65535.

    librdkafka does not refuse these itself: an empty entry or ``host:notaport`` only fails later, as
    "no answer from the brokers", and ``host:99999`` is silently taken modulo 65536 (port 34463).
    """
    rest = entry.split("://", 1)[-1]
    port: str | None = None
    if rest.startswith("["):  # [ipv6] or [ipv6]:port
        host, _, tail = rest[1:].partition("]")
        if tail:
            if not tail.startswith(":"):
                raise ValueError(f"broker address {entry!r} is not host:port")
            port = tail[1:]
    elif rest.count(":") == 1:
        host, port = rest.split(":")
    else:  # a host name, or a bare IPv6 address (no port)
        host = rest
    if not host or any(c.isspace() for c in entry):
        raise ValueError(f"broker address {entry!r} has no host or holds whitespace")
    if port is not None and not (port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"broker address {entry!r}: the port must be a number in 1..65535")


def _check_topic(topic: str) -> None:
    """Raise ``ValueError`` unless ``topic`` is a legal Kafka topic name or a ``^regex`` that compiles.

    librdkafka refuses an empty name or a broken regex only at ``subscribe()`` (a bare
    ``KafkaException``), and a name Kafka can never hold (``"bad topic!"``) is subscribed to forever.
    """
    if topic.startswith("^"):
        try:
            re.compile(topic)
        except re.error as exc:
            raise ValueError(f"topic regex {topic!r} does not compile: {exc}") from None
        return
    if not _TOPIC.fullmatch(topic) or topic in (".", ".."):
        raise ValueError(
            f"topic {topic!r} is not a Kafka topic name (1-249 of A-Z a-z 0-9 . _ -), "
            "nor a regex starting with '^'"
        )


def _split(value: Any) -> Any:
    if isinstance(value, str):
        value = value.strip()
        if value.startswith("["):
            return json.loads(value)
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


class ConsumerConfig(BaseSettings):
    """Options of a :class:`~keyedconsumer.KeyedConsumer`.

    Parameters
    ----------
    name:
        The consumer's name; also the consumer group id unless ``group_id`` is given.
    brokers:
        Bootstrap servers, ``host:port`` strings (librdkafka ``bootstrap.servers``). An empty entry,
        whitespace or a port outside 1..65535 is refused here (librdkafka would only time out, or
        take the port modulo 65536).
    topics:
        Topics to subscribe to (a name starting with ``^`` is a regex, as in librdkafka). A name that
        is not a legal Kafka topic name, or a regex that does not compile, is refused here.
    group_id:
        Consumer group id; defaults to ``name``.
    concurrency:
        Handlers running at once, >= 1. ``1`` runs one message at a time (the default). Booleans are
        refused for every numeric option (pydantic would take ``True`` as ``1``).
    ordering:
        ``"key"``: one message at a time per (partition, key), in offset order; null keys share one
        lane per partition. ``"partition"``: one at a time per partition. ``"none"``: no order.
    conflate:
        Latest value per key: of the messages waiting behind a lane's head only the newest runs.
        This is commons-processing's conflation: while messages of a lane wait behind its head
        (running, ready or retrying), each older waiting one is *conflated*: it never runs, counts
        done (its offset advances) and is handed to ``KeyedConsumer(on_conflated=...)`` and
        counted in ``KeyedConsumer.conflated``. Needs
        ``ordering="key"`` or ``"partition"``. With a ``RedisSequencer``, a key parked in Redis
        keeps its parked head and only its newest waiting message: each newer one replaces the
        waiting one in the Lua script that parks it (under the key's lease), and a drain cuts a
        longer list (scheduled messages moved in) the same way; those replaced are conflated alike.
    manual_commit:
        ``False``: librdkafka commits the stored offsets every ``auto.commit.interval.ms``.
        ``True``: each offset advance is committed synchronously and every per-partition commit
        error is checked.
    transactional:
        Exactly-once results: what handlers produce and their messages' offsets commit together.
        The records handlers produce (``msg.produce``) and the offsets of the messages that
        produced them are committed in one Kafka transaction (``send_offsets_to_transaction`` with
        the group metadata, KIP-447), every ``transaction_interval_s``, at a revoke and at the
        stop; a ``read_committed`` reader of the output sees each input's records once
        (docs/exactly-once.md). Offsets are then never committed outside a
        transaction (librdkafka's auto commit is off; ``manual_commit`` must stay ``False``). Not
        with a ``RedisSequencer``. Needs brokers with transactions (``transaction.state.log.*``).
    transactional_id:
        librdkafka ``transactional.id`` of the transactional producer; ``None``: the group id with a
        random suffix. Give each instance a stable one (its pod name) so that a restarted instance
        aborts what its crashed predecessor left open at once, instead of after
        ``transaction_timeout_s`` (meanwhile ``read_committed`` readers of the output wait).
    transaction_interval_s:
        Seconds between transactions (> 0, <= 60). It is the latency of results to
        ``read_committed`` readers and of offset commits, against the cost of a commit (two round
        trips to the transaction coordinator) per interval.
    transaction_timeout_s:
        librdkafka ``transaction.timeout.ms`` in seconds (1 to 900): a transaction its producer left
        open (a crash, a stall) is aborted by the broker after it. Also the longest time transactions
        may keep being refused (abortable errors that do not pass by themselves, e.g. a record the
        topic refuses) before the consumer stops; failures that pass by themselves (no answer, a
        commit in doubt, the group rebalancing) may last librdkafka's ``max.poll.interval.ms``
        (docs/exactly-once.md, "Failures").
    produce_timeout_s:
        Without ``transactional``: seconds a produced record is tried (librdkafka
        ``message.timeout.ms``) before its attempt fails with ``PublishError``.
    max_in_flight:
        Messages buffered or running, >= 1. Above it the assigned partitions are paused; they are
        resumed below half of it. Polling goes on while paused.
    max_in_flight_bytes:
        The same bound in bytes of key + value.
    batch_size:
        Records asked of librdkafka per ``consume()`` call.
    poll_timeout_s:
        Seconds one ``consume()`` call may wait; also the longest delay of an offset store.
    handler_timeout_s:
        Seconds one handler run may take (``None``: no limit). At the limit an ``async def``
        handler is cancelled; a plain handler cannot be interrupted: it is logged, counted and
        health turns not-ready while it overruns, and its run fails when it returns. Either way the
        attempt fails with ``HandlerTimeoutError``, which retry and dead-letter middleware handle
        (the limit applies inside every middleware).
    handler_batch_size:
        With ``KeyedConsumer(batch_handler=...)``: the most messages one batch call gets, >= 1. A
        batch holds at most one message per key (per partition with ``ordering="partition"``), so
        it is also bounded by the keys ready at once. Unused with ``handler``.
    handler_batch_linger_s:
        With ``batch_handler``: seconds a batch worker waits for a fuller batch (0, the default: no
        wait). A worker that found fewer than ``handler_batch_size`` ready messages waits this long
        for more before calling the handler. Not waited while stopping. Kafka producers'
        ``linger.ms``, for batches.
    shutdown_timeout_s:
        Seconds ``stop()`` waits for running handlers before committing and closing.
    revoke_timeout_s:
        Seconds a revoke waits for the revoked partitions' running handlers before committing.
    startup_timeout_s:
        Seconds to wait for the first metadata answer from the brokers before failing.
    require_topics:
        A subscribed topic the cluster does not have is an error at start, not a warning.
        ``True``: the consumer stops at start, and ``run()`` raises ``KafkaClientError`` code
        ``UNKNOWN_TOPIC_OR_PART`` naming the topic and the closest existing name. ``False`` (the
        default): the same is logged as a warning and the consumer waits for the topic (librdkafka
        assigns its partitions once it is created; meanwhile none is assigned, so health is not
        ready). Checked against the brokers' metadata at start (the real client), and by
        librdkafka as it refreshes it; regex subscriptions (``^...``) are not checked.
    auto_offset_reset:
        Where a group with no committed offset starts (librdkafka ``auto.offset.reset``).
    commit_metadata_max_bytes:
        Bytes of commit metadata naming the offsets finished above the committed one (0: none).
        The metadata (ASCII characters) is written with the commits of a revoke, a stop and a lease
        check after a stall, and read by the partition's next owner, which skips those offsets
        instead of running them again (Confluent Parallel Consumer's offset map). Brokers accept up to
        ``offset.metadata.max.bytes`` (4096 by default); a refused commit is retried without it.
    event_loop:
        The event loop of ``async def`` handlers: ``"auto"``, ``"asyncio"`` or ``"uvloop"``. It is
        the loop :meth:`~keyedconsumer.KeyedConsumer.run` starts (``run_async`` uses the caller's):
        ``"auto"`` is uvloop's when the ``keyedconsumer[uvloop]`` extra is installed, else
        asyncio's; ``"uvloop"`` is refused at start when uvloop is not installed.
    config:
        Any other librdkafka property, passed through unchanged. The properties the engine owns
        (``bootstrap.servers``, ``group.id``, ``enable.auto.commit``, ``enable.auto.offset.store``)
        are rejected here: use the fields above. The value of a property whose name holds a secret
        word (``sasl.password``, ``ssl.key.password``, ``sasl.oauthbearer.client.secret`` ...; see
        ``SECRET_WORDS``) is kept as a ``pydantic.SecretStr``: no repr, dump, JSON, log line or
        validation error (``errors()`` and ``json()`` included) shows it. ``librdkafka()`` and
        ``properties()`` give the real values. The callback properties ``oauth_cb``, ``error_cb``,
        ``stats_cb``, ``throttle_cb`` (callables) and ``logger`` (a ``logging.Logger``), as
        confluent-kafka names them, take their Python objects (``CALLBACK_PROPERTIES``); any other
        property given a callable, or one of them given anything else, is refused. A callback is
        passed to the client as it is, and shown in a repr, a dump or JSON (``--print-settings``)
        only as ``"<callable name>"``. A given ``error_cb`` runs after the engine's own (which
        reports client errors to ``error_handler``); an exception it raises is logged. Another
        client of the same cluster takes the connection properties of ``connection_properties()``
        (``DeadLetter()`` does).
    """

    model_config = SettingsConfigDict(
        env_prefix="KEYEDCONSUMER_",
        extra="forbid",
        allow_inf_nan=False,
        validate_default=True,
        hide_input_in_errors=True,  # an input may hold a secret (sasl.password); errors name fields only
    )

    name: str = Field(min_length=1)
    brokers: Annotated[list[str], NoDecode] = Field(default_factory=lambda: ["127.0.0.1:9092"], min_length=1)
    topics: Annotated[list[str], NoDecode] = Field(min_length=1)
    group_id: str | None = None
    concurrency: int = Field(default=1, ge=1, le=100_000)
    ordering: Ordering = "key"
    conflate: bool = False
    manual_commit: bool = False
    transactional: bool = False
    transactional_id: str | None = Field(default=None, min_length=1, max_length=512)
    transaction_interval_s: float = Field(default=0.1, gt=0, le=60)
    transaction_timeout_s: float = Field(default=10.0, ge=1, le=900)
    produce_timeout_s: float = Field(default=30.0, gt=0, le=3600)
    max_in_flight: int = Field(default=10_000, ge=1)
    max_in_flight_bytes: int = Field(default=64 * 1024 * 1024, ge=1)
    batch_size: int = Field(default=500, ge=1, le=1_000_000)
    poll_timeout_s: float = Field(default=0.1, gt=0, le=60)
    handler_timeout_s: float | None = Field(default=None, gt=0)
    handler_batch_size: int = Field(default=100, ge=1, le=100_000)
    handler_batch_linger_s: float = Field(default=0.0, ge=0, le=60)
    shutdown_timeout_s: float = Field(default=30.0, gt=0)
    revoke_timeout_s: float = Field(default=10.0, gt=0)
    startup_timeout_s: float = Field(default=30.0, gt=0)
    require_topics: bool = False
    auto_offset_reset: Literal["earliest", "latest"] = "earliest"
    commit_metadata_max_bytes: int = Field(default=2048, ge=0, le=1_000_000)
    event_loop: Literal["auto", "asyncio", "uvloop"] = "auto"
    config: dict[str, ConfigValue] = Field(default_factory=dict)
    #: True when ``group_id`` was not given and follows ``name``.
    _group_follows_name: bool = PrivateAttr(default=False)

    @field_validator("brokers", "topics", mode="before")
    @classmethod
    def _split_lists(cls, value: Any) -> Any:
        return _split(value)

    @field_validator("brokers")
    @classmethod
    def _broker_addresses(cls, value: list[str]) -> list[str]:
        for item in value:
            for entry in item.split(","):  # librdkafka takes "a:9092, b:9092" too
                _check_broker(entry.strip())
        return value

    @field_validator("topics")
    @classmethod
    def _topic_names(cls, value: list[str]) -> list[str]:
        for topic in value:
            _check_topic(topic)
        return value

    @field_validator(
        "concurrency",
        "max_in_flight",
        "max_in_flight_bytes",
        "batch_size",
        "poll_timeout_s",
        "handler_batch_size",
        "handler_batch_linger_s",
        "shutdown_timeout_s",
        "revoke_timeout_s",
        "startup_timeout_s",
        "commit_metadata_max_bytes",
        "transaction_interval_s",
        "transaction_timeout_s",
        "produce_timeout_s",
        "handler_timeout_s",
        mode="before",
    )
    @classmethod
    def _no_bool_for_number(cls, value: Any) -> Any:
        # pydantic's lax mode takes True for 1 and 1.0: a boolean here is a mix-up, not a number
        if isinstance(value, bool):
            raise ValueError("expected a number, got a boolean")
        return value

    @field_validator("manual_commit", "conflate", "transactional", "require_topics", mode="before")
    @classmethod
    def _no_int_for_bool(cls, value: Any) -> Any:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            raise ValueError("expected a boolean, got a number")
        return value

    @field_validator("config")
    @classmethod
    def _not_owned(cls, value: dict[str, Any]) -> dict[str, Any]:
        for prop, field in _OWNED.items():
            if prop in value:
                hint = f"use the {field!r} option" if field else "the engine always sets it"
                raise ValueError(f"librdkafka property {prop!r} is owned by keyedconsumer: {hint}")
        return value

    @field_validator("config")
    @classmethod
    def _callbacks_where_taken(cls, value: dict[str, Any]) -> dict[str, Any]:
        for prop, v in value.items():
            is_logger = isinstance(v, (logging.Logger, logging.LoggerAdapter))
            if prop == "logger" and not is_logger:  # confluent-kafka calls its log() method
                raise ValueError(
                    f"'logger' takes a logging.Logger (or LoggerAdapter), got a {type(v).__name__}"
                )
            if prop in CALLBACK_PROPERTIES and prop != "logger" and (is_logger or not callable(v)):
                raise ValueError(f"librdkafka property {prop!r} takes a callable, got a {type(v).__name__}")
            if prop not in CALLBACK_PROPERTIES and _is_callback(v):
                raise ValueError(
                    f"librdkafka property {prop!r} takes no callable (callbacks: {', '.join(CALLBACK_PROPERTIES)})"
                )
        return value

    @field_serializer("config", mode="wrap")
    def _callbacks_by_name(self, value: dict[str, Any], handler: SerializerFunctionWrapHandler) -> Any:
        # every dump (python and JSON) shows a callback by its name only: a bound method's repr
        # shows its object, which may hold a secret; and a function is no JSON
        return handler({k: (_callback_text(v) if _is_callback(v) else v) for k, v in value.items()})

    # Rules between two options are checked on the later one (its validator sees the earlier ones,
    # in field order), so the error's ``loc`` names a field as every other error does.
    @field_validator("conflate")
    @classmethod
    def _conflate_needs_order(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("ordering") == "none":
            raise PydanticCustomError(
                "conflate_needs_order",
                "conflate replaces a lane's waiting messages: it needs ordering='key' or 'partition'",
            )
        return value

    @field_validator("transactional")
    @classmethod
    def _transactional_commits(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("manual_commit"):
            raise PydanticCustomError(
                "transactional_commits",
                "transactional=True commits offsets in its transactions: manual_commit must be False",
            )
        return value

    @model_validator(mode="after")
    def _defaults(self) -> ConsumerConfig:
        if self.group_id is None:
            self.group_id = self.name
            self._group_follows_name = True
        return self

    @field_validator("config", mode="after")
    @classmethod
    def _librdkafka_accepts(cls, value: dict[str, Any]) -> dict[str, Any]:
        # librdkafka itself knows its properties: an unknown name or a bad value fails here, at
        # construction, instead of at run().
        from .kafka.properties import check_config  # loads librdkafka: only when a config is checked

        conf = {"group.id": "keyedconsumer-config-check", "bootstrap.servers": "127.0.0.1:9"}
        # without the callbacks: confluent-kafka calls oauth_cb when it builds the client, and a
        # check must not fetch a token (their types were checked above)
        conf.update(reveal({k: v for k, v in value.items() if k not in CALLBACK_PROPERTIES}))
        check_config(conf)
        return value

    @model_validator(mode="wrap")
    @classmethod
    def _secrets_hidden(cls, data: Any, handler: ModelWrapValidatorHandler[ConsumerConfig]) -> ConsumerConfig:
        # Defined last, so it runs first (outermost): secrets are wrapped before any validation, and
        # no error's input (errors(), json()) can hold one.
        return handler(hide_secrets(data))

    def __init__(self, **values: Any) -> None:
        _refuse_unknown_environment_variables(type(self).__name__)
        super().__init__(**values)

    def override(self, **options: Any) -> ConsumerConfig:
        """A new config: these fields, with ``options`` (field names) replacing them, validated again.
        This one is left unchanged. A new ``name`` moves the group id too when it followed the name
        (``group_id`` not given). ``KeyedConsumer(settings=cfg, **options)`` uses it.

        Raises
        ------
        pydantic.ValidationError
            A bad or unknown option, naming the field.
        """
        data = {name: getattr(self, name) for name in type(self).model_fields}
        if "name" in options and "group_id" not in options and self._group_follows_name:
            data["group_id"] = None
        data.update(options)
        return type(self).model_validate(data)

    @property
    def group(self) -> str:
        """The consumer group id (``group_id``, else ``name``)."""
        return self.group_id or self.name

    @property
    def uses_consumer_protocol(self) -> bool:
        """True when ``group.protocol=consumer`` (KIP-848) is configured."""
        return str(self.config.get("group.protocol", "classic")).lower() == "consumer"

    def librdkafka(self) -> dict[str, Any]:
        """Return the librdkafka property dict the engine passes to the client.

        ``partition.assignment.strategy`` defaults to ``cooperative-sticky`` under the classic
        protocol; under ``group.protocol=consumer`` (KIP-848) the assignor runs on the broker and
        the client-side properties the new protocol rejects are not set. ``client.id`` defaults to
        ``keyedconsumer-<name>`` (librdkafka's own default, ``rdkafka``, would be every member's),
        so the routes of a ``KeyedApp`` (unique names) are told apart in the group's member list;
        a ``client.id`` in ``config`` is used as given.
        """
        conf: dict[str, Any] = {
            "bootstrap.servers": ",".join(self.brokers),
            "group.id": self.group,
            "enable.auto.offset.store": False,
            "enable.auto.commit": not (self.manual_commit or self.transactional),
            "auto.offset.reset": self.auto_offset_reset,
            # librdkafka's own prefetch queue, bounded like ours (max_in_flight(_bytes)): a quarter
            # of max_in_flight_bytes (1 to 64 MiB) and half of max_in_flight messages per partition
            # (librdkafka's default queued.min.messages, 100,000, would prefetch ten times our bound).
            "queued.max.messages.kbytes": max(1024, min(65536, self.max_in_flight_bytes // 1024 // 4)),
            "queued.min.messages": max(1000, min(100_000, self.max_in_flight // 2)),
            # Past either threshold librdkafka postpones the partition's next fetch by
            # fetch.queue.backoff.ms (librdkafka: 1,000 ms; its CONFIGURATION.md advises lowering
            # it when the thresholds are low): with 1 KB messages a 16 MiB queue drains in ~0.2 s,
            # so a 1 s back-off capped throughput (workload 4 of bench/README.md). 20 ms refills it
            # promptly at the cost of more fetch wake-ups.
            "fetch.queue.backoff.ms": 20,
            # Back-pressure pauses and resumes partitions. A fetch request sent while a partition
            # was paused waits at the broker for up to fetch.wait.max.ms (librdkafka: 500) and holds
            # back the fetch after the resume; 50 ms keeps a pause/resume cycle short (measured:
            # ~470 ms -> ~40 ms from resume to the next messages) at the cost of more idle fetches.
            "fetch.wait.max.ms": 50,
        }
        if not self.uses_consumer_protocol:
            conf["partition.assignment.strategy"] = "cooperative-sticky"
        # each consumer of a process its own client.id (librdkafka's default is "rdkafka" for all):
        # the members of a group, the broker's logs and quotas tell a KeyedApp's routes apart
        conf["client.id"] = f"keyedconsumer-{self.name}"
        conf.update(self.properties())
        return conf

    def properties(self) -> dict[str, Any]:
        """The ``config`` pass-through properties with the secret values revealed: what librdkafka
        gets. Build another client with the same security settings from this, not from ``config``:
        confluent-kafka would take a ``SecretStr`` as its masked text (``Publisher`` and
        ``DeadLetter(producer_config=...)`` reveal it themselves)."""
        return reveal(self.config)

    def connection_properties(self) -> dict[str, Any]:
        """The pass-through properties another client of the same cluster needs, secrets revealed:
        how to reach and authenticate with the brokers, nothing about consuming.

        The rule: a property is shared when :func:`is_connection_property` says so, that is
        ``security.protocol``, every ``ssl.*``, ``ssl_*``, ``sasl.*`` and ``https.*`` property,
        ``enable.ssl.certificate.verification``, ``enable.sasl.oauthbearer.unsecure.jwt``,
        ``broker.address.family``, ``client.dns.lookup``, and the callbacks ``oauth_cb`` (the same
        token source) and ``logger`` (the same log destination). Each is a global property that
        librdkafka's CONFIGURATION.md marks ``*`` (for consumers and producers alike), the security
        block of that table and the two that choose how broker addresses resolve. Everything else
        stays with the consumer: consumer-only properties (``C``: ``session.timeout.ms``,
        ``fetch.*``, ``group.*`` ...), and the shared ones that tune or observe one client
        (``client.id``, ``statistics.interval.ms``, ``error_cb``, ``stats_cb``, ``throttle_cb``,
        ``debug``, ``socket.*``, ``message.max.bytes`` ...): give those to the other client
        yourself (``DeadLetter(producer_config=...)``).

        Returns
        -------
        A new dict, ``{property: value}``; the consumer's ``brokers`` are not in it.
        """
        return {k: v for k, v in self.properties().items() if is_connection_property(k)}

    def __repr_args__(self) -> Any:
        for k, v in super().__repr_args__():
            yield (k, redact(v) if k == "config" and isinstance(v, dict) else v)


#: Every environment variable the package reads: ``KEYEDCONSUMER_`` + a :class:`ConsumerConfig`
#: field or one of :data:`CLI_SETTINGS`, upper case (pydantic-settings matches names in any case).
#: :class:`ConsumerConfig` refuses any other ``KEYEDCONSUMER_*`` variable, as it refuses an unknown
#: keyword: a misspelt one would otherwise be ignored without a word.
ENVIRONMENT_VARIABLES = frozenset(
    ENV_PREFIX + name.upper() for name in (*ConsumerConfig.model_fields, *CLI_SETTINGS)
)


#: Variables other settings models read (``register_environment_variables``): the Redis sequencer's
#: options, ``KEYEDCONSUMER_SEQUENCER__<OPTION>``.
_REGISTERED: set[str] = set()


def register_environment_variables(names: Iterable[str]) -> None:
    """Declare more ``KEYEDCONSUMER_*`` variables the package reads (a settings model defined
    elsewhere, e.g. the Redis sequencer's options, registers its own at import): they are not
    refused as unknown."""
    _REGISTERED.update(n.upper() for n in names)


def _refuse_unknown_environment_variables(title: str) -> None:
    """Raise :class:`pydantic.ValidationError` naming each ``KEYEDCONSUMER_*`` variable that is
    not in :data:`ENVIRONMENT_VARIABLES`. Its value is never shown (it may be a secret)."""
    unknown = sorted(
        k for k in os.environ if k.upper().startswith(ENV_PREFIX) and k.upper() not in ENVIRONMENT_VARIABLES
    )
    unknown = [k for k in unknown if k.upper() not in _REGISTERED]
    if not unknown:
        return
    errors: list[InitErrorDetails] = []
    for name in unknown:
        known = sorted(v[len(ENV_PREFIX) :] for v in ENVIRONMENT_VARIABLES)
        close = difflib.get_close_matches(name.upper()[len(ENV_PREFIX) :], known, n=1)
        hint = (
            f"did you mean {ENV_PREFIX}{close[0]}?" if close else f"it reads {ENV_PREFIX}<{'|'.join(known)}>"
        )
        errors.append(
            {
                "type": PydanticCustomError(
                    "unknown_environment_variable",
                    "unknown environment variable: keyedconsumer reads no such setting ({hint})",
                    {"hint": hint},
                ),
                "loc": (name,),
                "input": SecretStr(os.environ[name]),
            }
        )
    raise ValidationError.from_exception_data(title, errors, hide_input=True)
