"""keyedconsumer: concurrent Kafka consumption, in order per key, storing only finished offsets.

Public names are listed in ``__all__``; everything else is internal.
"""

from importlib import metadata as _metadata
from typing import TYPE_CHECKING, Any

from .app import KeyedApp, Route
from .config import ConsumerConfig
from .consumer import BatchHandler, ErrorHandler, Handler, KeyedConsumer, Middleware, PartitionStatus
from .errors import (
    CommitError,
    HandlerContractError,
    HandlerTimeoutError,
    KafkaClientError,
    KeyedConsumerError,
    MessageError,
    PublishError,
)
from .kafka import BatchPublisher, PublisherFactory, RecordPublisher
from .message import Message, Status
from .outcomes import BatchFailed, PermanentError, RetryLater, SkipMessage
from .sequencing import RedisSequencer, RedisSequencerConfig

if TYPE_CHECKING:
    from .kafka.publisher import Publisher

__all__ = [
    "KeyedApp",
    "Route",
    "KeyedConsumer",
    "Message",
    "Status",
    "ConsumerConfig",
    "Handler",
    "BatchHandler",
    "Middleware",
    "ErrorHandler",
    "KeyedConsumerError",
    "MessageError",
    "HandlerContractError",
    "KafkaClientError",
    "CommitError",
    "HandlerTimeoutError",
    "RetryLater",
    "SkipMessage",
    "PermanentError",
    "BatchFailed",
    "Publisher",
    "RecordPublisher",
    "BatchPublisher",
    "PublisherFactory",
    "PartitionStatus",
    "RedisSequencer",
    "RedisSequencerConfig",
    "PublishError",
]

try:  # one place: the version in pyproject.toml, as installed
    __version__ = _metadata.version("keyedconsumer")
except _metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"


def __getattr__(name: str) -> Any:
    """``Publisher`` is imported on first use (PEP 562): importing the package loads no Kafka library,
    so ``keyedconsumer run --processes N`` forks its children before ``confluent_kafka`` is loaded."""
    if name == "Publisher":
        from .kafka.publisher import Publisher

        return Publisher
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
