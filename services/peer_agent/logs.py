"""The agent's log shipping (docs/design.md §3.6; layout in ``shared/logs.py``): each
live run's ``stdout`` and ``stderr`` (each task's) go into the peer's log stream while
the run runs, in order, a pass every ``interval_s``.

A file is followed from where the stream says it stopped (its subject's last piece:
an agent restarted mid-run resumes there, so no byte is shipped twice and none is
lost) and read from there each pass: each file at most its share of ``PER_PASS_BYTES``
(never more than ``PER_FILE_BYTES``, never less than ``MIN_FILE_BYTES``), so memory
stays bounded however fast runs write and one run's flood never starves another's.
Never more than ``max_bytes`` behind a file's end (``skip_to``), and at most
``max_bytes`` of a file held in the stream: the oldest pieces are purged
(``purge_below``); a reader sees both as a gap and says how much was dropped.

The files are the job's: a file read only through folders and a name that are not
symbolic links (``O_NOFOLLOW`` at every step from the run's folder), and only when it
is a regular file (``O_NONBLOCK``: a FIFO never blocks the agent). A run's file that is
not (a link, a FIFO, gone) ships nothing more; when the run ended, its end message
goes out where its output stopped.

When a run ends, ``finish`` ships its files to their end and adds the end message
before the run's end is reported; if NATS does not answer then, the pass loop keeps
trying (the files stay on the peer's disk until shipped). A marker per run in the
agent's own folder (``marks``; never in the run's folder, which the job may write),
written at launch and removed once the end message is stored, tells an agent started
later which runs to finish shipping (``resume_unshipped``, then ``end_unless``): a
run that ended while its agent was away is shipped to its end all the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import re
import stat
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from irisfed.services.common.log import EventLogger
from irisfed.services.common.logstore import LogStore
from irisfed.services.common.objects import ObjectStoreError
from irisfed.shared.logs import log_subject, purge_below, skip_to, split, subject_token
from irisfed.shared.messages import MAX_REPLICAS
from irisfed.shared.users import STORED_JOB_ID_PATTERN

log = EventLogger("irisfed.peer_agent.logs")

PER_FILE_BYTES = 4 * 2**20
MIN_FILE_BYTES = 64 * 2**10
PER_PASS_BYTES = 32 * 2**20
_STORED_JOB_ID = re.compile(STORED_JOB_ID_PATTERN)
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_NOT_A_FILE = (errno.ELOOP, errno.ENOTDIR, errno.ENXIO)
FINISH_WAIT_S = 10.0  # how long a run's end waits for its last output to be shipped


@dataclass
class _File:
    subject: str
    path: Path  # the run's folder / [task-<i> /] name
    parts: tuple[str, ...] = ()  # the path below the run's folder, each opened without following links
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

    def __init__(self, store: LogStore, prefix: str, peer: str, max_bytes: int, interval_s: float = 0.25,
                 marks: Path | None = None) -> None:
        self.store, self.prefix, self.peer = store, prefix, peer
        self.max_bytes, self.interval_s = max_bytes, interval_s
        self.marks = marks  # the agent's own folder of runs not shipped whole (None: none kept)
        self.files: dict[str, _File] = {}
        self.runs: dict[tuple[str, int], list[str]] = {}  # run -> its files' subjects
        self.dirs: dict[tuple[str, int], str] = {}  # run -> its output folder
        self.shipped = 0  # bytes shipped (tests and the bench read it)
        self.lock = asyncio.Lock()

    def follow(self, job_id: str, epoch: int, tasks: int, log_dir: str | None, fresh: bool = False) -> None:
        """Ship run (``job_id``, ``epoch``)'s files from now on (again: nothing new).
        ``fresh``: launched by this agent just now, so nothing of it was shipped yet (no
        need to ask the stream where it stopped)."""
        if (job_id, epoch) in self.runs:
            return
        files = run_files(log_dir, job_id, epoch, tasks, self.prefix, self.peer)
        if not files:  # it writes nowhere (a simulated backend)
            return
        self.runs[(job_id, epoch)] = [subject for subject, _ in files]
        self.dirs[(job_id, epoch)] = log_dir
        for subject, path in files:
            parts = path.relative_to(log_dir).parts
            self.files.setdefault(subject, _File(subject, path, parts, resumed=fresh))
        if fresh and self.marks is not None:
            _mark(self.marks, job_id, epoch, tasks, log_dir)

    def follows(self, job_id: str, epoch: int) -> bool:
        return (job_id, epoch) in self.runs

    async def finish(self, job_id: str, epoch: int, tasks: int, log_dir: str | None) -> bool:
        """The run ended: ship its files to their end and mark them ended. True when
        done now; False when NATS did not answer within ``FINISH_WAIT_S`` (the pass
        loop goes on trying)."""
        self.follow(job_id, epoch, tasks, log_dir)
        subjects = self.runs.get((job_id, epoch), [])
        files = [self.files[s] for s in subjects if s in self.files]
        if not files:  # nothing written, or shipped whole already
            return True
        for file in files:
            file.finishing = True
        try:
            await asyncio.wait_for(self._ship(files, drain=True), FINISH_WAIT_S)
        except TimeoutError:
            pass
        return all(file.subject not in self.files for file in files)

    async def resume_unshipped(self) -> int:
        """Follow again every run an earlier agent marked and did not ship whole (from
        where the stream says); ``end_unless`` then ends those not running any more.
        How many."""
        if self.marks is None:
            return 0
        found = await asyncio.to_thread(_marked, self.marks)
        for job_id, epoch, tasks, folder in found:
            self.follow(job_id, epoch, tasks, folder)
        return len(found)

    def end_unless(self, live: set[tuple[str, int]]) -> None:
        """The followed runs not in ``live`` (runs of this agent now) ended: ship each
        file to its end, then its end message (the pass loop does)."""
        for run, subjects in self.runs.items():
            if run not in live:
                for subject in subjects:
                    if subject in self.files:
                        self.files[subject].finishing = True

    async def run(self, before_pass: Callable[[], None] | None = None) -> None:
        """A pass every ``interval_s`` (from the start of one to the next) until cancelled,
        ``before_pass()`` first (the agent: follow every run it has now). A pass that
        fails is logged; the next goes on."""
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                if before_pass is not None:
                    before_pass()
                await self.ship_pass()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - shipping never stops on one error
                log.error("log_pass_failed", error=repr(exc))
            await asyncio.sleep(max(0.0, started + self.interval_s - loop.time()))

    async def ship_pass(self) -> None:
        await self._ship(list(self.files.values()), drain=False)

    async def _ship(self, files: list[_File], drain: bool) -> None:
        """One pass over ``files`` (``drain``: until each is shipped to its end); one at a
        time, so no range of a file is read and shipped twice."""
        async with self.lock:
            await self._ship_locked(files, drain)

    async def _ship_locked(self, files: list[_File], drain: bool) -> None:
        while files:
            before = (self.shipped, len(self.files), sum(f.resumed for f in files))
            reads = await asyncio.to_thread(_read_new, files, self.max_bytes)
            await asyncio.gather(*(self._ship_file(file, data, start)
                                   for file, (data, start) in zip(files, reads, strict=True)))
            files = [f for f in files if f.subject in self.files and not f.failing and
                     (drain and (f.finishing or not f.resumed))]
            if not drain or (self.shipped, len(self.files), sum(f.resumed for f in files)) == before:
                return  # one pass; or draining went nowhere this round (a file unreadable now)

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
                self.dirs.pop(run, None)
                if self.marks is not None:
                    with contextlib.suppress(OSError):
                        os.unlink(_mark_path(self.marks, *run))


def _mark_path(marks: Path, job_id: str, epoch: int) -> Path:
    return marks / f"{subject_token(job_id)}.{epoch}.json"


def _mark(marks: Path, job_id: str, epoch: int, tasks: int, log_dir: str | None) -> None:
    """Note (in the agent's own folder) that run (job, epoch)'s output is not shipped whole."""
    with contextlib.suppress(OSError):
        marks.mkdir(parents=True, exist_ok=True)
        _mark_path(marks, job_id, epoch).write_text(
            json.dumps({"job_id": job_id, "epoch": epoch, "tasks": tasks, "log_dir": log_dir}))


def _marked(marks: Path) -> list[tuple[str, int, int, str]]:
    """(job id, epoch, tasks, folder) of each run marked in ``marks``; a mark that does
    not read as one is dropped."""
    found = []
    for path in sorted(marks.glob("*.json")) if marks.is_dir() else []:
        try:
            note = json.loads(path.read_text())
            job_id, epoch, tasks, folder = note["job_id"], note["epoch"], note["tasks"], note["log_dir"]
            if not (isinstance(job_id, str) and _STORED_JOB_ID.fullmatch(job_id) and type(epoch) is int
                    and epoch >= 1 and type(tasks) is int and 1 <= tasks <= MAX_REPLICAS
                    and isinstance(folder, str) and os.path.isabs(folder)):
                raise ValueError(path.name)
            found.append((job_id, epoch, tasks, folder))
        except (OSError, ValueError, KeyError, TypeError):
            with contextlib.suppress(OSError):
                path.unlink()  # not a mark of ours: nothing to resume from
    return found


def _open_regular(file: _File) -> int | None:
    """``file`` opened for reading through its run's folder without following any link,
    if it is a regular file; None when it is not (a link, a FIFO, a device); raises
    OSError (FileNotFoundError: it is not there)."""
    try:
        fd = os.open(file.path.parents[len(file.parts) - 1], _OPEN_DIR)
        try:
            for part in file.parts[:-1]:
                inner = os.open(part, _OPEN_DIR, dir_fd=fd)
                os.close(fd)
                fd = inner
            found = os.open(file.parts[-1], _OPEN_FILE, dir_fd=fd)
        finally:
            os.close(fd)
    except OSError as exc:
        if exc.errno in _NOT_A_FILE:  # a link (or a folder that is one), a FIFO with no writer
            return None
        raise
    if not stat.S_ISREG(os.fstat(found).st_mode):
        os.close(found)
        return None
    return found


def _read_new(files: list[_File], cap: int) -> list[tuple[bytes | None, int | None]]:
    """For each file: (its bytes past what is shipped, where they start); (None, None)
    for one not resumed yet or not readable now; (b"", offset) at its end, and for a
    file that is gone or not a regular file (nothing more will be read of it)."""
    share = min(PER_FILE_BYTES, max(MIN_FILE_BYTES, PER_PASS_BYTES // max(1, len(files))))
    out: list[tuple[bytes | None, int | None]] = []
    for file in files:
        if not file.resumed:
            out.append((None, None))
            continue
        if not file.finishing:  # a cheap look first: most files of most passes have nothing new
            try:
                seen = os.lstat(file.path)
                if stat.S_ISREG(seen.st_mode) and seen.st_size == file.offset:
                    out.append((b"", file.offset))
                    continue
            except OSError:
                pass  # opened below, which says what it is
        try:
            fd = _open_regular(file)
        except FileNotFoundError:
            out.append((b"", file.offset))
            continue
        except OSError:  # a passing trouble of the disk: read it again next pass
            out.append((None, None))
            continue
        if fd is None:
            out.append((b"", file.offset))
            continue
        try:
            size = os.fstat(fd).st_size
            start = skip_to(file.offset, size, cap)
            want = min(size - start, share)
            data = os.pread(fd, want, start) if want > 0 else b""
        except OSError:
            out.append((None, None))
            continue
        finally:
            os.close(fd)
        out.append((data, start) if data else (b"", file.offset))
    return out
