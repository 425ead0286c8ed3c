"""``irisfed``: the command line for operators and users.

Servers come from flags, then the environment (IRISFED_DATABASE_URL,
IRISFED_NATS_URL, IRISFED_CONFIG), then ``.irisfed/connect.json`` that a running
``irisfed up`` writes in the current directory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from services.cli.parse import CONSTRAINT_HELP, parse_attr_flags, parse_constraint, parse_pairs
from services.common.redact import redact
from shared.config import (
    CONFIG_ENV,
    DATABASE_URL_ENV,
    NATS_URL_ENV,
    FederationConfig,
    load_config,
)
from shared.errors import ConfigError, IrisfedError, Unavailable
from shared.subjects import Subjects

CONNECT_FILE = Path(".irisfed") / "connect.json"
TERMINAL = {"succeeded", "failed", "killed", "rejected", "unschedulable"}


# ---------------------------------------------------------------- settings


def _connect_defaults() -> dict[str, str]:
    try:
        return json.loads(CONNECT_FILE.read_text())
    except (OSError, ValueError):
        return {}


def database_url(args: argparse.Namespace) -> str:
    url = getattr(args, "database_url", None) or os.environ.get(DATABASE_URL_ENV) \
        or _connect_defaults().get("database_url")
    if not url:
        raise ConfigError(f"no database: pass --database-url or set {DATABASE_URL_ENV} (or run `irisfed up`)")
    return url


def nats_url(args: argparse.Namespace) -> str:
    url = getattr(args, "nats_url", None) or os.environ.get(NATS_URL_ENV) \
        or _connect_defaults().get("nats_url")
    if not url:
        raise ConfigError(f"no NATS server: pass --nats-url or set {NATS_URL_ENV} (or run `irisfed up`)")
    return url


def federation_config(args: argparse.Namespace, required: bool = True) -> FederationConfig | None:
    path = getattr(args, "config", None) or os.environ.get(CONFIG_ENV) or _connect_defaults().get("config")
    if not path:
        if required:
            raise ConfigError(f"no configuration: pass --config FILE or set {CONFIG_ENV}")
        return None
    return load_config(path)


def subjects(args: argparse.Namespace) -> Subjects:
    if getattr(args, "prefix", None):
        return Subjects(args.prefix)
    config = federation_config(args, required=False)
    return config.subjects if config else Subjects()


# ---------------------------------------------------------------- services


def _service_main(args: argparse.Namespace) -> int:
    from services.common import db, metrics
    from services.common.bus import connect_nats
    from services.common.log import setup_logging
    from services.common.runtime import run_service, start_with_retry

    setup_logging(args.log_level)
    config = federation_config(args)
    metrics.serve(args.metrics_port, args.metrics_host)
    db_url, n_url = database_url(args), nats_url(args)

    async def main(stop: asyncio.Event) -> None:
        timeouts = db.DbTimeouts(command_s=args.db_timeout, acquire_s=args.db_timeout)
        pool = await db.with_retry(lambda: db.connect(db_url, max_size=args.db_pool, timeouts=timeouts),
                                   attempts=30)
        holder: dict[str, Any] = {}

        async def reconnected() -> None:
            if "service" in holder and hasattr(holder["service"], "on_reconnect"):
                await holder["service"].on_reconnect()

        async def attempt() -> tuple[Any, Any]:
            # A fresh NATS connection per attempt: a failed start's subscriptions go with it.
            nc = await connect_nats(n_url, f"irisfed-{args.command}", on_reconnect=reconnected, stop=stop)
            service = _build_service(args, config, pool, nc)
            holder["service"] = service
            try:
                await service.start()
            except BaseException:
                holder.pop("service", None)
                await service.close()
                await nc.close()
                raise
            return service, nc

        nc = None
        try:
            started = await start_with_retry(attempt, stop, args.command)
            if started is None:
                return
            service, nc = started
            await stop.wait()
            await service.close()
        finally:
            if nc is not None:
                await nc.drain() if nc.is_connected else await nc.close()
            await pool.close()

    return run_service(main)


def _build_service(args, config, pool, nc):
    if args.command == "router":
        from services.router.service import Router, RouterSettings

        return Router(config, pool, nc, RouterSettings(writers=args.writers, max_queue=args.max_queue,
                                                       submit_timeout_s=args.submit_timeout))
    if args.command == "tick":
        from services.tick.service import Tick, TickSettings

        return Tick(config, pool, nc, TickSettings(batch_size=args.batch_size))
    from services.peer_agent.service import PeerAgent

    return PeerAgent(config, pool, nc, agent_settings(args, config))


def agent_settings(args: argparse.Namespace, config: FederationConfig):
    from services.peer_agent.service import AgentSettings, BackendSpec

    peer = config.peer(args.peer_id)  # a clear error when the peer is not configured
    attributes = parse_attr_flags(args.attr) if args.attr else {k: list(v) for k, v in peer.attributes.items()}
    slots = args.slots if args.slots is not None else peer.slots
    kind = args.backend or peer.backend
    if slots < 0:
        raise ConfigError("--slots must be >= 0")
    return AgentSettings(
        peer_id=args.peer_id,
        backends=(BackendSpec(name=kind, kind=kind, attributes=attributes, slots=slots),),
        work_root=Path(args.work_dir),
        heartbeat_interval_s=args.heartbeat_interval or config.heartbeat_interval_s,
        heartbeat_ttl_s=args.heartbeat_ttl or config.heartbeat_ttl_s,
        reconcile_interval_s=args.reconcile_interval or config.heartbeat_interval_s,
        simulated_duration_s=args.sim_duration,
    )


def cmd_migrate(args: argparse.Namespace) -> int:
    from services.common import db

    url = database_url(args)
    if args.downgrade:
        db.downgrade(url, args.downgrade)
        print(f"downgraded to {args.downgrade}")
    else:
        db.migrate(url, args.revision)
        print(f"database at schema revision {db.schema_head() if args.revision == 'head' else args.revision}")
    return 0


# ---------------------------------------------------------------- client commands


async def _nats(args: argparse.Namespace, **options):
    """A NATS connection as the URL's user, with that user's own inbox prefix.

    Failures become a clear ``Unavailable`` that names the server but never its password.
    """
    from services.common.bus import connect_client

    url = nats_url(args)

    async def quiet(exc: Exception) -> None:  # nats-py would print a traceback per attempt
        pass

    options.setdefault("max_reconnect_attempts", 1)
    try:
        return await connect_client(url, connect_timeout=3, error_cb=quiet, **options)
    except Exception as exc:  # noqa: BLE001 - any failure to connect is "unreachable" to a user
        raise Unavailable(f"cannot reach NATS at {redact(url)}: {redact(exc)}") from None


async def _request(args: argparse.Namespace, subject: str, body: bytes) -> dict:
    import nats

    nc = await _nats(args)
    try:
        reply = await nc.request(subject, body, timeout=args.timeout)
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
        raise Unavailable(f"no router answered on {subject} within {args.timeout}s") from None
    finally:
        await nc.close()
    return msgspec.json.decode(reply.data)


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, default=str))


def _reply_or_fail(reply: dict) -> dict:
    if "error" in reply:
        err = reply["error"]
        raise _ReplyError(err["code"], err["message"])
    return reply


class _ReplyError(IrisfedError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


def cmd_submit(args: argparse.Namespace) -> int:
    command = args.cmd[1:] if args.cmd and args.cmd[0] == "--" else args.cmd
    if not command:
        raise ConfigError("give the command to run after --, e.g. irisfed submit -- echo hi")
    body: dict[str, Any] = {"command": command}
    if args.id:
        body["job_id"] = args.id
    if args.name:
        body["name"] = args.name
    if args.constraint:
        body["constraints"] = [parse_constraint(c).to_wire() for c in args.constraint]
    if args.pin:
        body["cluster_pin"] = args.pin
    if args.priority is not None:
        body["priority"] = args.priority
    if args.max_retries is not None:
        body["max_retries"] = args.max_retries
    if args.deadline is not None:
        body["deadline_s"] = args.deadline
    if args.env:
        body["env"] = parse_pairs(args.env, "--env")
    if args.label:
        body["labels"] = parse_pairs(args.label, "--label")
    reply = asyncio.run(_request(args, subjects(args).submit, json.dumps(body).encode()))
    if args.json:
        _print_json(reply)
        return 1 if "error" in reply else 0
    reply = _reply_or_fail(reply)
    from services.cli.views import printable

    where = f" on {reply['peer_id']}" if reply["peer_id"] else ""
    dup = " (duplicate: original answer)" if reply["duplicate"] else ""
    print(printable(f"{reply['job_id']}: {reply['disposition']} → {reply['state']}{where}{dup}"))
    if reply["disposition"] == "reject":
        print(printable(f"  {reply['reason']}"))
        return 3
    if args.wait:
        return _watch(args, reply["job_id"])
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    reply = asyncio.run(_request(args, subjects(args).cancel, json.dumps({"job_id": args.job_id}).encode()))
    if args.json:
        _print_json(reply)
        return 1 if "error" in reply else 0
    reply = _reply_or_fail(reply)
    from shared.messages import CANCEL_OUTCOMES

    print(f"{reply['job_id']}: {reply['state']} ({reply['outcome']}: {CANCEL_OUTCOMES.get(reply['outcome'], '')})")
    return 0


async def _with_store(args: argparse.Namespace, action):
    from services.common import db
    from services.common.store import Store

    pool = await db.connect(database_url(args), max_size=2)
    try:
        return await action(Store(pool))
    finally:
        await pool.close()


def cmd_jobs(args: argparse.Namespace) -> int:
    from services.cli import views

    rows = asyncio.run(_with_store(args, lambda s: s.job_list(args.state, args.limit)))
    if args.json:
        _print_json([dict(r) for r in rows])
    else:
        views.console().print(views.jobs_table(rows))
    return 0


def _job_and_history(args: argparse.Namespace):
    """The job row and its changelog, or (None, []) after saying it does not exist."""

    async def fetch(store):
        return await store.job_get(args.job_id), await store.changelog_for_job(args.job_id)

    job, history = asyncio.run(_with_store(args, fetch))
    if job is None:
        print(f"irisfed: no job {args.job_id!r}", file=sys.stderr)
    return job, history


def cmd_job(args: argparse.Namespace) -> int:
    from services.cli import views

    job, history = _job_and_history(args)
    if job is None:
        return 1
    if args.json:
        _print_json({"job": dict(job), "changelog": [dict(r) for r in history]})
    else:
        views.print_job(job, history)
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from services.cli import views

    job, history = _job_and_history(args)
    if job is None:
        return 1
    if args.json:
        _print_json({"job_id": job["job_id"], "state": job["state"], "disposition": job["disposition"],
                     "reason": job["reason"], "explanation": job["explanation"]})
    else:
        views.print_explain(job, history)
    return 0


def cmd_peers(args: argparse.Namespace) -> int:
    from services.cli import views

    rows = asyncio.run(_with_store(args, lambda s: s.peer_heartbeat_list()))
    config = federation_config(args, required=False)
    if args.json:
        _print_json([dict(r) for r in rows])
    else:
        views.console().print(views.peers_table(rows, config))
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    job = asyncio.run(_with_store(args, lambda s: s.job_get(args.job_id)))
    if job is None:
        print(f"irisfed: no job {args.job_id!r}", file=sys.stderr)
        return 1
    if not job["log_dir"]:
        print(f"irisfed: job {args.job_id} has no logs yet (state {job['state']})", file=sys.stderr)
        return 1
    path = Path(job["log_dir"]) / ("stderr" if args.stderr else "stdout")
    try:
        sys.stdout.write(path.read_text(errors="replace"))
    except OSError:
        print(f"irisfed: logs are on peer {job['owner_peer_id']} at {path}", file=sys.stderr)
        return 1
    return 0


def cmd_watch(args: argparse.Namespace) -> int:
    return _watch(args, args.job_id)


def _watch(args: argparse.Namespace, job_id: str) -> int:
    """Follow one job to a terminal state: NATS events, with Postgres as the fallback."""
    from services.cli.views import printable
    from services.common import db
    from services.common.store import Store

    async def follow() -> str:
        pool = await db.connect(database_url(args), max_size=2)
        store = Store(pool)
        nc = await _nats(args, max_reconnect_attempts=60)  # nats-py's default, as before
        changed = asyncio.Event()

        async def on_event(msg) -> None:
            changed.set()

        await nc.subscribe(subjects(args).events(job_id), cb=on_event)
        last = None
        try:
            deadline = time.monotonic() + args.timeout if args.timeout else None
            while True:
                job = await store.job_get(job_id)
                if job is None:
                    raise IrisfedError(f"no job {job_id!r}")
                line = (job["state"], job["owner_peer_id"], job["epoch"])
                if line != last:
                    owner = f" on {job['owner_peer_id']}" if job["owner_peer_id"] else ""
                    code = f" exit={job['exit_code']}" if job["exit_code"] is not None else ""
                    print(printable(f"{time.strftime('%H:%M:%S')} {job_id}: {job['state']}{owner} "
                                    f"epoch={job['epoch']}{code} {job['reason']}"), flush=True)
                    last = line
                if job["state"] in TERMINAL:
                    return job["state"]
                if deadline and time.monotonic() > deadline:
                    raise IrisfedError(f"timed out waiting for {job_id}")
                changed.clear()
                try:
                    await asyncio.wait_for(changed.wait(), timeout=1.0)
                except TimeoutError:
                    pass
        finally:
            await nc.close()
            await pool.close()

    state = asyncio.run(follow())
    return 0 if state == "succeeded" else 1


def cmd_health(args: argparse.Namespace) -> int:
    """Exit 0 when the named service answers (for container health checks)."""

    async def probe() -> bool:
        if args.service == "peer-agent":
            if not args.peer_id:
                raise ConfigError("health peer-agent needs --peer-id")
            rows = await _with_store(args, lambda s: s.peer_heartbeat_list())
            return any(r["peer_id"] == args.peer_id and r["reachable"] for r in rows)
        names = subjects(args)
        subject = names.cancel if args.service == "router" else names.tick_ping
        body = json.dumps({"job_id": "health-probe"}).encode() if args.service == "router" else b""
        import nats

        nc = await _nats(args)
        try:
            await nc.request(subject, body, timeout=args.timeout)
            return True
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
            return False
        finally:
            await nc.close()

    healthy = asyncio.run(probe())
    print(f"{args.service}: {'healthy' if healthy else 'not answering'}")
    return 0 if healthy else 1


def cmd_top(args: argparse.Namespace) -> int:
    """Live view of peers and jobs: redraws on NATS events, polls Postgres as the fallback."""
    from services.cli import views
    from services.common import db
    from services.common.store import Store

    config = federation_config(args, required=False)

    async def run() -> None:
        pool = await db.connect(database_url(args), max_size=2)
        store = Store(pool)
        try:
            if args.once:
                views.console().print(await views.dashboard(store, config, f"[bold]irisfed top[/] {views.now_stamp()}"))
                return
            from rich.live import Live

            changed = asyncio.Event()

            async def on_message(msg) -> None:
                changed.set()

            nc = await _nats(args, max_reconnect_attempts=-1)
            names = subjects(args)
            await nc.subscribe(names.events(), cb=on_message)
            await nc.subscribe(names.heartbeat(), cb=on_message)
            try:
                with Live(refresh_per_second=4, screen=False) as live:
                    while True:
                        changed.clear()
                        live.update(await views.dashboard(store, config, f"[bold]irisfed top[/] {views.now_stamp()}"))
                        try:  # redraw on the next event, but at most 4 times a second
                            await asyncio.wait_for(changed.wait(), timeout=args.interval)
                        except TimeoutError:
                            pass
                        await asyncio.sleep(0.25)
            finally:
                await nc.close()
        finally:
            await pool.close()

    asyncio.run(run())
    return 0


def cmd_chaos(args: argparse.Namespace) -> int:
    """Seeded random faults against a real federation; exit 1 on any violation."""
    from tooling.chaos import ChaosSettings, run_chaos

    settings = ChaosSettings(schedules=args.schedules, seed=args.seed, steps=args.steps,
                             first=args.first, keep=args.keep, restricted_roles=args.restricted_roles)
    roles = "restricted login roles" if settings.restricted_roles else "the owner role"
    print(f"chaos: {settings.schedules} schedules of {settings.steps} steps, seed {settings.seed}, "
          f"services on {roles}", flush=True)
    summary = run_chaos(settings, say=lambda line: print(line, flush=True))
    print(summary.line(), flush=True)
    return 1 if summary.violations else 0


def cmd_nats_auth(args: argparse.Namespace) -> int:
    """Generate NATS users per role for a federation: a server config and a credentials file."""
    from services.common.nats_auth import NatsAuth

    config = federation_config(args)
    auth = NatsAuth.create(config.subject_prefix, config.peer_ids)
    conf, creds = auth.write(Path(args.out))
    print(f"wrote {conf} (nats-server -c {conf}) and {creds} (0600: one password per role)")
    print("roles: " + ", ".join(auth.permissions))
    return 0


def cmd_db_roles(args: argparse.Namespace) -> int:
    """Create login roles per service and peer (row-level security does the rest)."""
    import asyncpg

    from services.common.db_roles import apply_roles, write_passwords

    config = federation_config(args)

    async def run() -> dict[str, str]:
        conn = await asyncpg.connect(database_url(args))
        try:
            return await apply_roles(conn, config)
        finally:
            await conn.close()

    passwords = asyncio.run(run())
    write_passwords(Path(args.out), passwords)
    print(f"created {len(passwords)} login roles; passwords in {args.out} (0600)")
    for role in passwords:
        print(f"  {role}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Benchmarks against baselines measured in the same run; prints a table, writes JSON."""
    from bench.run import run_bench

    known = {"submit", "dispatch", "tick", "heartbeat", "scale"}
    sections = {s.strip() for s in args.sections.split(",")} if args.sections else known
    if sections - known:
        print(f"irisfed: unknown bench section(s): {', '.join(sorted(sections - known))} "
              f"(known: {', '.join(sorted(known))})", file=sys.stderr)
        return 2
    run_bench(args.quick, Path(args.out) if args.out else None, sections)
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    """Write the JSON Schema of every wire message, one file each."""
    from shared.messages import json_schemas

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, schema in json_schemas().items():
        (out / f"{name}.json").write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
    print(f"wrote {len(json_schemas())} schemas to {out}")
    return 0


# ---------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="irisfed", description="Federate batch jobs across clusters.")
    sub = parser.add_subparsers(dest="command", required=True)

    def servers(p: argparse.ArgumentParser, db: bool = True, nats: bool = True) -> None:
        if db:
            p.add_argument("--database-url", help=f"Postgres URL (default ${DATABASE_URL_ENV})")
        if nats:
            p.add_argument("--nats-url", help=f"NATS URL (default ${NATS_URL_ENV})")
        p.add_argument("--config", help=f"federation TOML (default ${CONFIG_ENV})")

    def service(p: argparse.ArgumentParser) -> None:
        servers(p)
        p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
        p.add_argument("--db-pool", type=int, default=10, help="max Postgres connections")
        p.add_argument("--db-timeout", type=float, default=15.0, metavar="SECONDS",
                       help="longest wait for one statement or a free connection (0: none)")
        p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
        p.add_argument("--metrics-host", default="127.0.0.1", help="address for --metrics-port")

    p = sub.add_parser("up", help="start a whole federation on this machine (the embedded default)")
    servers(p)
    p.add_argument("--state-dir", default=".irisfed", help="where data, logs and job output live")
    p.add_argument("--no-live", action="store_true", help="print plain progress lines instead of a live table")

    p = sub.add_parser("router", help="run a router (answers submit and cancel)")
    service(p)
    p.add_argument("--writers", type=int, default=4, help="concurrent group-commit writers")
    p.add_argument("--max-queue", type=int, default=10_000,
                   help="submits waiting for a writer at most; more are answered unavailable")
    p.add_argument("--submit-timeout", type=float, default=2.0, metavar="SECONDS",
                   help="longest a submit waits for a writer, and for its commit, before unavailable")

    p = sub.add_parser("tick", help="run a scheduler tick (places queued jobs)")
    service(p)
    p.add_argument("--batch-size", type=int, default=1000, help="queued jobs claimed per transaction")

    p = sub.add_parser("peer-agent", help="run the agent of one peer cluster")
    service(p)
    p.add_argument("--peer-id", required=True)
    p.add_argument("--attr", action="append", metavar="KEY=VALUE", help="advertised attribute (repeatable)")
    p.add_argument("--slots", type=int, help="jobs this peer runs at once")
    p.add_argument("--backend", choices=["subprocess", "simulated"])
    p.add_argument("--work-dir", default=".irisfed/work", help="per-job working directories")
    p.add_argument("--heartbeat-interval", type=float)
    p.add_argument("--heartbeat-ttl", type=float)
    p.add_argument("--reconcile-interval", type=float)
    p.add_argument("--sim-duration", type=float, default=0.0, help="simulated backend: default job length (s)")

    p = sub.add_parser("migrate", help="upgrade (or downgrade) the database schema")
    p.add_argument("--database-url")
    p.add_argument("--revision", default="head")
    p.add_argument("--downgrade", metavar="REVISION")

    def client(p: argparse.ArgumentParser) -> None:
        servers(p, db=False)
        p.add_argument("--prefix", help="subject prefix (default: from the config, else irisfed)")
        p.add_argument("--timeout", type=float, default=10.0)
        p.add_argument("--json", action="store_true")

    p = sub.add_parser("submit", help="submit a job: irisfed submit [flags] -- COMMAND...")
    client(p)
    p.add_argument("--database-url", help="for --wait")
    p.add_argument("--id", help="job_id (idempotency key)")
    p.add_argument("--name")
    p.add_argument("--constraint", action="append", metavar="EXPR", help=CONSTRAINT_HELP)
    p.add_argument("--pin", help="run only on this peer")
    p.add_argument("--priority", type=int)
    p.add_argument("--max-retries", type=int)
    p.add_argument("--deadline", type=float, metavar="SECONDS", help="max time queued")
    p.add_argument("--env", action="append", metavar="KEY=VALUE")
    p.add_argument("--label", action="append", metavar="KEY=VALUE")
    p.add_argument("--wait", action="store_true", help="follow the job until it ends")
    p.add_argument("cmd", nargs=argparse.REMAINDER)

    p = sub.add_parser("cancel", help="cancel a job")
    client(p)
    p.add_argument("job_id")

    p = sub.add_parser("watch", help="follow one job until it ends")
    client(p)
    p.add_argument("--database-url")
    p.add_argument("job_id")
    p.set_defaults(timeout=0.0)

    p = sub.add_parser("health", help="exit 0 when a service answers (container health checks)")
    client(p)
    p.add_argument("--database-url", help="for peer-agent")
    p.add_argument("service", choices=["router", "tick", "peer-agent"])
    p.add_argument("--peer-id")
    p.set_defaults(timeout=3.0)

    p = sub.add_parser("jobs", help="list jobs (the unified view)")
    servers(p, nats=False)
    p.add_argument("--state")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("job", help="one job and its history")
    servers(p, nats=False)
    p.add_argument("job_id")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("top", help="live view of peers and jobs")
    servers(p)
    p.add_argument("--prefix", help="subject prefix (default: from the config, else irisfed)")
    p.add_argument("--interval", type=float, default=2.0, help="redraw at least this often (s)")
    p.add_argument("--once", action="store_true", help="print one frame and exit")

    p = sub.add_parser("chaos", help="run the chaos suite (seeded faults, then the invariants)")
    p.add_argument("--schedules", type=int, default=20)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--steps", type=int, default=8, help="fault/submit steps per schedule")
    p.add_argument("--first", type=int, default=0, help="first schedule index (to replay one)")
    p.add_argument("--keep", action="store_true", help="keep logs even when nothing failed")
    p.add_argument("--restricted-roles", action="store_true",
                   help="services and agents connect as their own login roles (irisfed db-roles)")

    p = sub.add_parser("nats-auth", help="generate NATS users and subject permissions per role")
    p.add_argument("--config", help=f"federation TOML (default ${CONFIG_ENV})")
    p.add_argument("--out", default="nats-auth", help="folder for nats-auth.conf and nats-credentials.json")

    p = sub.add_parser("db-roles", help="create Postgres login roles per service and peer")
    servers(p, nats=False)
    p.add_argument("--out", default="db-credentials.json", help="where the passwords go (0600)")

    p = sub.add_parser("bench", help="benchmarks with same-run baselines (a table, and JSON with --out)")
    p.add_argument("--quick", action="store_true", help="small sizes, for CI smoke runs")
    p.add_argument("--out", help="write the figures as JSON here")
    p.add_argument("--sections", help="comma-separated: submit,dispatch,tick,heartbeat,scale (default: all)")

    p = sub.add_parser("schema", help="write the JSON Schema of every wire message")
    p.add_argument("--out", default="docs/schema")

    p = sub.add_parser("explain", help="why a job was rejected, is queued, or went where it went")
    servers(p, nats=False)
    p.add_argument("job_id")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("peers", help="peers and their newest advertisement")
    servers(p, nats=False)
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("logs", help="a job's stdout (or --stderr)")
    servers(p, nats=False)
    p.add_argument("job_id")
    p.add_argument("--stderr", action="store_true")
    return parser


COMMANDS = {
    "router": _service_main,
    "tick": _service_main,
    "peer-agent": _service_main,
    "migrate": cmd_migrate,
    "submit": cmd_submit,
    "cancel": cmd_cancel,
    "jobs": cmd_jobs,
    "job": cmd_job,
    "peers": cmd_peers,
    "logs": cmd_logs,
    "watch": cmd_watch,
    "health": cmd_health,
    "explain": cmd_explain,
    "top": cmd_top,
    "schema": cmd_schema,
    "chaos": cmd_chaos,
    "nats-auth": cmd_nats_auth,
    "db-roles": cmd_db_roles,
    "bench": cmd_bench,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "up":
        from services.cli.up import cmd_up

        handler = cmd_up
    else:
        handler = COMMANDS[args.command]
    try:
        return handler(args)
    except _ReplyError as exc:
        print(f"irisfed: {redact(exc.message)}", file=sys.stderr)
        return 1
    except IrisfedError as exc:
        print(f"irisfed: {redact(exc.message)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception:  # noqa: BLE001 - a bug or an odd failure: keep the traceback, not the secrets
        import traceback

        print(redact(traceback.format_exc()), end="", file=sys.stderr)
        return 1
