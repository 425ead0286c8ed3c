"""The ``irisfed`` command line: every command and its flags (what each does is in
``client``, ``reads``, ``admin``, ``up``; the services' own flags are theirs)."""

from __future__ import annotations

import argparse
import typing

from irisfed.services.common.startup import SERVICES, add_server_flags, add_service_parser
from irisfed.shared.bands import BANDS, DEFAULT_BAND, DEFAULT_MAX_PREEMPTIONS
from irisfed.shared.config import CONFIG_ENV
from irisfed.shared.messages import DEFAULT_GRACE_S, MAX_GRACE_S
from irisfed.shared.shorthands import CONSTRAINT_HELP


def _client_flags(p: argparse.ArgumentParser) -> None:
    add_server_flags(p, db=False)
    p.add_argument("--prefix", help="subject prefix (default: from the config, else irisfed)")
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--json", action="store_true")


# How reads print (irisfed/cli/views.py renders each).
OUTPUTS = ("table", "plain", "tsv", "json")


def _output_flags(p: argparse.ArgumentParser) -> None:
    """How a read prints: a table on a terminal, plain columns when piped (views.output_mode)."""
    p.add_argument("--output", "-o", choices=OUTPUTS,
                   help="table (a terminal's default), plain (aligned columns: the default when piped), "
                        "tsv, or json")
    p.add_argument("--json", action="store_true", help="same as --output json")
    p.add_argument("--wide", action="store_true", help="show long cells whole instead of cut with …")


def _user_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--user", metavar="ID",
                   help="act as this configured user, on its own subjects (the NATS URL must carry its "
                        "credentials: eval \"$(irisfed env --user ID)\"); default: the URL's user-<ID>, "
                        "else `default`")


def _read_flags(p: argparse.ArgumentParser) -> None:
    """A read's servers: Postgres (an operator's view of everything), else the user's
    own jobs through the router over NATS."""
    add_server_flags(p)
    p.add_argument("--prefix", help="subject prefix, for reads over NATS (default: from the config, else irisfed)")


def _about_one_job(sub, name: str, help: str) -> None:
    p = sub.add_parser(name, help=help)
    _read_flags(p)
    p.add_argument("job_id")
    _output_flags(p)


class _Parser(argparse.ArgumentParser):
    """Every command's parser: a flag given wrongly is one line naming it and what is
    allowed (argparse's own would print the whole usage first), exit 2."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="irisfed", description="Federate batch jobs across clusters.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("up", help="start a whole federation on this machine (the embedded default)")
    add_server_flags(p)
    p.add_argument("--state-dir", default=".irisfed", help="where data, logs and job output live")
    p.add_argument("--no-live", action="store_true", help="print plain progress lines instead of a live table")
    p.add_argument("--ha", action="store_true",
                   help="past one machine, on this one: Postgres as a primary and a synchronous standby under "
                        "Patroni (with etcd; apt-get install patroni etcd-server) and a NATS cluster of three, "
                        "every service on their multi-host URLs (docs/operations.md, \"High availability\")")

    p = sub.add_parser("env", help='shell exports for a role while `irisfed up` runs: eval "$(irisfed env)"')
    p.add_argument("--role", choices=["producer", "operator"], default="producer",
                   help="producer: NATS as the producer user (default); operator: the CLI's NATS user and the database")
    p.add_argument("--user", metavar="ID",
                   help="a configured user's NATS credentials (.irisfed/users/ID.json) instead of --role's")
    p.add_argument("--state-dir", default=".irisfed", help="the state folder of `irisfed up`")

    for command in SERVICES:  # router, tick, peer-agent, web: flags of their own (services/*/flags.py)
        add_service_parser(sub, command)

    p = sub.add_parser("migrate", help="upgrade (or downgrade) the database schema")
    p.add_argument("--database-url")
    p.add_argument("--revision", default="head")
    p.add_argument("--downgrade", metavar="REVISION")

    p = sub.add_parser("submit", help="submit a job: irisfed submit [flags] -- COMMAND...")
    _client_flags(p)
    _user_flag(p)
    p.add_argument("--database-url", help=argparse.SUPPRESS)  # once for --wait, which reads over NATS now
    p.add_argument("--id", help="job_id (idempotency key)")
    p.add_argument("--workspace", metavar="DIR",
                   help="pack DIR (minus .git/ and .irisfedignore's patterns) into the object store; every "
                        "run starts in a fresh copy of it")
    p.add_argument("--name")
    p.add_argument("--constraint", action="append", metavar="EXPR", help=CONSTRAINT_HELP)
    p.add_argument("--prefer", action="append", metavar="EXPR",
                   help="a soft constraint (same form): among peers that can run it now, prefer these")
    p.add_argument("--resource", action="append", metavar="NAME=AMOUNT",
                   help="what the job needs, e.g. cpu=4, memory_mb=16384, gpu=2 (repeatable; default cpu=1)")
    p.add_argument("--pin", help="run only on this peer")
    p.add_argument("--priority", type=int)
    p.add_argument("--max-retries", type=int, metavar="N",
                   help="how many times an infrastructure failure (a lost peer, a launch error) may start the "
                        "job again (0-100, default 2); a non-zero exit is the job's own end")
    p.add_argument("--band", choices=BANDS,
                   help=f"priority band (default {DEFAULT_BAND}): the queue is ordered by band first, and a "
                        "waiting job may preempt running jobs of lower bands (never production); at most "
                        "your user's max_band")
    p.add_argument("--max-preemptions", type=int, metavar="N",
                   help=f"preemptions the job takes before the next one fails it (default {DEFAULT_MAX_PREEMPTIONS})")
    p.add_argument("--replicas", type=int, metavar="N",
                   help="a gang of N tasks of the command (each asking --resource), started together on N "
                        "distinct nodes of one backend, all or nothing (default 1)")
    p.add_argument("--group-by", metavar="KEY",
                   help="a gang's nodes all share one value of this node attribute (a TPU slice, a rack)")
    p.add_argument("--dry-run", action="store_true",
                   help="say what the submit would do now (disposition, where it would be placed or why it "
                        "would wait, which jobs it would preempt) and submit nothing")
    p.add_argument("--deadline", type=float, metavar="SECONDS", help="max time queued")
    p.add_argument("--time-limit", metavar="DURATION",
                   help="stop the run after this much running time (90, 30m, 2h); the job then fails, "
                        "not retried")
    p.add_argument("--grace", metavar="DURATION",
                   help=f"time between SIGTERM and SIGKILL when a run is stopped, to checkpoint (0-{MAX_GRACE_S}s, "
                        f"default {DEFAULT_GRACE_S:g}s)")
    p.add_argument("--after", action="append", metavar="ID",
                   help="wait until your job ID succeeded (repeatable); if it ends otherwise, this job ends "
                        "unschedulable")
    p.add_argument("--after-any", action="append", metavar="ID", help="wait until your job ID ended, however")
    p.add_argument("--after-failed", action="append", metavar="ID",
                   help="wait until your job ID ended other than succeeded (runs only then)")
    p.add_argument("--array", metavar="N[%K]",
                   help="N jobs <job_id>_<i> (1-10000), each told IRISFED_ARRAY_INDEX and IRISFED_ARRAY_SIZE; "
                        "%%K: at most K of them live at once")
    p.add_argument("--retry-failures", type=int, metavar="N",
                   help="run again, up to N times (0-100, default 0), after the command exits non-zero")
    p.add_argument("--env", action="append", metavar="KEY=VALUE")
    p.add_argument("--label", action="append", metavar="KEY=VALUE")
    p.add_argument("--wait", action="store_true",
                   help="follow the job until it ends: its stdout as it runs, its states on stderr; exit with "
                        "its status")
    p.add_argument("cmd", nargs=argparse.REMAINDER)

    p = sub.add_parser("cancel", help="cancel a job")
    _client_flags(p)
    _user_flag(p)
    p.add_argument("--operator", action="store_true",
                   help="cancel any user's job by its stored id (alice:train-1), on the operators' subject "
                        "(needs the operator's NATS credentials)")
    p.add_argument("job_id")

    p = sub.add_parser("watch", help="follow one job until it ends")
    _client_flags(p)
    p.add_argument("--database-url")
    p.add_argument("job_id")
    p.set_defaults(timeout=0.0)

    p = sub.add_parser("health", help="exit 0 when a service answers (container health checks)")
    _client_flags(p)
    p.add_argument("--database-url", help="for peer-agent")
    p.add_argument("service", choices=list(SERVICES))
    p.add_argument("--peer-id")
    p.add_argument("--url", help="for web: the dashboard's address (default http://127.0.0.1:8080)")
    p.set_defaults(timeout=3.0)

    p = sub.add_parser("jobs", help="list jobs (the unified view)")
    _read_flags(p)
    p.add_argument("--state")
    p.add_argument("--user", metavar="ID", help="only this user's jobs")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--expand", action="store_true", help="each job of an array on its own line")
    _output_flags(p)

    _about_one_job(sub, "job", "one job and its history")

    p = sub.add_parser("top", help="live view of peers and jobs")
    add_server_flags(p)
    p.add_argument("--prefix", help="subject prefix (default: from the config, else irisfed)")
    p.add_argument("--interval", type=float, default=2.0, help="redraw at least this often (s)")
    p.add_argument("--once", action="store_true", help="print one frame and exit")

    # Defaults of chaos runs live in ChaosSettings (a flag left out keeps its default).
    p = sub.add_parser("chaos", help="run the chaos suite (seeded faults, then the invariants)")
    p.add_argument("--schedules", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--steps", type=int, help="fault/submit steps per schedule")
    p.add_argument("--first", type=int, help="first schedule index (to replay one)")
    p.add_argument("--keep", action="store_true", help="keep logs even when nothing failed")
    p.add_argument("--restricted-roles", action="store_true",
                   help="services and agents connect as their own login roles (irisfed db-roles)")
    p.add_argument("--ha", action="store_true",
                   help="on Patroni (a primary, a synchronous standby) and a NATS cluster of three, with the "
                        "faults failover_postgres and kill_nats_node (needs patroni and etcd-server)")

    p = sub.add_parser("nats-auth", help="generate NATS users and subject permissions per role")
    p.add_argument("--config", help=f"federation TOML (default ${CONFIG_ENV})")
    p.add_argument("--out", default="nats-auth", help="folder for nats-auth.conf and nats-credentials.json")

    p = sub.add_parser("db-roles", help="create Postgres login roles per service and peer")
    add_server_flags(p, nats=False)
    p.add_argument("--out", default="db-credentials.json", help="where the passwords go (0600)")
    p.add_argument("--passwords", metavar="FILE",
                   help="set these passwords (JSON role → password, e.g. from compose-secrets) instead of new ones")

    p = sub.add_parser("compose-secrets", help="write every secret compose.yaml mounts (0600; keeps existing ones)")
    p.add_argument("--config", help=f"federation TOML (default ${CONFIG_ENV})")
    p.add_argument("--out", default="deploy/secrets", help="the folder compose.yaml reads secrets from")
    p.add_argument("--database-url", default=None,
                   help="the Postgres every service's URL names, without credentials (default "
                        "postgresql://postgres:5432/irisfed; HA: postgresql://pg-1:5432,pg-2:5432/irisfed"
                        "?target_session_attrs=read-write)")
    p.add_argument("--nats-url", default=None,
                   help="the NATS servers, comma-separated, without credentials (default compose.yaml's "
                        "nats://nats-1:4222,nats://nats-2:4222,nats://nats-3:4222)")

    p = sub.add_parser("bench", help="benchmarks with same-run baselines (a table, and JSON with --out)")
    p.add_argument("--quick", action="store_true", help="small sizes, for CI smoke runs")
    p.add_argument("--out", help="write the figures as JSON here")
    p.add_argument("--sections", help="comma-separated: pgqueuer,submit,dispatch,tick,heartbeat,scale,preemption,gangs,workspaces,logs,"
                                      "stops,pipelines,engines,web,ha (default: all; --quick leaves out engines and ha "
                                      "unless named)")
    p.add_argument("--report", metavar="FILE",
                   help="run nothing: print a results file (--out's JSON, e.g. bench/results/*.json) as the "
                        "README's Markdown table")
    p.add_argument("--readme", metavar="FILE",
                   help="with --report: write that table into this Markdown file (README.md, docs/performance.md) "
                        "between its <!-- bench-table:start --> and <!-- bench-table:end --> lines")
    p.add_argument("--all", action="store_true",
                   help="with --report: every figure, with its runs and notes, and the targets")
    p.add_argument("--compare", metavar="REV",
                   help="A/B: build commit REV in a temporary virtualenv and alternate its bench with this "
                        "tree's (--sections, default dispatch), printing medians and ratios")
    p.add_argument("--against", metavar="REV2[,REV3...]",
                   help="with --compare: build and bench commit REV2 in place of this tree (a bisect's step); "
                        "several, comma-separated, run as one series, each against REV")
    p.add_argument("--rounds", type=int, default=3,
                   help="with --compare: alternating rounds (default 3; each side runs once a round)")

    p = sub.add_parser("buckets", help="create the object store's buckets (workspaces and outputs, each user's) "
                                       "and each peer's log stream when missing; needs a NATS user that may "
                                       "create streams (admin)")
    add_server_flags(p, db=False)
    p.add_argument("--replicas", type=int, default=1,
                   help="copies of each bucket: the NATS cluster's nodes, at most 3 (default 1)")

    p = sub.add_parser("schema", help="write the JSON Schema of every wire message")
    p.add_argument("--out", default="docs/schema")

    _about_one_job(sub, "explain", "why a job was rejected, is queued, or went where it went")

    p = sub.add_parser("peers", help="peers and their newest advertisement")
    _read_flags(p)
    _output_flags(p)

    p = sub.add_parser("users", help="users: live usage against quota, weight, fair share, queued and "
                                     "running jobs")
    _read_flags(p)
    _output_flags(p)

    p = sub.add_parser("outputs", help="list a job's outputs (its newest run's), or fetch them with --to DIR")
    add_server_flags(p)
    p.add_argument("--prefix", help="subject prefix (default: from the config, else irisfed)")
    p.add_argument("job_id")
    p.add_argument("--task", type=int, metavar="I", help="a gang's task I only")
    p.add_argument("--epoch", type=int, metavar="N", help="run N's outputs (default: the newest run with any)")
    p.add_argument("--to", metavar="DIR", help="write the stored files under DIR (a gang's under task-<i>/)")
    _output_flags(p)

    p = sub.add_parser("logs", help="a job's stdout (or --stderr), wherever it ran; --follow while it runs")
    add_server_flags(p, db=False)
    p.add_argument("--prefix", help="subject prefix (default: from the config, else irisfed)")
    _user_flag(p)
    p.add_argument("--timeout", type=float, default=10.0, help="seconds one read waits for the router")
    p.add_argument("job_id")
    p.add_argument("--stderr", action="store_true")
    p.add_argument("--task", type=int, default=0, metavar="I", help="a gang's task I (0..replicas-1): its own output")
    p.add_argument("--epoch", type=int, metavar="N", help="run N's output (default: the newest run)")
    p.add_argument("--follow", "-f", action="store_true",
                   help="print each line as the job writes it; exit with the job's status when it ends")
    p.add_argument("--since", metavar="DURATION", help="only output shipped in the last 90s, 30m, 2h, 1d")
    return parser
