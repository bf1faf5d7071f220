"""Admin, inspection and replay helpers on librdkafka, used by the command line (:mod:`keyedconsumer.cli`).

The engine uses none of this. Every helper opens short-lived clients of its own from a librdkafka
property dict (``bootstrap.servers`` plus any pass-through properties such as security settings)
and closes them before it returns. librdkafka's own log lines go to the Python logger
``keyedconsumer.kafka.tools``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Generator, Sequence
from typing import Any, NoReturn

from confluent_kafka import (
    Consumer,
    ConsumerGroupTopicPartitions,
    KafkaError,
    KafkaException,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, OffsetSpec  # type: ignore[attr-defined]

from .. import hermetic
from ..errors import KafkaClientError, PublishError
from . import TP
from .oauth import with_token_source

__all__ = [
    "Record",
    "CommittedOffset",
    "GroupDescription",
    "GroupMember",
    "topic_partitions",
    "all_topics",
    "list_groups",
    "committed_offsets",
    "watermark_offsets",
    "describe_group",
    "record_timestamps",
    "TopicReader",
    "TransactionalPublisher",
    "offsets_for_times",
]

tools_log = logging.getLogger("keyedconsumer.kafka.tools")


@dataclasses.dataclass(frozen=True)
class Record:
    """One record read from a topic (read only: not a :class:`Message`, nothing is acknowledged).

    ``timestamp_ms`` is the record's timestamp in milliseconds since the epoch (``None`` if it has
    none); ``headers`` keep their order and duplicates.
    """

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]]
    timestamp_ms: int | None


@dataclasses.dataclass(frozen=True)
class CommittedOffset:
    """A consumer group's committed offset of one partition (``None``: nothing committed) and the
    metadata string committed with it (``""`` if none)."""

    offset: int | None
    metadata: str = ""


@dataclasses.dataclass(frozen=True)
class GroupMember:
    """One member of a consumer group: its ids, host and assigned partitions."""

    member_id: str
    client_id: str
    host: str
    assigned: tuple[TP, ...]


@dataclasses.dataclass(frozen=True)
class GroupDescription:
    """A consumer group as the group coordinator describes it.

    ``state``: lower-case state name (``"stable"``, ``"empty"``, ``"dead"``, ``"unknown"``, ...);
    ``members``: members now; ``assigned``: the partitions assigned to them; ``member_list``: each
    member with its own partitions.
    """

    state: str
    members: int
    assigned: list[TP]
    member_list: tuple[GroupMember, ...] = ()


def _tools_conf(conf: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """``conf`` for one more client: ``extra`` laid over it, librdkafka's log to ``tools_log``, and
    ``oauth_cb``'s first token fetched (:func:`~keyedconsumer.kafka.oauth.with_token_source`;
    raises its :class:`~keyedconsumer.kafka.oauth.TokenCallbackError`, a ``KafkaClientError``)."""
    hermetic.check("a Kafka admin tool (keyedconsumer.kafka.admin)", str(conf.get("bootstrap.servers")))
    out = dict(conf)
    out.update(extra)
    out.setdefault("logger", tools_log)
    return with_token_source(out)


def _fail(exc: BaseException, what: str, timeout_s: float) -> NoReturn:
    err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
    if err is None:
        raise KafkaClientError(f"{what}: {exc}") from None
    if err.code() in (KafkaError._TRANSPORT, KafkaError._TIMED_OUT, KafkaError._ALL_BROKERS_DOWN):
        raise KafkaClientError(
            f"{what}: no answer from the brokers within {timeout_s:g} s ({err.name()}; check the brokers)",
            code=err.name(),
        ) from None
    raise KafkaClientError(f"{what}: {err.name()}: {err.str()}", code=err.name(), fatal=err.fatal()) from None


def _admin(conf: dict[str, Any]) -> AdminClient:
    try:
        return AdminClient(_tools_conf(conf))
    except KafkaException as exc:
        _fail(exc, "cannot create the Kafka admin client", 0)


def topic_partitions(conf: dict[str, Any], topics: Sequence[str], timeout_s: float = 10.0) -> dict[str, int]:
    """The number of partitions of each topic in ``topics``.

    Asks for the metadata of all topics, so no topic is created by asking (even where the brokers
    auto-create topics).

    Returns
    -------
    ``{topic: partition count}`` for every topic asked.

    Raises
    ------
    KafkaClientError
        A topic does not exist, or no answer from the brokers within ``timeout_s`` seconds.
    """
    known = _topics(conf, timeout_s)
    out: dict[str, int] = {}
    for topic in topics:
        if topic not in known:
            raise KafkaClientError(f"topic {topic!r} does not exist", code="UNKNOWN_TOPIC_OR_PART")
        out[topic] = known[topic]
    return out


def _topics(conf: dict[str, Any], timeout_s: float) -> dict[str, int]:
    """``{topic: partition count}`` of every topic in the cluster's metadata (errors left out)."""
    admin = _admin(conf)
    try:
        meta = admin.list_topics(timeout=timeout_s)
    except KafkaException as exc:
        _fail(exc, "cannot read the topics' metadata", timeout_s)
    return {
        name: len(tm.partitions) for name, tm in meta.topics.items() if tm.error is None and tm.partitions
    }


def committed_offsets(
    conf: dict[str, Any],
    group: str,
    partitions: Sequence[TP] | None = None,
    timeout_s: float = 10.0,
    require_stable: bool = False,
) -> dict[TP, CommittedOffset]:
    """A consumer group's committed offsets, read from the group coordinator (the group is not joined).

    Parameters
    ----------
    partitions:
        The partitions to ask about; ``None`` asks for every partition the group has committed.
    require_stable:
        Wait while a transaction committing offsets for the group is open (else: the last
        committed offsets, at once).

    Returns
    -------
    ``{(topic, partition): CommittedOffset}``; ``offset`` is ``None`` where nothing is committed.

    Raises
    ------
    KafkaClientError
        No answer within ``timeout_s`` seconds, or the coordinator refused (e.g. not authorised).
    """
    admin = _admin(conf)
    tps = None if partitions is None else [TopicPartition(t, p) for t, p in partitions]
    request = ConsumerGroupTopicPartitions(group, tps)
    try:
        futures = admin.list_consumer_group_offsets(
            [request], require_stable=require_stable, request_timeout=timeout_s
        )
        result = futures[group].result(timeout=timeout_s + 5)
    except KafkaException as exc:
        _fail(exc, f"cannot read the committed offsets of group {group!r}", timeout_s)
    out: dict[TP, CommittedOffset] = {}
    for tp in result.topic_partitions or []:
        if tp.error is not None:
            raise KafkaClientError(
                f"committed offset of group {group!r} for {tp.topic}[{tp.partition}]: {tp.error.name()}",
                code=tp.error.name(),
            )
        out[(tp.topic, tp.partition)] = CommittedOffset(
            tp.offset if tp.offset >= 0 else None, tp.metadata or ""
        )
    return out


def watermark_offsets(
    conf: dict[str, Any], partitions: Sequence[TP], timeout_s: float = 10.0
) -> dict[TP, tuple[int, int]]:
    """The start offset (log start) and end offset (high watermark) of each partition.

    Returns
    -------
    ``{(topic, partition): (start_offset, end_offset)}``.

    Raises
    ------
    KafkaClientError
        No answer within ``timeout_s`` seconds, or a partition is unknown.
    """
    if not partitions:
        return {}
    admin = _admin(conf)
    out: dict[TP, list[int]] = {tp: [0, 0] for tp in partitions}
    specs = ((0, OffsetSpec.earliest()), (1, OffsetSpec.latest()))  # type: ignore[no-untyped-call]
    for index, spec in specs:
        try:
            futures = admin.list_offsets(
                {TopicPartition(t, p): spec for t, p in partitions}, request_timeout=timeout_s
            )
            for tp, fut in futures.items():
                out[(tp.topic, tp.partition)][index] = fut.result(timeout=timeout_s + 5).offset
        except KafkaException as exc:
            _fail(exc, "cannot read the partitions' offsets", timeout_s)
    return {tp: (v[0], v[1]) for tp, v in out.items()}


def describe_group(conf: dict[str, Any], group: str, timeout_s: float = 10.0) -> GroupDescription:
    """Describe a consumer group: its state, members and their assigned partitions.

    Raises
    ------
    KafkaClientError
        No answer within ``timeout_s`` seconds. A group that does not exist is described as
        ``state="dead"`` with no members, not as an error.
    """
    admin = _admin(conf)
    try:
        desc = admin.describe_consumer_groups([group], request_timeout=timeout_s)[group].result(
            timeout=timeout_s + 5
        )
    except KafkaException as exc:
        err = exc.args[0] if exc.args else None
        if isinstance(err, KafkaError) and err.code() == KafkaError.GROUP_ID_NOT_FOUND:
            return GroupDescription("dead", 0, [])
        _fail(exc, f"cannot describe group {group!r}", timeout_s)
    assigned = sorted(
        {
            (tp.topic, tp.partition)
            for m in desc.members or []
            for tp in (m.assignment.topic_partitions if m.assignment else [])
        }
    )
    state = getattr(desc.state, "name", str(desc.state)).lower()
    members = tuple(
        GroupMember(
            str(m.member_id or ""),
            str(m.client_id or ""),
            str(m.host or ""),
            tuple(
                sorted(
                    (tp.topic, tp.partition) for tp in (m.assignment.topic_partitions if m.assignment else [])
                )
            ),
        )
        for m in desc.members or []
    )
    return GroupDescription(state, len(desc.members or []), assigned, members)


def all_topics(conf: dict[str, Any], timeout_s: float = 10.0) -> dict[str, int]:
    """Every topic the brokers list (internal ``__`` topics left out) and its partition count.

    Raises
    ------
    KafkaClientError
        No answer from the brokers within ``timeout_s`` seconds.
    """
    return {name: n for name, n in _topics(conf, timeout_s).items() if not name.startswith("__")}


def list_groups(conf: dict[str, Any], timeout_s: float = 10.0) -> dict[str, str]:
    """The consumer groups the brokers know: ``{group id: lower-case state}``, sorted by id.

    Raises
    ------
    KafkaClientError
        No answer from the brokers within ``timeout_s`` seconds.
    """
    admin = _admin(conf)
    try:
        result = admin.list_consumer_groups(request_timeout=timeout_s).result(timeout=timeout_s + 5)
    except KafkaException as exc:
        _fail(exc, "cannot list the consumer groups", timeout_s)
    listed = sorted(result.valid or [], key=lambda g: str(g.group_id))
    return {str(g.group_id): getattr(g.state, "name", str(g.state)).lower() for g in listed}


def _record(raw: Any) -> Record:
    ts_type, ts = raw.timestamp()
    return Record(
        raw.topic(),
        raw.partition(),
        raw.offset(),
        raw.key(),
        raw.value(),
        list(raw.headers() or []),
        ts if ts_type else None,
    )


def record_timestamps(
    conf: dict[str, Any], positions: dict[TP, int], timeout_s: float = 10.0
) -> dict[TP, int | None]:
    """The timestamp of the record at (or, past a gap, first after) each given offset.

    Reads one record per partition with a consumer of a throw-away group that is never joined and
    commits nothing.

    Returns
    -------
    ``{(topic, partition): timestamp in ms since the epoch}``; ``None`` where no record came within
    ``timeout_s`` seconds (e.g. the offset is the partition's end) or the record has no timestamp.

    Raises
    ------
    KafkaClientError
        The consumer could not be created (an invalid property).
    """
    out: dict[TP, int | None] = dict.fromkeys(positions)
    if not positions:
        return out
    try:
        consumer = Consumer(
            _tools_conf(
                conf,
                **{
                    "group.id": f"keyedconsumer-inspect-{uuid.uuid4().hex}",
                    "enable.auto.commit": False,
                    "auto.offset.reset": "earliest",
                    "enable.partition.eof": True,
                    # one record per partition is wanted: no prefetching of megabytes behind it
                    "queued.min.messages": 1,
                    "max.partition.fetch.bytes": 65536,
                    "fetch.max.bytes": 1048576,
                },
            )
        )
    except KafkaException as exc:
        _fail(exc, "cannot create the Kafka consumer", timeout_s)
    try:
        consumer.assign([TopicPartition(t, p, o) for (t, p), o in positions.items()])
        waiting = set(positions)
        deadline = time.monotonic() + timeout_s
        while waiting and time.monotonic() < deadline:
            for raw in consumer.consume(len(waiting), min(0.5, max(0.01, deadline - time.monotonic()))):
                tp = (raw.topic(), raw.partition())
                if tp not in waiting:
                    continue
                if raw.error() is None:
                    out[tp] = _record(raw).timestamp_ms
                    waiting.discard(tp)
                elif raw.error().code() == KafkaError._PARTITION_EOF:  # type: ignore[union-attr]
                    waiting.discard(tp)
    finally:
        consumer.close()
    return out


def offsets_for_times(
    conf: dict[str, Any], topic: str, partitions: Sequence[int], ts_ms: int, timeout_s: float = 10.0
) -> dict[int, int | None]:
    """Per partition, the first offset whose record's timestamp is at or after ``ts_ms`` (ms since
    the epoch): the broker's ListOffsets by timestamp (librdkafka ``offsets_for_times``, KIP-79).

    Returns
    -------
    ``{partition: offset}``; ``None`` where no record is that recent (read nothing there).

    Raises
    ------
    KafkaClientError
        The consumer could not be created, or no answer within ``timeout_s`` seconds.
    """
    try:
        consumer = Consumer(_tools_conf(conf, **{"group.id": f"keyedconsumer-times-{uuid.uuid4().hex}"}))
    except KafkaException as exc:
        _fail(exc, "cannot create the Kafka consumer", timeout_s)
    try:
        found = consumer.offsets_for_times(
            [TopicPartition(topic, p, ts_ms) for p in partitions], timeout=timeout_s
        )
    except KafkaException as exc:
        _fail(exc, f"cannot look up the offsets of {topic} by time", timeout_s)
    finally:
        consumer.close()
    return {tp.partition: (tp.offset if tp.offset >= 0 else None) for tp in found}


class TopicReader:
    """Read every partition of one topic from given offsets up to its end offsets as seen at start.

    The reader uses the consumer group ``group`` only to name the offsets it reads and that a
    :class:`TransactionalPublisher` commits: it never joins the group (partitions are assigned, not
    subscribed) and commits nothing itself. Records written after it started are not read, so a
    topic written to meanwhile (e.g. a dead-letter topic that a replayed record fails into again)
    still ends. Reads only committed records (``isolation.level=read_committed``).

    Parameters
    ----------
    conf:
        librdkafka properties (``bootstrap.servers`` and any pass-through properties).
    topic:
        The topic to read.
    group:
        The consumer group whose committed offsets :meth:`committed` reads.
    timeout_s:
        Bound in seconds of each metadata, offset or fetch wait.

    Raises
    ------
    KafkaClientError
        The topic does not exist, or the brokers did not answer within ``timeout_s``.
    """

    def __init__(self, conf: dict[str, Any], topic: str, group: str, timeout_s: float = 10.0) -> None:
        self.topic = topic
        self.group = group
        self.timeout_s = timeout_s
        self._conf = conf
        count = topic_partitions(conf, [topic], timeout_s)[topic]
        self.partitions = list(range(count))
        offsets = watermark_offsets(conf, [(topic, p) for p in self.partitions], timeout_s)
        #: ``{partition: offset}``: the log start offsets when the reader started
        self.start_offsets = {p: offsets[(topic, p)][0] for p in self.partitions}
        #: ``{partition: offset}``: the end offsets (high watermarks) when the reader started
        self.end_offsets = {p: offsets[(topic, p)][1] for p in self.partitions}
        try:
            self._consumer = Consumer(
                _tools_conf(
                    conf,
                    **{
                        "group.id": group,
                        "enable.auto.commit": False,
                        "enable.auto.offset.store": False,
                        "auto.offset.reset": "earliest",
                        "enable.partition.eof": True,
                        "isolation.level": "read_committed",
                    },
                )
            )
        except KafkaException as exc:
            _fail(exc, "cannot create the Kafka consumer", timeout_s)

    def committed(self, stable: bool = True) -> dict[int, CommittedOffset]:
        """The group's committed offset and metadata of each partition (``offset=None``: none).

        ``stable=True`` waits while a transaction that commits offsets for the group is open (the
        broker answers only once it ended); ``stable=False`` returns the last committed offsets at
        once, without those of an open transaction.

        Raises
        ------
        KafkaClientError
            No answer within ``timeout_s`` seconds.
        """
        if not stable:
            found = committed_offsets(
                self._conf,
                self.group,
                [(self.topic, p) for p in self.partitions],
                self.timeout_s,
                require_stable=False,
            )
            return {p: found.get((self.topic, p), CommittedOffset(None)) for p in self.partitions}
        try:
            tps = self._consumer.committed(
                [TopicPartition(self.topic, p) for p in self.partitions], timeout=self.timeout_s
            )
        except KafkaException as exc:
            _fail(exc, f"cannot read the committed offsets of group {self.group!r}", self.timeout_s)
        return {
            tp.partition: CommittedOffset(tp.offset if tp.offset >= 0 else None, tp.metadata or "")
            for tp in tps
        }

    def read(self, start: dict[int, int]) -> Generator[Record, None, None]:
        """Yield the records from ``start[partition]`` up to the end offsets seen at start, in offset
        order per partition (partitions interleave). A partition missing from ``start`` is not read;
        an offset below the log start reads from the log start.

        Raises
        ------
        KafkaClientError
            No record came for ``timeout_s`` seconds while some partition had not reached its end
            offset, or a fetch error.
        """
        todo = {p: o for p, o in start.items() if o < self.end_offsets.get(p, 0)}
        if not todo:
            return
        self._consumer.assign([TopicPartition(self.topic, p, o) for p, o in todo.items()])
        last_progress = time.monotonic()
        try:
            while todo:
                # consume() waits for a full batch or its timeout: short, so that the last records of a
                # small topic come without waiting (the loop ends when each partition reached its end)
                batch = self._consumer.consume(500, 0.05)
                if not batch and time.monotonic() - last_progress > self.timeout_s:
                    where = ", ".join(f"{self.topic}[{p}] at {o}" for p, o in sorted(todo.items()))
                    raise KafkaClientError(
                        f"no record came for {self.timeout_s:g} s from {where} (before its end offset)"
                    )
                for raw in batch:
                    p, offset = raw.partition(), raw.offset()
                    if p is None or offset is None or p not in todo:
                        continue
                    err = raw.error()
                    if err is not None:
                        if err.code() == KafkaError._PARTITION_EOF:
                            if offset >= self.end_offsets[p]:
                                del todo[p]
                            continue
                        raise KafkaClientError(
                            f"reading {self.topic}[{p}]: {err.name()}: {err.str()}", code=err.name()
                        )
                    last_progress = time.monotonic()
                    if offset >= self.end_offsets[p]:
                        del todo[p]
                        continue
                    todo[p] = offset + 1
                    if offset + 1 >= self.end_offsets[p]:
                        del todo[p]
                    yield _record(raw)
        finally:
            try:
                self._consumer.unassign()
            except KafkaException:
                pass

    def _group_metadata(self) -> Any:
        return self._consumer.consumer_group_metadata()

    def close(self) -> None:
        """Close the consumer (it commits nothing)."""
        self._consumer.close()


class TransactionalPublisher:
    """Publish records and commit a consumer group's offsets in one Kafka transaction.

    Either every record of a transaction and the offsets committed with it become visible, or none
    of them (to consumers with ``isolation.level=read_committed``, librdkafka's default; consumers
    reading uncommitted records also see the records of aborted transactions). The producer is
    idempotent with ``acks=all``. Starting a publisher with a ``transactional_id`` aborts any
    transaction left open under that id (by a crashed process) and fences off any other live
    publisher of that id: its next commit fails.

    Parameters
    ----------
    conf:
        librdkafka properties (``bootstrap.servers`` and any pass-through properties).
    transactional_id:
        librdkafka ``transactional.id``: one id per logical writer.
    timeout_s:
        Bound in seconds of starting, committing and aborting a transaction.

    Raises
    ------
    KafkaClientError
        The producer could not be created, or the transaction coordinator did not answer (the
        brokers may not support transactions: they need ``transaction.state.log.*`` topics).
    """

    def __init__(self, conf: dict[str, Any], transactional_id: str, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        settings = _tools_conf(
            conf,
            **{
                "transactional.id": transactional_id,
                "acks": "all",
                "enable.idempotence": True,
                "linger.ms": 5,
            },
        )
        try:
            self._producer = Producer(settings)
            self._producer.init_transactions(timeout_s)
        except KafkaException as exc:
            _fail(exc, f"cannot start a transaction as {transactional_id!r}", timeout_s)
        self._results: list[Any] = []
        self._open = False

    def begin(self) -> None:
        """Start a transaction.

        Raises
        ------
        KafkaClientError
            librdkafka refused (e.g. this publisher was fenced by a newer one).
        """
        try:
            self._producer.begin_transaction()
        except KafkaException as exc:
            _fail(exc, "cannot begin a transaction", self.timeout_s)
        self._results = []
        self._open = True

    def send(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: list[tuple[str, bytes | None]],
        partition: int | None = None,
    ) -> None:
        """Queue one record in the open transaction (``partition=None``: the partitioner picks by key).

        Raises
        ------
        PublishError
            The record could not be queued (e.g. larger than ``message.max.bytes``).
        KafkaClientError
            The producer hit a fatal error (e.g. ``_FENCED``: a newer publisher of this
            ``transactional_id`` started); the error names it.
        """
        index = len(self._results)
        self._results.append(None)

        def on_delivery(err: KafkaError | None, msg: Any) -> None:
            self._results[index] = (err, msg.partition(), msg.offset())

        kwargs: dict[str, Any] = {} if partition is None else {"partition": partition}
        while True:
            try:
                self._producer.produce(
                    topic,
                    value=value,
                    key=key,
                    headers=list(headers) or None,
                    on_delivery=on_delivery,
                    **kwargs,
                )
                return
            except BufferError:
                self._producer.poll(0.1)
            except KafkaException as exc:
                err = exc.args[0]
                if err.code() == KafkaError._FATAL:
                    raise self._fatal_error(f"cannot publish to {topic}") from None
                raise PublishError(f"cannot publish to {topic}: {err.str()}") from None

    def _fatal_error(self, what: str) -> KafkaClientError:
        """The producer's fatal error (e.g. ``_FENCED``) as a :class:`KafkaClientError`.

        ``produce`` only says "Local: Fatal error"; the error itself is raised by the next poll,
        where confluent-kafka turns librdkafka's fatal error event into a ``KafkaException``.
        """
        try:
            self._producer.poll(0)
        except KafkaException as exc:
            err = exc.args[0]
            return KafkaClientError(f"{what}: {err.name()}: {err.str()}", code=err.name(), fatal=True)
        return KafkaClientError(f"{what}: a fatal producer error", code="_FATAL", fatal=True)

    def commit(self, offsets: dict[TP, tuple[int, str]], reader: TopicReader) -> list[tuple[int, int]]:
        """Commit the open transaction with ``offsets`` (``{(topic, partition): (offset, metadata)}``)
        committed for the reader's consumer group in the same transaction.

        A commit librdkafka answers with a retriable error is resumed (``commit_transaction`` again)
        until ``timeout_s``; one that fails otherwise is aborted, as librdkafka's transactional API
        asks (``txn_requires_abort``).

        Returns
        -------
        ``(partition, offset)`` of each record sent in the transaction, in the order sent.

        Raises
        ------
        PublishError
            A record was refused or the commit failed, and the abort that followed was confirmed:
            none of its records and none of ``offsets`` became visible.
        KafkaClientError
            - ``fatal``: this publisher was fenced (another publisher with the same id started) or
              hit a fatal error, either in the commit or in the abort after a commit that failed
              otherwise (a commit racing the fence); its open transaction is aborted by the broker.
            - not ``fatal``: the transaction's outcome is not known. Either the commit was still
              unanswered at ``timeout_s`` (it is not aborted then: librdkafka may still complete it,
              and the broker commits or aborts it as a whole), or it failed and the abort was not
              confirmed. Read the group's committed offsets with ``require_stable`` to learn which.
        """
        tps = [TopicPartition(t, p, o, metadata=m) for (t, p), (o, m) in offsets.items()]
        committing = False
        try:
            if tps:
                self._producer.send_offsets_to_transaction(tps, reader._group_metadata(), self.timeout_s)
            deadline = time.monotonic() + self.timeout_s
            committing = True
            while True:
                try:
                    self._producer.commit_transaction(max(0.1, deadline - time.monotonic()))
                    break
                except KafkaException as exc:
                    err = exc.args[0]
                    if err.retriable() and time.monotonic() < deadline:
                        continue
                    raise
        except KafkaException as exc:
            self._open = False
            self._commit_failed(exc.args[0], committing)
        self._open = False
        return [(r[1], r[2]) if r is not None else (-1, -1) for r in self._results]

    def _commit_failed(self, err: KafkaError, committing: bool) -> NoReturn:
        """Raise what a failed commit means (``err``, raised by ``send_offsets_to_transaction``, or
        by ``commit_transaction`` when ``committing``): see :meth:`commit`."""
        if err.fatal() or err.code() == KafkaError._FENCED:
            raise KafkaClientError(
                f"transaction failed: {err.name()}: {err.str()}", code=err.name(), fatal=True
            ) from None
        if committing and err.retriable() and not err.txn_requires_abort():
            # librdkafka keeps such a commit going and refuses an abort meanwhile (_CONFLICT): the
            # broker may still commit it (the engine's producer calls this "in doubt" too)
            raise KafkaClientError(
                f"the commit was not answered within {self.timeout_s:g} s ({err.name()}: {err.str()}): "
                "its outcome is not known (the transaction commits or aborts as a whole); the "
                "consumer group's committed offsets say which once the broker ends it",
                code=err.name(),
            ) from None
        refused = next((r for r in self._results if r is not None and r[0] is not None), None)
        cause = f"{refused[0].name()}: {refused[0].str()}" if refused else f"{err.name()}: {err.str()}"
        # a commit that races a newer publisher's fencing can fail with another error (seen:
        # Kafka 4.1's transaction coordinator answered EndTxn with UNKNOWN_SERVER_ERROR); the
        # abort then meets the fence, and the fence is what the caller must hear about
        failed = self._abort()
        if failed is None:
            raise PublishError(f"the transaction was aborted, nothing of it was published: {cause}") from None
        if failed.fatal() or failed.code() == KafkaError._FENCED:
            raise KafkaClientError(
                f"transaction failed: {failed.name()}: {failed.str()} (the commit had failed with {cause})",
                code=failed.name(),
                fatal=True,
            ) from None
        raise KafkaClientError(
            f"the commit failed ({cause}) and its abort was not confirmed ({failed.name()}: "
            f"{failed.str()}): the transaction's outcome is not known until the broker ends it",
            code=failed.name(),
        ) from None

    def _abort(self) -> KafkaError | None:
        """Abort the open transaction; return the abort's error (logged too), or ``None`` when the
        abort was confirmed."""
        try:
            self._producer.abort_transaction(self.timeout_s)
        except KafkaException as exc:
            err: KafkaError = exc.args[0]
            tools_log.warning("abort_transaction failed: %s", err.str())
            return err
        return None

    def abort(self) -> None:
        """Abort the open transaction, if any (best effort: errors are logged)."""
        if self._open:
            self._open = False
            self._abort()

    def close(self) -> None:
        """Abort an open transaction and release the producer (errors are logged, not raised).

        There is no flush: ``commit_transaction`` flushed a committed transaction's records and
        ``abort_transaction`` purged an aborted one's (librdkafka). A flush after a fatal error
        (e.g. this publisher was fenced) would run the purged records' delivery callbacks while
        confluent-kafka holds the fatal error as a pending Python exception, which CPython turns
        into a ``SystemError`` (confluent-kafka-python #865).
        """
        self.abort()
