"""`irisfed web`'s settings and flags: their checks, the operator token and
``--refused-retry``. Reading the flags also binds the dashboard's address once, so
the tests that read a whole flag set are in tests/integration/test_listen_addresses.py."""

from __future__ import annotations

import re

import pytest

from irisfed.services.common.startup import service_parser
from irisfed.services.web import flags
from irisfed.services.web.settings import (
    DEFAULT_OPERATOR_TOKEN_FILE,
    MAX_REFUSED_RETRY_S,
    OPERATOR_TOKEN_ENV,
    Secret,
    WebSettings,
    load_operator_token,
)
from irisfed.shared.errors import ConfigError

TOKEN = "operator-token-0123456789abcdef"


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


# ---------------------------------------------------------------- --refused-retry
# How long a refused live viewer is told to wait (the page and its Retry-After header).
# A value that cannot work stops the dashboard before it starts anything, with a message
# naming the setting and its flag; what reaches the page is a plain whole number.

NAMED = re.compile(r"^web setting refused_retry_s \(--refused-retry\) must be ")


@pytest.mark.parametrize("given", ["nan", "NaN", "inf", "-inf", "-1", "0", "-0", "1e308", "86401", "0.5",
                                   "0.0004", "1e-9"])
def test_a_refused_retry_that_cannot_work_is_a_config_error_naming_the_setting(given):
    args = service_parser("web").parse_args([f"--refused-retry={given}"])
    with pytest.raises(ConfigError) as refused:
        flags.settings(args, None)
    assert NAMED.match(refused.value.message), refused.value.message
    assert "got " in refused.value.message


@pytest.mark.parametrize("given", ["30s", "", "0x10", "1_0_", "true", "None", "\u0661e308x"])
def test_a_refused_retry_that_is_no_number_is_refused_by_the_parser(given, capsys):
    with pytest.raises(SystemExit) as refused:
        service_parser("web").parse_args([f"--refused-retry={given}"])
    assert refused.value.code == 2
    assert "--refused-retry" in capsys.readouterr().err


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1, 0, 0.5, MAX_REFUSED_RETRY_S + 0.001, 10**10,
                                   True, False, "30", None, [30], 1j])
def test_refused_retry_values_given_in_code_that_cannot_work_are_refused(value):
    with pytest.raises(ConfigError) as refused:
        WebSettings(refused_retry_s=value)
    assert NAMED.match(refused.value.message), refused.value.message


@pytest.mark.parametrize("value", [1, 1.0, 2.5, 30, MAX_REFUSED_RETRY_S])
def test_the_refused_retry_bounds_themselves_are_accepted(value):
    assert WebSettings(refused_retry_s=value).refused_retry_s == value


# ---------------------------------------------------------------- --port


@pytest.mark.parametrize("port", [-1, 65536, 10**30, True, False, 80.0, "80", None])
def test_web_port_values_that_are_not_a_port_are_refused(port):
    with pytest.raises(ConfigError, match=r"^web setting port \(--port\) must be a port 0\.\.65535, got "):
        WebSettings(port=port)


@pytest.mark.parametrize("port", [0, 1, 65535])
def test_web_port_edges_are_taken(port):
    assert WebSettings(port=port).port == port
