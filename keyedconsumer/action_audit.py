"""Operators' actions in the audit trail: one record per action of the dashboard or of
``keyedconsumer dead-letter replay --audit-topic`` (and one per replayed dead letter) written to the
audit topic of the ``Audit`` middleware, where ``keyedconsumer audit`` finds them (``--outcome
ACTION``, ``--key``). Library code below both faces.

A record's value is JSON with the audit record's fields where they apply (``v``, ``time_ms``,
``key`` / ``key_b64``, ``topic``, ``partition``, ``offset``, ``outcome`` = ``"ACTION"``,
``instance``) and the action's own (:data:`ACTION_FIELDS`). Its Kafka key is the message key the
action concerns (so a key's records, the handler's and the dashboard's, are on one partition of the
audit topic, in order), or none.

Each record is written after its action ran, and the writer waits for the broker's
acknowledgement (``acks=all``, idempotent: :class:`~keyedconsumer.Publisher`); a record Kafka
refused is logged and named in the action's answer, the action itself is not undone.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from .errors import PublishError
from .kafka import BatchPublisher

__all__ = [
    "ActionAudit",
    "ACTION_FIELDS",
    "OUTCOME",
    "MAX_LISTED",
    "action_record",
    "action_records",
    "replay_fields",
]

log = logging.getLogger("keyedconsumer.actions")

#: The ``outcome`` of an action's record.
OUTCOME = "ACTION"
#: An action's fields, beside the audit record's: ``action`` (``replay``, ``unpark``,
#: ``cancel-scheduled``), ``result`` (``done``, ``failed``, ``bad request``), ``message`` (what the
#: dashboard or the command answered, at most 1,000 characters), ``session`` (who: the signed-in
#: session's label, never its cookie, ``bearer token``, or ``cli <user>`` for the command line),
#: ``client`` (the request's address, or the command's host), and what it acted on: ``namespace``
#: and ``lid`` (un-park), ``scheduled_id`` (cancel), ``dlq_topic``, ``selected`` and ``records``
#: (replay: the selected ``[partition, offset]`` of the dead-letter topic), ``targets`` (``[dlq
#: partition, dlq offset, topic, partition]`` of each record sent), ``refused`` (``[dlq partition,
#: dlq offset, topic, reason]`` of each record left pending) (each list at most 1,000 long),
#: ``dlq_partition`` and ``dlq_offset`` (one replayed dead letter, whose ``topic`` / ``partition`` /
#: ``offset`` are where it was replayed to).
ACTION_FIELDS = (
    "action",
    "result",
    "message",
    "session",
    "client",
    "namespace",
    "lid",
    "scheduled_id",
    "dlq_topic",
    "selected",
    "records",
    "targets",
    "refused",
    "dlq_partition",
    "dlq_offset",
)


def action_record(
    action: str, who: str, client: str, result: str, message: str, key: bytes | None = None, **fields: Any
) -> dict[str, Any]:
    """The audit record of one dashboard action (or of one dead letter a replay sent): the JSON value's
    fields (see the module docstring); ``key``: the message key it concerns, if any."""
    rec: dict[str, Any] = {
        "v": 1,
        "time_ms": int(time.time() * 1000),
        "group": None,
        "topic": None,
        "partition": None,
        "offset": None,
        "key": None,
        "outcome": OUTCOME,
        "action": action,
        "result": result,
        "message": message[:1000],
        "session": who,
        "client": client,
    }
    if key is not None:
        try:
            rec["key"] = key.decode("utf-8")
        except UnicodeDecodeError:
            rec["key_b64"] = base64.b64encode(key).decode()
    rec.update(fields)
    return rec


#: Records, targets and refusals one replay's record lists at most.
MAX_LISTED = 1000

#: A sent dead letter's key (``None``: a null key) and its record's fields.
Sent = tuple[bytes | None, dict[str, Any]]


def action_records(
    action: str, who: str, client: str, result: str, message: str, fields: dict[str, Any], sent: list[Sent]
) -> list[dict[str, Any]]:
    """The records of one action: the action's own (``fields``; ``fields["key"]``: the message key
    it concerns, as bytes), then one per dead letter a replay sent (``sent``)."""
    fields = dict(fields)
    key = fields.pop("key", None)
    out = [action_record(action, who, client, result, message, key, **fields)]
    out += [
        action_record(action, who, client, "done", f"replayed {fields.get('dlq_topic')} record", k, **row)
        for k, row in sent
    ]
    return out


def replay_fields(
    dlq: str, selected: set[tuple[int, int]] | None, result: dict[str, Any]
) -> tuple[dict[str, Any], list[Sent]]:
    """A replay's record fields and its sent dead letters, from ``result``
    (:meth:`keyedconsumer.deadletters.ReplayJob.result`): ``dlq_topic``, ``selected`` and ``records``
    (how many and which ``[partition, offset]`` were selected; ``selected=None``: those sent or left
    pending), ``targets``, ``refused`` (each list at most :data:`MAX_LISTED` long)."""
    sent_rows, refused = result["records"], result["refused"]
    chosen = (
        selected
        if selected is not None
        else {(r["dlq_partition"], r["dlq_offset"]) for r in sent_rows + refused}
    )
    fields = {
        "dlq_topic": dlq,
        "selected": len(chosen),
        "records": [list(r) for r in sorted(chosen)[:MAX_LISTED]],
        "targets": [[r["dlq_partition"], r["dlq_offset"], r["topic"], r["partition"]] for r in sent_rows][
            :MAX_LISTED
        ],
        "refused": [[r["dlq_partition"], r["dlq_offset"], r["topic"], r["reason"][:300]] for r in refused][
            :MAX_LISTED
        ],
    }
    sent = [
        (
            _key(r),
            {
                "dlq_topic": dlq,
                "dlq_partition": r["dlq_partition"],
                "dlq_offset": r["dlq_offset"],
                "topic": r["topic"],
                "partition": r["partition"],
                "offset": r["offset"],
            },
        )
        for r in sent_rows
    ]
    return fields, sent


def _key(row: dict[str, Any]) -> bytes | None:
    if row.get("key_b64") is not None:
        return base64.b64decode(row["key_b64"])
    return None if row["key"] is None else str(row["key"]).encode()


class ActionAudit:
    """Writes action records to an audit topic.

    Parameters
    ----------
    conf:
        librdkafka properties of the dashboard (``bootstrap.servers``, security); the producer is
        made on the first write.
    topic:
        The audit topic (the ``Audit`` middleware's ``topic``).
    timeout_s:
        Seconds a write waits for the broker's acknowledgement (librdkafka's ``message.timeout.ms``).
    publisher:
        ``publisher()`` makes the :class:`~keyedconsumer.kafka.BatchPublisher` to write with (tests);
        by default a :class:`~keyedconsumer.Publisher` on ``conf``.
    source:
        Who writes, for each record's ``instance`` (``<source>@<host>:<pid>``): ``web``, ``cli``.
    """

    def __init__(
        self,
        conf: dict[str, Any],
        topic: str,
        *,
        timeout_s: float = 10.0,
        publisher: Callable[[], BatchPublisher] | None = None,
        source: str = "web",
    ) -> None:
        self.topic = topic
        self._conf = dict(conf)
        self._timeout_s = timeout_s
        self._make = publisher
        self._publisher: BatchPublisher | None = None
        self._lock = threading.Lock()
        self.instance = f"{source}@{socket.gethostname()}:{os.getpid()}"
        #: Records acknowledged, and refused (each logged), so far.
        self.written = 0
        self.failed = 0

    def write(self, records: list[dict[str, Any]]) -> str | None:
        """Write ``records`` (:func:`action_record`) and wait for the broker. Returns ``None`` when
        every one was acknowledged, else why not (also logged). Never raises."""
        if not records:
            return None
        batch = []
        for rec in records:
            rec.setdefault("instance", self.instance)
            key = rec.get("key")
            raw = (
                key.encode()
                if isinstance(key, str)
                else base64.b64decode(rec["key_b64"])
                if rec.get("key_b64")
                else None
            )
            batch.append((self.topic, raw, json.dumps(rec, separators=(",", ":")).encode(), None))
        try:
            with self._lock:
                if self._publisher is None:
                    self._publisher = self._make() if self._make else _publisher(self._conf, self._timeout_s)
            results: list[Any] = self._publisher.publish_many(batch)
        except PublishError as exc:
            results = [exc] * len(batch)
        errors = [r for r in results if isinstance(r, PublishError)]
        with self._lock:
            self.written += len(results) - len(errors)
            self.failed += len(errors)
        if errors:
            log.error(
                "%d action record(s) not written to the audit topic %s: %s",
                len(errors),
                self.topic,
                errors[0],
            )
            return f"{len(errors)} of {len(batch)} record(s) not written to the audit topic {self.topic}: {errors[0]}"
        return None

    def close(self, timeout_s: float = 10.0) -> None:
        with self._lock:
            publisher, self._publisher = self._publisher, None
        if publisher is not None:
            publisher.close(timeout_s)

    def __repr__(self) -> str:
        return f"ActionAudit(topic={self.topic!r}, written={self.written}, failed={self.failed})"


def _publisher(conf: dict[str, Any], timeout_s: float) -> BatchPublisher:
    from .kafka.publisher import Publisher

    servers = str(conf.get("bootstrap.servers", ""))
    props = {k: v for k, v in conf.items() if k != "bootstrap.servers"}
    return Publisher(servers.split(","), props, delivery_timeout_s=timeout_s)
