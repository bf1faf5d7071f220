"""The options of :class:`~keyedconsumer.sequencing.RedisSequencer`, validated (pydantic), and
the Redis URL kept secret."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    Secret,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ..config import SEQUENCER_ENV_PREFIX, hide_secrets, register_environment_variables

__all__ = ["RedisSequencerConfig", "RedisUrl", "redact_url"]


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for reprs, logs and errors)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<invalid url>"
    if parts.query:  # redis-py also reads ?password=... from the query string
        query = re.sub(r"(?i)(^|&)([^=&]*(?:pass|pwd|secret|token)[^=&]*)=[^&]*", r"\1\2=***", parts.query)
        parts = parts._replace(query=query)
    if parts.password is None:
        return urlunsplit(parts)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


#: URL schemes of a Redis Cluster: ``redis+cluster://[user:password@]host:port[,host:port...][/0]``
#: (``rediss+cluster://`` with TLS). The hosts are startup nodes; the client learns the rest of the
#: cluster from them (``CLUSTER SLOTS``) and follows its slot moves and failovers.
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")


class RedisUrl(Secret[str]):
    """A Redis URL that shows only with its password replaced by ``***`` (:func:`redact_url`): in a
    repr, ``str()``, ``model_dump_json()`` and validation errors. ``get_secret_value()`` is the URL
    itself, what redis-py gets."""

    def _display(self) -> str:
        return redact_url(self.get_secret_value())


class RedisSequencerConfig(BaseModel):
    """Options of :class:`RedisSequencer` (a bad value raises ``pydantic.ValidationError``).

    ``lease_ttl_s`` must be above three renewal intervals, so a lease survives two lost renewals;
    ``instance_timeout_s`` too, so an instance survives two lost check-ins. Durations that reach
    Redis as milliseconds are rounded up and at least 1 ms (``PEXPIRE key 0`` would delete the key:
    redis-py #4279); the bounds keep the smallest accepted value meaningful.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, hide_input_in_errors=True)

    url: RedisUrl = Field(repr=False)
    namespace: str = Field(min_length=1, pattern=r"^[^{}:\s]+$")
    lease_ttl_s: float = Field(default=10.0, gt=0.05, le=3600)
    renew_interval_s: float | None = Field(default=None, ge=0.01)
    lease_linger_s: float = Field(default=1.0, ge=0)
    socket_timeout_s: float = Field(default=2.0, gt=0, le=60)
    require_durable: bool = True
    max_parked_per_key: int = Field(default=10_000, ge=1, strict=True)
    max_parked_bytes_per_key: int = Field(default=64 * 1024 * 1024, ge=1, strict=True)
    max_parked_total: int = Field(default=1_000_000, ge=1, strict=True)
    max_parked_bytes_total: int = Field(default=1024 * 1024 * 1024, ge=1, strict=True)
    seen_retention_s: float = Field(default=7 * 24 * 3600.0, ge=1.0)
    quarantine_on_dead_letter: bool = False
    max_drains: int = Field(default=64, ge=1, strict=True)
    instance_timeout_s: float | None = Field(default=None, gt=0)
    scheduler: bool = True

    @field_validator("url")
    @classmethod
    def _url_not_empty(cls, value: RedisUrl) -> RedisUrl:
        if not value.get_secret_value():
            raise ValueError("the Redis URL is empty")
        return value

    @field_validator(
        "lease_ttl_s",
        "renew_interval_s",
        "lease_linger_s",
        "socket_timeout_s",
        "seen_retention_s",
        "instance_timeout_s",
        mode="before",
    )
    @classmethod
    def _no_bool_for_number(cls, value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError("expected a number, got a boolean")
        return value

    @field_validator("require_durable", "quarantine_on_dead_letter", "scheduler", mode="before")
    @classmethod
    def _no_number_for_bool(cls, value: Any) -> Any:
        if not isinstance(value, bool):
            raise ValueError("expected a boolean")
        return value

    # Rules between two options are checked on the later one (its validator sees the earlier ones,
    # in field order), so the error's ``loc`` names a field as every other error does. The derived
    # defaults always keep them: lease_ttl_s > 3 * lease_ttl_s / 4, and three TTLs > three intervals.
    @field_validator("renew_interval_s")
    @classmethod
    def _ttl_above_three_renewals(cls, value: float | None, info: ValidationInfo) -> float | None:
        ttl = info.data.get("lease_ttl_s")
        if value is not None and ttl is not None and not ttl > 3 * value:
            raise ValueError(f"lease_ttl_s ({ttl:g}) must be above three renew_interval_s ({value:g})")
        return value

    @field_validator("instance_timeout_s")
    @classmethod
    def _timeout_above_three_check_ins(cls, value: float | None, info: ValidationInfo) -> float | None:
        if "renew_interval_s" not in info.data:  # it was refused: its own error says why
            return value
        ttl, renew = info.data.get("lease_ttl_s"), info.data["renew_interval_s"]
        if renew is None and ttl is not None:  # the default: a quarter of the TTL
            renew = ttl / 4
        if value is not None and renew is not None and not value > 3 * renew:
            raise ValueError(
                f"instance_timeout_s ({value:g}) must be above three renew_interval_s ({renew:g}): "
                "an instance checks in once per renewal"
            )
        return value

    @model_validator(mode="after")
    def _derived_defaults(self) -> RedisSequencerConfig:
        if self.renew_interval_s is None:
            self.renew_interval_s = self.lease_ttl_s / 4
        if self.instance_timeout_s is None:
            self.instance_timeout_s = 3 * self.lease_ttl_s
        return self

    def seen_retention_for(self, session_timeout_s: float | None, commit_interval_s: float | None) -> float:
        """How long, in seconds, the "already parked" markers of a key live after its parked list
        empties: ``seen_retention_s``, but at least ``lease_ttl_s + session_timeout_s +
        commit_interval_s`` (defaults 45 s and 5 s, librdkafka's), so every value validation accepts
        is safe.

        While the list holds anything its markers do not expire (a message parked, then delivered
        again by Kafka because its offset was not committed yet, is recognised however long its key
        stays parked). After it empties, a parked offset is committed within ``commit_interval_s``
        while its consumer lives; if the consumer dies first, the partition's next owner is assigned
        after ``session_timeout_s`` and reads it again, and takes the key's lease within
        ``lease_ttl_s``: the markers outlive that.
        """
        floor = self.lease_ttl_s + (session_timeout_s or 45.0) + (commit_interval_s or 5.0)
        return max(self.seen_retention_s, floor)

    @model_validator(mode="wrap")
    @classmethod
    def _secrets_hidden(
        cls, data: Any, handler: ModelWrapValidatorHandler[RedisSequencerConfig]
    ) -> RedisSequencerConfig:
        # Defined last, so it runs first (outermost): the URL is wrapped before any validation, and
        # no error's input (errors(), json()) can show it.
        if isinstance(data, dict) and isinstance(data.get("url"), str):
            data = {**data, "url": RedisUrl(data["url"])}
        return handler(hide_secrets(data))


# the sequencer's options as environment variables (KEYEDCONSUMER_SEQUENCER__<OPTION>; the URL and
# the namespace come from their own flags): read by the command line's settings layers
register_environment_variables(
    SEQUENCER_ENV_PREFIX + name.upper()
    for name in RedisSequencerConfig.model_fields
    if name not in ("url", "namespace")
)
