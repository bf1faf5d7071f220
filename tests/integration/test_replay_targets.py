"""Where ``keyedconsumer dead-letter replay`` sends a dead letter, on the real broker.

A dead-letter record's headers can be written by anyone who may write to the dead-letter topic: a
record that names another team's topic is not sent there unless that topic is consumed by the dead
letters' own consumer group (``--group``) or listed (``--allow-topic``, ``--to``). Each record goes to
the partition its key has in the target now, under the producers' partitioner (``murmur2_random``,
the Java producer's default, unless told otherwise); a key whose partition changed because the topic
gained partitions is left pending unless ``--repartitioned``; a null key goes where the producer's
partitioner puts it.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewPartitions

from keyedconsumer.cli.audit import find
from keyedconsumer.kafka.partitioners import partition_for

from .kafkautil import end_offsets
from .test_cli import cli, cli_json, create_topic, produce_dead_letters, read_committed_records

pytestmark = [pytest.mark.kafka]


def consume_as(bootstrap: str, group: str, topic: str, partitions: int) -> None:
    """Make ``group`` a consumer group of ``topic``: commit offset 0 of each partition for it."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    try:
        c.commit(offsets=[TopicPartition(topic, p, 0) for p in range(partitions)], asynchronous=False)
    finally:
        c.close()


def java_partition(bootstrap: str, topic: str, key: bytes) -> int:
    """Where a producer with the Java client's default partitioner puts ``key`` in ``topic`` now."""
    where: list[int] = []
    p = Producer({"bootstrap.servers": bootstrap, "partitioner": "murmur2_random"})
    p.produce(topic, key=key, value=b"probe", on_delivery=lambda err, msg: where.append(msg.partition()))
    assert p.flush(30) == 0 and len(where) == 1
    return where[0]


def failed_in(topic: str, key: bytes, partitions: int) -> dict[str, Any]:
    """A dead letter (for ``produce_dead_letters``) of ``key``, which failed in ``topic`` of
    ``partitions`` partitions on its key's partition under the Java producer's partitioner."""
    return {
        "topic": topic,
        "key": key,
        "value": key,
        "failed_at_ms": 1,
        "partition": partition_for("murmur2_random", key, partitions),
    }


def base(dlq: str, bootstrap: str, *extra: str) -> list[str]:
    return ["dead-letter", "replay", "--from", dlq, "--brokers", bootstrap, *extra]


def replay_json(*args: str, env: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """Exit code and ``--json`` answer (exit 1 when a record was left pending: its answer says which)."""
    result = cli(*args, "--json", env=env)
    assert result.exit_code in (0, 1), result.output
    return result.exit_code, json.loads(result.stdout)


@pytest.mark.timeout(120)
def test_a_forged_dead_letter_naming_another_topic_is_left_pending_not_sent(kafka_bootstrap: str) -> None:
    # given the orders service's group consuming "orders", another team's topic "payments" (consumed by
    # its own group), and in orders' dead-letter topic one real dead letter and one written by someone
    # else that names "payments" (and one naming a topic nobody consumes)
    tag = uuid.uuid4().hex[:8]
    orders = create_topic(kafka_bootstrap, f"orders-{tag}", 1)
    payments = create_topic(kafka_bootstrap, f"payments-{tag}", 1)
    idle = create_topic(kafka_bootstrap, f"idle-{tag}", 1)
    dlq = create_topic(kafka_bootstrap, f"{orders}.dlq", 1)
    group = f"orders-svc-{tag}"
    consume_as(kafka_bootstrap, group, orders, 1)
    consume_as(kafka_bootstrap, f"payments-svc-{tag}", payments, 1)
    produce_dead_letters(
        kafka_bootstrap,
        dlq,
        [
            {"topic": orders, "key": b"order-1", "value": b"real", "failed_at_ms": 1},
            {"topic": payments, "key": b"acct-9", "value": b'{"pay": 1000000}', "failed_at_ms": 2},
            {"topic": idle, "key": b"x", "value": b"y", "failed_at_ms": 3},
        ],
    )
    # when replaying without saying where the dead letters may go, then it refuses to start
    result = cli(*base(dlq, kafka_bootstrap))
    assert result.exit_code == 2 and "--group" in result.output and "--allow-topic" in result.output
    # when a dry run names the dead letters' group, then it shows each record's target topic and partition
    code, data = replay_json(*base(dlq, kafka_bootstrap, "--group", group, "--dry-run"))
    assert code == 1 and data["dry_run"] and data["no_target"] == 2
    assert [(r["key"], r["topic"], r["partition"]) for r in data["records"]] == [("order-1", orders, 0)]
    refused = {r["key"]: r for r in data["refused"]}
    assert set(refused) == {"acct-9", "x"}
    assert (
        f"names topic {payments!r}, which is not consumed by group(s) {group}" in refused["acct-9"]["reason"]
    )
    # when it runs, then only the real dead letter is sent; the others stay pending, and it says so
    result = cli(*base(dlq, kafka_bootstrap, "--group", group))
    assert result.exit_code == 1 and "left behind" in result.output, result.output
    assert f"names topic {payments!r}" in result.output
    assert [m.value() for m in read_committed_records(kafka_bootstrap, orders, 1)] == [b"real"]
    assert end_offsets(kafka_bootstrap, payments, 1) == {0: 0}, "nothing reached the other team's topic"
    assert end_offsets(kafka_bootstrap, idle, 1) == {0: 0}
    # and with the group in the environment (a service's settings), the same; an explicit allow-list
    # sends the pending one the operator allows, and nothing twice
    env = {"KEYEDCONSUMER_GROUP": group}
    code, again = replay_json(*base(dlq, kafka_bootstrap), env=env)
    assert code == 1 and again["sent"] == 0 and again["no_target"] == 2
    code, data = replay_json(*base(dlq, kafka_bootstrap, "--allow-topic", idle))
    assert code == 1
    assert [(r["key"], r["topic"]) for r in data["records"]] == [("x", idle)]
    assert [r["key"] for r in data["refused"]] == ["acct-9"]
    assert end_offsets(kafka_bootstrap, payments, 1) == {0: 0}


@pytest.mark.timeout(120)
def test_each_record_goes_to_its_keys_partition_under_the_java_partitioner(kafka_bootstrap: str) -> None:
    # given a fixed-up topic of 7 partitions whose producers are Java clients (murmur2), and dead
    # letters of 40 keys, an empty key and a null key
    tag = uuid.uuid4().hex[:8]
    fixed = create_topic(kafka_bootstrap, f"fixed-{tag}", 7)
    dlq = create_topic(kafka_bootstrap, f"src-{tag}.dlq", 1)
    keys: list[bytes | None] = [f"cust-{i}".encode() for i in range(40)] + [b"", None]
    produce_dead_letters(
        kafka_bootstrap,
        dlq,
        [{"topic": "src", "key": k, "value": str(i).encode(), "failed_at_ms": 1} for i, k in enumerate(keys)],
    )
    # when replaying them to the fixed-up topic
    data = cli_json(*base(dlq, kafka_bootstrap, "--to", fixed))
    # then each keyed record is on the partition a Java producer gives its key there (the empty key
    # too: murmur2 hashes it); the null key's record is where the producer put it
    by_value = {int(m.value()): m for m in read_committed_records(kafka_bootstrap, fixed, len(keys))}
    assert len(by_value) == len(keys) and data["sent"] == len(keys)
    for i, key in enumerate(keys):
        if key is None:
            continue
        assert by_value[i].key() == key
        assert by_value[i].partition() == partition_for("murmur2_random", key, 7), key
    assert by_value[0].partition() == java_partition(kafka_bootstrap, fixed, b"cust-0")
    assert by_value[40].partition() == java_partition(kafka_bootstrap, fixed, b"")
    shown = {r["key"]: r["partition"] for r in data["records"]}
    assert shown[None] == by_value[41].partition()  # the answer says where it went
    # and the partitioner of librdkafka-based producers is one flag away: the same keys, their crc32
    # partitions, the empty key spread (shown as any partition in a dry run)
    plan = cli_json(
        *base(
            dlq,
            kafka_bootstrap,
            "--to",
            fixed,
            "--partitioner",
            "consistent_random",
            "--marker-group",
            f"other-{tag}",
            "--dry-run",
        )
    )
    planned = {r["key"]: r["partition"] for r in plan["records"]}
    assert planned["cust-1"] == partition_for("consistent_random", b"cust-1", 7)
    assert planned[""] is None and planned[None] is None


@pytest.mark.timeout(120)
def test_a_topic_that_gained_partitions_refuses_moved_keys_unless_repartitioned(kafka_bootstrap: str) -> None:
    # given "orders" with 3 partitions written by a Java producer, its group, and dead letters of 30
    # keys that failed there (each from its key's partition then)
    tag = uuid.uuid4().hex[:8]
    orders = create_topic(kafka_bootstrap, f"orders-{tag}", 3)
    dlq = create_topic(kafka_bootstrap, f"{orders}.dlq", 1)
    group = f"orders-svc-{tag}"
    consume_as(kafka_bootstrap, group, orders, 3)
    keys = [f"k{i}".encode() for i in range(30)]
    produce_dead_letters(kafka_bootstrap, dlq, [failed_in(orders, k, 3) for k in keys])
    # when the topic then grows to 7 partitions (new records of a key go to its partition among 7)
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_partitions([NewPartitions(orders, 7)])[orders].result(timeout=30)
    moved = {
        k for k in keys if partition_for("murmur2_random", k, 7) != partition_for("murmur2_random", k, 3)
    }
    assert moved and len(moved) < len(keys)
    # and the dead letters are replayed to it
    code, data = replay_json(*base(dlq, kafka_bootstrap, "--group", group))
    # then each key that kept its partition is sent there; each moved key is left pending, saying why
    assert code == 1
    assert {r["key"].encode() for r in data["records"]} == set(keys) - moved
    for r in data["records"]:
        assert r["partition"] == partition_for("murmur2_random", r["key"].encode(), 7)
    assert {r["key"].encode() for r in data["refused"]} == moved
    assert all("gained partitions" in r["reason"] for r in data["refused"])
    # when replayed again with --repartitioned, then each moved key goes to its partition now: where a
    # Java producer sends that key's next record
    data = cli_json(*base(dlq, kafka_bootstrap, "--group", group, "--repartitioned"))
    assert {r["key"].encode() for r in data["records"]} == moved
    for r in data["records"]:
        key = r["key"].encode()
        assert r["partition"] == java_partition(kafka_bootstrap, orders, key) != r["moved_from"]


class Terminal:
    """The command in a pseudo-terminal (stdin is a terminal: the replay asks), its output read."""

    def __init__(self, args: list[str]) -> None:
        import pty
        import subprocess
        import sys

        self.master, slave = pty.openpty()
        env = {**os.environ, "COLUMNS": "400", "TERM": "dumb"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "keyedconsumer", *args], stdin=slave, stdout=slave, stderr=slave, env=env
        )
        os.close(slave)
        self.output = b""

    def read_until(self, text: bytes, timeout_s: float = 60.0) -> str:
        import select

        deadline = time.monotonic() + timeout_s
        while text not in self.output and time.monotonic() < deadline:
            if select.select([self.master], [], [], 0.2)[0]:
                try:
                    chunk = os.read(self.master, 65536)
                except OSError:  # the command ended
                    break
                self.output += chunk
        return self.output.decode(errors="replace")

    def answer(self, line: bytes) -> int:
        os.write(self.master, line + b"\n")
        self.read_until(b"\x00 never", 60.0 if self.proc.poll() is None else 0.5)
        code = self.proc.wait(60)
        os.close(self.master)
        return code


@pytest.mark.timeout(120)
def test_on_a_terminal_it_shows_each_target_asks_and_writes_the_audit_trail(kafka_bootstrap: str) -> None:
    # given two dead letters of orders and one naming another team's topic, and an audit topic
    tag = uuid.uuid4().hex[:8]
    orders = create_topic(kafka_bootstrap, f"orders-{tag}", 4)
    payments = create_topic(kafka_bootstrap, f"payments-{tag}", 1)
    audit = create_topic(kafka_bootstrap, f"audit-{tag}", 2)
    dlq = create_topic(kafka_bootstrap, f"{orders}.dlq", 1)
    group = f"orders-svc-{tag}"
    consume_as(kafka_bootstrap, group, orders, 4)
    produce_dead_letters(
        kafka_bootstrap,
        dlq,
        [
            failed_in(orders, b"order-1", 4),
            failed_in(orders, b"order-2", 4),
            {"topic": payments, "key": b"acct-9", "value": b"forged", "failed_at_ms": 2},
        ],
    )
    args = base(dlq, kafka_bootstrap, "--group", group, "--audit-topic", audit)
    where = {k: f"{orders}[{partition_for('murmur2_random', k, 4)}]" for k in (b"order-1", b"order-2")}
    # when the replay runs on a terminal and the person says no
    term = Terminal(args)
    shown = term.read_until(b"[y/N]")
    # then it showed where each would go, and why the third would not, and sent nothing
    assert "would send 2 record(s)" in shown and all(w in shown for w in where.values()), shown
    assert f"names topic {payments!r}" in shown
    assert term.answer(b"n") == 1 and "nothing sent: not confirmed" in term.read_until(b"")
    assert sum(end_offsets(kafka_bootstrap, orders, 4).values()) == 0
    # when it runs again and the person says yes, then the two are sent where shown, the third is not
    term = Terminal(args)
    term.read_until(b"[y/N]")
    assert term.answer(b"y") == 1  # one record left pending
    out = term.read_until(b"")
    assert "sent 2" in out and "without a target 1" in out, out
    sent = read_committed_records(kafka_bootstrap, orders, 2)
    assert sorted((m.key(), f"{orders}[{m.partition()}]") for m in sent) == sorted(where.items())
    assert end_offsets(kafka_bootstrap, payments, 1) == {0: 0}
    # and the audit trail holds the replay: who, each target, the one left pending, each record sent
    records = list(find({"bootstrap.servers": kafka_bootstrap}, audit, outcome="ACTION", timeout_s=30))
    summary = next(d for d in records if d["key"] is None)
    assert (
        summary["action"] == "replay"
        and summary["session"].startswith("cli ")
        and summary["result"] == "failed"
    )
    assert sorted(f"{t}[{p}]" for _, _, t, p in summary["targets"]) == sorted(where.values())
    assert [r[:3] for r in summary["refused"]] == [[0, 2, payments]] and "not consumed" in summary["refused"][
        0
    ][3]
    assert sorted((d["key"], f"{d['topic']}[{d['partition']}]") for d in records if d["key"]) == sorted(
        (k.decode(), w) for k, w in where.items()
    )
    assert summary["instance"].startswith("cli@")
