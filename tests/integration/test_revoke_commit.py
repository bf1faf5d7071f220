"""Commits around a revoke, on the real broker.

A commit in the revoke callback that the group refuses because the rebalance moved on meanwhile
(``STALE_MEMBER_EPOCH`` under KIP-848: getsentry/arroyo PR #419, librdkafka PR #4672) is made again
within the revoke budget, so the next owner does not run again what the revoked member finished.
The broker is real (``group.protocol=consumer``); the refusal is planted by a wrapping client, the
one seam that makes the broker's answer certain: the first commit made inside ``on_revoke`` is
refused with ``STALE_MEMBER_EPOCH``, as the coordinator answers a member whose epoch it has moved.

The ownership check a sequencer asks for during a revoke's catch-up (issue 15: a committed offset
seen going back, 1303 -> 1301 -> 1303, in the Redis Cluster fault run) commits nothing inside the
callback: a bounded commit is made from a helper thread that confluent-kafka lets into the client
only once the poll serving the callback returned, so it landed after the revoke's own commit, with
the offsets of before the catch-up. The order is made certain by handshakes, not sleeps: the slow
messages holding the offsets back run until the test releases them, once the revoke started and
the check was asked inside it. Whether the broker then accepts the late commit depends on the
generation current when it is sent, so the test also asserts what is certain on the engine's side:
no bounded commit is made inside a rebalance callback.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from typing import Any

import pytest

from keyedconsumer import CommitError, KeyedConsumer, Message, RedisSequencer
from keyedconsumer.kafka.client import connect
from keyedconsumer.sequencing.base import InMemorySequencer
from keyedconsumer.sequencing.connection import connect as connect_redis

from .kafkautil import committed, produce, wait_until

pytestmark = pytest.mark.kafka


class StaleOnce:
    """A real client whose first commit inside ``on_revoke`` is refused with STALE_MEMBER_EPOCH."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.in_revoke = False
        self.refused = 0
        self.revoking = threading.Event()  # set once a revoke started

    def subscribe(self, topics: Any, listener: Any) -> None:
        outer = self

        class Listener:
            def on_assign(self, partitions: Any) -> None:
                listener.on_assign(partitions)

            def on_lost(self, partitions: Any) -> None:
                listener.on_lost(partitions)

            def on_revoke(self, partitions: Any) -> None:
                outer.in_revoke = True
                outer.revoking.set()
                try:
                    listener.on_revoke(partitions)
                finally:
                    outer.in_revoke = False

        self._inner.subscribe(topics, Listener())

    def commit(self, offsets: Any, metadata: Any = None, *args: Any, **kwargs: Any) -> None:
        if self.in_revoke and not self.refused:
            self.refused += 1
            raise CommitError(
                "commit failed: STALE_MEMBER_EPOCH: The member epoch is stale", code="STALE_MEMBER_EPOCH"
            )
        self._inner.commit(offsets, metadata, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@pytest.mark.timeout(120)
def test_a_revoke_commit_refused_with_a_stale_member_epoch_is_made_again(
    kafka_bootstrap, new_topic, start
) -> None:  # type: ignore[no-untyped-def]
    # given a member of a KIP-848 group with manual commits (no commit of librdkafka's own at the
    # unassign) whose two partitions each start with a slow message that runs until the member's
    # revoke started and 1 s more, the rest finished meanwhile
    topic = new_topic(2)
    produce(
        kafka_bootstrap,
        topic,
        [(b"slow0", b"slow", 0), (b"slow1", b"slow", 1)]
        + [(f"k{i % 40}".encode(), b"x", i % 2) for i in range(400)],
    )
    group = f"g-{uuid.uuid4().hex[:8]}"
    runs: Counter[tuple[int, int]] = Counter()
    lock = threading.Lock()

    def handle(msg: Message) -> None:
        if msg.value == b"slow":
            clients[0].revoking.wait(60)
            time.sleep(1.0)
        with lock:
            runs[(msg.partition, msg.offset)] += 1

    clients: list[StaleOnce] = []

    def factory(conf: Any, on_error: Any) -> Any:
        clients.append(StaleOnce(connect(conf, on_error)))
        return clients[-1]

    options: dict[str, Any] = {
        "name": group,
        "handler": handle,
        "brokers": [kafka_bootstrap],
        "topics": [topic],
        "concurrency": 4,
        "manual_commit": True,
        "config": {"group.protocol": "consumer"},
    }
    a = KeyedConsumer(client_factory=factory, **options)
    ra = start(a)
    assert wait_until(lambda: sum(runs.values()) >= 400, 60), len(runs)
    # when a second member joins while the slow messages run: the first member's revoke waits for
    # its slow message, and its commit is refused once with STALE_MEMBER_EPOCH
    rb = start(KeyedConsumer(**options))
    assert wait_until(lambda: sum(runs.values()) >= 402 and len(a.assignment) == 1, 60), (
        len(runs),
        a.assignment,
    )
    time.sleep(2.0)  # the new owner has read its committed offset and fetched
    assert rb.stop(30) and ra.stop(30)
    assert ra.error is None and rb.error is None
    # then it was made again and accepted: the new owner ran nothing the first had finished
    assert clients[0].refused == 1
    assert len(runs) == 402 and max(runs.values()) == 1, sorted(k for k, n in runs.items() if n > 1)[:20]
    assert committed(kafka_bootstrap, group, topic, 2) == {0: 201, 1: 201}


class Recording:
    """A real client that records each commit the engine makes: its offsets, whether it was made
    while a rebalance callback was being served, its ``timeout_s`` (a bounded commit is made from a
    helper thread, see ``KafkaClient.commit``) and the error it raised."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.callback_thread: int | None = None  # the thread serving a rebalance callback now
        self.revoking = threading.Event()  # set when a revoke of partitions starts
        self.commits: list[dict[str, Any]] = []

    def in_callback(self) -> bool:
        return self.callback_thread is not None

    def subscribe(self, topics: Any, listener: Any) -> None:
        outer = self

        class Listener:
            def _serve(self, fn: Any, partitions: Any) -> None:
                outer.callback_thread = threading.get_ident()
                try:
                    fn(partitions)
                finally:
                    outer.callback_thread = None

            def on_assign(self, partitions: Any) -> None:
                self._serve(listener.on_assign, partitions)

            def on_lost(self, partitions: Any) -> None:
                self._serve(listener.on_lost, partitions)

            def on_revoke(self, partitions: Any) -> None:
                if partitions:
                    outer.revoking.set()
                self._serve(listener.on_revoke, partitions)

        self._inner.subscribe(topics, Listener())

    def commit_async(self, offsets: Any, metadata: Any = None) -> None:
        self.commits.append(
            {"offsets": list(offsets), "in_callback": self.in_callback(), "timeout_s": None, "async": True}
        )
        self._inner.commit_async(offsets, metadata)

    def commit(self, offsets: Any, metadata: Any = None, *args: Any, **kwargs: Any) -> None:
        record: dict[str, Any] = {
            "offsets": list(offsets),
            "in_callback": self.in_callback(),
            "timeout_s": kwargs.get("timeout_s"),
            "error": None,
        }
        self.commits.append(record)
        try:
            self._inner.commit(offsets, metadata, *args, **kwargs)
        except CommitError as exc:
            record["error"] = exc.code
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class AskingSequencer(InMemorySequencer):
    """In-memory sequencing whose ``tick`` asks the consumer's ownership check at most every 0.5 s,
    as the Redis sequencer does after a stall or a lost lease (its ``tick`` runs in the poll thread,
    also during a revoke's catch-up, inside the rebalance callback). ``asked_inside`` is set when it
    asks inside a rebalance callback (``in_callback``, given by the test)."""

    def __init__(self) -> None:
        self._confirm: Any = None
        self._next_s = 0.0
        self.in_callback: Any = lambda: False
        self.asked_inside = threading.Event()

    def attach(self, port: Any, fatal: Any, confirm: Any, timing: Any) -> None:
        self._confirm = confirm

    def tick(self) -> float | None:
        now = time.monotonic()
        if self._confirm is not None and now >= self._next_s:
            self._next_s = now + 0.5
            if self.in_callback():
                self.asked_inside.set()
            self._confirm()
        return None


def _revoke_during_ownership_checks(  # type: ignore[no-untyped-def]
    kafka_bootstrap, new_topic, start, sequencer: Any, suspect: Any, asked: Any
) -> tuple[Recording, list[dict[int, int | None]], dict[int, int | None]]:
    """Member A (``sequencer``) runs two partitions, each led by a slow message whose handler waits
    until released, the 199 quick ones behind it finished; member B joins. Once A's revoke started,
    ``suspect(client)`` makes A's sequencer ask for the ownership check, and once ``asked()`` (it
    was asked inside the callback) the slow messages are released: the revoke's catch-up finishes
    them and commits 200 on each partition. Returns A's client, the group's committed offsets
    sampled every 50 ms from B's start until 6 s after they reached 200 (or 60 s), and the
    committed offsets once both members stopped."""
    topic = new_topic(2)
    produce(
        kafka_bootstrap,
        topic,
        [(b"slow0", b"slow", 0), (b"slow1", b"slow", 1)]
        + [(f"k{i % 40}".encode(), b"x", i % 2) for i in range(398)],
    )
    group = f"g-{uuid.uuid4().hex[:8]}"
    done: Counter[int] = Counter()
    lock = threading.Lock()
    release = threading.Event()

    def handle(msg: Message) -> None:
        if msg.value == b"slow":
            release.wait(60)
        with lock:
            done[msg.partition] += 1

    clients: list[Recording] = []

    def factory(conf: Any, on_error: Any) -> Any:
        clients.append(Recording(connect(conf, on_error)))
        return clients[-1]

    options: dict[str, Any] = {
        "name": group,
        "handler": handle,
        "brokers": [kafka_bootstrap],
        "topics": [topic],
        "concurrency": 8,
        "revoke_timeout_s": 40.0,
        "config": {"heartbeat.interval.ms": 100, "session.timeout.ms": 6000},
    }
    samples: list[dict[int, int | None]] = []
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            samples.append(committed(kafka_bootstrap, group, topic, 2))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    ra = start(KeyedConsumer(client_factory=factory, sequencer=sequencer, **options))
    rb = None
    try:
        assert wait_until(lambda: done[0] + done[1] >= 398, 60), done
        sampler.start()
        rb = start(KeyedConsumer(**options))
        assert clients[0].revoking.wait(60)
        suspect(clients[0])
        assert wait_until(asked, 30)
        release.set()
        wait_until(lambda: samples and samples[-1] == {0: 200, 1: 200}, 60)
        time.sleep(6.0)  # a commit made inside the revoke would have landed by now (about 2 s after it)
    finally:
        release.set()
        sampling.set()
    sampler.join(10)
    assert rb.stop(30) and ra.stop(30)
    assert ra.error is None and rb.error is None
    return clients[0], samples, committed(kafka_bootstrap, group, topic, 2)


def _went_back(samples: list[dict[int, int | None]]) -> list[tuple[int, int, int]]:
    back = []
    for p in (0, 1):
        seen = [s[p] for s in samples if s[p] is not None]
        back += [(p, x, y) for x, y in zip(seen, seen[1:], strict=False) if y < x]
    return back


@pytest.mark.timeout(180)
def test_an_ownership_check_during_a_revoke_commits_nothing_that_lands_after_the_revoke_commit(  # type: ignore[no-untyped-def]
    kafka_bootstrap, new_topic, start
) -> None:
    # given a member whose sequencer asks for the ownership check (as the Redis sequencer does after
    # a stall or a lost lease, e.g. once a cut host is back), on two partitions each led by a slow
    # message with the 199 quick ones behind it finished: the offset to commit is held at 0
    seq = AskingSequencer()

    def suspect(client: Recording) -> None:
        seq.in_callback = client.in_callback

    # when a second member joins: the first member's revoke catches up (its catch-up ticks the
    # sequencer, which asks for the ownership check), finishes the slow messages and commits
    client, samples, final = _revoke_during_ownership_checks(
        kafka_bootstrap, new_topic, start, seq, suspect, seq.asked_inside.is_set
    )
    # then no commit made inside the callback was a bounded one: that one is made from a helper
    # thread, which confluent-kafka lets into the consumer only once the poll serving the callback
    # returned, so it lands after the revoke's own commit (with the offsets of before the catch-up),
    # under whatever generation is current then; and the group's committed offsets never went back
    # (and end at 200: a late commit of 0 stays, as nothing newer is left to commit)
    late = [c for c in client.commits if c["in_callback"] and c["timeout_s"] is not None]
    assert late == [] and _went_back(samples) == [] and final == {0: 200, 1: 200}, (
        late,
        _went_back(samples),
        final,
    )


@pytest.mark.redis
@pytest.mark.timeout(180)
def test_a_redis_sequencer_that_lost_a_lease_during_a_revoke_commits_nothing_that_lands_after_it(  # type: ignore[no-untyped-def]
    kafka_bootstrap, redis_url, new_topic, start
) -> None:
    # given the same member with the Redis sequencer (a finished key's lease lingers 60 s: at most
    # half the lease TTL, so a TTL of 120 s, renewed every 0.5 s), on two partitions each led by a
    # slow message with the quick ones behind it finished
    ns = f"rv{uuid.uuid4().hex[:8]}"
    seq = RedisSequencer(
        redis_url, ns, lease_ttl_s=120.0, renew_interval_s=0.5, lease_linger_s=60.0, require_durable=False
    )
    r = connect_redis(redis_url, 5.0)
    stalls: list[int] = []

    def suspect(client: Recording) -> None:
        # the quick keys' idle leases are taken away in Redis (as a lease lapses during a cut):
        # the renewer finds them lost, and the sequencer asks for the ownership check at its next
        # tick, in the revoke's catch-up
        stalls.append(seq.stalls)
        quick = [n for n in r.scan_iter(f"kc:{ns}:*:lease") if b"{k.6b" in n]
        assert quick
        r.delete(*quick)

    # when a second member joins and, once the first member's revoke started, leases are lost
    client, samples, final = _revoke_during_ownership_checks(
        kafka_bootstrap, new_topic, start, seq, suspect, lambda: stalls and seq.stalls > stalls[0]
    )
    # then nothing committed inside the callback was sent late, and the committed offsets never went back
    late = [c for c in client.commits if c["in_callback"] and c["timeout_s"] is not None]
    assert late == [] and _went_back(samples) == [] and final == {0: 200, 1: 200}, (
        late,
        _went_back(samples),
        final,
    )


@pytest.mark.timeout(120)
def test_a_long_revoke_catch_up_commits_its_progress_on_the_commit_cadence(  # type: ignore[no-untyped-def]
    kafka_bootstrap, new_topic, start
) -> None:
    # given a member whose two partitions each hold a chain of 12 messages of one key (0.3 s each),
    # the first held until the test releases it, and 188 quick messages of other keys behind it,
    # finished: the offsets to commit are held at 0, and the revoke's catch-up of whichever
    # partition moves has its chain to run (about 3.6 s)
    topic = new_topic(2)
    produce(
        kafka_bootstrap,
        topic,
        [(b"chain%d" % p, b"first", p) for p in (0, 1)]
        + [(b"chain%d" % p, b"next", p) for p in (0, 1) for _ in range(11)]
        + [(f"k{i % 40}".encode(), b"x", i % 2) for i in range(376)],
    )
    group = f"g-{uuid.uuid4().hex[:8]}"
    done = [0]
    lock = threading.Lock()
    release = threading.Event()

    def handle(msg: Message) -> None:
        if msg.value == b"first":
            release.wait(60)
        if msg.key in (b"chain0", b"chain1"):
            time.sleep(0.3)
        with lock:
            done[0] += 1

    clients: list[Recording] = []

    def factory(conf: Any, on_error: Any) -> Any:
        clients.append(Recording(connect(conf, on_error)))
        return clients[-1]

    options: dict[str, Any] = {
        "name": group,
        "handler": handle,
        "brokers": [kafka_bootstrap],
        "topics": [topic],
        "concurrency": 8,
        "revoke_timeout_s": 40.0,
        "config": {"heartbeat.interval.ms": 100, "session.timeout.ms": 6000, "auto.commit.interval.ms": 200},
    }
    ra = start(KeyedConsumer(client_factory=factory, **options))
    assert wait_until(lambda: done[0] >= 376, 60), done
    # when a second member joins (the partition is revoked from the first) and the chain is released
    rb = start(KeyedConsumer(**options))
    try:
        assert clients[0].revoking.wait(60)
        release.set()
        assert wait_until(lambda: committed(kafka_bootstrap, group, topic, 2) == {0: 200, 1: 200}, 60)
    finally:
        release.set()
    assert rb.stop(30) and ra.stop(30)
    assert ra.error is None and rb.error is None
    # then, inside the revoke callback, before its final commit, the catch-up committed (without
    # waiting) what the chain had finished so far: an offset above 0 and below 200
    inside = [c for c in clients[0].commits if c["in_callback"] and c.get("async")]
    progress = [o for c in inside for (_t, _p, o) in c["offsets"] if 0 < o < 200]
    assert progress, clients[0].commits
