"""Reading a job's output as the router serves it (docs/design.md §3.6): the
client's ``logs`` and the CLI's ``irisfed logs`` and ``submit --wait`` share this.

``read_logs`` asks again from where the last answer ended. Without ``follow`` it
stops once an answer brings nothing new (what was shipped so far); with ``follow``
it asks every ``FOLLOW_POLL_S`` until the run's output is done, and when the job is
run again (a retry, a preemption) goes on with the new run, until the job has
ended.
"""

from __future__ import annotations

import asyncio
import codecs
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec

from irisfed.shared.lifecycle import JobState
from irisfed.shared.messages import LogsReply, LogsRequest

FOLLOW_POLL_S = 0.15  # a follower asks again this often: a line shows ~0.2 s after it was written


async def read_logs(ask: Callable[[LogsRequest], Awaitable[LogsReply]], first: LogsRequest,
                    follow: bool = False) -> AsyncIterator[LogsReply]:
    """The answers to ``first`` and the requests that continue it (module docstring)."""
    request = first
    while True:
        reply = await ask(request)
        yield reply
        if reply.done:
            # A run asked for by number is answered with the job's state now: maybe a later run's.
            if not follow or (JobState(reply.state).is_terminal and request.epoch is None):
                return
            # Its output ended before its end was recorded, or the job runs again.
            following = await _next_run(ask, first, reply)
            if isinstance(following, LogsReply):
                if not JobState(reply.state).is_terminal:
                    yield following  # the job's end, without output read already
                return
            if following is None:
                return
            request = following
            continue
        if not reply.data:
            if not follow:
                return
            await asyncio.sleep(FOLLOW_POLL_S)
        # From a time until something was read; then on from where it ended.
        request = msgspec.structs.replace(request, seq=reply.seq, offset=reply.offset, epoch=reply.epoch or None,
                                          since_s=None if reply.seq else request.since_s)


async def _next_run(ask: Callable[[LogsRequest], Awaitable[LogsReply]], first: LogsRequest,
                    done: LogsReply) -> LogsRequest | LogsReply | None:
    """After run ``done.epoch``'s output ended: the request for the job's next run once it
    has one (None when ``first`` asked for a run by number); when the job ended with that
    run its last, its end: ``done`` without its data, with the job's state and exit code."""
    while True:
        newest = await ask(msgspec.structs.replace(first, seq=0, offset=0, since_s=None, epoch=None))
        if newest.epoch > done.epoch:
            if first.epoch is not None:
                return None
            return msgspec.structs.replace(first, seq=0, offset=0, since_s=None, epoch=newest.epoch)
        if JobState(newest.state).is_terminal:
            return msgspec.structs.replace(done, data=b"", state=newest.state, exit_code=newest.exit_code)
        await asyncio.sleep(FOLLOW_POLL_S)


LONGEST_LINE = 64 * 1024  # a line without its newline yet is given out in parts this long


async def lines(replies: AsyncIterator[LogsReply]) -> AsyncIterator[str]:
    """The text of ``replies`` line by line (undecodable bytes replaced), each with its
    newline; a line longer than LONGEST_LINE (progress bars redrawn with CR) in parts
    without one; a last line without one at the end."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")  # a character split between answers stays whole
    rest = ""
    async for reply in replies:
        rest += decoder.decode(reply.data)
        *whole, rest = rest.split("\n")
        for line in whole:
            yield line + "\n"
        while len(rest) > LONGEST_LINE:
            yield rest[:LONGEST_LINE]
            rest = rest[LONGEST_LINE:]
    rest += decoder.decode(b"", final=True)
    if rest:
        yield rest
