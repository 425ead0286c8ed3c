"""A peer's workspaces (docs/design.md §3.5): fetched once per user and digest (sent by
the object store on the router's word, for a job assigned here: agents read no
workspace bucket), verified, unpacked into a bounded on-disk cache, copied fresh for
each run.

The cache is ``<work root>/.workspaces/<user>/<hex>``, one unpacked tree per user and
digest (a user's metadata in its own bucket is its own to write, so a tree another
user's bytes made is never handed to it: each user's tree comes from that user's bucket), made by
``shared.workspace.unpack_stream``: a thread unpacks the bytes into a partial folder
while they arrive, hashing them as it reads (once), and renames the folder only
after the last byte matched the digest. A tree under its final name is always whole
and verified, so an agent killed mid-fetch or mid-unpack leaves only a partial
folder, removed at the next start, and never runs it. Trees are evicted least recently used first when their
bytes pass ``max_bytes``, never while a run holds one (``acquire``/``release``).

What fails, and how the job ends (``WorkspaceUnusable`` carries the reason):
- the archive refused (``WorkspaceRefused``), an object that holds other bytes than
  its digest (they match the store's own record of them), over the cap, or a
  workspace no longer in the store: the job fails, not retried — retrying would not
  make the bytes good;
- the store unreachable for now (``StoreUnavailable``/``StoreMissing``), or bytes that
  arrived but match neither the digest nor the store's record (garbled on the way, or
  chunks damaged in the store: the agent cannot tell which): a launch error like any
  other, so the job is handed back while retries remain.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import os
import queue
import re
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import nats.errors

from irisfed.services.common.log import EventLogger
from irisfed.services.common.objects import (
    DigestMismatch,
    ObjectMissing,
    ObjectTooLarge,
    StoreUnavailable,
    store_digest,
)
from irisfed.shared.errors import ErrorCode
from irisfed.shared.messages import FETCH_PART, FetchEnd, FetchRequest, encoder
from irisfed.shared.users import DEFAULT_USER, USER_ID_PATTERN
from irisfed.shared.workspace import DIGEST_RE, WorkspaceRefused, unpack_stream

log = EventLogger("irisfed.peer_agent.workspaces")

CACHE_FOLDER = ".workspaces"
_USER = re.compile(USER_ID_PATTERN)
Key = tuple[str, str]  # (user, digest)
Job = tuple[str, int]  # (job id, epoch): the run a fetch is for
_NAME_ERRORS = (errno.ENAMETOOLONG, errno.EILSEQ, errno.EINVAL)
DEFAULT_CACHE_MB = 4096


Sink = Callable[[bytes], None]  # takes a fetch's chunks in order
# A fetch: (digest, user, job, sink) → the store's own record of the chunks' SHA-256
# (``SHA-256=<base64url>``; None or "" when it has none).
Fetch = Callable[[str, str, Job | None, Sink], Awaitable[str | None]]


class WorkspaceUnusable(Exception):
    """A job's workspace cannot be run, for good; the message is the job's reason."""


class _TransferFailed(Exception):
    """The fetch feeding an unpack failed: its own error is the one raised."""


_END, _FAILED = object(), object()


class _Feed:
    """A fetch's chunks, put on the event loop and read in order by the unpacking
    thread (``read`` blocks for the next one), hashed once as they are read."""

    def __init__(self) -> None:
        self._chunks: queue.SimpleQueue = queue.SimpleQueue()
        self._rest = memoryview(b"")
        self._ended = False
        self.sha = hashlib.sha256()
        self.size = 0
        self.stored: str | None = None  # the store's record of the bytes' SHA-256, once the fetch ended

    def put(self, chunk: bytes) -> None:
        self._chunks.put(chunk)

    def end(self, ok: bool) -> None:
        self._chunks.put(_END if ok else _FAILED)

    def read(self, size: int = -1) -> bytes:
        while not self._rest:
            if self._ended:
                return b""
            item = self._chunks.get()
            if item is _END:
                self._ended = True
                return b""
            if item is _FAILED:
                self._ended = True
                raise _TransferFailed
            self.sha.update(item)
            self.size += len(item)
            self._rest = memoryview(item)
        take = len(self._rest) if size < 0 else min(size, len(self._rest))
        out, self._rest = self._rest[:take].tobytes(), self._rest[take:]
        return out


@dataclass
class _Entry:
    path: Path
    size: int  # unpacked file bytes
    used_at: float
    holders: int = 0


def _tree_bytes(path: Path) -> int:
    total = 0
    for folder, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(folder, name)).st_size
    return total


def _drop(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


class WorkspaceCache:
    """The agent's unpacked workspaces under ``root``; ``fetch(digest, user, job, sink)``
    hands the archive bytes of that user's workspace to ``sink`` as they come, for
    ``job`` (the (job id, epoch) of the run that asked first: the router sends a
    workspace only for a job assigned here). One tree per user and digest: unpacked
    while the bytes arrive, named only once they proved to be the digest's; each
    user's come from its own bucket."""

    def __init__(self, root: Path, fetch: Fetch, *, max_bytes: int,
                 max_files: int, max_unpacked_bytes: int) -> None:
        self.root = root
        self.fetch = fetch
        self.max_bytes = max_bytes
        self.max_files = max_files
        self.max_unpacked_bytes = max_unpacked_bytes
        self.entries: dict[Key, _Entry] = {}
        self._locks: dict[Key, asyncio.Lock] = {}
        self.fetches = 0  # archives fetched from the store (tests and the bench read it)

    async def open(self) -> WorkspaceCache:
        """Drop partial trees a killed agent left; index the whole ones."""
        self.entries = await asyncio.to_thread(self._scan)
        return self

    def _scan(self) -> dict[Key, _Entry]:
        self.root.mkdir(parents=True, exist_ok=True)
        found: dict[Key, _Entry] = {}
        for folder in self.root.iterdir():
            if _USER.fullmatch(folder.name) and folder.is_dir() and not folder.is_symlink():
                for path in folder.iterdir():
                    self._keep_or_drop(found, folder.name, path)
            else:
                _drop(folder)  # not a user's folder (or left by an older layout)
        return found

    @staticmethod
    def _keep_or_drop(found: dict[Key, _Entry], user: str, path: Path) -> None:
        if path.name.startswith("."):
            shutil.rmtree(path, ignore_errors=True)  # a partial unpack: never used
            return
        digest = f"sha256:{path.name}"
        try:
            if DIGEST_RE.fullmatch(digest) and path.is_dir() and not path.is_symlink():
                found[(user, digest)] = _Entry(path, _tree_bytes(path), path.stat().st_mtime)
                return
        except (OSError, RecursionError):  # unreadable: dropped, fetched again when needed
            pass
        _drop(path)

    async def acquire(self, digest: str, user: str = DEFAULT_USER, job: Job | None = None) -> Path:
        """The unpacked tree of ``digest``, held until ``release``: fetched and unpacked
        the first time (once, however many runs ask at once). Raises WorkspaceUnusable
        (the job fails) or the store's StoreUnavailable/StoreMissing (retry later)."""
        if not DIGEST_RE.fullmatch(digest):
            raise WorkspaceUnusable(f"workspace refused: {digest!r} is not a workspace digest")
        if not _USER.fullmatch(user):
            raise WorkspaceUnusable(f"workspace refused: {user!r} is not a user id")
        key = (user, digest)
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            if len(self._locks) > 4 * (len(self.entries) + 64):  # locks of digests long gone
                self._locks = {k: lk for k, lk in self._locks.items() if lk.locked() or k in self.entries}
                self._locks[key] = lock
            entry = self.entries.get(key)
            if entry is None or not entry.path.is_dir():
                entry = await self._add(digest, user, job)
            entry.holders += 1
            entry.used_at = time.time()
            gone = self._evict()
        if gone:
            await asyncio.to_thread(lambda: [shutil.rmtree(path, ignore_errors=True) for path in gone])
        return entry.path

    def release(self, digest: str, user: str = DEFAULT_USER) -> None:
        entry = self.entries.get((user, digest))
        if entry is not None and entry.holders > 0:
            entry.holders -= 1
            entry.used_at = time.time()

    async def _add(self, digest: str, user: str, job: Job | None) -> _Entry:
        path = self.root / user / digest.removeprefix("sha256:")
        path.parent.mkdir(exist_ok=True)
        feed = _Feed()
        unpacking = asyncio.ensure_future(asyncio.to_thread(self._unpack, feed, path, digest))
        try:
            feed.stored = await self.fetch(digest, user, job, feed.put)
        except BaseException as exc:
            feed.end(ok=False)  # the thread stops and drops its partial folder
            unpacking.add_done_callback(_ignore_result)
            if isinstance(exc, ObjectMissing):
                raise WorkspaceUnusable(f"workspace {digest} is no longer in the object store") from None
            if isinstance(exc, (DigestMismatch, ObjectTooLarge)):
                raise WorkspaceUnusable(f"workspace refused: {exc}") from None
            raise
        feed.end(ok=True)
        self.fetches += 1
        try:
            stats = await unpacking
        except WorkspaceRefused as exc:
            log.warning("workspace_refused", digest=digest, why=str(exc))
            raise WorkspaceUnusable(f"workspace refused: {exc}") from None
        entry = _Entry(path, stats, time.time())
        self.entries[(user, digest)] = entry
        log.info("workspace_cached", digest=digest, bytes=stats)
        return entry

    def _unpack(self, feed: _Feed, path: Path, digest: str) -> int:
        if os.path.lexists(path):  # a tree someone removed from under us, or a stray file
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)

        def check() -> None:
            actual = feed.sha.digest()
            if f"sha256:{actual.hex()}" == digest:
                return
            if feed.stored and feed.stored == store_digest(actual):  # what the store holds: for good
                raise WorkspaceRefused(f"the object stored as workspace {digest} holds other bytes "
                                       f"(sha256:{actual.hex()})")
            raise StoreUnavailable(f"fetching workspace {digest}: the {feed.size:,} bytes that came are "
                                   f"not the workspace")
        try:
            stats = unpack_stream(feed, path, check=check, max_files=self.max_files,
                                  max_bytes=self.max_unpacked_bytes)
        except OSError as exc:
            if exc.errno in _NAME_ERRORS:  # the archive named something no filesystem here takes
                while feed.read(1 << 20):  # unless its bytes were garbled on the way
                    pass
                check()
                raise WorkspaceRefused(f"cannot unpack: {exc.strerror or exc}") from None
            raise  # the peer's own trouble (a full disk...): a launch error, tried again elsewhere
        return stats.bytes

    def _evict(self) -> list[Path]:
        """Take least recently used trees no run holds out of the cache until it fits;
        the renamed folders to remove. On the loop (a rename each), so no acquire sees
        a tree half gone; the removal itself is the caller's, in a thread."""
        total = sum(e.size for e in self.entries.values())
        gone = []
        for key, entry in sorted(self.entries.items(), key=lambda item: item[1].used_at):
            if total <= self.max_bytes:
                break
            if entry.holders > 0:
                continue
            del self.entries[key]
            total -= entry.size
            moved = entry.path.with_name(f".{entry.path.name}.evicted-{time.monotonic_ns()}")
            with contextlib.suppress(OSError):
                os.rename(entry.path, moved)
                gone.append(moved)
            log.info("workspace_evicted", user=key[0], digest=key[1], bytes=entry.size)
        return gone


def _ignore_result(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()  # the failed fetch's error is the one raised


FETCH_IDLE_S = 30.0  # how long a fetch waits for the next message before giving up
# The router busy (its fetches for this peer, or this peer's windows a second, at their
# bound; the store away for a moment): the window is asked again after a pause, up to
# BUSY_TRIES times in a row before the fetch fails (a launch error, retried later).
BUSY_PAUSE_S, BUSY_TRIES = 0.25, 40


class _Busy(StoreUnavailable):
    """The router answered `unavailable`: no window comes; ask again later."""
_STATUS, _SEQUENCE = "Status", "Nats-Sequence"
_LAST_SEQUENCE, _NUM_PENDING = "Nats-Last-Sequence", "Nats-Num-Pending"


async def fetch_through_router(nc, subject: str, job: Job, digest: str, max_bytes: int, sink: Sink,
                               idle_s: float = FETCH_IDLE_S) -> str:
    """Workspace ``digest`` of ``job`` (its id and epoch), asked of the router on
    ``subject`` (``P.fetch.<peer>``) window by window, received on an inbox of our own
    (docs/design.md §3.5; the messages: ``FetchRequest``), each chunk handed to ``sink``
    as it comes; returns the store's own record of the chunks' SHA-256 once every byte
    the router's end names came (the caller checks they are the digest's, as it reads
    them). The router's refusals: ObjectMissing (the workspace is gone from the
    store), DigestMismatch (over the cap, or more chunks than the workspace's size),
    StoreUnavailable (nothing came within ``idle_s``, chunks missing, the job not this
    peer's now, or the router busy: retried as a launch error)."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, pending_bytes_limit=max_bytes + 4 * 2**20)
    size = 0
    try:
        from_seq, busy = 0, 0
        while True:
            await nc.publish(subject, encoder.encode(FetchRequest(job[0], job[1], from_seq)), reply=inbox)
            try:
                end, left, next_seq, size = await _window(sub, digest, max_bytes, size, sink, idle_s)
            except _Busy:  # no window comes: asked again after a pause, a few times
                busy += 1
                if busy >= BUSY_TRIES:
                    raise
                await asyncio.sleep(BUSY_PAUSE_S)
                continue
            busy = 0
            if size == end.size:
                return end.sha256
            if left == 0 or next_seq <= from_seq:
                raise StoreUnavailable(f"fetching workspace {digest}: the store's chunks ended at {size:,} of "
                                       f"{end.size:,} bytes")
            from_seq = next_seq
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def _window(sub, digest: str, max_bytes: int, size: int, sink: Sink,
                  idle_s: float) -> tuple[FetchEnd, int | None, int, int]:
    """One window of a fetch: its chunks to ``sink`` until both the router's end and
    the store's status came (either first), or every byte the end names. Returns the
    end, the chunks the store says remain (None: unknown), the sequence to go on from,
    and the bytes received so far (``size`` before)."""
    end: FetchEnd | None = None
    left: int | None = None
    closed = False
    next_seq = 0
    while end is None or not closed and size < end.size:
        try:
            msg = await sub.next_msg(timeout=idle_s)
        except nats.errors.TimeoutError:
            raise StoreUnavailable(f"fetching workspace {digest}: nothing came for {idle_s:g} s") from None
        headers = msg.headers or {}
        # A stored chunk keeps the headers its writer gave it (the job's own user may
        # plant any), so what the server adds to every chunk decides first.
        if _SEQUENCE in headers:
            if not msg.data:
                raise StoreUnavailable(f"fetching workspace {digest}: the store sent an empty chunk")
            size += len(msg.data)
            if size > max_bytes:
                raise DigestMismatch(f"workspace {digest} is over the {max_bytes:,} bytes allowed")
            next_seq = _number(headers, _SEQUENCE, digest) + 1
            sink(msg.data)
        elif status := headers.get(_STATUS):
            if status not in ("204", "404"):
                raise StoreUnavailable(f"fetching workspace {digest}: the store answered {status} "
                                       f"{headers.get('Description', '')}".rstrip())
            closed = True
            if status == "204":
                left = _number(headers, _NUM_PENDING, digest)
                next_seq = _number(headers, _LAST_SEQUENCE, digest) + 1
            else:
                left = 0
        elif headers.get(FETCH_PART) == "end":
            end = _fetched(msg.data, digest)
        else:
            raise StoreUnavailable(f"fetching workspace {digest}: a message that is neither a chunk nor an end came")
        if end is not None and size > end.size:
            raise DigestMismatch(f"workspace {digest}: the store sent more than its {end.size:,} bytes")
    return end, left, next_seq, size


def _number(headers: dict, name: str, digest: str) -> int:
    """Header ``name`` of a store's message, a whole number; StoreUnavailable if not."""
    try:
        return int(headers[name])
    except (KeyError, ValueError):
        raise StoreUnavailable(f"fetching workspace {digest}: the store's {name} is missing or not a number") \
            from None


def _fetched(end: bytes, digest: str) -> FetchEnd:
    """The router's end message ``end`` for ``digest``; else the error it tells of."""
    try:
        answer = msgspec.json.decode(end)
    except msgspec.DecodeError:
        raise StoreUnavailable(f"fetching workspace {digest}: the router's last message is not JSON") from None
    error = answer.get("error") if isinstance(answer, dict) else None
    if isinstance(error, dict):
        message = str(error.get("message", ""))[:500]
        if error.get("code") == ErrorCode.NOT_FOUND:
            raise ObjectMissing(message)
        if error.get("code") == ErrorCode.INVALID_REQUEST:
            raise DigestMismatch(message)
        if error.get("code") == ErrorCode.UNAVAILABLE:
            raise _Busy(f"fetching workspace {digest}: {message}")
        raise StoreUnavailable(f"fetching workspace {digest}: {message}")
    try:
        fetched = msgspec.convert(answer, FetchEnd)
    except msgspec.ValidationError:
        raise StoreUnavailable(f"fetching workspace {digest}: the router's end is not a fetch's end") from None
    if fetched.digest != digest:
        raise StoreUnavailable(f"fetching workspace {digest}: the router answered for another workspace")
    return fetched
