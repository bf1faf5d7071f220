"""The in-memory broker's member protocol (group coordinator, offsets, fetch path), driven directly,
and the rule that the fakes use only the broker's public methods."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import keyedconsumer.testing
from keyedconsumer import KafkaClientError, Publisher
from keyedconsumer.kafka import RecordPublisher
from keyedconsumer.testing import FakePublisher, GroupEvent, InMemoryBroker

pytestmark = [pytest.mark.timeout(30)]

TESTING = Path(keyedconsumer.testing.__file__).parent


def member(broker: InMemoryBroker, group: str = "g") -> str:
    return broker.client_factory({"group.id": group}, lambda err: None).member_id


def test_a_member_joins_is_assigned_fetches_stores_and_commits() -> None:
    # given a topic with three records, one committed by the group, and a member
    broker = InMemoryBroker()
    broker.create_topic("t", partitions=2)
    for i in range(3):
        broker.produce("t", f"v{i}", partition=0)
    a = member(broker)
    # when it joins
    broker.join_group(a, ["t"])
    # then its first event assigns both partitions, with the offsets to start from read at once
    event = broker.next_event(a)
    assert event == GroupEvent(
        "assign", [("t", 0), ("t", 1)], {("t", 0): None, ("t", 1): None}, {("t", 0): 3, ("t", 1): 0}
    )
    assert broker.next_event(a) is None and broker.assignment(a) == [("t", 0), ("t", 1)]
    assert broker.callbacks("g") == [(a, "assign", [("t", 0), ("t", 1)])]
    # and the fetch path reads from the positions it gives, up to the limit, counted as delivered
    assert [r.offset for r in broker.fetch(a, [(("t", 0), 1), (("t", 1), 0)], max_records=10)] == [1, 2]
    assert [r.offset for r in broker.fetch(a, [(("t", 0), 0)], max_records=2)] == [0, 1]
    assert broker.delivered("g") == 4 and broker.list_offsets([("t", 0), ("t", 9), ("x", 0)]) == {
        ("t", 0): 3,
        ("t", 9): None,
        ("x", 0): None,
    }
    # and a stored offset is committed by commit_stored once, an explicit commit at once
    assert broker.store_offset(a, ("t", 0), 2, "m")
    broker.commit_stored(a)
    broker.commit_stored(a)
    assert broker.commit_offsets(a, [(("t", 1), 0, "")]) == []
    assert [(c.partition, c.offset, c.automatic, c.metadata) for c in broker.commits("g")] == [
        (0, 2, True, "m"),
        (1, 0, False, ""),
    ]
    assert broker.fetch_committed("g", [("t", 0), ("t", 1)]) == {("t", 0): (2, "m"), ("t", 1): (0, "")}


def test_a_second_member_gets_partitions_only_after_the_first_revoked_them() -> None:
    # given a member holding both partitions of a topic, with a stored offset
    broker = InMemoryBroker()
    broker.create_topic("t", partitions=2)
    a, b = member(broker), member(broker)
    broker.join_group(a, ["t"])
    assert broker.next_event(a) is not None
    assert broker.store_offset(a, ("t", 1), 5)
    # when a second member joins
    broker.join_group(b, ["t"])
    # then the first is asked to revoke one partition, and the second gets nothing yet
    assert broker.next_event(a) == GroupEvent("revoke", [("t", 1)])
    assert broker.next_event(b) is None and broker.assignment(a) == [("t", 0), ("t", 1)]
    # and once the revoke is done (auto-committing what was stored), the partition is the second's
    broker.revoke_done(a, [("t", 1)], commit_stored=True)
    assert broker.committed("g") == {("t", 1): 5} and broker.assignment(a) == [("t", 0)]
    event = broker.next_event(b)
    assert event is not None and (event.kind, event.partitions, event.committed) == (
        "assign",
        [("t", 1)],
        {("t", 1): 5},
    )
    # and the old owner can no longer store or commit for it
    assert not broker.store_offset(a, ("t", 1), 6)
    assert broker.commit_offsets(a, [(("t", 1), 6, "")]) == [(("t", 1), 6)]
    # and when the first leaves, its partition goes to the second
    broker.leave_group(a, [("t", 0)])
    assert broker.assignment(a) == [] and broker.next_event(b) == GroupEvent(
        "assign", [("t", 0)], {("t", 0): None}, {("t", 0): 0}
    )
    assert [kind for _, kind, _ in broker.callbacks("g")] == [
        "assign",
        "revoke",
        "assign",
        "revoke",
        "assign",
    ]


def test_lost_partitions_are_gone_at_once_and_their_stored_offsets_dropped() -> None:
    # given a member holding a partition with a stored offset
    broker = InMemoryBroker()
    broker.create_topic("t")
    a = member(broker)
    broker.join_group(a, ["t"])
    assert broker.next_event(a) is not None and broker.store_offset(a, ("t", 0), 3)
    # when the partition is lost
    broker.rebalance("g", lost=True)
    # then it is no longer the member's, nothing stored remains, and "lost" comes before it is assigned again
    assert broker.assignment(a) == [] and broker.stored("g") == {}
    assert broker.fetch(a, [(("t", 0), 0)], 10) == []  # nothing owned: nothing read
    assert broker.next_event(a) == GroupEvent("lost", [("t", 0)])
    event = broker.next_event(a)
    assert event is not None and event.kind == "assign"


def test_waiting_for_a_change_returns_at_once_after_one() -> None:
    # given the broker's version
    broker = InMemoryBroker()
    seen = broker.version()
    # when nothing changes, the wait times out; after a produce it returns at once
    assert not broker.wait_for_change(seen, 0.001)
    broker.produce("t", "v")
    assert broker.wait_for_change(seen, 60.0)


def test_injected_errors_reach_each_live_member_of_the_group_once() -> None:
    # given members of two groups, when an error is injected for one group, then only its member gets it, once
    broker = InMemoryBroker()
    a, other = member(broker, "g"), member(broker, "h")
    err = KafkaClientError("boom", code="_TRANSPORT")
    broker.inject_error(err, group="g")
    assert broker.take_errors(a) == [err] and broker.take_errors(a) == [] and broker.take_errors(other) == []


def test_the_fake_publisher_is_a_record_publisher_without_the_real_one() -> None:
    # given a fake publisher typed as the seam, then it is no Publisher and it writes into the broker
    pub: RecordPublisher = FakePublisher(InMemoryBroker())
    assert not isinstance(pub, Publisher) and pub.delivery_timeout_s == 0.0
    assert pub.publish("dlq", b"k", b"v") == (0, 0)


def _private_reaches(path: Path) -> list[str]:
    """``owner._name`` attribute uses where ``owner`` is not ``self`` (nor the class itself)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_fakes_use_only_public_methods_of_the_broker_and_of_each_other() -> None:
    # given the testing package's modules
    modules = sorted(TESTING.glob("*.py"))
    assert {p.name for p in modules} >= {
        "__init__.py",
        "broker.py",
        "client.py",
        "clock.py",
        "group.py",
        "run.py",
    }
    # when every attribute use is read
    reaches = [r for p in modules for r in _private_reaches(p)]
    # then none reaches into another object's private state
    assert reaches == []
