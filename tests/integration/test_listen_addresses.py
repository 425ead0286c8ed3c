"""Addresses a service listens on are tried when it starts.

``irisfed web`` binds its ``--host``/``--port`` once while it reads its flags, and a
service's metrics server binds ``--metrics-host``/``--metrics-port`` at start: an
address that is not this host's, does not resolve, cannot be IDNA-encoded, or is in
use is a one-line ConfigError then, not a traceback, and not an error reported only
once Postgres answers. Every test here binds a real socket (so it is no unit test),
including those that read a whole web flag set."""

from __future__ import annotations

import argparse
import socket

import pytest

from irisfed.cli.parser import build_parser
from irisfed.services.common import metrics
from irisfed.services.common.startup import SERVICES, service_parser
from irisfed.services.web import flags
from irisfed.services.web.service import listen_socket
from irisfed.services.web.settings import OPERATOR_TOKEN_ENV, WebSettings
from irisfed.shared.errors import ConfigError


def _free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        return sock.getsockname()[1]


def test_web_defaults_and_flags(tmp_path, monkeypatch):
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


def test_a_dashboard_port_in_use_is_a_clear_error():
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


def test_the_per_client_share_is_a_flag_and_checked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no .irisfed/ token file here
    monkeypatch.delenv(OPERATOR_TOKEN_ENV, raising=False)
    parser = argparse.ArgumentParser()
    flags.add_flags(parser)
    assert flags.settings(parser.parse_args(["--viewers-per-client", "3"]), None).viewers_per_client == 3
    assert flags.settings(parser.parse_args([]), None).viewers_per_client == WebSettings().viewers_per_client
    with pytest.raises(ConfigError, match="viewers_per_client"):
        WebSettings(viewers_per_client=0)


# ---------------------------------------------------------------- hosts it cannot listen on


@pytest.mark.parametrize("host", [" ", "nonexistent.invalid", "1.2.3.4.5", "192.0.2.1", "a" * 300, "é" * 70],
                         ids=range(6))
def test_metrics_on_a_host_it_cannot_listen_on_is_a_config_error(host):
    with pytest.raises(ConfigError, match=r"^cannot serve metrics on --metrics-host '"):
        metrics.serve(_free_port(), host)


def test_metrics_on_a_port_in_use_is_a_config_error():
    busy = socket.create_server(("127.0.0.1", 0))
    try:
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"^cannot serve metrics on --metrics-host '127\.0\.0\.1' "
                                              rf"--metrics-port {port}: "):
            metrics.serve(port, "127.0.0.1")
    finally:
        busy.close()


@pytest.mark.parametrize("host", ["a" * 300, "é" * 70, "nonexistent.invalid", "192.0.2.1"], ids=range(4))
def test_the_dashboard_socket_on_a_host_it_cannot_listen_on_is_a_config_error(host):
    with pytest.raises(ConfigError, match=r"^cannot listen on "):
        listen_socket(host, 0)
