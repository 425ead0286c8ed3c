"""Reads of the unified view in Postgres: ``jobs``, ``job``, ``explain``, ``peers``,
``users``, ``logs`` and the live ``top``. A job id (the stored one operators see:
``alice:train-1``, a ``default`` job's bare) is checked before Postgres is asked
(``irisfed.reads.checked_stored_job_id``), and so is a ``--user``: one that nothing can
have is refused in one line (exit 2)."""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
from pathlib import Path

from irisfed.cli.connect import (
    nats_client,
    open_store,
    print_json,
    scoped_job_id,
    subjects,
    with_store,
)
from irisfed.jobs import task_views
from irisfed.reads import checked_stored_job_id, shown_job_id
from irisfed.services.common.startup import federation_config
from irisfed.shared.arrays import counts_words, fold_arrays
from irisfed.shared.errors import ConfigError
from irisfed.shared.users import USER_ID_PATTERN
from irisfed.transfer import output_views

_USER_ID = re.compile(USER_ID_PATTERN)


def checked_user_id(user_id: object, flag: str = "--user") -> str:
    """``user_id`` if it is a user id (``shared.users.USER_ID_PATTERN``), else a one-line
    ``ConfigError`` quoting at most its start. Pure: no I/O."""
    if isinstance(user_id, str) and _USER_ID.match(user_id):
        return user_id
    raise ConfigError(f"{flag} {shown_job_id(user_id)} is not a user id (a lower-case letter, then up to 31 "
                      "lower-case letters, digits, '_' or '-')")


def cmd_jobs(args: argparse.Namespace) -> int:
    from irisfed.cli import views

    user = None if getattr(args, "user", None) is None else checked_user_id(args.user)
    expand = getattr(args, "expand", False)

    async def fetch(store):
        rows = await store.job_list(args.state, args.limit, user_id=user)
        arrays = [] if expand else sorted({row.array_id for row in rows if row.array_id})
        return rows, {array_id: await store.job_array_counts(array_id) for array_id in arrays}

    rows, counts = asyncio.run(with_store(args, fetch))
    mode = views.output_mode(args)
    if mode == "json":  # every job, each naming its array: what a program reads
        print_json([views.job_json(row) for row in rows])
    else:  # one line per array unless --expand
        views.Out(mode, args.wide).grid(views.jobs_grid(rows if expand else fold_arrays(rows, counts)))
    return 0


def _job_and_history(args: argparse.Namespace, tasks: bool = False):
    """The job row, its changelog and (``tasks``) its gang's tasks, or (None, [], [])
    after saying it does not exist."""

    job_id = scoped_job_id(args, checked_stored_job_id(args.job_id))

    async def fetch(store):
        job = await store.job_get(job_id)
        if job is None:  # an array's id: its counts, said instead
            return None, await store.job_array_counts(job_id), [], [], ([], [])
        return (job, await store.changelog_list_for_job(job_id),
                await store.job_tasks_list(job_id) if tasks else [],
                await store.job_outputs_list(job_id) if tasks else [],
                (await store.job_dependencies_of(job_id), await store.job_dependents_of(job_id)))

    job, history, task_rows, outputs, links = asyncio.run(with_store(args, fetch))
    if job is None and history:
        print(f"irisfed: {args.job_id} is an array of {counts_words(history)}; "
              f"`irisfed jobs --expand` lists them, each {args.job_id}_<i>", file=sys.stderr)
        history = []
    elif job is None:
        print(f"irisfed: no job {args.job_id!r}", file=sys.stderr)
    return job, history, task_rows, output_views(outputs), links


def cmd_job(args: argparse.Namespace) -> int:
    from irisfed.cli import views

    job, history, task_rows, outputs, (needs, needed_by) = _job_and_history(args, tasks=True)
    if job is None:
        return 1
    mode = views.output_mode(args)
    if mode == "json":
        print_json({"job": views.job_json(job), "changelog": history, "tasks": task_views(task_rows),
                    "outputs": outputs, "after": needs, "dependents": needed_by})
    else:
        views.print_job(job, history, views.Out(mode, args.wide), task_views(task_rows), outputs)
        views.print_links(needs, needed_by, views.Out(mode, args.wide))
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from irisfed.cli import views

    job, history, _, _, (needs, _) = _job_and_history(args)
    if job is None:
        return 1
    mode = views.output_mode(args)
    if mode == "json":
        explained = job.explanation or {}
        print_json({"job_id": job.job_id, "user_id": job.user_id, "state": job.state,
                    "disposition": job.disposition, "reason": job.reason, "wait": explained.get("wait"),
                    "explanation": job.explanation, "after": needs})
    else:
        out = views.Out(mode, args.wide)
        views.print_explain(job, history, out)
        views.print_links(needs, (), out)
    return 0


def cmd_peers(args: argparse.Namespace) -> int:
    from irisfed.cli import views

    rows = asyncio.run(with_store(args, lambda s: s.peer_heartbeat_list()))
    config = federation_config(args, required=False)
    mode = views.output_mode(args)
    if mode == "json":
        print_json(rows)
    else:
        views.Out(mode, args.wide).grid(views.peers_grid(rows, config))
    return 0


def cmd_users(args: argparse.Namespace) -> int:
    """Each user: live usage against quota, weight, weighted dominant share of what the
    reachable peers advertise, queued and live jobs (every configured user, and any with jobs)."""
    from irisfed.cli import views

    config = federation_config(args, required=False)

    async def fetch(store):
        return (await store.job_live_usage_by_user(), await store.job_count_by_user(),
                await store.peer_heartbeat_list())

    held, counts, peers = asyncio.run(with_store(args, fetch))
    totals = views.federation_totals(peers, config)
    lines = views.user_lines(config, held, counts, totals)
    mode = views.output_mode(args)
    if mode == "json":
        print_json(views.users_json(lines))
    else:
        views.Out(mode, args.wide).grid(views.users_grid(lines, totals))
    return 0


def cmd_outputs(args: argparse.Namespace) -> int:
    """``irisfed outputs ID [--task I] [--epoch N] [--to DIR]``: the newest run's output
    files (Postgres lists them), and with ``--to`` their bytes from the object store."""
    from irisfed.cli import views
    from irisfed.transfer import download_outputs

    job_id = scoped_job_id(args, checked_stored_job_id(args.job_id))

    async def fetch(store):
        return await store.job_get(job_id), await store.job_outputs_list(job_id, args.epoch, args.task)

    job, rows = asyncio.run(with_store(args, fetch))
    if job is None:
        print(f"irisfed: no job {args.job_id!r}", file=sys.stderr)
        return 1
    outputs = output_views(rows)
    if not outputs:
        which = f" of epoch {args.epoch}" if args.epoch is not None else ""
        print(f"irisfed: job {args.job_id} has no outputs{which} (state {job.state})", file=sys.stderr)
        return 1
    if args.to:
        async def download() -> list[Path]:
            nc = await nats_client(args)
            try:
                return await download_outputs(nc, subjects(args).prefix, job_id, outputs, Path(args.to),
                                              job.replicas > 1)
            finally:
                await nc.close()
        written = asyncio.run(download())
        total = sum(o.size for o in outputs if o.stored)
        print(f"{len(written)} file{'s' if len(written) != 1 else ''} ({views.size_text(total)}) written under "
              f"{args.to}", file=sys.stderr)
    mode = views.output_mode(args)
    if mode == "json":
        print_json(outputs)
    else:
        views.Out(mode, getattr(args, "wide", False)).grid(
            views.outputs_grid(outputs, f"outputs of {job.job_id} (epoch {outputs[0].epoch})"))
    return 0


def cmd_top(args: argparse.Namespace) -> int:
    """Live view of peers and jobs: redraws on NATS events, polls Postgres as the fallback."""
    from irisfed.cli import views

    config = federation_config(args, required=False)

    async def run() -> None:
        pool, store = await open_store(args)
        try:
            if args.once:
                views.console().print(await views.dashboard(store, config, f"[bold]irisfed top[/] {views.now_stamp()}"))
                return
            from rich.live import Live

            from irisfed.services.common.runtime import wait_event

            changed = asyncio.Event()

            async def on_message(msg) -> None:
                changed.set()

            nc = await nats_client(args, max_reconnect_attempts=-1)
            names = subjects(args)
            await nc.subscribe(names.events(), cb=on_message)
            await nc.subscribe(names.heartbeat(), cb=on_message)
            try:
                with Live(refresh_per_second=4, screen=False) as live:
                    while True:
                        changed.clear()
                        live.update(await views.dashboard(store, config, f"[bold]irisfed top[/] {views.now_stamp()}"))
                        # Redraw on the next event, but at most 4 times a second.
                        await wait_event(changed, args.interval)
                        await asyncio.sleep(0.25)
            finally:
                await nc.close()
        finally:
            await pool.close()

    asyncio.run(run())
    return 0
