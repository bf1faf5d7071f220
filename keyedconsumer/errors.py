"""Exceptions raised by the engine."""

from __future__ import annotations

__all__ = ["KeyedConsumerError", "MessageError", "KafkaClientError", "CommitError", "PublishError"]


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


class PublishError(KeyedConsumerError):
    """A record could not be published (refused by the broker, or not acknowledged in time)."""
