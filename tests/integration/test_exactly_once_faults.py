"""Exactly-once results under broker faults (issue 25, items 1, 2 and 4), each on a broker of the
test's own (:mod:`.ownkafka`: its own ports and properties; the shared broker is never touched):

- a transactional id (and producer id) that the broker expired while its consumer idled;
- the broker stalled (SIGSTOP) while transactions run, for less and for more than
  ``transaction_timeout_s``; SIGTERM one second into a stall; a broker that stays away.

Each ends with a ``read_committed`` reader of the whole output: every input's result exactly once,
each key's in input order.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

from keyedconsumer import KeyedConsumer, Message
from keyedconsumer.consumer import BLOCKING_CALL_S, SHUTDOWN_MARGIN_S
from keyedconsumer.errors import TransactionError

from .conftest import Running
from .kafka_proxy import END_TXN, KafkaProxy
from .kafkautil import committed, end_offsets, once_in_key_order, produce, read_committed_all, wait_until
from .ownkafka import OwnKafka, own_kafka
from .procs.eos_consumer import spawn

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
PARTITIONS = 4
#: The broker's transaction timeout checker runs every 10 s by default; sooner here, so a stall longer
#: than transaction_timeout_s meets the broker's timeout abort as soon as the broker runs again.
FAST_ABORT = {"transaction.abort.timed.out.transaction.cleanup.interval.ms": "500"}


@pytest.fixture
def kafka_faults() -> Iterator[Callable[..., OwnKafka]]:
    """``kafka_faults(properties, proxied=False) -> OwnKafka``: a started broker of this test,
    stopped at the end."""
    with contextlib.ExitStack() as stack:
        yield lambda properties, proxied=False: stack.enter_context(own_kafka(properties, proxied))


def _topics(bootstrap: str) -> tuple[str, str]:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    names = (f"in-{uuid.uuid4().hex[:8]}", f"out-{uuid.uuid4().hex[:8]}")
    for fut in admin.create_topics([NewTopic(n, PARTITIONS, 1) for n in names]).values():
        fut.result(60)
    return names


def _inputs(keys: int, first: int, last: int) -> list[bytes]:
    """``k{key}:{seq}`` for seq in [first, last), interleaved over the keys."""
    return [f"k{k}:{s}".encode() for s in range(first, last) for k in range(keys)]


def _produce(bootstrap: str, topic: str, inputs: list[bytes]) -> None:
    produce(bootstrap, topic, [(v.split(b":")[0], v, None) for v in inputs])


def _consumer(bootstrap: str, src: str, out: str, tid: str, **options: object) -> KeyedConsumer:
    def handle(msg: Message) -> None:
        time.sleep(0.003)
        msg.produce(out, msg.key, msg.value)

    return KeyedConsumer(
        name=f"g-{tid}",
        handler=handle,
        brokers=[bootstrap],
        topics=[src],
        concurrency=4,
        transactional=True,
        transactional_id=tid,
        **options,
    )


def _all_committed(bootstrap: str, group: str, src: str) -> bool:
    """Every input's offset is committed (False while the broker, back from a stall, cannot say)."""
    try:
        ends = end_offsets(bootstrap, src, PARTITIONS)
        return committed(bootstrap, group, src, PARTITIONS) == {p: (ends[p] or None) for p in ends}
    except KafkaException:
        return False


def _check_output(bootstrap: str, out: str, inputs: list[bytes]) -> None:
    seen = read_committed_all(bootstrap, out, PARTITIONS)
    assert once_in_key_order(seen, inputs) == []


def _finishes(bootstrap: str, running: Running, tid: str, src: str) -> None:
    """The consumer commits every input without stopping, then stops cleanly."""
    assert wait_until(
        lambda: _all_committed(bootstrap, f"g-{tid}", src) or not running.thread.is_alive(), 120, 0.2
    )
    assert running.error is None, repr(running.error)
    assert running.stop(30) and running.error is None, repr(running.error)


def _committed_at_least(bootstrap: str, tid: str, src: str, n: int) -> bool:
    return sum(o or 0 for o in committed(bootstrap, f"g-{tid}", src, PARTITIONS).values()) >= n


@pytest.mark.timeout(240)
def test_a_transactional_id_expired_while_idle_is_recovered_without_loss_or_duplicate(
    kafka_faults: Callable[..., OwnKafka],
    start: Callable[[KeyedConsumer], Running],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # given a broker that forgets idle transactional ids and producer ids after 3 s
    kafka = kafka_faults(
        {
            "transactional.id.expiration.ms": "3000",
            "transaction.remove.expired.transaction.cleanup.interval.ms": "500",
            "producer.id.expiration.ms": "3000",
            "producer.id.expiration.check.interval.ms": "500",
        }
    )
    bootstrap = kafka.bootstrap
    src, out = _topics(bootstrap)
    tid = f"idle-{uuid.uuid4().hex[:8]}"
    first = _inputs(10, 0, 30)
    _produce(bootstrap, src, first)
    caplog.set_level(logging.WARNING, logger="keyedconsumer")
    running = start(_consumer(bootstrap, src, out, tid))
    # and a consumer that committed every result of a first batch
    assert wait_until(lambda: _all_committed(bootstrap, f"g-{tid}", src), 90, 0.2)
    # when it idles until the broker forgot its transactional id
    assert wait_until(lambda: tid not in kafka.transactional_ids(), 90, 0.5)
    # and a second batch comes
    second = _inputs(10, 30, 60)
    _produce(bootstrap, src, second)
    assert wait_until(lambda: _all_committed(bootstrap, f"g-{tid}", src), 90, 0.2)
    # then the consumer still runs, its first transaction after the idle was refused for the
    # forgotten id and done again (librdkafka's abort bumps the epoch), and every result of both
    # batches is there exactly once, in key order
    assert running.error is None
    assert "INVALID_PRODUCER_ID_MAPPING" in caplog.text
    assert running.stop(30)
    assert running.error is None
    _check_output(bootstrap, out, first + second)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "stall_s, transaction_timeout_s", [(3.0, 10.0), (9.0, 3.0)], ids=["shorter", "longer"]
)
def test_a_broker_stall_during_transactions_loses_and_duplicates_nothing(
    kafka_faults: Callable[..., OwnKafka],
    start: Callable[[KeyedConsumer], Running],
    caplog: pytest.LogCaptureFixture,
    stall_s: float,
    transaction_timeout_s: float,
) -> None:
    # given a transactional consumer working through a backlog, a transaction every 0.1 s
    kafka = kafka_faults(FAST_ABORT)
    bootstrap = kafka.bootstrap
    src, out = _topics(bootstrap)
    tid = f"stall-{uuid.uuid4().hex[:8]}"
    inputs = _inputs(20, 0, 300)
    _produce(bootstrap, src, inputs)
    caplog.set_level(logging.WARNING, logger="keyedconsumer")
    running = start(_consumer(bootstrap, src, out, tid, transaction_timeout_s=transaction_timeout_s))
    assert wait_until(lambda: _committed_at_least(bootstrap, tid, src, 300), 90)
    # when the broker stalls (SIGSTOP) for less, or for more, than the transaction timeout
    kafka.stall()
    try:
        time.sleep(stall_s)
    finally:
        kafka.resume()
    # then the consumer rides it out and finishes the backlog
    _finishes(bootstrap, running, tid, src)
    if stall_s > transaction_timeout_s:  # a transaction met the stall (aborted, or its commit in doubt)
        assert "transaction aborted (" in caplog.text or "transaction in doubt (" in caplog.text
    # and every result is there exactly once, in key order
    _check_output(bootstrap, out, inputs)


def _spawn(
    bootstrap: str, src: str, out: str, tid: str, folder: Path, *extra: str
) -> subprocess.Popen[bytes]:
    log = str(folder / "consumer.log")
    return spawn(bootstrap, f"g-{tid}", src, out, "tx", tid, "", str(folder), "--log-file", log, *extra)


def _exit(folder: Path, proc: subprocess.Popen[bytes]) -> str:
    path = folder / f"exit-{proc.pid}"
    return path.read_text() if path.exists() else f"no exit file (status {proc.returncode})"


@pytest.mark.timeout(240)
def test_sigterm_during_a_broker_stall_stops_within_the_bound_and_a_restart_finishes_exactly_once(
    kafka_faults: Callable[..., OwnKafka], tmp_path: Path
) -> None:
    # given a transactional consumer process (shutdown_timeout_s=5, transaction_timeout_s=10)
    # working through a backlog, a transaction every 0.1 s
    kafka = kafka_faults(FAST_ABORT)
    bootstrap = kafka.bootstrap
    src, out = _topics(bootstrap)
    tid = f"term-{uuid.uuid4().hex[:8]}"
    inputs = _inputs(20, 0, 300)
    _produce(bootstrap, src, inputs)
    shutdown_s = 5.0
    bound_s = max(shutdown_s, BLOCKING_CALL_S) + SHUTDOWN_MARGIN_S
    args = ("--shutdown-s", str(shutdown_s), "--sleep", "0.005")
    proc = _spawn(bootstrap, src, out, tid, tmp_path, *args)
    restarted = None
    try:
        assert wait_until(lambda: _committed_at_least(bootstrap, tid, src, 300), 90), (
            tmp_path / "consumer.log"
        ).read_text()[-3000:]
        # when the broker stalls and, a second later, the consumer is SIGTERMed
        kafka.stall()
        try:
            time.sleep(1.0)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(bound_s + 30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
            elapsed = time.monotonic() - t0
        finally:
            kafka.resume()
        # then run() returned normally (a graceful stop) within the documented bound
        log = (tmp_path / "consumer.log").read_text()
        outcome = (_exit(tmp_path, proc), proc.returncode, elapsed <= bound_s)
        print(f"SIGTERM during the stall: run() returned in {elapsed:.1f} s (bound {bound_s:g} s)")
        assert outcome == ("ok", 0, True), (outcome, elapsed, log[-3000:])
        # and a restart with the same transactional id finishes the backlog
        restarted = _spawn(bootstrap, src, out, tid, tmp_path, *args)
        assert wait_until(lambda: _all_committed(bootstrap, f"g-{tid}", src), 120, 0.2)
    finally:
        for p in (proc, restarted):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
    assert restarted is not None and restarted.returncode == 0, _exit(tmp_path, restarted)
    # with every result exactly once, in key order
    _check_output(bootstrap, out, inputs)


def _run_until_frozen(
    kafka_faults: Callable[..., OwnKafka],
    start: Callable[[KeyedConsumer], Running],
    forward: bool,
    **options: object,
) -> tuple[OwnKafka, KafkaProxy, Running, str, str, str, list[bytes]]:
    """A transactional consumer working through a backlog on a broker of its own behind the proxy;
    returns once a commit (``EndTxn``) froze the clients' traffic (``forward``: after the broker got
    it)."""
    kafka = kafka_faults(FAST_ABORT, proxied=True)
    bootstrap, proxy = kafka.bootstrap, kafka.proxy
    assert proxy is not None
    src, out = _topics(bootstrap)
    tid = f"frozen-{uuid.uuid4().hex[:8]}"
    inputs = _inputs(20, 0, 300)
    _produce(bootstrap, src, inputs)
    running = start(_consumer(bootstrap, src, out, tid, **options))
    assert wait_until(lambda: _committed_at_least(bootstrap, tid, src, 200), 90)
    proxy.freeze_at(END_TXN, forward=forward)
    assert proxy.triggered.wait(60)
    return kafka, proxy, running, src, out, tid, inputs


@pytest.mark.timeout(240)
def test_a_commit_whose_answer_comes_after_its_bound_is_resumed_not_redone(
    kafka_faults: Callable[..., OwnKafka],
    start: Callable[[KeyedConsumer], Running],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # given a transactional consumer (transaction_timeout_s=4) whose commit reached the broker and
    # whose answer is held back (the clients' traffic frozen right after EndTxn)
    caplog.set_level(logging.WARNING, logger="keyedconsumer")
    kafka, proxy, running, src, out, tid, inputs = _run_until_frozen(
        kafka_faults, start, True, transaction_timeout_s=4.0
    )
    try:
        # when the commit's bound passes without an answer, and 3 s more
        assert wait_until(lambda: "transaction in doubt (" in caplog.text, 30, 0.1)
        time.sleep(3.0)
    finally:
        proxy.release()
    # then the consumer neither stopped nor redid the transaction: it finished the backlog
    _finishes(kafka.bootstrap, running, tid, src)
    # and every result is there exactly once, in key order
    _check_output(kafka.bootstrap, out, inputs)


@pytest.mark.timeout(240)
def test_a_commit_the_broker_aborted_on_its_timeout_is_redone_not_taken_for_fencing(
    kafka_faults: Callable[..., OwnKafka],
    start: Callable[[KeyedConsumer], Running],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # given a transactional consumer (transaction_timeout_s=3) whose commit (EndTxn) is held back
    # before the broker sees it
    caplog.set_level(logging.WARNING, logger="keyedconsumer")
    kafka, proxy, running, src, out, tid, inputs = _run_until_frozen(
        kafka_faults, start, False, transaction_timeout_s=3.0
    )
    try:
        # until the broker aborted the transaction on its timeout (and bumped the producer epoch,
        # which librdkafka reports as _FENCED once the commit arrives)
        assert wait_until(lambda: kafka.transaction_state(tid) == "CompleteAbort", 60, 0.5)
    finally:
        proxy.release()
    # then the consumer took it for the broker's timeout abort, not for a newer producer: it started
    # its producer again and finished the backlog
    _finishes(kafka.bootstrap, running, tid, src)
    assert "taken as the broker's timeout abort" in caplog.text
    # and every result is there exactly once, in key order
    _check_output(kafka.bootstrap, out, inputs)


@pytest.mark.timeout(240)
def test_a_commit_in_doubt_while_the_broker_stays_away_stops_the_consumer_and_a_restart_finishes_exactly_once(
    kafka_faults: Callable[..., OwnKafka],
    start: Callable[[KeyedConsumer], Running],
) -> None:
    # given a transactional consumer allowed 8 s of failures without an answer (max.poll.interval.ms)
    config = {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500, "max.poll.interval.ms": 8000}
    options = {"transaction_timeout_s": 3.0, "shutdown_timeout_s": 5.0, "config": config}
    # when its commit reached the broker and then the broker stays away (the clients' traffic frozen)
    kafka, proxy, running, src, out, tid, inputs = _run_until_frozen(kafka_faults, start, True, **options)
    try:
        stopped = running.join(90)
    finally:
        proxy.release()
    # then the consumer stopped with a TransactionError that says the broker did not answer
    assert stopped
    assert isinstance(running.error, TransactionError) and running.error.retriable, repr(running.error)
    assert "max.poll.interval.ms" in str(running.error)
    # and a restart with the same transactional id finishes the backlog exactly once, in key order
    again = start(_consumer(kafka.bootstrap, src, out, tid, **options))
    assert wait_until(lambda: _all_committed(kafka.bootstrap, f"g-{tid}", src), 120, 0.2)
    assert again.stop(30) and again.error is None, repr(again.error)
    _check_output(kafka.bootstrap, out, inputs)
