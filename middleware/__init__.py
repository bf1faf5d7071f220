"""Middleware built only on the public handler API of :mod:`keyedconsumer`.

Installed as ``keyedconsumer.middleware``. A middleware takes a handler and returns a handler of
the same kind (sync or async); the first one given to ``KeyedConsumer(middlewares=[...])`` is the
outermost. A typical stack, outermost first::

    [Recover(), Tracing(), Logging(), Metrics(), DeadLetter(), Retry(), Typed(Order)]

A middleware may have a ``bind_settings(settings: ConsumerConfig) -> None`` method: ``KeyedConsumer``
calls it on each middleware, outermost first, before composing the chain. ``DeadLetter()`` uses it to
publish with the consumer's brokers and connection properties, so credentials are written once. Just
before it, ``bind_publishers(factory: PublisherFactory | None)`` gives the factory of the consumer's
producers (its client factory's, when that is a ``keyedconsumer.kafka.Connector`` such as the
in-memory broker's; ``None``: the real ``Publisher``): ``DeadLetter`` and ``Audit`` build their
producer with it, so under ``keyedconsumer.testing`` they write into the in-memory broker.

Retry state travels on the :class:`~keyedconsumer.Message` (``attempt``, ``last_error``), and
control flow uses exceptions (:class:`~keyedconsumer.RetryLater`,
:class:`~keyedconsumer.PermanentError`, :class:`~keyedconsumer.SkipMessage`), not flags.

``Typed`` decodes with a :class:`Decoder`: :class:`Json` (pydantic), :class:`Text` (UTF-8 keys), or
the Confluent Schema Registry ones in :mod:`keyedconsumer.middleware.schema_registry` (``Avro``,
``Protobuf``, ``JsonSchema``; extra ``keyedconsumer[schema-registry]``, imported from there only).
"""

from .audit import Audit
from .dead_letter import HEADERS as DEAD_LETTER_HEADERS
from .dead_letter import DeadLetter, DeadLetterError
from .decoders import Decoder, Json, Text, UndecodableError
from .logging import Logging
from .metrics import Metrics
from .recover import Recover
from .retry import Retry, Wait
from .tracing import Tracing
from .typed import DecodeError, Typed

__all__ = [
    "Retry",
    "Wait",
    "DeadLetter",
    "DeadLetterError",
    "DEAD_LETTER_HEADERS",
    "Typed",
    "DecodeError",
    "Decoder",
    "UndecodableError",
    "Json",
    "Text",
    "Logging",
    "Metrics",
    "Recover",
    "Tracing",
    "Audit",
]
