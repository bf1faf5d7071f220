"""``connect``: which redis-py client a Redis URL gives (no server is contacted: clients connect lazily,
except the cluster client, which is only built here from URLs it refuses)."""

from __future__ import annotations

import pytest
import redis

from keyedconsumer.sequencing.store import connect


def test_a_plain_url_gives_a_plain_client() -> None:
    r = connect("redis://:secret@127.0.0.1:6390/2", 1.5)
    kw = r.connection_pool.connection_kwargs
    assert isinstance(r, redis.Redis)
    assert (kw["host"], kw["port"], kw["db"], kw["password"], kw["socket_timeout"]) == (
        "127.0.0.1",
        6390,
        2,
        "secret",
        1.5,
    )


@pytest.mark.parametrize(
    "url, error",
    [
        ("redis+cluster://127.0.0.1:7000/3", "only database 0"),
        ("redis+cluster://127.0.0.1", "host:port"),
        ("redis+cluster://127.0.0.1:7000,:7001", "host:port"),
        ("redis+cluster://127.0.0.1:port", "host:port"),
    ],
)
def test_a_cluster_url_that_names_no_usable_node_or_a_database_is_refused(url: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        connect(url, 1.0)


def test_a_cluster_urls_password_is_hidden_wherever_it_is_shown() -> None:
    from keyedconsumer.sequencing.config import redact_url

    url = "redis+cluster://app:s3cret@127.0.0.1:7000,127.0.0.1:7001/0"
    assert redact_url(url) == "redis+cluster://app:***@127.0.0.1:7000,127.0.0.1:7001/0"
