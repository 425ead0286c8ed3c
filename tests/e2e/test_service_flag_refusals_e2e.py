"""Hostile process flags given to the real commands stop the service before it connects.

``irisfed router``, ``irisfed web``, ``python -m irisfed.services.tick`` and ``python -m
irisfed.services.peer_agent`` with a ``--db-pool``, ``--db-timeout``, ``--metrics-port``,
``--metrics-host`` or ``--event-loop`` that cannot work, the router's ``--writers`` with
its pool, and web's ``--port`` and ``--host``: exit 2, one ``irisfed: ...`` line on
stderr, no traceback, nothing on stdout, and nothing connected: the database and NATS
URLs point at local listeners that count connections. An operator sees what is wrong
at once, and a service that cannot run never half-starts against the servers. The
checks themselves, in process, are tests/unit/test_startup_checks.py and
tests/integration/test_listen_addresses.py.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from irisfed.services.common.startup import DB_POOL_MAX
from tests.infra.listeners import CountingListener, listeners_fixture  # noqa: F401 - the listeners fixture

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
    (["--db-pool", str(10**30)], POOL + str(10**30)),  # asyncpg would build 10**30 holders before connecting
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
    # What only the metrics server's bind can tell: one line too, not a traceback (exit 1).
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
    # Huge writers with a pool to match: the pool's own ceiling refuses it (the pool would
    # hang the service first; past that it would spawn 10**30 writers).
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
    assert done.stderr.startswith(f"irisfed web: argument {flags[0]}: ")  # one line, no usage dumped first
    assert done.stderr.count("\n") == 1 and done.stderr.endswith("(see irisfed web --help)\n")
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
    # The server itself binds only once Postgres answers: the address is tried before
    # that, so it is refused with Postgres away too (the dashboard would retry the
    # database for ever and never say what is wrong).
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


# ---------------------------------------------------------------- --event-loop

HOSTILE_LOOPS = ["", "UVLOOP", " asyncio", "uv\x1b[31mloop", "asyncio;id", "-x", "é" * 40, "a" * 2000,
                 "asyncio\nuvloop"]


@pytest.mark.parametrize("command", [[IRISFED, "router"], [sys.executable, "-m", "irisfed.services.tick"]],
                         ids=["irisfed-router", "python-m-services.tick"])
@pytest.mark.parametrize("value", HOSTILE_LOOPS, ids=range(len(HOSTILE_LOOPS)))
def test_a_hostile_event_loop_value_stops_the_service_before_it_connects(listeners, command, value):
    db, nats = listeners
    done = subprocess.run(
        [*command, f"--event-loop={value}", "--database-url", f"postgresql://u@127.0.0.1:{db.port}/x",
         "--nats-url", f"nats://127.0.0.1:{nats.port}"],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
        env={k: v for k, v in os.environ.items() if not k.startswith("IRISFED_")})
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("irisfed: event loop (--event-loop) must be one of auto, uvloop, asyncio, got ")
    assert "\x1b" not in done.stderr and "Traceback" not in done.stderr
    assert done.stdout == ""
    assert (db.accepted, nats.accepted) == (0, 0)
