"""No credential in any message: URL passwords are redacted in logs and CLI errors."""

from __future__ import annotations

import logging

import pytest

from irisfed.services.common.log import EventLogger, _Formatter

SECRET = "s3cret-PW"
URLS = [
    f"postgresql://irisfed:{SECRET}@db.example:5432/irisfed",
    f"postgres://irisfed:{SECRET}@db.example/irisfed?sslmode=require",
    f"nats://operator:{SECRET}@127.0.0.1:4222",
    f"nats://operator:{SECRET}@n1:4222,nats://operator:{SECRET}@n2:4222",
    f"tls://agent-gpu-west:{SECRET}@nats.example:4222",
    f"postgresql://db.example/irisfed?user=irisfed&password={SECRET}",
]


@pytest.mark.parametrize("url", URLS)
def test_redact_hides_passwords_and_keeps_the_rest(url):
    from irisfed.shared.redact import redact

    text = redact(f"cannot reach {url}: refused")
    assert SECRET not in text
    assert text.startswith("cannot reach ") and text.endswith("refused")
    assert "db.example" in text or "n1" in text or "127.0.0.1" in text or "nats.example" in text


def test_redact_hides_nats_tokens_but_not_plain_text():
    from irisfed.shared.redact import redact

    assert SECRET not in redact(f"nats://{SECRET}@127.0.0.1:4222")
    # A Postgres user name alone is no secret; ordinary text is left alone.
    assert redact("postgresql://postgres@127.0.0.1/x") == "postgresql://postgres@127.0.0.1/x"
    for plain in ("job j1: failed at 10:30 (exit 1)", "device_type=[cpu] does not satisfy", "mail a@b.c"):
        assert redact(plain) == plain


@pytest.mark.parametrize("as_json", [True, False])
def test_log_lines_never_carry_a_password(as_json):
    formatter = _Formatter(as_json)
    record = logging.LogRecord("bus", logging.WARNING, __file__, 1, f"retrying {URLS[2]}", None, None)
    record.fields = {"url": URLS[0], "detail": f"connect to {URLS[3]} failed"}
    try:
        raise OSError(f"cannot connect to {URLS[4]}")
    except OSError:
        import sys

        record.exc_info = sys.exc_info()
    line = formatter.format(record)
    assert SECRET not in line
    assert "db.example" in line and "n2:4222" in line and "operator" in line


def test_event_logger_output_is_redacted(caplog):
    caplog.set_level(logging.INFO)
    EventLogger("redact-test").info("nats_connect_retry", error=f"no server at {URLS[2]}")
    # caplog stores raw records; format them as our handler does
    assert caplog.records and all(SECRET not in _Formatter(True).format(r) for r in caplog.records)
