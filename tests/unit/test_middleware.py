"""Middleware logic without Kafka: back-off, retry decisions, headers, decoding, logging."""

from __future__ import annotations

import asyncio
import logging
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from keyedconsumer.middleware import (
    DEAD_LETTER_HEADERS,
    DeadLetter,
    DecodeError,
    Logging,
    Recover,
    Retry,
    Typed,
)
from pydantic import BaseModel

from keyedconsumer import Message, PermanentError, RetryLater, SkipMessage


def msg(value: bytes | None = b"{}", key: bytes | None = b"k", attempt: int = 1) -> Message:
    m = Message("orders", 3, 42, key, value, [("trace", b"abc")], 1_700_000_000_000)
    m.attempt = attempt
    return m


# -- back-off ---------------------------------------------------------------------------------------


def test_backoff_defaults_follow_bigben() -> None:
    r = Retry(jitter=0.0)
    assert (r.max_attempts, r.initial_delay_s, r.multiplier) == (3, 1.0, 2.0)
    assert [r.delay_s(n) for n in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 8.0]
    assert Retry(jitter=0.0, max_delay_s=5).delay_s(10) == 5.0


@given(
    attempt=st.integers(min_value=1, max_value=10_000),
    initial=st.floats(min_value=0, max_value=100),
    mult=st.floats(min_value=1, max_value=10),
    cap=st.floats(min_value=0, max_value=3600),
    jitter=st.floats(min_value=0, max_value=5),
)
def test_backoff_is_bounded_finite_and_at_least_the_exponential_delay(
    attempt: int, initial: float, mult: float, cap: float, jitter: float
) -> None:
    # the distribution is tenacity's wait_exponential_jitter: the exponential delay plus uniform(0,
    # jitter), capped at max_delay_s; what is certain: within [min(cap, exponential), cap]
    d = Retry(initial_delay_s=initial, multiplier=mult, max_delay_s=cap, jitter=jitter).delay_s(attempt)
    assert math.isfinite(d) and 0.0 <= d <= cap
    try:
        exponential = initial * mult ** (attempt - 1)
    except OverflowError:
        exponential = math.inf
    assert d >= min(cap, exponential) * (1 - 1e-12)
    if jitter == 0.0 and exponential <= cap:
        assert d == pytest.approx(exponential)


def test_backoff_policy_is_passed_in() -> None:
    import tenacity

    # given a deterministic tenacity wait strategy, when an attempt fails, then its delay is the one asked
    r = Retry(
        max_attempts=5, wait=tenacity.wait_fixed(2.5) + tenacity.wait_incrementing(start=0, increment=1)
    )
    assert [r.delay_s(n) for n in (1, 2, 3)] == [2.5, 3.5, 4.5]
    with pytest.raises(RetryLater) as caught:
        r(failing(ValueError("boom")))(msg(attempt=2))
    assert caught.value.delay_s == 3.5


@pytest.mark.parametrize(
    "kwargs",
    [
        {"initial_delay_s": math.nan},
        {"max_delay_s": math.inf},
        {"multiplier": 0.5},
        {"jitter": -0.1},
        {"max_attempts": 0},
        {"initial_delay_s": -1},
        {"max_attempts": True},
    ],
)
def test_bad_retry_settings_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        Retry(**kwargs)  # type: ignore[arg-type]


# -- retry decisions --------------------------------------------------------------------------------


def failing(exc: BaseException):  # type: ignore[no-untyped-def]
    def handler(m: Message) -> None:
        raise exc

    return handler


def test_retry_asks_for_a_later_run_until_the_last_attempt() -> None:
    h = Retry(max_attempts=3, jitter=0.0)(failing(ValueError("boom")))
    for attempt, delay in ((1, 1.0), (2, 2.0)):
        with pytest.raises(RetryLater) as info:
            h(msg(attempt=attempt))
        assert info.value.delay_s == delay and isinstance(info.value.__cause__, ValueError)
    with pytest.raises(ValueError):  # the last attempt's failure goes through
        h(msg(attempt=3))


def test_retry_gives_up_at_once_on_permanent_errors_and_passes_control_flow() -> None:
    with pytest.raises(PermanentError):
        Retry()(failing(PermanentError("bad input")))(msg())
    with pytest.raises(SkipMessage):
        Retry()(failing(SkipMessage()))(msg())
    with pytest.raises(KeyboardInterrupt):  # BaseException is never retried
        Retry()(failing(KeyboardInterrupt()))(msg())
    with pytest.raises(KeyError):  # not in retry_on
        Retry(retry_on=(ValueError,))(failing(KeyError("x")))(msg())


def test_retry_treats_ack_fail_as_a_failure() -> None:
    def handler(m: Message) -> None:
        m.ack_fail(RuntimeError("nope"))

    with pytest.raises(RetryLater):
        Retry()(handler)(msg())


def test_retry_wraps_async_handlers_as_async() -> None:
    async def handler(m: Message) -> None:
        raise ValueError("x")

    wrapped = Retry(jitter=0.0)(handler)
    assert asyncio.iscoroutinefunction(wrapped)
    with pytest.raises(RetryLater):
        asyncio.run(wrapped(msg()))


# -- dead-letter headers ----------------------------------------------------------------------------


class FakePublisher:
    def __init__(self) -> None:
        self.records: list[tuple[str, bytes | None, bytes | None, list[tuple[str, bytes | None]]]] = []

    def publish(self, topic, key, value, headers=None, timeout_s=30.0):  # type: ignore[no-untyped-def]
        self.records.append((topic, key, value, list(headers or [])))
        return 0, len(self.records) - 1


def test_dead_letter_headers_are_replaced_not_appended() -> None:
    pub = FakePublisher()
    dl = DeadLetter(publisher=pub)  # type: ignore[arg-type]
    m = msg()
    try:
        raise ValueError("first")
    except ValueError as exc:
        dl.publish(m, exc)
    topic, key, value, headers = pub.records[-1]
    assert topic == "orders.dlq" and key == b"k" and value == b"{}"
    names = [k for k, _ in headers]
    assert names[0] == "trace" and set(DEAD_LETTER_HEADERS) - {
        "kafka_dlt-exception-cause-fqcn",
        "kafka_dlt-validation-errors",
    } <= set(names)
    # when the dead-letter record is consumed, fails and is dead-lettered again, several times
    for i in range(5):
        again = Message("orders.dlq", 0, i, key, value, headers, None)
        try:
            raise RuntimeError("again")
        except RuntimeError as exc:
            dl.publish(again, exc)
        headers = pub.records[-1][3]
    # then the headers do not grow, and they describe the last failure
    assert sorted(k for k, _ in headers) == sorted(set(k for k, _ in headers))
    assert len(headers) <= len(names) + 1
    h = dict(headers)
    assert (
        h["kafka_dlt-exception-fqcn"] == b"builtins.RuntimeError"
        and h["kafka_dlt-original-topic"] == b"orders.dlq"
    )


def test_dead_letter_names_the_real_cause_and_bounds_the_trace() -> None:
    pub = FakePublisher()
    dl = DeadLetter(publisher=pub, max_stacktrace_bytes=300)  # type: ignore[arg-type]

    def deep(n: int) -> None:
        if n == 0:
            raise KeyError("root")
        deep(n - 1)

    try:
        try:
            deep(50)
        except KeyError as root:
            raise PermanentError("wrapped") from root
    except PermanentError as exc:
        dl.publish(msg(), exc)
    h = dict(pub.records[-1][3])
    assert h["kafka_dlt-exception-cause-fqcn"] == b"builtins.KeyError"
    assert len(h["kafka_dlt-exception-stacktrace"] or b"") <= 300


def test_dead_letter_publishes_then_counts_the_message_done() -> None:
    pub = FakePublisher()
    h = DeadLetter(publisher=pub)(failing(ValueError("x")))  # type: ignore[arg-type]
    m = msg()
    h(m)  # no exception: the message is done
    assert (
        m.status.value == "DEAD_LETTERED"
        and m.state["dead_lettered"] == "orders.dlq"
        and len(pub.records) == 1
    )
    with pytest.raises(RetryLater):  # a retry is not a final failure
        DeadLetter(publisher=pub)(failing(RetryLater(1.0)))(msg())  # type: ignore[arg-type]
    assert len(pub.records) == 1


# -- typed payloads ---------------------------------------------------------------------------------


class Order(BaseModel):
    id: int
    amount: float


@pytest.mark.parametrize("value", [b"\xff\xfe not json", b'{"id": "x", "amount": 1}', b"{}", b"[1, 2]"])
def test_typed_refuses_bad_values_permanently(value: bytes) -> None:
    seen: list[Message] = []
    h = Typed(Order)(seen.append)
    with pytest.raises(DecodeError) as info:
        h(msg(value))
    assert isinstance(info.value, PermanentError) and info.value.validation_errors
    assert "offset=42" in str(info.value) and not seen


def test_typed_decodes_and_passes_tombstones_and_odd_keys() -> None:
    seen: list[Message] = []
    h = Typed(Order)(seen.append)
    h(msg(b'{"id": 1, "amount": 2.5}', key=b"\xff\xfe"))
    h(msg(None, key=None))
    assert seen[0].payload == Order(id=1, amount=2.5) and seen[1].payload is None


# -- logging and recover ----------------------------------------------------------------------------


def test_logging_writes_one_structured_record(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "keyedconsumer.messages")
    Logging()(lambda m: None)(msg(key=b"\xffacct"))
    with pytest.raises(RetryLater):
        Logging()(failing(RetryLater(1)))(msg())
    records = [r for r in caplog.records if r.name == "keyedconsumer.messages"]
    assert len(records) == 2
    first = records[0].keyedconsumer  # type: ignore[attr-defined]
    assert first["outcome"] == "SUCCESS" and first["offset"] == 42 and first["key"] == "\\xffacct"
    assert records[1].keyedconsumer["outcome"] == "RETRY"  # type: ignore[attr-defined]
    assert "{}" not in records[0].getMessage()  # values are never logged


def test_recover_turns_a_middleware_crash_into_a_failed_message() -> None:
    def broken_middleware(handler):  # type: ignore[no-untyped-def]
        def h(m: Message) -> None:
            raise AttributeError("bug in a middleware")

        return h

    m = msg()
    Recover()(broken_middleware(lambda m: None))(m)
    assert m.status.value == "FAIL" and isinstance(m.error, AttributeError)
