"""Attack round 17: every service checks its process flags at start (033e934).

Hostile ``--db-pool``, ``--db-timeout``, ``--metrics-port`` and ``--metrics-host`` values
through the real commands (``irisfed router``, ``irisfed web``, ``python -m
services.tick``, ``python -m irisfed.services.peer_agent``): exit 2, one ``irisfed: ...`` line,
no traceback, nothing connected (the URLs point at local listeners that count
connections); the router's ``--writers``/``--db-pool`` rule with huge values; web's
``--port``.

Found and fixed here:

- ``--db-pool 10**30`` (any service) hung for ever, growing: asyncpg builds one holder
  per pool slot before it connects. ``--db-pool`` is now at most 262143, Postgres's own
  ceiling on ``max_connections``; it also bounds ``--writers`` through the router's
  ``--db-pool >= --writers + 2``.
- ``--metrics-host`` that does not resolve, is not this host's, or IDNA cannot encode,
  and a ``--metrics-port`` already in use, were tracebacks (exit 1): now one line, exit 2.
- web's listen socket let a host name IDNA cannot encode (``'a' * 300``) escape as a
  UnicodeError instead of its "cannot listen on" ConfigError.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys

import pytest

from irisfed.services.common import metrics
from irisfed.services.common.startup import (
    DB_POOL_MAX,
    ProcessSettings,
    process_settings,
    service_parser,
)
from irisfed.services.router import flags as router_flags
from irisfed.services.web.service import listen_socket
from irisfed.services.web.settings import WebSettings
from irisfed.shared.errors import ConfigError
from irisfed.shared.settings import require_count
from tests.infra.listeners import CountingListener

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IRISFED = os.path.join(os.path.dirname(sys.executable), "irisfed")
CONFIG = os.path.join(REPO, "deploy", "federation.toml")
POSTGRES_MAX_BACKENDS = 0x3FFFF  # src/include/postmaster/postmaster.h: max_connections' ceiling


def _run(command: list[str], flags: list[str], db: CountingListener, nats: CountingListener, servers: bool = True):
    urls = ["--database-url", f"postgresql://u@127.0.0.1:{db.port}/x",
            "--nats-url", f"nats://127.0.0.1:{nats.port}"] if servers else []
    # A service that gets past its checks would connect (and retry) for ever: the timeout
    # turns that, or a hang before it, into a failure.
    return subprocess.run(
        [*command, "--config", CONFIG, *flags, *urls],
        cwd=REPO, capture_output=True, text=True, timeout=30, check=False,
        env={k: v for k, v in os.environ.items() if not k.startswith("IRISFED_")})


def _refused_in_one_line(done, db: CountingListener, nats: CountingListener, starts: str) -> None:
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(starts), lines[0]
    assert "Traceback" not in done.stderr and "\x1b" not in done.stderr
    assert done.stdout == ""
    assert (db.accepted, nats.accepted) == (0, 0)  # refused before anything connected
    assert (db.accepted, nats.accepted) == (0, 0)


COMMANDS = {
    "irisfed-router": [IRISFED, "router"],
    "python-m-services.tick": [sys.executable, "-m", "irisfed.services.tick"],
    "python-m-services.peer_agent": [sys.executable, "-m", "irisfed.services.peer_agent", "--peer-id", "home"],
    "irisfed-web": [IRISFED, "web"],
}

POOL = "irisfed: service setting db_pool (--db-pool) must be a whole number 1..262143, got "
TIMEOUT = "irisfed: service setting db_timeout_s (--db-timeout) must be a number of seconds >= 0, got "
PORT = "irisfed: service setting metrics_port (--metrics-port) must be a port 1..65535, got "
SERVE = "irisfed: cannot serve metrics on --metrics-host "

# (flags, the line's start); the {busy} port is the Postgres listener's, in use on 127.0.0.1.
HOSTILE = [
    (["--db-pool", "0"], POOL + "0"),
    (["--db-pool", "-1"], POOL + "-1"),
    (["--db-pool", str(10**30)], POOL + str(10**30)),  # hung for ever (asyncpg's holders)
    (["--db-pool", "1000000000"], POOL + "1000000000"),
    (["--db-pool", str(DB_POOL_MAX + 1)], POOL + str(DB_POOL_MAX + 1)),
    (["--db-timeout", "nan"], TIMEOUT + "nan"),
    (["--db-timeout", "inf"], TIMEOUT + "inf"),
    (["--db-timeout", "1e309"], TIMEOUT + "inf"),
    (["--db-timeout=-1"], TIMEOUT + "-1.0"),
    (["--db-timeout=-inf"], TIMEOUT + "-inf"),
    (["--metrics-port", "0"], PORT + "0"),
    (["--metrics-port", "65536"], PORT + "65536"),
    (["--metrics-port=-1"], PORT + "-1"),
    (["--metrics-port", str(10**30)], PORT + str(10**30)),
    (["--metrics-host", ""], "irisfed: service setting metrics_host (--metrics-host) must not be empty"),
    # Were tracebacks (exit 1) from the metrics server's bind:
    (["--metrics-port", "{free}", "--metrics-host", " "], SERVE + "' '"),
    (["--metrics-port", "{free}", "--metrics-host", "nonexistent.invalid"], SERVE + "'nonexistent.invalid'"),
    (["--metrics-port", "{free}", "--metrics-host", "1.2.3.4.5"], SERVE + "'1.2.3.4.5'"),
    (["--metrics-port", "{free}", "--metrics-host", "192.0.2.1"], SERVE + "'192.0.2.1'"),  # not this host's
    (["--metrics-port", "{free}", "--metrics-host", "a" * 300], SERVE + "'aaa"),  # IDNA: label too long
    (["--metrics-port", "{free}", "--metrics-host", "é" * 70], SERVE + "'ééé"),
    (["--metrics-port", "{free}", "--metrics-host", "\x1b[31mhost"], SERVE + "'\\x1b[31mhost'"),
    (["--metrics-port", "{busy}"], SERVE + "'127.0.0.1' --metrics-port "),  # in use
]


def _free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        return sock.getsockname()[1]


def _filled(flags: list[str], db: CountingListener) -> list[str]:
    return [f.replace("{free}", str(_free_port())).replace("{busy}", str(db.port)) for f in flags]


@pytest.mark.parametrize("command", ["irisfed-router", "python-m-services.tick"])
@pytest.mark.parametrize(("flags", "starts"), HOSTILE, ids=range(len(HOSTILE)))
def test_a_hostile_process_flag_stops_the_service_in_one_line_before_it_connects(listeners, command, flags,
                                                                                  starts):
    db, nats = listeners
    _refused_in_one_line(_run(COMMANDS[command], _filled(flags, db), db, nats), db, nats, starts)


@pytest.mark.parametrize("command", ["python-m-services.peer_agent", "irisfed-web"])
@pytest.mark.parametrize(("flags", "starts"), [HOSTILE[2], HOSTILE[7], HOSTILE[13], HOSTILE[16], HOSTILE[19],
                                               HOSTILE[22]], ids=range(6))
def test_the_agent_and_the_dashboard_check_the_same_flags(listeners, command, flags, starts):
    db, nats = listeners
    _refused_in_one_line(_run(COMMANDS[command], _filled(flags, db), db, nats), db, nats, starts)


@pytest.mark.parametrize(("flags", "starts"), [
    # Huge writers with a pool to match: the pool's own ceiling refuses it (it hung, the
    # pool first; past that it would have spawned 10**30 writers).
    (["--writers", str(10**30), "--db-pool", str(10**30 + 2)], POOL + str(10**30 + 2)),
    (["--writers", str(10**30), "--db-pool", str(10**30 + 1)], POOL + str(10**30 + 1)),
    # At the ceiling the writers rule still applies, one short of it.
    (["--writers", str(DB_POOL_MAX - 1), "--db-pool", str(DB_POOL_MAX)],
     f"irisfed: router --writers {DB_POOL_MAX - 1} needs --db-pool of at least {DB_POOL_MAX + 1} "),
    (["--writers", "16"], "irisfed: router --writers 16 needs --db-pool of at least 18 "),
    (["--writers", "0", "--db-pool", "1"], "irisfed: router setting writers (--writers) must be a whole number >= 1"),
    (["--writers=-5"], "irisfed: router setting writers (--writers) must be a whole number >= 1, got -5"),
], ids=range(6))
def test_the_routers_writers_and_pool_are_refused_together_before_it_connects(listeners, flags, starts):
    db, nats = listeners
    _refused_in_one_line(_run(COMMANDS["irisfed-router"], flags, db, nats), db, nats, starts)


def test_a_bad_flag_is_said_before_the_missing_servers():
    done = _run(COMMANDS["python-m-services.tick"], ["--db-pool", "0"], None, None, servers=False)
    assert done.returncode == 2
    assert done.stderr == "irisfed: service setting db_pool (--db-pool) must be a whole number 1..262143, got 0\n"


@pytest.mark.parametrize("flags", [["--db-pool", "1.5"], ["--db-pool", "0x10"], ["--db-pool", ""],
                                   ["--db-pool", "1" * 5000], ["--metrics-port", "1e3"], ["--db-timeout", "ten"],
                                   ["--port", "0x50"], ["--port", "80.0"]],
                         ids=range(8))
def test_values_argparse_refuses_are_a_usage_error_not_a_traceback(listeners, flags):
    db, nats = listeners
    done = _run(COMMANDS["irisfed-web"], flags, db, nats)
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1].startswith(f"irisfed web: error: argument {flags[0]}: ")
    assert "Traceback" not in done.stderr
    assert (db.accepted, nats.accepted) == (0, 0)


@pytest.mark.parametrize(("port", "shown"), [("-1", "-1"), ("65536", "65536"), (str(10**30), str(10**30))])
def test_web_port_out_of_range_stops_the_dashboard_before_it_connects(listeners, port, shown):
    db, nats = listeners
    done = _run(COMMANDS["irisfed-web"], [f"--port={port}"], db, nats)
    _refused_in_one_line(done, db, nats, f"irisfed: web setting port (--port) must be a port 0..65535, got {shown}")


@pytest.mark.parametrize(("flags", "starts"), [
    (["--host", "192.0.2.1"], "irisfed: cannot listen on 192.0.2.1:"),  # not this host's
    (["--host", "nonexistent.invalid"], "irisfed: cannot listen on nonexistent.invalid:"),
    (["--host", "a" * 300], "irisfed: cannot listen on aaa"),  # IDNA: label too long
    (["--port", "{busy}"], "irisfed: cannot listen on 127.0.0.1:"),
], ids=["not-this-hosts", "unresolvable", "idna", "port-in-use"])
@pytest.mark.parametrize("servers", [True, False], ids=["servers-listening", "no-servers"])
def test_a_dashboard_address_that_cannot_be_bound_is_refused_before_it_connects(listeners, flags, starts, servers):
    # The server binds once Postgres answers: the address used to be refused after
    # connecting, and with Postgres away never (the dashboard retried the database).
    db, nats = listeners
    if servers:
        done = _run(COMMANDS["irisfed-web"], _filled(flags, db), db, nats)
    else:
        gone = CountingListener()
        gone.close()  # a port nothing listens on any more
        done = _run(COMMANDS["irisfed-web"], _filled(flags, db) + [
            "--database-url", f"postgresql://u@127.0.0.1:{gone.port}/x",
            "--nats-url", f"nats://127.0.0.1:{gone.port}"], db, nats, servers=False)
    _refused_in_one_line(done, db, nats, starts)


# ---------------------------------------------------------------- in-process


def test_the_pool_ceiling_is_postgres_own():
    assert DB_POOL_MAX == POSTGRES_MAX_BACKENDS
    assert ProcessSettings(db_pool=DB_POOL_MAX).db_pool == DB_POOL_MAX
    assert ProcessSettings(db_pool=1).db_pool == 1
    for bad in (DB_POOL_MAX + 1, 10**30, 0, -1, True, 10.0, "10", None):
        with pytest.raises(ConfigError, match=r"^service setting db_pool \(--db-pool\) must be a whole number "
                                              r"1\.\.262143, got "):
            ProcessSettings(db_pool=bad)


def test_require_count_without_a_ceiling_says_what_it_said():
    require_count("x", "n", 10**30)  # no ceiling: any whole number >= least
    with pytest.raises(ConfigError, match=r"^x setting n \(--n\) must be a whole number >= 1, got 0$"):
        require_count("x", "n", 0, flag="--n")
    with pytest.raises(ConfigError, match=r"^x setting n must be a whole number 2\.\.5, got 6$"):
        require_count("x", "n", 6, least=2, most=5)
    require_count("x", "n", 5, least=2, most=5)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), -1e-9, True, "15", None])
def test_db_timeout_that_cannot_work_is_refused(value):
    with pytest.raises(ConfigError, match=r"^service setting db_timeout_s \(--db-timeout\) must be a number"):
        ProcessSettings(db_timeout_s=value)


@pytest.mark.parametrize("value", [0, 0.0, -0.0, 1e300, 15])
def test_db_timeout_edges_that_work_are_taken(value):
    assert ProcessSettings(db_timeout_s=value).db_timeout_s == value


def _router_args(*argv: str) -> argparse.Namespace:
    return service_parser("router").parse_args(list(argv))


def test_huge_writers_with_a_pool_to_match_are_stopped_by_the_pool_ceiling():
    args = _router_args("--writers", str(10**30), "--db-pool", str(10**30 + 2))
    assert router_flags.settings(args, None).writers == 10**30  # the writers rule alone lets it by
    with pytest.raises(ConfigError, match="db_pool"):
        process_settings(args)  # and run() checks this first
    top = _router_args("--writers", str(DB_POOL_MAX - 2), "--db-pool", str(DB_POOL_MAX))
    assert process_settings(top).db_pool == DB_POOL_MAX
    assert router_flags.settings(top, None).writers == DB_POOL_MAX - 2


def test_no_environment_variable_feeds_the_process_flags(monkeypatch):
    for name in ("IRISFED_DB_POOL", "IRISFED_DB_TIMEOUT", "IRISFED_METRICS_PORT", "IRISFED_METRICS_HOST",
                 "IRISFED_WRITERS"):
        monkeypatch.setenv(name, "0")
    args = _router_args()
    assert process_settings(args) == ProcessSettings()
    assert router_flags.settings(args, None).writers == 4


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


def test_no_metrics_port_serves_nothing():
    metrics.serve(None, "")  # nothing to bind: not even the host is looked at


@pytest.mark.parametrize("host", ["a" * 300, "é" * 70, "nonexistent.invalid", "192.0.2.1"], ids=range(4))
def test_the_dashboard_socket_on_a_host_it_cannot_listen_on_is_a_config_error(host):
    with pytest.raises(ConfigError, match=r"^cannot listen on "):
        listen_socket(host, 0)


@pytest.mark.parametrize("port", [-1, 65536, 10**30, True, False, 80.0, "80", None])
def test_web_port_values_that_are_not_a_port_are_refused(port):
    with pytest.raises(ConfigError, match=r"^web setting port \(--port\) must be a port 0\.\.65535, got "):
        WebSettings(port=port)


@pytest.mark.parametrize("port", [0, 1, 65535])
def test_web_port_edges_are_taken(port):
    assert WebSettings(port=port).port == port
