"""Operators' sessions, CSRF tokens, where a login may lead, and the headers."""

from __future__ import annotations

import pytest

from irisfed.services.web.security import (
    CONTENT_SECURITY_POLICY,
    LoginThrottle,
    Signer,
    login_csrf_valid,
    safe_next,
    same_secret,
)

TOKEN = "operator-token-0123456789abcdef"
NOW = 1_800_000_000.0


def test_a_session_is_signed_never_the_token_and_expires():
    signer = Signer.for_token(TOKEN, ttl_s=3600)
    session = signer.new_session(NOW)
    assert TOKEN not in session and len(session) < 200
    assert signer.session_valid(session, NOW)
    assert signer.session_valid(session, NOW + 3599)
    assert not signer.session_valid(session, NOW + 3600)
    assert not signer.session_valid(session, NOW - 3600)  # from the future
    assert signer.new_session(NOW) != session
    assert TOKEN not in repr(signer) and str(signer.key) not in repr(signer)


@pytest.mark.parametrize("forged", [
    None, "", TOKEN, "v1.1800000000.nonce.mac", "v2.1800000000.nonce.0", "v1.abc.nonce.0", "v1..x.y",
    "x" * 5000, "v1.1800000000.n\u00e9.m", "<script>alert(1)</script>",
])
def test_a_forged_session_is_refused(forged):
    assert not Signer.for_token(TOKEN, 3600).session_valid(forged, NOW)


def test_a_session_is_tied_to_its_token():
    session = Signer.for_token(TOKEN, 3600).new_session(NOW)
    assert not Signer.for_token(TOKEN + "x", 3600).session_valid(session, NOW)
    body, _, mac = session.rpartition(".")
    assert not Signer.for_token(TOKEN, 3600).session_valid(body + "." + mac[:-1] + ("0" if mac[-1] != "0" else "1"),
                                                            NOW)


def test_csrf_tokens_belong_to_one_session():
    signer = Signer.for_token(TOKEN, 3600)
    one, two = signer.new_session(NOW), signer.new_session(NOW)
    token = signer.csrf_for(one)
    assert signer.csrf_valid(one, token)
    assert not signer.csrf_valid(two, token)
    assert not signer.csrf_valid(one, None) and not signer.csrf_valid(None, token)
    assert not signer.csrf_valid(one, token.upper()) and not signer.csrf_valid(one, "x" * 1000)


def test_the_login_form_is_double_submitted():
    assert login_csrf_valid("abc", "abc")
    assert not login_csrf_valid("abc", "abd") and not login_csrf_valid(None, "abc") and not login_csrf_valid("", "")
    assert not login_csrf_valid("a" * 300, "a" * 300)


@pytest.mark.parametrize("target, root, lands", [
    ("/jobs/j1", "", "/jobs/j1"),
    ("/fed/jobs?state=queued", "/fed", "/fed/jobs?state=queued"),
    ("/jobs", "/fed", "/fed/"),  # outside the root
    ("//evil.example/x", "", "/"),
    ("/\\evil.example", "", "/"),
    ("https://evil.example/", "", "/"),
    ("javascript:alert(1)", "", "/"),
    ("/jobs\r\nSet-Cookie: x=y", "", "/"),
    (None, "/fed", "/fed/"),
    ("/" + "x" * 3000, "", "/"),
])
def test_after_login_only_pages_of_this_dashboard(target, root, lands):
    assert safe_next(target, root) == lands


def test_failed_logins_are_throttled():
    throttle = LoginThrottle(limit=3, window_s=60)
    for i in range(3):
        assert throttle.allow(NOW + i)
        throttle.failed(NOW + i)
    assert not throttle.allow(NOW + 10)
    assert throttle.allow(NOW + 61)  # the first failure left the window


def test_same_secret_and_the_policy():
    assert same_secret("abc", "abc") and not same_secret("abc", "abd") and not same_secret("\ud800", "x")
    assert "script-src 'self'" in CONTENT_SECURITY_POLICY and "unsafe" not in CONTENT_SECURITY_POLICY
    assert "frame-ancestors 'none'" in CONTENT_SECURITY_POLICY
