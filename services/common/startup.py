"""Starting a service process: settings from flags, the environment and the config
file; logging and the metrics port; signals; start-up retries while Postgres is away.

``python -m irisfed.services.router`` (``tick``, ``peer_agent``) comes here directly, and
``irisfed router`` (``tick``, ``peer-agent``) through the CLI: a service needs no
CLI module to start. Each service declares its own flags and how they become its
settings in ``services/<name>/flags.py`` (:data:`SERVICES`); the settings
dataclasses hold every default, so a flag left out means "the dataclass default".

Servers come from flags, then the environment (IRISFED_DATABASE_URL,
IRISFED_NATS_URL, IRISFED_CONFIG), then ``.irisfed/connect.json`` that a running
``irisfed up`` writes in the current directory.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from irisfed.shared.config import (
    CONFIG_ENV,
    DATABASE_URL_ENV,
    NATS_URL_ENV,
    FederationConfig,
    load_config,
)
from irisfed.shared.errors import ConfigError, IrisfedError
from irisfed.shared.redact import redact
from irisfed.shared.settings import require_count, require_port, require_seconds

CONNECT_FILE = Path(".irisfed") / "connect.json"
POOL_CLOSE_S = 2.0  # at shutdown: the Postgres pool's graceful close, then its connections are cut
# Postgres's own ceiling on max_connections (MAX_BACKENDS): no server holds a larger pool.
# asyncpg builds one holder per pool slot before connecting: --db-pool 10**30 hung for ever.
DB_POOL_MAX = 262_143

# The command that runs each service → the module with its flags (COMMAND, HELP,
# add_flags(parser), settings(args, config), build(config, pool, nc, settings)). A
# module with CONNECTS_NATS_ITSELF = True is built with nc=None and
# connect_nats=<a coroutine function that connects, retrying>: it starts while NATS is
# away (the dashboard serves Postgres's view meanwhile) and owns its connection.
SERVICES = {
    "router": "irisfed.services.router.flags",
    "tick": "irisfed.services.tick.flags",
    "peer-agent": "irisfed.services.peer_agent.flags",
    "web": "irisfed.services.web.flags",
}

# ---------------------------------------------------------------- where the servers are


def _connect_defaults() -> dict[str, str]:
    try:
        return json.loads(CONNECT_FILE.read_text())
    except (OSError, ValueError):
        return {}


def _server_url(args: argparse.Namespace, key: str, env: str, what: str) -> str:
    """``--KEY``, else ``--KEY-file``, else ``$ENV``, else the file ``$ENV_FILE`` names (the
    container convention: a secret mounted as a file), else ``irisfed up``'s connect file."""
    flag = "--" + key.replace("_", "-")
    url = getattr(args, key, None)
    path = None if url else getattr(args, f"{key}_file", None)
    if not url and not path:
        url = os.environ.get(env)
        path = None if url else os.environ.get(f"{env}_FILE")
    if path:
        try:
            url = Path(path).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read the {what} URL from {path} ({flag}-file or ${env}_FILE): "
                              f"{exc.strerror or exc}") from None
        if not url:
            raise ConfigError(f"{path} ({flag}-file or ${env}_FILE) is empty")
    url = url or _connect_defaults().get(key)
    if not url:
        raise ConfigError(f"no {what}: pass {flag} or set {env} (or run `irisfed up`)")
    return url


def database_url(args: argparse.Namespace) -> str:
    return _server_url(args, "database_url", DATABASE_URL_ENV, "database")


def nats_url(args: argparse.Namespace) -> str:
    return _server_url(args, "nats_url", NATS_URL_ENV, "NATS server")


def federation_config(args: argparse.Namespace, required: bool = True) -> FederationConfig | None:
    path = getattr(args, "config", None) or os.environ.get(CONFIG_ENV) or _connect_defaults().get("config")
    if not path:
        if required:
            raise ConfigError(f"no configuration: pass --config FILE or set {CONFIG_ENV}")
        return None
    return load_config(path)


def add_server_flags(p: argparse.ArgumentParser, db: bool = True, nats: bool = True) -> None:
    if db:
        p.add_argument("--database-url", help=f"Postgres URL (default ${DATABASE_URL_ENV})")
        p.add_argument("--database-url-file", metavar="PATH",
                       help=f"read the Postgres URL from this file (default ${DATABASE_URL_ENV}_FILE)")
    if nats:
        p.add_argument("--nats-url", help=f"NATS URL (default ${NATS_URL_ENV})")
        p.add_argument("--nats-url-file", metavar="PATH",
                       help=f"read the NATS URL from this file (default ${NATS_URL_ENV}_FILE)")
    p.add_argument("--config", help=f"federation TOML (default ${CONFIG_ENV})")


# ---------------------------------------------------------------- every service's process


@dataclass(frozen=True)
class ProcessSettings:
    """What every service process has: logging, its Postgres pool, its metrics port."""

    log_level: str = "info"
    db_pool: int = 10  # max Postgres connections
    db_timeout_s: float = 15.0  # longest wait for one statement or a free connection (0: none)
    metrics_port: int | None = None  # serve Prometheus metrics here (None: not served)
    metrics_host: str = "127.0.0.1"
    event_loop: str = "auto"  # auto (uvloop when installed), uvloop or asyncio

    def __post_init__(self) -> None:
        require_count("service", "db_pool", self.db_pool, flag="--db-pool", most=DB_POOL_MAX)
        require_seconds("service", "db_timeout_s", self.db_timeout_s, positive=False, flag="--db-timeout")
        if self.metrics_port is not None:
            require_port("service", "metrics_port", self.metrics_port, flag="--metrics-port")
        if not self.metrics_host:
            raise ConfigError("service setting metrics_host (--metrics-host) must not be empty")


def add_process_flags(p: argparse.ArgumentParser) -> None:
    """The servers and :class:`ProcessSettings` flags every service takes."""
    add_server_flags(p)
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument("--db-pool", type=int, help="max Postgres connections")
    p.add_argument("--db-timeout", type=float, metavar="SECONDS",
                   help="longest wait for one statement or a free connection (0: none)")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    p.add_argument("--metrics-host", help="address for --metrics-port")
    p.add_argument("--event-loop", help="auto (uvloop when installed; the default), uvloop or asyncio")


def given(args: argparse.Namespace, **fields: str) -> dict[str, Any]:
    """``{field: args.<flag>}`` for each flag given; one left out keeps the dataclass default."""
    return {name: getattr(args, flag) for name, flag in fields.items() if getattr(args, flag, None) is not None}


def process_settings(args: argparse.Namespace) -> ProcessSettings:
    return ProcessSettings(**given(args, log_level="log_level", db_pool="db_pool", db_timeout_s="db_timeout",
                                   metrics_port="metrics_port", metrics_host="metrics_host",
                                   event_loop="event_loop"))


def _flags(command: str):
    return importlib.import_module(SERVICES[command])


def add_service_parser(subparsers, command: str) -> argparse.ArgumentParser:
    """``command``'s sub-parser (for ``irisfed``): the common flags and the service's own."""
    flags = _flags(command)
    p = subparsers.add_parser(command, help=flags.HELP)
    add_process_flags(p)
    flags.add_flags(p)
    return p


def service_parser(command: str) -> argparse.ArgumentParser:
    """The parser of ``python -m irisfed.services.<name>``: what ``irisfed <command>`` takes."""
    flags = _flags(command)
    p = argparse.ArgumentParser(prog=f"irisfed {command}")
    add_process_flags(p)
    flags.add_flags(p)
    return p


# ---------------------------------------------------------------- running one


def run(command: str, args: argparse.Namespace) -> int:
    """Run service ``command`` until SIGTERM/SIGINT; a process exit code.

    Its settings are built (and so checked) before anything connects; then the
    Postgres pool (retried while the server is not up yet), and a NATS connection
    and the service per start attempt, retried while Postgres is away.
    """
    from irisfed.services.common import db, metrics
    from irisfed.services.common.bus import close_quietly, connect_nats
    from irisfed.services.common.log import setup_logging
    from irisfed.services.common.runtime import event_loop_factory, run_service, start_with_retry

    flags = _flags(command)
    process = process_settings(args)
    loop_factory = event_loop_factory(process.event_loop)
    setup_logging(process.log_level)
    config = federation_config(args)
    settings = flags.settings(args, config)
    metrics.serve(process.metrics_port, process.metrics_host)
    db_url, n_url = database_url(args), nats_url(args)

    async def main(stop: asyncio.Event) -> None:
        timeouts = db.DbTimeouts(command_s=process.db_timeout_s, acquire_s=process.db_timeout_s)
        pool = await db.with_retry(lambda: db.connect(db_url, max_size=process.db_pool, timeouts=timeouts),
                                   attempts=30)
        holder: dict[str, Any] = {}

        async def reconnected() -> None:
            if "service" in holder and hasattr(holder["service"], "on_reconnect"):
                await holder["service"].on_reconnect()

        def connect() -> Any:
            return connect_nats(n_url, f"irisfed-{command}", on_reconnect=reconnected, stop=stop)

        async def attempt() -> tuple[Any, Any]:
            if getattr(flags, "CONNECTS_NATS_ITSELF", False):
                nc, service = None, flags.build(config, pool, None, settings, connect_nats=connect)
            else:
                # A fresh NATS connection per attempt: a failed start's subscriptions go with it.
                nc = await connect()
                service = flags.build(config, pool, nc, settings)
            holder["service"] = service
            try:
                await service.start()
            except BaseException:
                holder.pop("service", None)
                await service.close()
                if nc is not None:
                    await close_quietly(nc)  # the start's own failure decides: retried or not
                raise
            return service, nc

        nc = None
        try:
            started = await start_with_retry(attempt, stop, command)
            if started is None:
                return
            service, nc = started
            await stop.wait()
            await service.close()
        finally:
            if nc is not None:
                await nc.drain() if nc.is_connected else await nc.close()
            try:
                # A connection still held (a statement Postgres does not answer) would
                # keep a graceful close waiting for ever: then its connections are cut.
                await asyncio.wait_for(pool.close(), POOL_CLOSE_S)
            except TimeoutError:
                pool.terminate()

    return run_service(main, loop_factory)


def guarded(action: Callable[[], int]) -> int:
    """``action()``'s exit code, with irisfed's errors said in one line (exit 2) and any
    other failure's traceback shown without secrets (exit 1)."""
    try:
        return action()
    except IrisfedError as exc:
        print(f"irisfed: {redact(exc.message)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception:  # noqa: BLE001 - a bug or an odd failure: keep the traceback, not the secrets
        import traceback

        print(redact(traceback.format_exc()), end="", file=sys.stderr)
        return 1


def main(command: str, argv: list[str] | None = None) -> int:
    """``python -m irisfed.services.<name>``: parse ``argv`` as ``irisfed <command>`` would, and run."""
    args = service_parser(command).parse_args(argv)
    return guarded(lambda: run(command, args))
