"""The real :class:`~keyedconsumer.kafka.KafkaClient`, on ``confluent_kafka.Consumer`` (librdkafka).

:func:`connect` is the engine's default client factory. Tests pass another factory to the consumer (see :mod:`keyedconsumer.testing`).
"""

from __future__ import annotations

import difflib
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from .. import hermetic
from ..config import is_connection_property
from ..errors import CommitError, KafkaClientError
from ..message import Message
from . import MISSING_TOPIC, TP, BatchPublisher, KafkaClient, RebalanceListener, TransactionalProducer, logs
from .bounded import Deadline, Pending
from .oauth import with_token_source

__all__ = ["connect", "check_cluster", "missing_topic_text"]

log = logging.getLogger("keyedconsumer.kafka")

# Errors librdkafka reports on commit that mean "nothing to do", not a failure: a commit with no new
# offset fails with ``RD_KAFKA_RESP_ERR__NO_OFFSET`` ("Local: No offset stored").
_BENIGN_COMMIT = {KafkaError._NO_OFFSET}


def _client_error(err: KafkaError, what: str) -> KafkaClientError:
    return KafkaClientError(f"{what}: {err.name()}: {err.str()}", code=err.name(), fatal=err.fatal())


class _NotDone(Exception):
    """A bounded call did not return in time."""


def _bounded(fn: Callable[[], Any], timeout_s: float, name: str) -> Any:
    """Call ``fn()`` in a daemon thread and return its result, or raise :class:`_NotDone` if it has
    not returned within ``timeout_s`` seconds (it is then left to finish, or not, on its own; see
    :mod:`.bounded`)."""
    pending = Pending(fn, name)
    if not pending.wait(Deadline(timeout_s)):
        raise _NotDone()
    return pending.result()


def _tp(topic: str, partition: int, offset: int, metadata: str) -> TopicPartition:
    if metadata:
        return TopicPartition(topic, partition, offset, metadata=metadata)
    return TopicPartition(topic, partition, offset)


class _ConfluentClient:
    """:class:`KafkaClient` on ``confluent_kafka.Consumer``."""

    def __init__(self, conf: dict[str, Any], on_error: Callable[[KafkaClientError], None]) -> None:
        self._on_error = on_error
        conf = dict(conf)
        conf.setdefault("logger", logs.librdkafka_log)  # librdkafka's lines into Python logging
        #: the user's ``error_cb`` (``ConsumerConfig.config``): called after the engine's own
        self._user_error_cb: Callable[[KafkaError], Any] | None = conf.pop("error_cb", None)
        #: the last authentication error librdkafka reported (wrong SASL credentials, a refused token)
        self._auth_error: KafkaError | None = None
        #: the cluster's topic names, from the metadata answer of :meth:`check_brokers`
        self._topics: frozenset[str] | None = None
        #: subscribed topics reported missing at subscribe: librdkafka's own report of each is dropped
        self._missing: set[str] = set()
        conf["error_cb"] = self._error_cb
        #: what a producer of the same cluster takes: the brokers and the connection properties
        self._producer_conf = {
            "bootstrap.servers": conf["bootstrap.servers"],
            **{k: v for k, v in conf.items() if is_connection_property(k)},
        }
        hermetic.check(
            "a Kafka consumer client (KeyedConsumer's default client factory)", str(conf["bootstrap.servers"])
        )
        try:
            self._consumer = Consumer(with_token_source(conf))  # TokenCallbackError: oauth_cb's fault
        except KafkaException as exc:
            err = exc.args[0]
            raise KafkaClientError(
                f"cannot create the Kafka consumer: {err.str()}", code=err.name()
            ) from None

    def _error_cb(self, err: KafkaError) -> None:
        if err.code() == KafkaError._AUTHENTICATION:
            self._auth_error = err
        self._on_error(_client_error(err, "Kafka client error"))
        if self._user_error_cb is not None:
            try:
                self._user_error_cb(err)
            except Exception:  # raised inside librdkafka's poll, it would end the poll loop
                log.exception("the error_cb given in config raised")

    def subscribe(self, topics: Sequence[str], listener: RebalanceListener) -> None:
        def tps(parts: list[TopicPartition]) -> list[TP]:
            return [(p.topic, p.partition) for p in parts]

        # The callbacks never call assign()/unassign(): confluent-kafka applies the (incremental)
        # assignment itself after the callback returns. Under an incremental protocol
        # (cooperative-sticky, KIP-848) librdkafka refuses assign() in the callback ("Changes to the
        # current assignment must be made using incremental_assign()": rd_kafka_incremental_assign).
        try:
            self._consumer.subscribe(
                list(topics),
                on_assign=lambda _c, parts: listener.on_assign(tps(parts)),
                on_revoke=lambda _c, parts: listener.on_revoke(tps(parts)),
                on_lost=lambda _c, parts: listener.on_lost(tps(parts)),
            )
        except KafkaException as exc:  # e.g. a topic regex librdkafka's regex engine refuses
            err = exc.args[0]
            raise KafkaClientError(
                f"cannot subscribe to topics={list(topics)!r}: {err.name()}: {err.str()}",
                code=err.name(),
                fatal=True,
            ) from None
        if self._topics is not None:  # the metadata of check_brokers: report a missing topic now
            for topic in topics:
                if not topic.startswith("^") and topic not in self._topics:
                    self._missing.add(topic)
                    self._on_error(self._missing_topic(topic))

    def _missing_topic(self, topic: str) -> KafkaClientError:
        return KafkaClientError(missing_topic_text(topic, self._topics or ()), code=MISSING_TOPIC)

    def poll_batch(self, max_messages: int, timeout_s: float) -> list[Message]:
        out: list[Message] = []
        append = out.append
        for raw in self._consumer.consume(max_messages, timeout_s):
            err = raw.error()
            if err is not None:
                topic = raw.topic()
                if err.code() in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC) and topic:
                    if topic in self._missing:  # reported at subscribe
                        self._missing.discard(topic)
                    else:
                        self._on_error(self._missing_topic(topic))
                elif err.code() != KafkaError._PARTITION_EOF:
                    where = f"topic={topic} partition={raw.partition()}"
                    self._on_error(_client_error(err, f"consume error ({where})"))
                continue
            try:
                ts_type, ts = raw.timestamp()
                msg = Message(
                    raw.topic(),  # type: ignore[arg-type]
                    raw.partition(),  # type: ignore[arg-type]
                    raw.offset(),  # type: ignore[arg-type]
                    raw.key(),
                    raw.value(),
                    raw.headers(),  # type: ignore[arg-type]
                    ts if ts_type else None,
                )
            except Exception as exc:
                # confluent-kafka cannot decode a header name that is not UTF-8; it may leave the
                # error set and let the next call raise it (SystemError), so the whole record is
                # read in this block. Stop, naming the record: it is neither run nor skipped. The
                # rest of the batch is dropped too (not admitted, so no offset past the record can
                # be stored).
                where = f"topic={raw.topic()} partition={raw.partition()} offset={raw.offset()}"
                self._on_error(
                    KafkaClientError(
                        f"cannot read the record {where} (a header name that is not UTF-8?): "
                        f"{type(exc).__name__}: {exc}",
                        code="BAD_RECORD",
                        fatal=True,
                    )
                )
                return out
            append(msg)
        return out

    def store(self, topic: str, partition: int, offset: int, metadata: str = "") -> None:
        # One partition per call: librdkafka's rd_kafka_offsets_store() (rdkafka.h) fails the call
        # only when none of its offsets could be stored and reports the others in each partition's
        # error, which confluent-kafka's store_offsets() does not raise: a mixed call could
        # silently drop one.
        try:
            self._consumer.store_offsets(offsets=[_tp(topic, partition, offset, metadata)])
        except KafkaException as exc:
            raise _client_error(exc.args[0], f"store_offsets topic={topic} partition={partition}") from None

    def commit(
        self,
        offsets: Sequence[tuple[str, int, int]],
        metadata: Mapping[TP, str] | None = None,
        timeout_s: float | None = None,
    ) -> None:
        """Commit ``(topic, partition, offset)`` synchronously, each with ``metadata[(topic, partition)]``.

        ``timeout_s`` bounds the wait for the group coordinator's answer (``None``: librdkafka's own
        request timeouts). Never pass it from inside a rebalance callback: the commit is then made
        from a helper thread, which confluent-kafka lets into the consumer only once the poll
        serving the callback returned (it serializes the calls on one consumer, and ``consume()``
        holds it while it serves callbacks): the commit lands after the callback's own commits,
        under whatever generation is current by then. A commit with nothing new (``_NO_OFFSET``) is
        not an error. A broker refusing the metadata's size (``OFFSET_METADATA_TOO_LARGE``) gets the
        offsets again without it.

        Raises
        ------
        CommitError
            Refused for at least one partition (named), or no answer within ``timeout_s`` (code
            ``_TIMED_OUT``; the commit may still be applied later, and it is never past an
            unfinished message, so that is safe).
        """
        if timeout_s is None:
            self._commit(offsets, metadata)
            return
        try:
            _bounded(lambda: self._commit(offsets, metadata), timeout_s, "commit")
        except _NotDone:
            where = ", ".join(f"{t}[{p}]@{o}" for t, p, o in offsets)
            raise CommitError(
                f"commit of {where} not confirmed within {timeout_s:g} s", code="_TIMED_OUT"
            ) from None

    def commit_async(
        self, offsets: Sequence[tuple[str, int, int]], metadata: Mapping[TP, str] | None = None
    ) -> None:
        """Send a commit without waiting for its answer (a failure is not reported: the caller
        commits again later). Used for periodic commits of metadata only."""
        meta = metadata or {}
        try:
            self._consumer.commit(
                offsets=[_tp(t, p, o, meta.get((t, p), "")) for t, p, o in offsets], asynchronous=True
            )
        except KafkaException as exc:
            log.debug("asynchronous commit not sent: %s", exc)

    def _commit(self, offsets: Sequence[tuple[str, int, int]], metadata: Mapping[TP, str] | None) -> None:
        meta = metadata or {}
        tps = [_tp(t, p, o, meta.get((t, p), "")) for t, p, o in offsets]
        try:
            result = self._consumer.commit(offsets=tps, asynchronous=False)
        except KafkaException as exc:
            err = exc.args[0]
            if err.code() in _BENIGN_COMMIT:
                return
            if err.code() == KafkaError.OFFSET_METADATA_TOO_LARGE and meta:
                # a broker with a lower offset.metadata.max.bytes: the offsets alone still count
                log.warning(
                    "commit metadata refused by the broker (offset.metadata.max.bytes); committing without it"
                )
                self._commit(offsets, None)
                return
            raise CommitError(
                f"commit failed: {err.name()}: {err.str()}", code=err.name(), fatal=err.fatal()
            ) from None
        failed = [
            (tp, tp.error)
            for tp in result or []
            if tp.error is not None and tp.error.code() not in _BENIGN_COMMIT
        ]
        if meta and any(e.code() == KafkaError.OFFSET_METADATA_TOO_LARGE for _, e in failed):
            log.warning(
                "commit metadata refused by the broker (offset.metadata.max.bytes); committing without it"
            )
            self._commit([(tp.topic, tp.partition, tp.offset) for tp, _ in failed], None)
            failed = [(tp, e) for tp, e in failed if e.code() != KafkaError.OFFSET_METADATA_TOO_LARGE]
        if failed:
            desc = ", ".join(f"{tp.topic}[{tp.partition}]@{tp.offset}: {e.name()}" for tp, e in failed)
            raise CommitError(f"commit failed for {desc}", code=failed[0][1].name())

    def committed(self, partitions: Sequence[TP], timeout_s: float) -> dict[TP, tuple[int, str]]:
        """The group's committed ``(offset, metadata)`` of ``partitions`` (offset < 0: none).

        Raises
        ------
        KafkaClientError
            No answer from the group coordinator within ``timeout_s``, or an error.
        """
        if not partitions:
            return {}
        try:
            result = self._consumer.committed(
                [TopicPartition(t, p) for t, p in partitions], timeout=timeout_s
            )
        except KafkaException as exc:
            raise _client_error(exc.args[0], "committed offsets") from None
        out: dict[TP, tuple[int, str]] = {}
        for tp in result:
            if tp.error is not None:
                raise _client_error(
                    tp.error, f"committed offset of topic={tp.topic} partition={tp.partition}"
                )
            out[(tp.topic, tp.partition)] = (tp.offset, tp.metadata or "")
        return out

    def pause(self, partitions: Sequence[TP]) -> None:
        if partitions:
            self._consumer.pause([TopicPartition(t, p) for t, p in partitions])

    def resume(self, partitions: Sequence[TP]) -> None:
        if not partitions:
            return
        tps = [TopicPartition(t, p) for t, p in partitions]
        self._consumer.resume(tps)
        # librdkafka resumes fetching only at its broker thread's next periodic fetch decision, up
        # to about 1 s after a pause (measured here: 0.9 s per pause/resume cycle). A seek to the
        # position it would resume from anyway (the offset after the last message consumed) wakes
        # the fetcher at once: ~4 ms. Nothing is skipped or read twice: it is the same offset.
        try:
            for tp in self._consumer.position(tps):
                if tp.offset >= 0:
                    self._consumer.seek(tp)
        except KafkaException as exc:  # e.g. the partition is being revoked: fetching resumes by itself
            log.debug("seek after resume failed: %s", exc)

    def high_watermarks(self, partitions: Sequence[TP]) -> dict[TP, int | None]:
        # cached=True: the end offsets librdkafka learnt from its last fetch responses; no request
        out: dict[TP, int | None] = {}
        for t, p in partitions:
            try:
                high = self._consumer.get_watermark_offsets(TopicPartition(t, p), cached=True)
            except KafkaException:
                high = None
            out[(t, p)] = high[1] if high and high[1] >= 0 else None
        return out

    def check_brokers(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` seconds for a metadata answer.

        The wait is cut in slices (1 s, doubling), and between them the client's callbacks are
        served (``poll(0)``: librdkafka reports errors only there; ``oauth_cb`` runs on its
        background thread, :mod:`keyedconsumer.kafka.oauth`), so that a refused authentication ends
        the wait at once instead of at ``timeout_s``.

        Raises
        ------
        KafkaClientError
            Authentication failed (code ``_AUTHENTICATION``, fatal: wrong SASL credentials, a
            refused token), or no answer within ``timeout_s`` (librdkafka's code).
        """
        deadline = time.monotonic() + timeout_s
        slice_s = 1.0
        while True:
            left = deadline - time.monotonic()
            try:
                metadata = self._consumer.list_topics(timeout=max(0.01, min(slice_s, left)))
                self._topics = frozenset(metadata.topics)
                return
            except KafkaException as exc:
                err = exc.args[0]
            slice_s *= 2
            self._consumer.poll(0)  # serves error_cb; not subscribed: no message
            auth = self._auth_error
            if auth is not None:
                raise KafkaClientError(
                    f"authentication with the brokers failed: {auth.str()} (check the SASL/SSL "
                    "properties in 'config': sasl.mechanism, sasl.username, sasl.password, oauth_cb ...)",
                    code=auth.name(),
                    fatal=True,
                ) from None
            if time.monotonic() >= deadline:
                raise KafkaClientError(
                    f"no answer from the brokers within {timeout_s:g} s: {err.name()}: {err.str()} "
                    "(check 'brokers' / bootstrap.servers)",
                    code=err.name(),
                ) from None

    def publisher(self, delivery_timeout_s: float) -> BatchPublisher:
        """A :class:`~keyedconsumer.Publisher` of the same cluster (brokers, security properties)."""
        from .publisher import Publisher

        brokers = str(self._producer_conf["bootstrap.servers"]).split(",")
        extra = {k: v for k, v in self._producer_conf.items() if k != "bootstrap.servers"}
        return Publisher(brokers, extra, delivery_timeout_s=delivery_timeout_s)

    def transactional_producer(
        self, transactional_id: str, timeout_s: float, transaction_timeout_s: float
    ) -> TransactionalProducer:
        """A started transactional producer of the same cluster, committing with this consumer's
        group metadata (:class:`~keyedconsumer.kafka.transactional.KafkaTransactionalProducer`)."""
        from .transactional import KafkaTransactionalProducer

        return KafkaTransactionalProducer(
            self._producer_conf,
            transactional_id,
            self._consumer.consumer_group_metadata,
            self.committed,
            timeout_s,
            transaction_timeout_s,
        )

    def wait_outcomes(self, wait: Callable[[float], int], timeout_s: float) -> int:
        return wait(timeout_s)

    def close(self, timeout_s: float | None = None) -> bool:
        """Close the consumer: librdkafka revokes the assignment (``on_revoke``), commits the stored
        offsets and leaves the group. Returns ``False`` if that did not end within ``timeout_s``
        seconds (a stopped or unreachable broker): the close is then left to finish on its own.
        The counts of repeated log lines and client errors not told yet are logged
        (:func:`keyedconsumer.kafka.logs.flush`)."""
        try:
            if timeout_s is None:
                self._consumer.close()
                return True
            try:
                _bounded(self._consumer.close, timeout_s, "close")
            except _NotDone:
                return False
            return True
        finally:
            logs.flush()


def missing_topic_text(topic: str, known: Iterable[str]) -> str:
    """What to say of a subscribed ``topic`` the cluster does not have, with the closest of the
    ``known`` topic names (``difflib``; internal ``__`` topics left out) as a suggestion."""
    names = [t for t in known if not t.startswith("__")]
    close = difflib.get_close_matches(topic, names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"subscribed topic {topic!r} does not exist{hint}: none of its partitions is assigned until it is created"


def check_cluster(conf: dict[str, Any], timeout_s: float) -> None:
    """Build a consumer of ``conf`` (it joins no group), wait up to ``timeout_s`` seconds for the
    brokers' metadata answer (:meth:`KafkaClient.check_brokers`) and close it. The client errors
    meanwhile are logged, a repeat counted (:data:`keyedconsumer.kafka.logs.client_errors`).

    Raises
    ------
    KafkaClientError
        As ``check_brokers``: authentication failed, or no answer within ``timeout_s``; or an
        invalid librdkafka property.
    """
    client = _ConfluentClient(conf, lambda err: logs.client_errors.warning("%s", err))
    try:
        client.check_brokers(timeout_s)
    finally:
        client.close(timeout_s=CLOSE_TIMEOUT_S)


#: Seconds :func:`check_cluster` waits for its consumer's close (it joined no group: it is quick).
CLOSE_TIMEOUT_S = 5.0


def connect(conf: dict[str, Any], on_error: Callable[[KafkaClientError], None]) -> KafkaClient:
    """Build the real client. Raises :class:`KafkaClientError` on an invalid librdkafka property."""
    return _ConfluentClient(conf, on_error)
