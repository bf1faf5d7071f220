"""keyedconsumer: concurrent Kafka consumption, in order per key, storing only finished offsets.

Public names are listed in ``__all__``; everything else is internal.
"""

from importlib import metadata as _metadata

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
from .kafka.publisher import Publisher
from .message import Message, Status
from .outcomes import BatchFailed, PermanentError, RetryLater, SkipMessage
from .sequencing import RedisSequencer, RedisSequencerConfig

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
