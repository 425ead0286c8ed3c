"""``irisfed``: the command line for operators and users.

The parts, by what a command does: ``client`` (submit, cancel, watch: requests
over NATS), ``reads`` (jobs, job, explain, peers, users, logs, top: the unified
view in Postgres), ``admin`` (migrate, nats-auth, db-roles, schema, health, chaos,
bench) and ``up``; ``parser`` holds every command's flags, ``connect`` how
commands reach the servers, ``views`` what they draw. ``irisfed router|tick|
peer-agent|web`` run the services through their own start-up
(``irisfed.services.common.startup``), which needs none of this.

``env`` prints a role's shell exports from what ``up`` wrote.

Servers come from flags, then the environment (IRISFED_DATABASE_URL,
IRISFED_NATS_URL, IRISFED_CONFIG), then ``.irisfed/connect.json`` that a running
``irisfed up`` writes in the current directory.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable

from irisfed.cli import admin, client, logs, reads
from irisfed.cli.parser import build_parser
from irisfed.services.common import startup
from irisfed.shared.redact import redact

__all__ = ["COMMANDS", "build_parser", "main"]


def _up(args: argparse.Namespace) -> int:
    from irisfed.cli.up import cmd_up  # imports the harness (tooling/): only for `up`

    return cmd_up(args)


def _env(args: argparse.Namespace) -> int:
    from irisfed.cli.env import cmd_env

    return cmd_env(args)


def _service(args: argparse.Namespace) -> int:
    return startup.run(args.command, args)


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "up": _up,
    "env": _env,
    "router": _service,
    "tick": _service,
    "peer-agent": _service,
    "web": _service,
    "migrate": admin.cmd_migrate,
    "submit": client.cmd_submit,
    "cancel": client.cmd_cancel,
    "jobs": reads.cmd_jobs,
    "job": reads.cmd_job,
    "peers": reads.cmd_peers,
    "users": reads.cmd_users,
    "logs": logs.cmd_logs,
    "outputs": reads.cmd_outputs,
    "watch": client.cmd_watch,
    "health": admin.cmd_health,
    "explain": reads.cmd_explain,
    "top": reads.cmd_top,
    "schema": admin.cmd_schema,
    "buckets": admin.cmd_buckets,
    "chaos": admin.cmd_chaos,
    "nats-auth": admin.cmd_nats_auth,
    "db-roles": admin.cmd_db_roles,
    "compose-secrets": admin.cmd_compose_secrets,
    "bench": admin.cmd_bench,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = COMMANDS[args.command]

    def run() -> int:
        try:
            code = handler(args)
            sys.stdout.flush()  # a reader gone shows here, not in Python's flush at exit
            return code
        except client.ReplyError as exc:  # the router's answer: exit 1
            print(f"irisfed: {redact(exc.message)}", file=sys.stderr)
            return 1
        except BrokenPipeError:
            if not _stdout_closed():
                raise  # some other pipe: a failure like any other
            return STDOUT_CLOSED

    return startup.guarded(run)


# `irisfed jobs | head -3`: the reader went away. Say nothing and end as a program
# killed by SIGPIPE would (128 + 13), which is what the shell expects of a pipeline.
STDOUT_CLOSED = 141


def _stdout_closed() -> bool:
    """Whether standard output's reader is gone (output to it fails with EPIPE); if so,
    point it at /dev/null so that Python's own flush at exit stays quiet too."""
    try:
        sys.stdout.flush()  # what a failed buffered write left fails again
        gone = _no_reader(sys.stdout.fileno())
    except BrokenPipeError:
        gone = True
    except (OSError, ValueError):  # no stdout at all, or not a file
        gone = False
    if gone:
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
    return gone


def _no_reader(fd: int) -> bool:
    """A pipe's (or socket's) writing end with nobody left to read: poll says error or hang-up."""
    import select

    if not hasattr(select, "poll"):
        return True  # cannot tell: a BrokenPipeError reaching here was most likely stdout's
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
