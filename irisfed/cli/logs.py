"""``irisfed logs`` and the output ``submit --wait`` streams (docs/design.md §3.6): a
job's output as shipped into the federation, read through the router with only the
user's own NATS credentials (no database URL), wherever the job ran.

On a terminal, control characters in the output (terminal escapes, CR, bidi
overrides) are shown escaped; piped, the bytes are written as the job wrote them.
``--follow`` exits with the job's status: 0 when it succeeded, its exit code when it
failed with one (1 otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import sys
import time

from irisfed.cli.connect import cli_user, client_nats_url, subjects
from irisfed.cli.views import printable
from irisfed.shared.lifecycle import JobState
from irisfed.shared.messages import LogsReply
from irisfed.shared.shorthands import parse_duration
from irisfed.shared.users import stored_job_id


def exit_status(state: str, exit_code: int | None) -> int:
    """The shell status a followed job ends the command with."""
    if state == JobState.SUCCEEDED:
        return 0
    if state == JobState.FAILED and exit_code is not None and 0 < exit_code < 256:
        return exit_code
    return 1


class Output:
    """Where a job's output goes: on a terminal shown inert (a character split between two
    answers decoded whole), else the bytes as they are."""

    def __init__(self, tty: bool) -> None:
        self.tty = tty
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def write(self, data: bytes, final: bool = False) -> None:
        if self.tty:
            text = self.decoder.decode(data, final=final)
            if text:
                sys.stdout.write(printable(text))
                sys.stdout.flush()
        elif data:
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()


def write_output(data: bytes, tty: bool) -> None:
    """``data`` written as Output does, whole."""
    Output(tty).write(data, final=True)


async def _client(args: argparse.Namespace):
    from irisfed.client import Client

    return await Client.connect(nats_url=client_nats_url(args), prefix=subjects(args).prefix, user=cli_user(args),
                                timeout=getattr(args, "timeout", 10.0) or 10.0)


def cmd_logs(args: argparse.Namespace) -> int:
    since = parse_duration(args.since, "--since") if args.since else None
    out = Output(sys.stdout.isatty())

    async def run() -> LogsReply | None:
        client = await _client(args)
        last, wrote = None, False
        try:
            async for reply in client.log_replies(args.job_id, stderr=args.stderr, task=args.task, epoch=args.epoch,
                                                  follow=args.follow, since_s=since):
                out.write(reply.data)
                wrote = wrote or bool(reply.data)
                last = reply
            out.write(b"", final=True)
        finally:
            await client.close()
        if last is not None and not wrote and not args.follow:
            print(printable(f"irisfed: job {args.job_id} has no {'stderr' if args.stderr else 'output'} "
                            f"shipped (state {last.state})"), file=sys.stderr)
        return last

    last = asyncio.run(run())
    if args.follow and last is not None:
        return exit_status(last.state, last.exit_code)
    return 0


def follow_submitted(args: argparse.Namespace, user: str, job_id: str) -> int:
    """``submit --wait``: the job's stdout as it runs, its state changes on stderr; the
    job's status as the command's."""
    from irisfed.connection import reads_as_operator

    out = Output(sys.stdout.isatty())

    async def run() -> LogsReply | None:
        client = await _client(args)
        name = stored_job_id(user, job_id) if reads_as_operator(client.servers.nats_url) else job_id
        last, seen = None, None
        try:
            async for reply in client.log_replies(name, follow=True):
                out.write(reply.data)
                now = (reply.state, reply.peer_id, reply.epoch)
                if now != seen:
                    seen = now
                    where = f" on {reply.peer_id}" if reply.peer_id else ""
                    code = f" exit={reply.exit_code}" if reply.exit_code is not None else ""
                    print(printable(f"{time.strftime('%H:%M:%S')} {job_id}: {reply.state}{where} "
                                    f"epoch={reply.epoch}{code}"), file=sys.stderr, flush=True)
                last = reply
            out.write(b"", final=True)
        finally:
            await client.close()
        return last

    last = asyncio.run(run())
    return 1 if last is None else exit_status(last.state, last.exit_code)
