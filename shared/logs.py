"""Logs (docs/design.md §3.6): where each run's stdout and stderr are shipped, and how
they are read back. Pure: names, offsets and arithmetic; the agent's shipper
(``services/peer_agent/logs.py``) and the router's reads (``services/router/reads.py``)
do the I/O over ``services/common/logstore.py``.

Layout. Each peer has one JetStream stream, ``<prefix>-logs__<peer>``, holding the
subjects ``<prefix>.logs.<peer>.<job>.<epoch>.<task>.<out|err>``: one subject per
output stream of each task of each run (a single-task job is task 0). Only agent
``<peer>`` may publish there, and only the router and operators read it: a user
reads through the router, which checks the job is the user's.

Messages. Each holds the next bytes of the file, in order (at most
``MESSAGE_BYTES``); header ``Irisfed-Offset`` is where in the file they start. So a
reader sees what was dropped (a gap between one message's end and the next's
offset: the run's oldest output past ``max_log_mb``, or what the agent skipped to
stay within it), and a restarted agent resumes at the last message's end: no byte
shipped twice, none lost. Each message's id (``Nats-Msg-Id``) is its subject and
offset, so a publish retried after a lost acknowledgement is stored once. After the
run ended and its files were shipped to their end, one more message with header
``Irisfed-End`` (the file's final size) and no data says nothing more will come.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

OFFSET_HEADER = "Irisfed-Offset"
END_HEADER = "Irisfed-End"
MESSAGE_BYTES = 256 * 1024  # a log message's most bytes
OUTPUT_STREAMS = {"stdout": "out", "stderr": "err"}


def subject_token(job_id: str) -> str:
    """A job id as one subject token: ``_``, ``.`` and ``:`` escaped (``_5F``, ``_2E``,
    ``_3A``), so no two ids meet and none splits into tokens."""
    return job_id.replace("_", "_5F").replace(".", "_2E").replace(":", "_3A")


def log_subject(prefix: str, peer: str, job_id: str, epoch: int, task: int, stream: str) -> str:
    """The subject of ``stream`` (``stdout``/``stderr``) of task ``task`` of run
    (``job_id``, ``epoch``) at ``peer``."""
    return f"{prefix}.logs.{peer}.{subject_token(job_id)}.{epoch}.{task}.{OUTPUT_STREAMS[stream]}"


def peer_logs_subjects(prefix: str, peer: str) -> str:
    """Every log subject of ``peer`` (its stream's subjects; its agent's publish right)."""
    return f"{prefix}.logs.{peer}.>"


def split(data: bytes, offset: int, limit: int = MESSAGE_BYTES) -> list[tuple[int, bytes]]:
    """``data`` (the file's bytes from ``offset``) as messages of at most ``limit`` bytes:
    (offset, bytes) each."""
    return [(offset + at, data[at:at + limit]) for at in range(0, len(data), limit)]


def skip_to(offset: int, size: int, cap: int) -> int:
    """Where to ship from when the file is ``size`` bytes and ``offset`` is shipped: never
    more than ``cap`` behind its end (what lies before is dropped, as the cap would drop
    it anyway: a run writing faster than it can be shipped costs bounded work)."""
    return max(offset, size - cap)


def purge_below(shipped: Iterable[tuple[int, int]], cap: int) -> int | None:
    """Given one subject's messages held in the stream as (sequence, bytes), oldest
    first, the sequence from which to keep them so at most ``cap`` bytes stay (the
    newest); None when all fit."""
    kept = 0
    first = None
    for seq, size in reversed(list(shipped)):
        if kept + size > cap:
            return first if first is not None else seq  # the newest alone is kept whatever its size
        kept += size
        first = seq
    return None


@dataclass(frozen=True)
class Piece:
    """One log message as read: its stream sequence, file offset, bytes and time
    (seconds since the epoch); ``end`` the final size when it is the end message."""

    seq: int
    offset: int
    data: bytes
    time: float = 0.0
    end: int | None = None


def dropped_text(count: int) -> bytes:
    """The line a reader shows where ``count`` bytes of output were dropped."""
    size = f"{count / 2**20:,.1f} MiB" if count >= 2**20 else f"{count:,} bytes"
    return f"[irisfed: {size} of output dropped here (max_log_mb)]\n".encode()


def assemble(pieces: Iterable[Piece], offset: int) -> tuple[bytes, int, bool]:
    """The bytes of ``pieces`` (in order) as a reader shows them, the reader being at
    file offset ``offset``: each gap marked with ``dropped_text``, bytes before
    ``offset`` left out (a piece read twice). Returns (bytes, the new offset, ended)."""
    out = bytearray()
    ended = False
    for piece in pieces:
        if piece.end is not None:
            if piece.end > offset:
                out += dropped_text(piece.end - offset)
                offset = piece.end
            ended = True
            continue
        if piece.offset > offset:
            out += dropped_text(piece.offset - offset)
            offset = piece.offset
        start = offset - piece.offset
        if start < len(piece.data):
            out += piece.data[start:]
            offset = piece.offset + len(piece.data)
    return bytes(out), offset, ended
