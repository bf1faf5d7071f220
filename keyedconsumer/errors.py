"""Exceptions raised by the engine."""

from __future__ import annotations

__all__ = [
    "KeyedConsumerError",
    "MessageError",
    "HandlerContractError",
    "HandlerContractViolation",
    "KafkaClientError",
    "CommitError",
    "PublishError",
    "TransactionError",
]


class KeyedConsumerError(Exception):
    """Base class of every error the engine raises."""


class MessageError(KeyedConsumerError):
    """A message failed and nothing handled the failure.

    ``run()`` raises it after the graceful stop. ``topic``, ``partition`` and ``offset`` name the
    message; ``__cause__`` is the handler's exception.
    """

    def __init__(self, topic: str, partition: int, offset: int, cause: BaseException) -> None:
        self.topic = topic
        self.partition = partition
        self.offset = offset
        self.cause = cause
        super().__init__(
            f"unhandled failure of message topic={topic} partition={partition} offset={offset}: "
            f"{type(cause).__name__}: {cause}"
        )


class HandlerContractError(KeyedConsumerError):
    """The handler broke the handler contract: it returned an awaitable that nothing awaits.

    A plain ``def`` handler is called in a worker thread and its result is not awaited, so one that
    returns a coroutine (``handler=lambda m: handle_async(m)`` where ``handle_async`` is
    ``async def``) would never run its body while the message counted as done. This is a
    programming error, not a failure of the message: the engine closes the coroutine (no "never
    awaited" warning), never retries, dead-letters or passes it to ``error_handler``, and stops the
    consumer as for an unhandled failure (offsets committed up to, never past, the message);
    ``run()`` raises this error. The same holds when the composed chain (a middleware, or an
    ``async def`` handler) returns an awaitable. ``topic``, ``partition`` and ``offset`` name the
    message; ``returned`` is the type name of what was returned.
    """

    def __init__(self, topic: str, partition: int, offset: int, returned: str) -> None:
        self.topic = topic
        self.partition = partition
        self.offset = offset
        self.returned = returned
        super().__init__(
            f"the handler of message topic={topic} partition={partition} offset={offset} returned a "
            f"{returned} instead of running it: nothing awaits a handler's result, so its body never ran. "
            "Declare the handler `async def` and await inside it (e.g. `async def handle(msg): await "
            "handle_async(msg)`), or make it a plain function that does the work itself"
        )


class HandlerContractViolation(BaseException):
    """Carries a :class:`HandlerContractError` out through the middleware chain.

    Raised right where the user's handler returned an awaitable (the innermost level, inside every
    middleware). A ``BaseException`` that is not an ``Exception``, like ``KeyboardInterrupt``: the
    built-in middleware (``Retry``, ``DeadLetter``, ``Recover``) and ``except Exception`` blocks let
    it through. A middleware that swallows it anyway changes nothing: the engine recorded the
    violation before raising it, and stops. ``error`` is the :class:`HandlerContractError`.
    """

    def __init__(self, error: HandlerContractError) -> None:
        self.error = error
        super().__init__(str(error))


class KafkaClientError(KeyedConsumerError):
    """An error reported by the Kafka client (librdkafka).

    ``code`` is librdkafka's error name (e.g. ``"_TRANSPORT"``), ``fatal`` is librdkafka's fatal flag.
    """

    def __init__(self, message: str, code: str = "", fatal: bool = False) -> None:
        self.code = code
        self.fatal = fatal
        super().__init__(message)


class CommitError(KafkaClientError):
    """A synchronous offset commit failed for at least one partition (named in the message)."""


class TransactionError(KafkaClientError):
    """A Kafka transaction of ``transactional=True`` failed (librdkafka's transactional API).

    ``abortable``: the transaction was aborted and nothing of it became visible, and the producer
    can run another one (librdkafka ``txn_requires_abort``: e.g. the group rebalanced and refused
    the offsets, KIP-447's generation check, KIP-848's ``STALE_MEMBER_EPOCH``); the engine tries the
    same records and offsets again in a new transaction. ``in_doubt``: the commit was sent but not
    answered within its bound, so its outcome is unknown; it is neither redone nor given up, but
    resumed (``TransactionalProducer.resolve``) until the broker says whether it committed.
    ``retriable``: the broker did not answer in time (a stall, an outage, the transaction
    coordinator moving), as opposed to refusing; the same work may go through once it answers.
    Otherwise it is ``fatal`` (e.g. ``_FENCED``: a newer producer with the same
    ``transactional.id`` started) or the broker refused a record for good (too large, no such topic,
    not authorised), and the consumer stops with this error.
    """

    def __init__(
        self,
        message: str,
        code: str = "",
        fatal: bool = False,
        abortable: bool = False,
        retriable: bool = False,
        in_doubt: bool = False,
    ) -> None:
        super().__init__(message, code=code, fatal=fatal)
        self.abortable = abortable
        self.retriable = retriable
        self.in_doubt = in_doubt


class PublishError(KeyedConsumerError):
    """A record could not be published (refused by the broker, or not acknowledged in time)."""


class HandlerTimeoutError(KeyedConsumerError, TimeoutError):
    """A handler run took longer than ``handler_timeout_s``: an ``async def`` handler was cancelled;
    a plain one (which cannot be interrupted) overran and its run counts as failed. Retry and
    dead-letter middleware handle it like any other failure."""
