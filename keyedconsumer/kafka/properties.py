"""librdkafka's own check of a property dict (:func:`check_config`): the settings
(:mod:`keyedconsumer.config`) ask it when they are validated, without the Kafka client."""

from __future__ import annotations

from typing import Any

from confluent_kafka import Consumer, KafkaException

__all__ = ["check_config"]


def check_config(conf: dict[str, Any]) -> None:
    """Check librdkafka properties by building (and at once closing) a consumer; no broker is contacted
    for long and no group is joined.

    Raises
    ------
    ValueError
        librdkafka's own message for an unknown property or an invalid value.
    """
    try:
        Consumer({**conf, "log_level": 0}).close()  # silent: it is only a check
    except KafkaException as exc:
        raise ValueError(exc.args[0].str()) from None
