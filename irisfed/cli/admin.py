"""Operating a federation: ``migrate``, ``nats-auth``, ``db-roles``, ``schema``, ``health``,
and the tooling it ships: ``chaos`` and ``bench`` (``up`` is in ``up.py``)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

from irisfed.cli.connect import nats_client, subjects, with_store
from irisfed.services.common.startup import database_url, federation_config, given
from irisfed.shared.errors import ConfigError


def cmd_migrate(args: argparse.Namespace) -> int:
    from alembic.util import CommandError
    from sqlalchemy.exc import DBAPIError

    from irisfed.services.common import db
    from irisfed.shared.redact import redact

    url = database_url(args)
    try:
        if args.downgrade:
            db.downgrade(url, args.downgrade)
            print(f"downgraded to {args.downgrade}")
        else:
            db.migrate(url, args.revision)
            print(f"database at schema revision {db.schema_head() if args.revision == 'head' else args.revision}")
    except (DBAPIError, OSError, CommandError, ValueError) as exc:
        # Alembic wraps the driver's error (unreachable, refused login, bad URL): the
        # innermost one says what happened; a migration's own bug stays a traceback.
        cause = exc
        while getattr(cause, "orig", None) is not None or cause.__cause__ is not None:
            cause = getattr(cause, "orig", None) or cause.__cause__
        print(f"irisfed: cannot migrate {redact(url)}: {redact(str(cause) or type(cause).__name__)}",
              file=sys.stderr)
        return 2
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    """Exit 0 when the named service answers (for container health checks)."""

    if args.service == "web":
        healthy = web_answers(args.url or "http://127.0.0.1:8080", args.timeout)
        print(f"web: {'healthy' if healthy else 'not answering'}")
        return 0 if healthy else 1

    async def probe() -> bool:
        if args.service == "peer-agent":
            if not args.peer_id:
                raise ConfigError("health peer-agent needs --peer-id")
            rows = await with_store(args, lambda s: s.peer_heartbeat_list())
            return any(r.peer_id == args.peer_id and r.reachable for r in rows)
        names = subjects(args)
        subject = names.cancel if args.service == "router" else names.tick_ping
        body = json.dumps({"job_id": "health-probe"}).encode() if args.service == "router" else b""
        import nats

        nc = await nats_client(args)
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


def web_answers(url: str, timeout: float) -> bool:
    """Whether the dashboard at ``url`` answers its ``/healthz`` (HTTP 200)."""
    import urllib.error
    import urllib.request

    target = url.rstrip("/") + "/healthz"
    if not target.startswith(("http://", "https://")):
        raise ConfigError(f"--url must be an http:// or https:// address, got {url!r}")
    try:
        with urllib.request.urlopen(target, timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


@contextlib.contextmanager
def interrupted_by_signals() -> Iterator[None]:
    """SIGTERM (what ``timeout``, CI runners and supervisors send) and SIGINT raise
    KeyboardInterrupt: the run's own ``finally`` blocks stop every server, service and
    job process it started, instead of the interpreter dying and leaving them to init.
    Set here rather than inherited: a shell starting a command in the background (``&``
    without job control) hands it SIGINT ignored, and Python then keeps it ignored."""
    def interrupt(_signum, _frame):
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def cmd_chaos(args: argparse.Namespace) -> int:
    """Seeded random faults against a real federation; exit 1 on any violation."""
    from irisfed.tooling.chaos import ChaosSettings, run_chaos

    settings = ChaosSettings(keep=args.keep, restricted_roles=args.restricted_roles, ha=args.ha,
                             **given(args, schedules="schedules", seed="seed", steps="steps", first="first"))
    roles = "restricted login roles" if settings.restricted_roles else "the owner role"
    where = ", on Patroni and a NATS cluster of three" if settings.ha else ""
    print(f"chaos: {settings.schedules} schedules of {settings.steps} steps, seed {settings.seed}, "
          f"services on {roles}{where}", flush=True)
    with interrupted_by_signals():
        summary = run_chaos(settings, say=lambda line: print(line, flush=True))
    print(summary.line(), flush=True)
    return 1 if summary.violations else 0


def _kept_passwords(path: Path) -> dict[str, str]:
    """Role → password from an earlier ``nats-auth`` run's credentials file (none: {})."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict) or not all(isinstance(v, str) and v for v in data.values()):
        raise ConfigError(f"{path} is not a role → password table: move it away to start afresh")
    return data


def cmd_nats_auth(args: argparse.Namespace) -> int:
    """Generate NATS users per role for a federation: a server config and a credentials file."""
    from irisfed.services.common.nats_auth import NatsAuth

    config = federation_config(args)
    existing = Path(args.out) / "nats-credentials.json"
    kept = _kept_passwords(existing)
    auth = NatsAuth.create(config.subject_prefix, config.peer_ids, config.user_ids, keep=kept)
    conf, creds = auth.write(Path(args.out))
    print(f"wrote {conf} (nats-server -c {conf}) and {creds} (0600: one password per role)")
    if kept:
        print(f"kept the passwords of roles already in {existing}; new roles got new ones "
              f"(reload the server: nats-server --signal reload=PID)")
    print("roles: " + ", ".join(auth.permissions))
    return 0


def cmd_compose_secrets(args: argparse.Namespace) -> int:
    """Write every secret compose.yaml mounts (irisfed/cli/compose_secrets.py)."""
    import os

    from irisfed.cli.compose_secrets import (
        DEFAULT_DATABASE_URL,
        DEFAULT_NATS_URL,
        IMAGE_UID,
        write_secrets,
    )

    config = federation_config(args)
    owner = IMAGE_UID if os.geteuid() == 0 else None
    database = DEFAULT_DATABASE_URL if args.database_url is None else args.database_url
    nats = DEFAULT_NATS_URL if args.nats_url is None else args.nats_url
    written = write_secrets(config, Path(args.out), database=database, nats=nats, owner=owner)
    print(f"secrets for compose.yaml in {args.out} (0600; existing files kept): {len(written)} files")
    if owner is None:
        print(f"  not root: give the containers their files with "
              f"sudo chown {IMAGE_UID} {args.out}/* && sudo chown 0 {args.out}/postgres-password {args.out}/nats.conf")
    return 0


def cmd_db_roles(args: argparse.Namespace) -> int:
    """Create login roles per service and peer (row-level security does the rest)."""
    from irisfed.services.common import db
    from irisfed.services.common.db_roles import apply_roles, write_passwords

    config = federation_config(args)
    given = None
    if args.passwords:
        try:
            given = json.loads(Path(args.passwords).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--passwords {args.passwords}: not a readable JSON object of role → password "
                              f"({exc})") from None
        if not isinstance(given, dict) or not all(isinstance(v, str) and v for v in given.values()):
            raise ConfigError(f"--passwords {args.passwords}: must map each role to a non-empty password")

    async def run() -> dict[str, str]:
        pool = await db.connect(database_url(args), max_size=1)
        try:
            return await apply_roles(pool, config, given)
        finally:
            await pool.close()

    passwords = asyncio.run(run())
    if args.passwords and not set(passwords) - set(given):
        print(f"created {len(passwords)} login roles with the passwords in {args.passwords}")
    else:
        write_passwords(Path(args.out), passwords)
        print(f"created {len(passwords)} login roles; passwords in {args.out} (0600)")
    for role in passwords:
        print(f"  {role}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Benchmarks against baselines measured in the same run; prints a table, writes JSON.
    With --report, runs nothing: renders a results file (and --readme writes it into README)."""
    if args.report is not None:
        return bench_report(args)
    if args.readme is not None or args.all:
        print("irisfed: --readme and --all go with --report FILE (they render a results file)", file=sys.stderr)
        return 2
    if args.compare is not None:
        return bench_compare(args)
    if args.against is not None:
        print("irisfed: --against goes with --compare REV (it names the other side)", file=sys.stderr)
        return 2
    try:
        from irisfed.bench.run import SECTIONS, run_bench
    except ModuleNotFoundError as exc:  # the bench's own dependencies are an extra
        print(f"irisfed: irisfed bench needs {exc.name}, which is not installed: "
              "pip install 'irisfed[bench]'", file=sys.stderr)
        return 2

    known = set(SECTIONS)
    sections = {s.strip() for s in args.sections.split(",")} if args.sections else known
    if sections - known:
        print(f"irisfed: unknown bench section(s): {', '.join(sorted(sections - known))} "
              f"(known: {', '.join(sorted(known))})", file=sys.stderr)
        return 2
    with interrupted_by_signals():
        run_bench(args.quick, Path(args.out) if args.out else None, sections)
    return 0


def bench_compare(args: argparse.Namespace) -> int:
    """``irisfed bench --compare REV``: REV and this tree alternating (bench/compare.py)."""
    if args.rounds < 1:
        print("irisfed: --rounds must be at least 1", file=sys.stderr)
        return 2
    from irisfed.bench.compare import compare

    with interrupted_by_signals():
        compare(args.compare, args.sections or "dispatch", args.rounds, args.quick,
                Path(args.out) if args.out else None,
                [r for r in args.against.split(",") if r] if args.against else None)
    return 0


def bench_report(args: argparse.Namespace) -> int:
    """``irisfed bench --report FILE [--all | --readme README]``: the Markdown of a results file."""
    from irisfed.bench.report import ResultsError, headline, load_results, markdown, with_table

    if args.quick or args.sections or args.out:
        print("irisfed: --report renders a results file and runs nothing: drop --quick, --sections and --out",
              file=sys.stderr)
        return 2
    if args.all and args.readme is not None:
        print("irisfed: --readme writes the README's table; --all is for reading (drop one)", file=sys.stderr)
        return 2
    try:
        doc = load_results(_read(args.report), args.report)
        if args.all:
            print(markdown(doc), end="")
            return 0
        table = headline(doc, args.report, args.readme or "README.md")
        if args.readme is None:
            print(table, end="")
            return 0
        text = _read(args.readme)
        updated = with_table(text, table, args.readme)
        if updated != text:
            _write(args.readme, updated)
    except ResultsError as exc:
        print(f"irisfed: {exc}", file=sys.stderr)
        return 2
    print(f"{args.readme}: performance table from {args.report} ({'updated' if updated != text else 'unchanged'})")
    return 0


def _read(path: str) -> str:
    from irisfed.bench.report import ResultsError

    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ResultsError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None


def _write(path: str, text: str) -> None:
    """Replace ``path``'s contents with ``text`` at once, or leave it as it was: written to a
    temporary file beside it and flushed to disk, given the file's mode (and owner, where
    that is allowed), then renamed over it, so a full disk cannot leave half a README. The
    file a symlink points at is the one replaced; a file that cannot be opened for writing
    (read-only) is refused, though a rename alone would not ask."""
    import contextlib
    import os
    import stat
    import tempfile

    from irisfed.bench.report import ResultsError

    target = os.path.realpath(path)
    tmp = None
    try:
        os.close(os.open(target, os.O_WRONLY | os.O_APPEND))  # writable, as write_text asked; changes nothing
        before = os.stat(target)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=f".{os.path.basename(target)}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as out:
            out.write(text.encode("utf-8"))
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, stat.S_IMODE(before.st_mode))
        if (before.st_uid, before.st_gid) != (os.getuid(), os.getgid()):
            with contextlib.suppress(OSError):
                os.chown(tmp, before.st_uid, before.st_gid)
        os.replace(tmp, target)
        tmp = None
    except OSError as exc:
        raise ResultsError(f"cannot write {path}: {exc.strerror or exc} (left as it was)") from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


BUCKETS_WAIT_S = 30.0


def cmd_buckets(args: argparse.Namespace) -> int:
    """``irisfed buckets``: the object store's buckets (docs/operations.md), created when
    missing, the outputs' retention set from the configuration; safe to run again. It waits
    up to BUCKETS_WAIT_S for JetStream to answer (a cluster started with it elects a meta
    leader first)."""
    from irisfed.services.common.objects import ObjectStoreError, ensure_buckets

    if not 1 <= args.replicas <= 3:
        raise ConfigError(f"--replicas must be 1, 2 or 3 (a bucket's copies), got {args.replicas}")
    config = federation_config(args)

    async def create() -> None:
        nc = await nats_client(args)
        try:
            await ensure_buckets(nc, config.subject_prefix, replicas=args.replicas,
                                 output_ttl_s=config.output_retention_days * 86400, users=config.user_ids,
                                 peers=config.peer_ids, wait_s=BUCKETS_WAIT_S,
                                 log_ttl_s=config.log_retention_days * 86400)
        finally:
            await nc.close()
    try:
        asyncio.run(create())
    except ObjectStoreError as exc:
        print(f"irisfed buckets: {exc}", file=sys.stderr)
        return 1
    users = ", ".join(("default", *config.user_ids))
    print(f"object store buckets ready for {users} ({args.replicas} "
          f"{'replica' if args.replicas == 1 else 'replicas'}, outputs kept {config.output_retention_days:g} days)")
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    """Write the JSON Schema of every wire message, one file each."""
    from irisfed.shared.messages import json_schemas

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, schema in json_schemas().items():
        (out / f"{name}.json").write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
    print(f"wrote {len(json_schemas())} schemas to {out}")
    return 0
