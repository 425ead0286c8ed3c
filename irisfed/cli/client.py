"""What a user asks of the federation over NATS: ``submit``, ``cancel``, ``watch``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from typing import Any

import msgspec

from irisfed.cli.connect import (
    cli_user,
    federation_config,
    nats_client,
    print_json,
    scoped_job_id,
    subjects,
    with_store,
)
from irisfed.shared.config import DEFAULT_MAX_WORKSPACE_MB
from irisfed.shared.errors import ConfigError, IrisfedError, Unavailable
from irisfed.shared.lifecycle import TERMINAL_STATES, JobState
from irisfed.shared.resources import ResourceError, normalize_request, parse_amount_flags
from irisfed.shared.shorthands import parse_array, parse_constraint, parse_duration, parse_pairs
from irisfed.shared.users import split_job_id


class ReplyError(IrisfedError):
    """The router answered with an error (exit 1, where our own errors exit 2)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


async def _request(args: argparse.Namespace, subject: str, body: bytes) -> dict:
    import nats

    nc = await nats_client(args)
    try:
        reply = await nc.request(subject, body, timeout=args.timeout)
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
        raise Unavailable(f"no router answered on {subject} within {args.timeout}s") from None
    finally:
        await nc.close()
    return msgspec.json.decode(reply.data)


async def _store_workspace(args: argparse.Namespace) -> dict:
    """Pack and store ``--workspace DIR``: the submit's workspace field."""
    from irisfed.transfer import store_workspace

    config = federation_config(args, required=False)
    max_mb = config.max_workspace_mb if config else DEFAULT_MAX_WORKSPACE_MB
    nc = await nats_client(args)
    try:
        workspace, sent = await store_workspace(nc, subjects(args).prefix, args.workspace, max_mb,
                                                cli_user(args))
    finally:
        await nc.close()
    if not args.json:
        print(f"workspace {workspace.digest[:19]}… {workspace.size / 2**20:,.1f} MiB "
              f"{'stored' if sent else 'already stored'}", file=sys.stderr)
    return {"digest": workspace.digest, "size": workspace.size}


def _reply_or_fail(reply: dict) -> dict:
    if "error" in reply:
        err = reply["error"]
        raise ReplyError(err["code"], err["message"])
    return reply


def _given(args: argparse.Namespace, **fields: str) -> dict[str, Any]:
    """The submit's fields whose flags were given: ``fields`` maps each field to its
    flag's attribute in ``args``, left out when None (not given)."""
    return {field: getattr(args, flag) for field, flag in fields.items() if getattr(args, flag) is not None}


def cmd_submit(args: argparse.Namespace) -> int:
    command = args.cmd[1:] if args.cmd and args.cmd[0] == "--" else args.cmd
    if not command:
        raise ConfigError("give the command to run after --, e.g. irisfed submit -- echo hi")
    if args.dry_run and args.wait:
        raise ConfigError("--wait follows a submitted job, and --dry-run submits nothing: give one of them")
    body: dict[str, Any] = {"command": command}
    if args.id:
        body["job_id"] = args.id
    if args.name:
        body["name"] = args.name
    if args.constraint:
        body["constraints"] = [parse_constraint(c).to_wire() for c in args.constraint]
    if args.prefer:
        body["preferences"] = [parse_constraint(c).to_wire() for c in args.prefer]
    if args.resource:
        try:
            body["resources"] = parse_amount_flags(args.resource, "--resource")
            normalize_request(body["resources"], "--resource")  # the router's own check, said before sending
        except ResourceError as exc:
            raise ConfigError(str(exc)) from None
    if args.pin:
        body["cluster_pin"] = args.pin
    body.update(_given(args, priority="priority", max_retries="max_retries", deadline_s="deadline"))
    if args.time_limit is not None:
        body["time_limit_s"] = parse_duration(args.time_limit, "--time-limit")
    if args.grace is not None:
        body["grace_s"] = parse_duration(args.grace, "--grace", zero=True)
    body.update(_given(args, max_failure_retries="retry_failures"))
    after = [{"job_id": job_id, "when": when} for when, named in (
        ("ok", args.after), ("any", args.after_any), ("failed", args.after_failed)) for job_id in named or ()]
    if after:
        body["after"] = after
    if args.array is not None:
        body["array"], parallel = parse_array(args.array)
        if parallel is not None:
            body["array_parallel"] = parallel
    if args.env:
        body["env"] = parse_pairs(args.env, "--env")
    if args.label:
        body["labels"] = parse_pairs(args.label, "--label")
    body.update(_given(args, band="band", max_preemptions="max_preemptions", replicas="replicas"))
    if args.group_by:
        body["coschedule"] = {"group_by": args.group_by}
    if args.dry_run:
        body["dry_run"] = True
    user = cli_user(args)
    if args.workspace:
        body["workspace"] = asyncio.run(_store_workspace(args))
    reply = asyncio.run(_request(args, subjects(args).submit_for(user), json.dumps(body).encode()))
    if args.dry_run:
        return _dry_run(args, reply)
    if args.json:
        print_json(reply)
        return 1 if "error" in reply else 0
    reply = _reply_or_fail(reply)
    from irisfed.cli.views import printable

    where = f" on {reply['peer_id']}" if reply["peer_id"] else ""
    dup = " (duplicate: original answer)" if reply["duplicate"] else ""
    print(printable(f"{reply['job_id']}: {reply['disposition']} → {reply['state']}{where}{dup}"))
    if reply["disposition"] == "reject":
        print(printable(f"  {reply['reason']}"))
        return 3
    if args.wait:
        from irisfed.cli.logs import follow_submitted

        return follow_submitted(args, user, reply["job_id"])
    return 0


def _dry_run(args: argparse.Namespace, reply: dict) -> int:
    """A dry run's answer: what the submit would do (exit 0, or 3 for a reject, as a real
    submit's; with --json 0 either way, as a submit's), an error (exit 1), or a router that
    does not know dry runs and submitted the job for real (said loudly; exit 1)."""
    from irisfed.cli import views
    from irisfed.shared.messages import DryRunReply

    if "error" not in reply and reply.get("dry_run") is not True:
        if args.json:
            print_json(reply)
        raise ReplyError("not_a_dry_run", views.printable(
            f"the router does not know dry runs and SUBMITTED the job: {reply.get('job_id')!r} "
            f"({reply.get('disposition')} → {reply.get('state')}); cancel it with irisfed cancel "
            f"{reply.get('job_id')}"))
    if args.json:
        print_json(reply)
        return 1 if "error" in reply else 0  # as a submit's --json: the answer is the document
    reply = _reply_or_fail(reply)
    try:
        answer = msgspec.convert(reply, DryRunReply)
    except msgspec.ValidationError as exc:
        raise IrisfedError(f"the router's dry-run answer is not one this irisfed reads: {exc}") from None
    views.print_dry_run(answer, views.Out(views.output_mode(args)))
    return 3 if answer.disposition == "reject" else 0


def cmd_cancel(args: argparse.Namespace) -> int:
    if args.operator:
        if getattr(args, "user", None):
            raise ConfigError("--operator cancels any user's job by its stored id (alice:train-1); drop --user")
        subject, body = subjects(args).operator_cancel, {"job_id": args.job_id, "by": "cli"}
    else:
        subject, body = subjects(args).cancel_for(cli_user(args)), {"job_id": args.job_id}
    reply = asyncio.run(_request(args, subject, json.dumps(body).encode()))
    if args.json:
        print_json(reply)
        return 1 if "error" in reply else 0
    reply = _reply_or_fail(reply)
    from irisfed.shared.messages import CANCEL_OUTCOMES

    print(f"{reply['job_id']}: {reply['state']} ({reply['outcome']}: {CANCEL_OUTCOMES.get(reply['outcome'], '')})")
    return 0


def cmd_watch(args: argparse.Namespace) -> int:
    return _watch(args, args.job_id)


def _watch(args: argparse.Namespace, shown: str) -> int:
    """Follow one job to a terminal state: reads (Postgres, or the user's own through the
    router), again on each NATS event for it (when the NATS user may hear them) and at
    least every second."""
    from irisfed.cli.views import printable
    from irisfed.services.common.runtime import wait_event

    job_id = scoped_job_id(args, shown)

    async def follow(store) -> str:
        nc = await nats_client(args, max_reconnect_attempts=60)  # nats-py's default, as before
        changed = asyncio.Event()

        async def on_event(msg) -> None:
            changed.set()

        with contextlib.suppress(Exception):  # events wake the reads; without them, every second
            # Its user's copy of its events: what that user's own credentials may hear (§3.6).
            await nc.subscribe(subjects(args).user_events(*split_job_id(job_id)), cb=on_event)
        seen = 0  # the changelog's seq printed last: each change once, at its own time
        try:
            deadline = time.monotonic() + args.timeout if args.timeout else None
            while True:
                history = await store.changelog_list_for_job(job_id)
                job = await store.job_get(job_id)  # after the history: at least as new
                if job is None:
                    raise IrisfedError(f"no job {shown!r}")
                for entry in (e for e in history if e.seq > seen):
                    seen = entry.seq
                    owner = f" on {entry.peer_id}" if entry.peer_id else ""
                    code = (f" exit={job.exit_code}" if job.exit_code is not None and entry.to_state == job.state
                            and entry.to_state in TERMINAL_STATES else "")
                    print(printable(f"{entry.at.astimezone().strftime('%H:%M:%S')} {shown}: {entry.to_state}{owner} "
                                    f"epoch={entry.epoch}{code} {entry.detail}"), flush=True)
                if job.state in TERMINAL_STATES and (not history or history[-1].to_state in TERMINAL_STATES):
                    return job.state
                if deadline and time.monotonic() > deadline:
                    raise IrisfedError(f"timed out waiting for {job_id}")
                changed.clear()
                await wait_event(changed, 1.0)
        finally:
            await nc.close()

    state = asyncio.run(with_store(args, follow))
    return 0 if state == JobState.SUCCEEDED else 1
