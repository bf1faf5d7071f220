"""A consumed Kafka record and its outcome.

The outcome vocabulary follows the xkafka proposal (gojekfarm/xtools issue #25): a message ends as
``SUCCESS``, ``SKIP`` or ``FAIL``. A message is *done* (its offset may be stored) when it ends
``SUCCESS`` or ``SKIP``, or when its ``FAIL`` was handled by the ``error_handler``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Generic
from weakref import ref as _weakref

if TYPE_CHECKING:
    # A type variable with a default (PEP 696): ``Message`` alone means ``Message[Any]``, so
    # handlers annotated with the bare ``Message`` still type-check under mypy --strict. The
    # runtime TypeVar of Python < 3.13 has no ``default``; type checkers read this branch.
    from typing_extensions import TypeVar

    P = TypeVar("P", default=Any)
else:
    from typing import TypeVar

    P = TypeVar("P")

__all__ = ["Message", "Status", "Record"]

#: A record a handler produces: ``(topic, key, value, headers)`` (:meth:`Message.produce`).
Record = tuple[str, "bytes | None", "bytes | None", "list[tuple[str, bytes | None]] | None"]


class Status(enum.Enum):
    """Outcome of one message.

    ``PENDING`` until the handler ends; then ``SUCCESS`` (returned normally or ``ack_success()``),
    ``SKIP`` (``ack_skip()``), ``DEAD_LETTERED`` (``ack_dead_lettered()``: published to a
    dead-letter topic; done, like ``SKIP``) or ``FAIL`` (raised, or ``ack_fail(error)``).
    """

    PENDING = "PENDING"
    SUCCESS = "SUCCESS"
    SKIP = "SKIP"
    DEAD_LETTERED = "DEAD_LETTERED"
    FAIL = "FAIL"


class Message(Generic[P]):
    """One Kafka record handed to a handler; generic in the type of its decoded ``payload``.

    ``Message[Order]`` is a message whose ``payload`` is an ``Order`` (what
    ``Typed(Order)`` puts there), so ``def handle(msg: Message[Order]) -> None`` type-checks
    ``msg.payload.cents``. ``Message`` alone is ``Message[Any]``.

    Attributes
    ----------
    topic, partition, offset:
        Where the record was read from (``offset`` is the record's own offset, not offset + 1).
    key, value:
        Raw bytes, or ``None`` (a null key; a tombstone value). An empty key ``b""`` is not null.
    headers:
        ``list[tuple[str, bytes | None]]`` in broker order; duplicates are kept.
    timestamp_ms:
        The record's timestamp in milliseconds since the epoch, or ``None`` when the broker gave none.
    status:
        The :class:`Status`; ``PENDING`` while the handler runs.
    error:
        The exception that failed the message, or ``None``.
    attempt:
        The attempt number of the current run: 1 for the first; the engine increases it before each
        new attempt (after a :class:`~keyedconsumer.RetryLater`).
    last_error:
        The error that caused the last retry (``RetryLater``'s ``__cause__``), or ``None``.
    payload:
        The decoded value (type ``P``), set by a decoding middleware such as
        :class:`~keyedconsumer.middleware.Typed`; ``None`` until one runs, and for a tombstone.
    key_payload:
        The decoded key (``Typed(..., key=...)``), or ``None`` (not decoded, or a null key).
    state:
        A free ``dict`` for middleware (retry state, decoded payloads, timings).
    fencing_token:
        With a :class:`~keyedconsumer.RedisSequencer`, the fencing token of the key's lease this run
        holds (guard external writes with it); ``None`` otherwise.
    group_id:
        The consumer group that consumed it (``""`` when not consumed by the engine).
    """

    __slots__ = (
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
        "key_payload",
        "fencing_token",
        "group_id",
        "_headers",
        "_ts",
        "_state",
        "_owns",
        "_delivery",
        "_produced",
    )

    def __init__(
        self,
        topic: str,
        partition: int,
        offset: int,
        key: bytes | None = None,
        value: bytes | None = None,
        headers: list[tuple[str, bytes | None]] | None = None,
        timestamp_ms: int | None = None,
    ) -> None:
        self.topic = topic
        self.partition = partition
        self.offset = offset
        self.key = key
        self.value = value
        self.status = Status.PENDING
        self.error: BaseException | None = None
        self.attempt = 1
        self.last_error: BaseException | None = None
        # None until a decoding middleware sets it (Typed); typed P for the handlers that declare
        # Message[P] behind such a middleware.
        self.payload: P = None  # type: ignore[assignment]
        self.key_payload: Any = None
        self.fencing_token: int | None = None
        # The headers list (when the record has none) and the state dict are made on first use:
        # most handlers never touch them, and not allocating containers per message keeps the
        # garbage collector out of the hot path.
        self._headers = headers
        self._ts = timestamp_ms
        self._state: dict[str, Any] | None = None
        #: The consumer group that consumed it (``""`` when not consumed by the engine).
        self.group_id = ""
        # the engine's ownership check of this run and its record of the message (Message.still_owned)
        self._owns: Callable[[Any], bool] | None = None
        self._delivery: Any = None
        # records the current attempt produced (msg.produce), written when the handler returns
        self._produced: list[Record] | None = None

    @property
    def headers(self) -> list[tuple[str, bytes | None]]:
        """``list[tuple[str, bytes | None]]`` in broker order; duplicates are kept."""
        h = self._headers
        if h is None:
            h = self._headers = []
        return h

    @headers.setter
    def headers(self, value: list[tuple[str, bytes | None]]) -> None:
        self._headers = value

    @property
    def timestamp_ms(self) -> int | None:
        """The record's timestamp in milliseconds since the epoch, or ``None`` when there is none."""
        return self._ts

    @timestamp_ms.setter
    def timestamp_ms(self, value: int | None) -> None:
        self._ts = value

    @property
    def state(self) -> dict[str, Any]:
        """A free ``dict`` for middleware (retry state, decoded payloads, timings)."""
        st = self._state
        if st is None:
            st = self._state = {}
        return st

    def still_owned(self) -> bool:
        """True while this run's outcome still counts; check it before a side effect that must
        happen once per message, such as a dead-letter publish (karafka PR #3220 guards its DLQ
        dispatch the same way).

        ``False`` once its partition was revoked or lost and the revoke stopped waiting for it
        (``revoke_timeout_s``), once the consumer's run is over (``shutdown_timeout_s`` passed), or,
        with a :class:`~keyedconsumer.RedisSequencer`, once its key's lease was lost or taken over.
        The partition's (or the key's) new owner then runs the message again, so this run must not
        act as if it were the last. Also ``False`` once the run ended and the engine let the message go. A message not consumed by a :class:`~keyedconsumer.KeyedConsumer`
        (built by hand) is always owned.
        """
        owns = self._owns
        if owns is None:
            return True
        delivery = self._delivery()
        return delivery is not None and owns(delivery)

    def _bind(self, owns: Callable[[Any], bool], delivery: Any) -> None:
        """Set by the engine when it admits the message: how :meth:`still_owned` asks it. The
        engine's record of the message refers to the message, so it is held weakly here: no
        reference cycle per message for the cyclic garbage collector to find (and once the engine
        let the record go, the run is over)."""
        self._owns = owns
        self._delivery = _weakref(delivery)

    @property
    def timestamp(self) -> datetime | None:
        """The record timestamp as an aware UTC ``datetime``, or ``None``."""
        if self.timestamp_ms is None:
            return None
        return datetime.fromtimestamp(self.timestamp_ms / 1000.0, tz=timezone.utc)

    def header(self, name: str) -> bytes | None:
        """Return the value of the last header called ``name``, or ``None`` when absent."""
        for k, v in reversed(self.headers):
            if k == name:
                return v
        return None

    def produce(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: list[tuple[str, bytes | None]] | None = None,
    ) -> None:
        """Produce a result record of this message (Confluent Parallel Consumer's
        ``pollAndProduce``): it is written only when the handler returns normally (not when it
        raises or calls :meth:`ack_fail`), and the message counts done only after that.

        Without ``transactional``, the engine writes the attempt's records when the handler returns
        and waits for the broker's acknowledgement (``acks=all``, idempotent producer) before the
        message counts done: a refused record fails the attempt with
        :class:`~keyedconsumer.PublishError` (``Retry`` and ``DeadLetter`` handle it like any failure),
        so an offset never passes a message whose records were not acknowledged. A retried or re-run
        message produces its records again (at-least-once).

        With ``transactional=True`` (docs/exactly-once.md), the records are written in the Kafka
        transaction that also commits the message's offset: a ``read_committed`` reader sees them
        exactly once.

        Parameters
        ----------
        topic:
            The topic to write to; the partition is chosen from ``key`` by the producer's partitioner.
        key, value:
            Raw bytes, or ``None``.
        headers:
            ``[(name, bytes or None)]``, or ``None``.

        Raises
        ------
        TypeError
            ``topic`` is not a non-empty ``str``, or ``key`` / ``value`` is neither bytes nor ``None``.
        """
        if not isinstance(topic, str) or not topic:
            raise TypeError(f"produce() needs a topic name, got {topic!r}")
        for name, v in (("key", key), ("value", value)):
            if v is not None and not isinstance(v, (bytes, bytearray, memoryview)):
                raise TypeError(f"produce() {name} must be bytes or None, got {type(v).__name__}")
        records = self._produced
        if records is None:
            records = self._produced = []
        records.append((topic, key, value, list(headers) if headers else None))

    @property
    def produced(self) -> list[Record]:
        """The records this attempt produced so far (:meth:`produce`), not yet written; a copy."""
        return list(self._produced or ())

    def take_produced(self) -> list[Record]:
        """Remove and return the records this attempt produced (the engine calls it: when an
        attempt starts, to drop an earlier attempt's records, and when it writes them)."""
        records = self._produced
        self._produced = None
        return records or []

    def ack_success(self) -> None:
        """Mark the message ``SUCCESS`` (the default when the handler returns normally)."""
        self.status = Status.SUCCESS
        self.error = None

    def ack_skip(self) -> None:
        """Mark the message ``SKIP``: it is done, its offset may be stored, nothing else happens."""
        self.status = Status.SKIP
        self.error = None

    def ack_dead_lettered(self) -> None:
        """Mark the message ``DEAD_LETTERED``: it was published to a dead-letter topic and is done
        (the dead-letter middleware calls it once the broker acknowledged the record)."""
        self.status = Status.DEAD_LETTERED
        self.error = None

    def ack_fail(self, error: BaseException) -> None:
        """Mark the message ``FAIL`` with ``error``; it then follows the error path like a raise."""
        self.status = Status.FAIL
        self.error = error

    def __repr__(self) -> str:
        return (
            f"Message(topic={self.topic!r}, partition={self.partition}, offset={self.offset}, "
            f"key={self.key!r}, status={self.status.value})"
        )
