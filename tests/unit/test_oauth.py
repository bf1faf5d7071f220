"""``oauth_cb`` as every client of the package takes it (issue 25, item 18): tokens checked, failures
retried, the first token fetched before the client is built. Against the real broker:
tests/integration/test_oauth.py and tests/integration/test_oauth_refresh.py."""

from __future__ import annotations

import time
from typing import Any

import pytest

from keyedconsumer.kafka.oauth import TokenCallbackError, TokenSource, with_token_source

pytestmark = pytest.mark.timeout(30)


GOOD = object()


class Provider:
    """A token callback that raises ``fail`` times, then returns ``result`` (default: a token
    valid for an hour); it records the configurations it was called with."""

    def __init__(self, fail: int = 0, result: Any = GOOD) -> None:
        self.fail = fail
        self.result = result
        self.calls: list[Any] = []

    def __call__(self, config: Any) -> Any:
        self.calls.append(config)
        if len(self.calls) <= self.fail:
            raise ConnectionError(f"identity provider down ({len(self.calls)})")
        return ("secret-token", time.time() + 3600) if self.result is GOOD else self.result


@pytest.mark.parametrize(
    "result, words",
    [
        (None, "returned NoneType"),
        ("secret-token", "returned str"),
        (("secret-token",), "returned a tuple of 1"),
        (("", time.time() + 7 * 86400), "an empty token"),
        ((b"secret-token", time.time() + 7 * 86400), "a token of type bytes"),
        (("secret-token", "soon"), "an expiry of type str"),
        (("secret-token", True), "an expiry of type bool"),
        (("secret-token", 3600.0), "expired"),
        (("secret-token", time.time() * 1000), "milliseconds"),
        (("secret-token", time.time() + 7 * 86400, None, {}), "principal or extensions"),  # valid all week
    ],
)
def test_a_token_that_is_not_usable_is_a_clear_error_naming_the_callback_never_the_token(
    result: Any, words: str
) -> None:
    source = TokenSource(Provider(result=result), sleep=lambda s: None)
    with pytest.raises(TokenCallbackError) as info:
        source.fetch("scope=x")
    assert words in str(info.value) and "oauth_cb Provider" in str(info.value), str(info.value)
    assert "secret-token" not in str(info.value) and info.value.code == "_OAUTH_CB"


def test_a_good_token_passes_with_its_principal_and_extensions() -> None:
    exp = time.time() + 60
    assert TokenSource(Provider(result=("t", exp))).fetch(None) == ("t", exp)
    assert TokenSource(Provider(result=["t", int(exp), "me", {"k": "v"}])).fetch(None) == (
        "t",
        float(int(exp)),
        "me",
        {"k": "v"},
    )


def test_a_callback_that_raises_is_called_again_after_a_back_off() -> None:
    slept: list[float] = []
    provider = Provider(fail=2)
    token = TokenSource(provider, sleep=slept.append).fetch("scope=x")
    assert token[0] == "secret-token" and len(provider.calls) == 3 and slept == [0.5, 1.0]
    # one that keeps raising: the last error is the cause
    source = TokenSource(Provider(fail=5), sleep=slept.append)
    with pytest.raises(TokenCallbackError) as info:
        source.fetch("scope=x")
    assert "raised ConnectionError on 3 calls" in str(info.value)
    assert isinstance(info.value.__cause__, ConnectionError)


def test_the_first_token_is_fetched_before_the_client_and_handed_to_librdkafkas_first_call() -> None:
    provider = Provider()
    conf = {"bootstrap.servers": "b:9092", "oauth_cb": provider, "sasl.oauthbearer.config": "scope=x"}
    ready = with_token_source(conf)
    # the caller's properties are not changed; the client's hold a primed source
    assert conf["oauth_cb"] is provider and isinstance(ready["oauth_cb"], TokenSource)
    assert provider.calls == ["scope=x"]
    source = ready["oauth_cb"]
    assert source("scope=x")[0] == "secret-token" and provider.calls == ["scope=x"]  # the primed one
    source("scope=x")  # a refresh asks the callback
    assert provider.calls == ["scope=x", "scope=x"]
    # properties made from them again wrap the user's callback, with a token of their own
    again = with_token_source(ready)
    assert again["oauth_cb"] is not source and again["oauth_cb"].callback is provider
    assert with_token_source({"bootstrap.servers": "b:9092"}) == {"bootstrap.servers": "b:9092"}


def test_a_refresh_retries_without_sleeping_in_librdkafkas_thread() -> None:
    slept: list[float] = []
    provider = Provider(fail=0)
    source = TokenSource(provider, sleep=slept.append)
    source.prime(None)
    provider.fail, provider.calls = 2, []
    assert source(None)[0] == "secret-token"  # the primed token
    assert source(None)[0] == "secret-token" and len(provider.calls) == 3 and slept == []
    provider.fail, provider.calls = 9, []
    with pytest.raises(TokenCallbackError):  # librdkafka asks again in 10 s
        source(None)


def test_a_bad_first_token_fails_before_any_client_is_built() -> None:
    with pytest.raises(TokenCallbackError, match="returned NoneType"):
        with_token_source({"oauth_cb": lambda cfg: None})
