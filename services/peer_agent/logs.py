"""The agent's log shipping (docs/design.md §3.6; layout in ``shared/logs.py``): each
live run's ``stdout`` and ``stderr`` (each task's) go into the peer's log stream while
the run runs, in order, a pass every ``interval_s``.

A file is followed from where the stream says it stopped (its subject's last piece:
an agent restarted mid-run resumes there, so no byte is shipped twice and none is
lost) and read from there each pass, at most ``PER_FILE_BYTES`` a pass and
``PER_PASS_BYTES`` for all files (memory stays bounded however fast runs write).
Never more than ``max_bytes`` behind a file's end (``skip_to``), and at most
``max_bytes`` of a file held in the stream: the oldest pieces are purged
(``purge_below``); a reader sees both as a gap and says how much was dropped.
When a run ends, ``finish`` ships its files to their end and adds the end message
before the run's end is reported; if NATS does not answer then, the pass loop keeps
trying (the files stay on the peer's disk until shipped). A store that does not
answer never stops a run: its files wait on disk and are caught up later.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from irisfed.services.common.log import EventLogger
from irisfed.services.common.logstore import LogStore
from irisfed.services.common.objects import ObjectStoreError
from irisfed.shared.logs import log_subject, purge_below, skip_to, split

log = EventLogger("irisfed.peer_agent.logs")

PER_FILE_BYTES = 4 * 2**20
PER_PASS_BYTES = 32 * 2**20
FINISH_WAIT_S = 10.0  # how long a run's end waits for its last output to be shipped


@dataclass
class _File:
    subject: str
    path: Path
    offset: int = 0  # the next byte of the file to ship
    resumed: bool = False  # offset read from the stream
    finishing: bool = False  # the run ended: ship to the end, then the end message
    held: deque = field(default_factory=deque)  # (stream seq, bytes) of its pieces in the stream
    failing: bool = False


def run_files(log_dir: str | None, job_id: str, epoch: int, tasks: int, prefix: str,
              peer: str) -> list[tuple[str, Path]]:
    """(subject, path) of each output file of a run whose output is under ``log_dir``:
    ``stdout``/``stderr`` there, a gang's in ``task-<i>/``."""
    if not log_dir:
        return []
    base = Path(log_dir)
    folders = [(0, base)] if tasks <= 1 else [(i, base / f"task-{i}") for i in range(tasks)]
    return [(log_subject(prefix, peer, job_id, epoch, task, stream), folder / stream)
            for task, folder in folders for stream in ("stdout", "stderr")]


class LogShipper:
    """Ships followed files to ``store`` (the peer's log stream)."""

    def __init__(self, store: LogStore, prefix: str, peer: str, max_bytes: int, interval_s: float = 0.25) -> None:
        self.store, self.prefix, self.peer = store, prefix, peer
        self.max_bytes, self.interval_s = max_bytes, interval_s
        self.files: dict[str, _File] = {}
        self.runs: dict[tuple[str, int], list[str]] = {}  # run -> its files' subjects
        self.shipped = 0  # bytes shipped (tests and the bench read it)
        self.lock = asyncio.Lock()

    def follow(self, job_id: str, epoch: int, tasks: int, log_dir: str | None, fresh: bool = False) -> None:
        """Ship run (``job_id``, ``epoch``)'s files from now on (again: nothing new).
        ``fresh``: launched by this agent just now, so nothing of it was shipped yet (no
        need to ask the stream where it stopped)."""
        if (job_id, epoch) in self.runs:
            return
        files = run_files(log_dir, job_id, epoch, tasks, self.prefix, self.peer)
        self.runs[(job_id, epoch)] = [subject for subject, _ in files]
        for subject, path in files:
            self.files.setdefault(subject, _File(subject, path, resumed=fresh))

    async def finish(self, job_id: str, epoch: int, tasks: int, log_dir: str | None) -> bool:
        """The run ended: ship its files to their end and mark them ended. True when
        done now; False when NATS did not answer within ``FINISH_WAIT_S`` (the pass
        loop goes on trying)."""
        self.follow(job_id, epoch, tasks, log_dir)
        subjects = self.runs.get((job_id, epoch), [])
        files = [self.files[s] for s in subjects if s in self.files]
        for file in files:
            file.finishing = True
        try:
            await asyncio.wait_for(self._ship(files, drain=True), FINISH_WAIT_S)
        except TimeoutError:
            return False
        return all(file.subject not in self.files for file in files)

    async def run(self) -> None:
        """Pass after pass until cancelled."""
        while True:
            await self.ship_pass()
            await asyncio.sleep(self.interval_s)

    async def ship_pass(self) -> None:
        await self._ship(list(self.files.values()), drain=False)

    async def _ship(self, files: list[_File], drain: bool) -> None:
        """One pass over ``files`` (``drain``: until each is shipped to its end); one at a
        time, so no range of a file is read and shipped twice."""
        async with self.lock:
            await self._ship_locked(files, drain)

    async def _ship_locked(self, files: list[_File], drain: bool) -> None:
        while files:
            reads = await asyncio.to_thread(_read_new, files, self.max_bytes)
            await asyncio.gather(*(self._ship_file(file, data, start) for file, (data, start) in zip(files, reads, strict=True)))
            files = [f for f in files if f.subject in self.files and not f.failing and
                     (drain and (f.finishing or not f.resumed))]
            if not drain:
                return

    async def _ship_file(self, file: _File, data: bytes | None, start: int | None) -> None:
        try:
            await self._ship_new(file, data, start)
        except ObjectStoreError as exc:
            if not file.failing:
                log.warning("log_shipping_deferred", subject=file.subject, error=str(exc))
            file.failing = True
        else:
            file.failing = False

    async def _ship_new(self, file: _File, data: bytes | None, start: int | None) -> None:
        if not file.resumed:
            await self._resume(file)  # then read again from where the stream says, next round
            return
        if data:
            for offset, piece in split(data, start):
                seq = await self.store.publish(file.subject, offset, piece)
                if seq is None:  # stored by an earlier try, maybe shorter: go on from the stream's end
                    file.resumed = False
                    return
                file.held.append((seq, len(piece)))
                file.offset = offset + len(piece)
                self.shipped += len(piece)
            await self._cap(file)
        elif file.finishing and data is not None:  # at its end: nothing more will come
            await self.store.publish(file.subject, file.offset, b"", end=file.offset)
            self._forget(file)

    async def _resume(self, file: _File) -> None:
        last = await self.store.last(file.subject)
        if last is None:
            file.offset, file.resumed = 0, True
            return
        if last.end is not None:  # shipped whole by an earlier agent
            self._forget(file)
            return
        first = (await self.store.read(file.subject, 1, limit=1) or [last])[0]
        file.offset = last.offset + len(last.data)
        file.held = deque([(first.seq, file.offset - first.offset)])  # what an earlier agent shipped, as one
        file.resumed = True

    async def _cap(self, file: _File) -> None:
        keep_from = purge_below(file.held, self.max_bytes)
        if keep_from is None:
            return
        await self.store.purge_below(file.subject, keep_from)
        while file.held and file.held[0][0] < keep_from:
            file.held.popleft()

    def _forget(self, file: _File) -> None:
        self.files.pop(file.subject, None)
        for run, subjects in list(self.runs.items()):
            if file.subject in subjects and not any(s in self.files for s in subjects):
                del self.runs[run]


def _read_new(files: list[_File], cap: int) -> list[tuple[bytes | None, int | None]]:
    """For each file: (its bytes past what is shipped, where they start); (None, None)
    for one not resumed yet; (b"", offset) at its end or when missing."""
    budget = PER_PASS_BYTES
    out: list[tuple[bytes | None, int | None]] = []
    for file in files:
        if not file.resumed:
            out.append((None, None))
            continue
        try:
            size = os.stat(file.path).st_size
        except OSError:
            out.append((b"", file.offset))
            continue
        start = skip_to(file.offset, size, cap)
        want = min(size - start, PER_FILE_BYTES, budget)
        if want <= 0:  # at its end, or this pass's budget spent (read next pass)
            out.append((b"", file.offset) if size <= file.offset else (None, None))
            continue
        data = b""
        with contextlib.suppress(OSError), open(file.path, "rb") as handle:
            handle.seek(start)
            data = handle.read(want)
        budget -= len(data)
        out.append((data, start))
    return out
