"""A reply lost after Redis ran the command (issue 25 §11): every script the sequencer sends again
after such a loss is idempotent.

A TCP proxy of the test's own, in front of a private Redis, forwards a command and then drops the
connection instead of the reply: the caller sees a connection error although Redis ran it, and
sends it again the way the sequencer does (the same lease owner, the same entries). Redis must end
in the state one call gives: one fencing token issued, one parked entry, one removal.
"""

from __future__ import annotations

import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from keyedconsumer import KeyedConsumer, Message, RedisSequencer
from keyedconsumer.sequencing import keys
from keyedconsumer.sequencing.store import LeaseStore, StoreUnavailable

from .kafkautil import produce
from .redisnodes import RedisNode, TcpProxy, free_ports

pytestmark = [pytest.mark.redis]


@pytest.fixture
def node() -> Iterator[RedisNode]:
    n = RedisNode(free_ports(1)[0], Path(tempfile.mkdtemp(prefix="kc-lost-")))
    n.start()
    try:
        yield n
    finally:
        n.stop()


@pytest.fixture
def proxy(node: RedisNode) -> Iterator[TcpProxy]:
    p = TcpProxy(node.port)
    try:
        yield p
    finally:
        p.close()


def _load_scripts(node: RedisNode) -> None:
    """Load the store's scripts into Redis's cache first, so the first ``EVALSHA`` of each runs
    (a ``NOSCRIPT`` answer, also lost, would not show a command that ran)."""
    store = LeaseStore(f"redis://127.0.0.1:{node.port}/0", "load")
    r = node.client()
    try:
        for script in vars(store).values():
            if hasattr(script, "sha") and hasattr(script, "script"):
                r.script_load(script.script)
    finally:
        store.close()
        r.close()


def _twice(proxy: TcpProxy, sha: str, call: Callable[[], Any]) -> Any:
    """``call()`` with its reply lost once (a ``StoreUnavailable``), then ``call()`` again."""
    proxy.drop_reply_after(sha.encode())
    with pytest.raises(StoreUnavailable):
        call()
    assert proxy.pending_drops() == 0
    return call()


@pytest.mark.timeout(60)
def test_every_store_script_sent_again_after_a_lost_reply_acts_once(node: RedisNode, proxy: TcpProxy) -> None:
    # given a store that reaches Redis through the proxy, and a direct view of Redis
    _load_scripts(node)
    ns = f"lost{uuid.uuid4().hex[:6]}"
    store = LeaseStore(f"redis://127.0.0.1:{proxy.port}/0", ns, socket_timeout_s=2.0)
    r = node.client()
    lid = keys.lease_id(b"acct-1", "t", 0)
    try:
        # when an acquire's reply is lost and the same owner asks again: the same lease, the same
        # token, and the slot's counter moved once
        token = _twice(proxy, store._acquire.sha, lambda: store.acquire([(lid, "o1")], 30_000))[0][0]
        assert token == 1 and int(r.hget(keys.slot_fence(ns, lid), "n")) == 1
        # a renewal's: still held
        assert _twice(proxy, store._renew_many.sha, lambda: store.renew([(lid, "o1")], 30_000)) == [True]
        # a park's: each entry parked once
        entries = [("74.0", i, f"m{i}".encode()) for i in range(3)]
        park = lambda: store.park([(lid, "o1", entries, None)], 60_000, 100, 1 << 20)  # noqa: E731
        assert _twice(proxy, store._park.sha, park)[0][0] == 1
        assert r.lrange(keys.park(ns, lid), 0, -1) == [b"m0", b"m1", b"m2"]
        # a head replaced (a retry's new attempt): replaced once, the sent-again call changes nothing
        replace = lambda: store.replace_head(lid, "o1", b"m0", b"m0'")  # noqa: E731
        _twice(proxy, store._replace_head.sha, replace)
        assert r.lrange(keys.park(ns, lid), 0, -1) == [b"m0'", b"m1", b"m2"]
        # a removal of finished heads: removed once (the call sent again removes nothing more)
        assert _twice(proxy, store._pop_many.sha, lambda: store.pop_many(lid, "o1", [b"m0'"])) == 0
        assert r.lrange(keys.park(ns, lid), 0, -1) == [b"m1", b"m2"]
        # a scheduled message and its move into the key's list: once each
        sid = uuid.uuid4().hex
        _twice(proxy, store._schedule.sha, lambda: store.schedule(sid, 1, b"s1"))
        assert r.zcard(keys.sched_due(ns)) == 1
        assert _twice(proxy, store._move_in.sha, lambda: store.move_in(lid, sid, b"s1", 60_000)) == (False, 3)
        assert r.lrange(keys.park(ns, lid), 0, -1) == [b"m1", b"m2", b"s1"]
        # the scheduler's lease and a check-in
        assert _twice(proxy, store._hold.sha, lambda: store.hold(keys.scheduler(ns), "i1", 30_000))
        assert _twice(proxy, store._check_in.sha, lambda: store.check_in("i1", 30_000)) == []
        # a release's: released once, the lease and its token gone
        assert _twice(proxy, store._release_many.sha, lambda: store.release([(lid, "o1")])) == [False]
        assert not r.exists(keys.lease(ns, lid), keys.fence(ns, lid))
        # and the next owner's token is the next one (no token was issued twice or skipped back)
        assert store.acquire([(lid, "o2")], 30_000)[0][0] == 2
        assert len(proxy.dropped) == 10
    finally:
        store.close()
        r.close()


@pytest.mark.timeout(120)
def test_a_consumer_whose_acquire_reply_is_lost_gets_the_same_lease_back_at_once(
    kafka_bootstrap: str, new_topic: Callable[[int], str], node: RedisNode, proxy: TcpProxy, start: Any
) -> None:
    # given a consumer whose Redis is behind the proxy, with a long lease TTL (20 s), and the reply
    # to the first acquire of key "k" lost on its way back
    _load_scripts(node)
    topic, ns = new_topic(1), f"lost{uuid.uuid4().hex[:6]}"
    lid = keys.lease_id(b"k", topic, 0)
    proxy.drop_reply_after(keys.lease(ns, lid).encode())
    tokens: list[int | None] = []
    done = threading.Event()

    def handle(msg: Message) -> None:
        tokens.append(msg.fencing_token)
        done.set()

    seq = RedisSequencer(f"redis://127.0.0.1:{proxy.port}/0", ns, lease_ttl_s=20.0)
    run = start(
        KeyedConsumer(
            name=f"g-{ns}", handler=handle, brokers=[kafka_bootstrap], topics=[topic], sequencer=seq
        )
    )
    # when a message of key "k" arrives
    produce(kafka_bootstrap, topic, [(b"k", b"v", None)])
    # then it runs under the lease the lost reply granted (token 1, the only one issued), without
    # waiting 20 s for that lease to expire
    assert done.wait(15), "the message did not run within 15 s (its lease TTL is 20 s)"
    assert proxy.pending_drops() == 0 and tokens == [1]
    r = node.client()
    try:
        assert int(r.hget(keys.slot_fence(ns, lid), "n")) == 1
    finally:
        r.close()
    assert run.stop(30) and run.error is None
