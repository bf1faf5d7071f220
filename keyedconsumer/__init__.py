"""keyedconsumer: concurrent Kafka consumption, in order per key, storing only finished offsets.

Public names are listed in ``__all__``; everything else is internal.
"""

from .config import ConsumerConfig
from .consumer import ErrorHandler, Handler, KeyedConsumer, Middleware
from .errors import CommitError, KafkaClientError, KeyedConsumerError, MessageError
from .message import Message, Status

__all__ = [
    "KeyedConsumer",
    "Message",
    "Status",
    "ConsumerConfig",
    "Handler",
    "Middleware",
    "ErrorHandler",
    "KeyedConsumerError",
    "MessageError",
    "KafkaClientError",
    "CommitError",
]

__version__ = "0.1.0"
