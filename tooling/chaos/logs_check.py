"""Invariant 15 in the chaos suite (docs/design.md §6): what runs printed is read back
through the federation after the faults, whole and once, by its own user only.

After every acknowledged job ended, a sample of jobs that succeeded on the peers with
real processes is read back through the router with the job's own user's credentials
(``P.read.logs[.<user>]``, as ``irisfed logs`` does): their stdout must be exactly the
two lines the job script printed for that run (``out``/``done``, naming the job and
epoch), none lost, none twice, although agents were killed, partitioned and restarted
meanwhile. A user that never sent that job id asks for it too: ``not_found``.
"""

from __future__ import annotations

import asyncio
import base64
import random
import time
from collections.abc import Awaitable, Callable

import asyncpg

from irisfed.shared.errors import ErrorCode
from irisfed.shared.users import split_job_id
from irisfed.tooling.chaos.result import ScheduleResult
from irisfed.tooling.chaos.world import SUBMITTERS, SUBPROCESS_PEERS

LOG_SAMPLE = 6  # jobs read back per schedule
READ_WITHIN_S = 30.0  # a run's output readable to its end this long after every job ended
POLL_S = 0.25

Request = Callable[[str, dict, str], Awaitable[dict | None]]


def expected_output(stored_id: str, epoch: int) -> bytes:
    """What the job script prints to stdout in run ``epoch`` of job ``stored_id``."""
    return f"out {stored_id} {epoch}\ndone {stored_id} {epoch}\n".encode()


async def read_whole(request: Request, user: str, job_id: str, epoch: int) -> tuple[bytes | None, str]:
    """Run ``epoch``'s stdout as ``user`` reads it, to its end; (None, why) when it cannot."""
    deadline = time.monotonic() + READ_WITHIN_S
    data, seq, offset = b"", 0, 0
    why = "no answer"
    while time.monotonic() < deadline:
        reply = await request("read.logs", {"job_id": job_id, "epoch": epoch, "seq": seq, "offset": offset}, user)
        if reply is not None and "error" in reply:
            if reply["error"].get("code") != ErrorCode.UNAVAILABLE:
                return None, f"answered {reply}"
            why = reply["error"].get("message", "unavailable")
        elif reply is not None:
            data += base64.b64decode(reply["data"])
            seq, offset = reply["seq"], reply["offset"]
            if reply["done"]:
                return data, ""
            why = f"not ended after {len(data)} bytes"
            if reply["data"]:
                continue
        await asyncio.sleep(POLL_S)
    return None, why


async def check_shipped_logs(database_url: str, request: Request, sent: set[tuple[str, str]],
                             rng: random.Random, result: ScheduleResult) -> None:
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch("SELECT job_id, epoch FROM jobs WHERE state = 'succeeded' AND replicas = 1 "
                                "AND owner_peer_id = ANY($1::text[]) ORDER BY job_id", list(SUBPROCESS_PEERS))
    finally:
        await conn.close()
    for row in rng.sample(rows, min(LOG_SAMPLE, len(rows))):
        stored, epoch = row["job_id"], row["epoch"]
        user, job_id = split_job_id(stored)
        got, why = await read_whole(request, user, job_id, epoch)
        if got is None:
            result.violations.append(f"{stored}: its run {epoch}'s output is not readable by {user}: {why}")
        elif got != expected_output(stored, epoch):
            result.violations.append(f"{stored}: its run {epoch} printed {expected_output(stored, epoch)!r}, "
                                     f"{user} reads {got[:300]!r}")
        else:
            result.logs_read += 1
        other = next((u for u in SUBMITTERS if u != user and (u, job_id) not in sent), None)
        if other is not None:
            reply = await request("read.logs", {"job_id": job_id}, other)
            code = (reply or {}).get("error", {}).get("code")
            if reply is not None and code not in (ErrorCode.NOT_FOUND, ErrorCode.UNAVAILABLE):
                result.violations.append(f"{stored}: {other}, whose job it is not, read its output: {reply!r:.300}")
