"""`irisfed web`'s settings and flags: defaults, checks, and the operator token."""

from __future__ import annotations

import pytest

from irisfed.cli.parser import build_parser
from irisfed.services.common.startup import SERVICES, service_parser
from irisfed.services.web import flags
from irisfed.services.web.settings import (
    DEFAULT_OPERATOR_TOKEN_FILE,
    OPERATOR_TOKEN_ENV,
    Secret,
    WebSettings,
    load_operator_token,
)
from irisfed.shared.errors import ConfigError

TOKEN = "operator-token-0123456789abcdef"


def test_defaults_and_flags(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no .irisfed/web-operator-token here
    monkeypatch.delenv(OPERATOR_TOKEN_ENV, raising=False)
    assert SERVICES["web"] == "irisfed.services.web.flags"
    args = service_parser("web").parse_args(["--host", "0.0.0.0", "--port", "9000", "--root-path", "/irisfed"])
    settings = flags.settings(args, None)
    assert (settings.host, settings.port, settings.root_path, settings.page_size) == ("0.0.0.0", 9000, "/irisfed", 50)
    assert settings.operator_token is None
    assert settings.refused_retry_s == 30.0
    assert flags.settings(service_parser("web").parse_args(["--refused-retry", "2.5"]), None).refused_retry_s == 2.5
    cli = build_parser().parse_args(["web", "--port", "0"])
    assert cli.command == "web" and cli.port == 0
    health = build_parser().parse_args(["health", "web", "--url", "http://127.0.0.1:9000/irisfed"])
    assert health.service == "web" and health.url.endswith("/irisfed")


@pytest.mark.parametrize("fields", [
    {"port": 70000}, {"port": -1}, {"host": ""}, {"root_path": "irisfed"}, {"root_path": "/irisfed/"},
    {"root_path": "/a b"}, {"root_path": '/x"><script>'}, {"root_path": "//evil"}, {"root_path": "/jobs"},
    {"root_path": "/static/x"}, {"page_size": 0}, {"poll_s": 0}, {"flush_s": float("nan")},
    {"refused_retry_s": 0}, {"refused_retry_s": float("inf")}, {"refused_retry_s": 30 * 86400},
])
def test_settings_that_cannot_work_are_refused(fields):
    with pytest.raises(ConfigError):
        WebSettings(**fields)


def test_the_token_is_never_shown():
    settings = WebSettings(operator_token=Secret(TOKEN))
    assert TOKEN not in repr(settings) and TOKEN not in str(settings.operator_token)
    assert settings.operator_token.reveal() == TOKEN


def test_where_the_operator_token_comes_from(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(OPERATOR_TOKEN_ENV, raising=False)
    assert load_operator_token(None, {}) is None  # view-only

    DEFAULT_OPERATOR_TOKEN_FILE.parent.mkdir()
    DEFAULT_OPERATOR_TOKEN_FILE.write_text("default-file-token-0123456789\n")
    DEFAULT_OPERATOR_TOKEN_FILE.chmod(0o600)
    assert load_operator_token(None, {}).reveal() == "default-file-token-0123456789"
    assert load_operator_token(None, {OPERATOR_TOKEN_ENV: TOKEN}).reveal() == TOKEN  # the environment first

    given = tmp_path / "given"
    given.write_text(" given-file-token-0123456789 ")
    assert load_operator_token(str(given), {OPERATOR_TOKEN_ENV: TOKEN}).reveal() == "given-file-token-0123456789"

    with pytest.raises(ConfigError, match="cannot read"):
        load_operator_token(str(tmp_path / "missing"), {})
    given.write_text("short")
    with pytest.raises(ConfigError, match="at least 16"):
        load_operator_token(str(given), {})
    with pytest.raises(ConfigError, match="at least 16") as refused:
        load_operator_token(None, {OPERATOR_TOKEN_ENV: "tiny\x1b"})
    assert "tiny" not in str(refused.value)  # a refused token is not echoed either


def test_a_port_in_use_is_a_clear_error():
    import socket

    from irisfed.services.web.service import listen_socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        with pytest.raises(ConfigError, match="cannot listen on 127.0.0.1:"):
            listen_socket("127.0.0.1", taken.getsockname()[1])
        free = listen_socket("127.0.0.1", 0)
        assert free.getsockname()[1] > 0
        free.close()
    finally:
        taken.close()
