"""Operators' sessions and CSRF tokens, and the headers every response carries. Pure.

- Login: the operator pastes the token; it is compared in constant time and never
  stored: the session cookie holds ``v1.<issued>.<nonce>.<mac>``, an HMAC under a key
  derived from the token (so sessions outlive a restart of the dashboard, and a new
  token ends every session).
- CSRF: a POST of a logged-in operator carries ``HMAC(key, "csrf" + session)`` in a
  form field (checked in constant time). The login form itself, before any session,
  uses a double-submit token: a random value in a cookie and the same in the form.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections import deque
from dataclasses import dataclass

SESSION_COOKIE = "irisfed_session"
LOGIN_CSRF_COOKIE = "irisfed_login_csrf"
CSRF_FIELD = "csrf"
_VERSION = "v1"
_MAX_COOKIE = 200  # a real session cookie is ~90 characters
_CLOCK_SKEW_S = 60

CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
)
SECURITY_HEADERS: tuple[tuple[str, str], ...] = (
    ("content-security-policy", CONTENT_SECURITY_POLICY),
    ("x-content-type-options", "nosniff"),
    ("referrer-policy", "no-referrer"),
    ("x-frame-options", "DENY"),
    ("cross-origin-opener-policy", "same-origin"),
)


def same_secret(given: str, expected: str) -> bool:
    """Whether ``given`` equals ``expected``, in time that does not depend on where they differ."""
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode("utf-8", "surrogatepass"))


def new_nonce() -> str:
    return secrets.token_urlsafe(24)


@dataclass(frozen=True)
class Signer:
    """Signs and checks operator sessions and their CSRF tokens (one per operator token)."""

    key: bytes
    ttl_s: float

    @classmethod
    def for_token(cls, token: str, ttl_s: float) -> Signer:
        key = hmac.new(token.encode(), b"irisfed web session key v1", hashlib.sha256).digest()
        return cls(key, ttl_s)

    def __repr__(self) -> str:
        return f"Signer(ttl_s={self.ttl_s})"

    def _mac(self, purpose: str, value: str) -> str:
        return hmac.new(self.key, f"{purpose}:{value}".encode(), hashlib.sha256).hexdigest()

    def new_session(self, now: float) -> str:
        body = f"{_VERSION}.{int(now)}.{new_nonce()}"
        return f"{body}.{self._mac('session', body)}"

    def session_valid(self, cookie: str | None, now: float) -> bool:
        """Whether ``cookie`` is a session this key signed, issued within the last ``ttl_s``."""
        if not cookie or len(cookie) > _MAX_COOKIE or not cookie.isascii():
            return False
        body, _, mac = cookie.rpartition(".")
        parts = body.split(".")
        if len(parts) != 3 or parts[0] != _VERSION or not parts[1].isdigit():
            return False
        if not same_secret(mac, self._mac("session", body)):
            return False
        issued = int(parts[1])
        return issued - _CLOCK_SKEW_S <= now < issued + self.ttl_s

    def csrf_for(self, session: str) -> str:
        return self._mac("csrf", session)

    def csrf_valid(self, session: str | None, token: str | None) -> bool:
        if not session or not token or len(token) > _MAX_COOKIE:
            return False
        return same_secret(token, self.csrf_for(session))


def login_csrf_valid(cookie: str | None, field: str | None) -> bool:
    """The login form's double-submit check: the form carries the cookie's random value."""
    if not cookie or not field or len(cookie) > _MAX_COOKIE or len(field) > _MAX_COOKIE:
        return False
    return same_secret(field, cookie)


def safe_next(target: str | None, root: str) -> str:
    """Where to go after logging in: a path of this dashboard, else its front page.

    Never another site: ``//evil``, ``/\\evil``, ``https://evil`` and control
    characters all fall back to the front page.
    """
    home = root + "/"
    if not target or len(target) > 2000 or not target.isprintable():
        return home
    if not target.startswith(home) or target.startswith("//") or "\\" in target:
        return home
    return target


class LoginThrottle:
    """At most ``limit`` failed logins per ``window_s`` (all clients together); beyond,
    logins are refused until the window moves on. Sessions already open are unaffected."""

    def __init__(self, limit: int = 20, window_s: float = 60.0) -> None:
        self.limit = limit
        self.window_s = window_s
        self._failures: deque[float] = deque()

    def _prune(self, now: float) -> None:
        while self._failures and self._failures[0] <= now - self.window_s:
            self._failures.popleft()

    def allow(self, now: float) -> bool:
        self._prune(now)
        return len(self._failures) < self.limit

    def failed(self, now: float) -> None:
        self._prune(now)
        self._failures.append(now)
