"""Who may act: the access token, the sessions it opens, and the CSRF check of every action.

Actions are off unless the dashboard was started with them enabled and a token. A person signs in
once with the token (compared with :func:`hmac.compare_digest`); the session lives in an
``HttpOnly``, ``SameSite=Strict`` cookie that holds a random id, never the token. Each action is a
``POST`` that must carry both that cookie and the session's CSRF token in the ``X-CSRF-Token``
header: a page of another site can neither read the CSRF token nor set the header on a
cross-site request. A script may instead send ``Authorization: Bearer <token>``.
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time

__all__ = ["Guard", "COOKIE"]

#: The session cookie's name.
COOKIE = "kc_session"


class Guard:
    """Sessions opened with the access token.

    Parameters
    ----------
    token:
        The access token; ``None``: actions are off and nobody signs in.
    session_s:
        Seconds a session lasts.
    """

    def __init__(self, token: str | None, session_s: float = 8 * 3600.0) -> None:
        self._token = token.encode() if token else None
        self.session_s = session_s
        self._sessions: dict[str, tuple[str, float, str]] = {}  # id -> (CSRF token, monotonic expiry, label)
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self._token is not None

    def token_ok(self, given: str | None) -> bool:
        """True when ``given`` is the access token (constant-time comparison)."""
        if self._token is None or not given:
            return False
        return hmac.compare_digest(given.encode(), self._token)

    def open(self, given: str | None) -> str | None:
        """A new session id when ``given`` is the token, else ``None``."""
        if not self.token_ok(given):
            return None
        sid = secrets.token_urlsafe(32)
        with self._lock:
            now = time.monotonic()
            self._sessions = {k: v for k, v in self._sessions.items() if v[1] > now}
            self._sessions[sid] = (
                secrets.token_urlsafe(32),
                now + self.session_s,
                f"session-{secrets.token_hex(4)}",
            )
        return sid

    def close(self, sid: str | None) -> None:
        if sid:
            with self._lock:
                self._sessions.pop(sid, None)

    def csrf(self, sid: str | None) -> str | None:
        """The CSRF token of a live session, else ``None``."""
        if not sid or self._token is None:
            return None
        with self._lock:
            found = self._sessions.get(sid)
        if found is None or found[1] <= time.monotonic():
            return None
        return found[0]

    def who(self, sid: str | None, authorization: str | None) -> str:
        """Who acts, for the log and the audit trail: the session's label (``session-<8 hex>``, random,
        made at sign-in; it reveals nothing of the session id), ``bearer token``, or ``unknown``."""
        if authorization and authorization.startswith("Bearer "):
            return "bearer token"
        with self._lock:
            found = self._sessions.get(sid or "")
        return found[2] if found is not None else "unknown"

    def allowed(self, sid: str | None, csrf_header: str | None, authorization: str | None) -> bool:
        """May this request act: a live session with its CSRF token in the header, or the token as
        a bearer credential."""
        if self._token is None:
            return False
        if authorization and authorization.startswith("Bearer "):
            return self.token_ok(authorization[len("Bearer ") :])
        expected = self.csrf(sid)
        return expected is not None and bool(csrf_header) and hmac.compare_digest(expected, csrf_header or "")
