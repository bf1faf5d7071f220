"""The host names the dashboard answers for (Starlette's ``TrustedHostMiddleware``).

A page of another site cannot read the dashboard's answers (the same-origin policy), unless its
name is made to point at the dashboard's address after the page loaded (DNS rebinding): the
browser then sends the attacker's name in the ``Host`` header. So the dashboard answers only
requests whose ``Host`` is one it is meant to be reached by, and ``400 Invalid host header`` to
any other: the loopback names by default, plus those the operator adds (the name of the proxy in
front of it, its own name on the network). An IP address literal is safe to add: a page cannot
send it as ``Host`` from another origin.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable

__all__ = ["LOOPBACK_HOSTS", "ANY_HOST", "allowed_hosts", "host_pattern"]

#: The names the dashboard always answers for: loopback, as ``Host`` carries them.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
#: Allow any host (no check: only behind a proxy that checks the ``Host`` header itself).
ANY_HOST = "*"

_LABEL = r"(?!-)[a-z0-9_-]{1,63}(?<!-)"
_NAME = re.compile(rf"(\*\.)?{_LABEL}(\.{_LABEL})*\.?")


def host_pattern(text: str) -> str:
    """One allowed host as ``TrustedHostMiddleware`` compares it: a DNS name (lower case), ``*.name``
    for every name below ``name``, an IPv4 address, an IPv6 address (in brackets, as ``Host`` carries
    it), or ``*`` (any host).

    Raises
    ------
    ValueError
        Anything else (a port, a URL, a wildcard elsewhere than the first label), naming the value.
    """
    host = text.strip().lower()
    if host == ANY_HOST:
        return host
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        address = None
    if address is not None:
        return f"[{address.compressed}]" if address.version == 6 else address.compressed
    if len(host) > 253 or not _NAME.fullmatch(host):
        raise ValueError(
            f"allowed host {text.strip()[:100]!r}: expected a host name (dash.example.com), *.example.com, "
            "an IP address or *, without scheme or port"
        )
    return host.rstrip(".")


def allowed_hosts(extra: Iterable[str]) -> list[str]:
    """:data:`LOOPBACK_HOSTS` and each of ``extra`` (:func:`host_pattern`), without repeats.

    Raises
    ------
    ValueError
        A host of ``extra`` is not a host name, pattern or address.
    """
    out = list(LOOPBACK_HOSTS)
    for text in extra:
        pattern = host_pattern(text)
        if pattern not in out:
            out.append(pattern)
    return out
