"""The federation's object store (DESIGN 3.5): workspaces and run outputs as bytes in
NATS JetStream's object store, on the NATS servers the federation already runs.

Buckets per subject prefix and user (:func:`bucket`; ``_`` -> ``_5F`` and ``.`` ->
``_2E``, so ``irisfed`` gives ``irisfed-workspaces`` for the user ``default`` and
``irisfed-workspaces-alice`` for ``alice``), and per user at each peer ``P`` the
outputs of runs there (``...-outputs__P``, ``...-outputs-alice__P``, kept
``output_retention_days``, the bucket's max age). A bucket is a stream, so NATS
permissions can give each user its own, and each peer's agent its own outputs, and no
one else's; agents read no workspace bucket at all: the router relays a job's
workspace to its peer (docs/decisions.md "The object store's rights"). Workspaces are stored under their digest, as ``sha256-<64 hex>``;
outputs as ``<job>/<epoch>/<task>/<name>`` where the job id and the name escape every
byte of their UTF-8 outside ``[-_.A-Za-z0-9]`` (the name keeps its ``/``) as ``=XX``,
``=`` included: reversible, and within the names every client accepts.

Every nats error is translated here into an :class:`ObjectStoreError` whose message is
one sentence: :class:`StoreMissing` (JetStream off, or a bucket never created),
:class:`ObjectMissing`, :class:`DigestMismatch`, :class:`StoreUnavailable` (timeouts).
Listing outputs reads the metadata of every object in the bucket (names are hashed
into subjects, so the server cannot filter by job): Postgres keeps the references.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import io
import json
import os
import re
import stat
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

import nats.errors
from nats.aio.client import Client
from nats.js import api
from nats.js import errors as js_errors

from irisfed.shared.federation.peer import PEER_ID_PATTERN
from irisfed.shared.users import DEFAULT_USER, USER_ID_PATTERN
from irisfed.shared.workspace import DIGEST_RE

WORKSPACES = "irisfed-workspaces"
OUTPUTS = "irisfed-outputs"
KINDS = ("workspaces", "outputs", "logs")  # logs: a peer's log stream (logstore.py), named alike
MAX_REPLICAS = 3
CHUNKS_PER_GET = 32  # chunks a read asks for at once (nats-py's chunks are 128 KiB: 4 MiB)
# What ``send_chunks`` asks the store to send at once: bounded by bytes (the reader asks
# for the next window only when one ended, so a reader never has more than this on its
# way), and by count only as the server requires a batch size.
WINDOW_BYTES = 8 * 1024 * 1024
WINDOW_CHUNKS_MAX = 10_000
MIN_RATE = 1024 * 1024  # bytes/s a put is given beyond timeout_s: 1 MiB/s, a slow link's worst
_STREAM_NOT_FOUND, _STREAM_NAME_IN_USE = 10059, 10058  # JetStream error codes
_NO_PEERS_FOR_PLACEMENT = 10005  # JetStream: no suitable peers for placement (too few nodes current)
_PLAIN = re.compile(r"[A-Za-z0-9._-]")
_ESCAPED = re.compile(r"(?:=[0-9A-F]{2})+")
_NUMBER = re.compile(r"[0-9]+")
_NUID = re.compile(r"[A-Za-z0-9]{1,64}")  # an object's chunk subject token (nats-py: a 22-letter NUID)
_USER = re.compile(USER_ID_PATTERN)
_PEER = re.compile(PEER_ID_PATTERN)


@dataclass(frozen=True)
class ChunkSource:
    """Where a stored object's chunks are: its bucket's stream and chunk subject, its
    recorded size and the store's own record of their SHA-256 (``SHA-256=<base64url>``,
    or "" when it has none)."""

    stream: str
    subject: str
    size: int
    sha256: str


class ObjectStoreError(Exception):
    """Anything the object store could not do; the message is one sentence."""


class StoreMissing(ObjectStoreError):
    """JetStream is off, or the federation's buckets were never created."""


class StoreUnavailable(ObjectStoreError):
    """NATS did not answer in time, or the connection is gone: worth retrying later."""


class ObjectMissing(ObjectStoreError):
    """No such workspace or output (never stored, deleted, or past its retention)."""


class ObjectTooLarge(ObjectStoreError):
    """An object bigger than the reader allows (its recorded size, before any byte is read)."""


class DigestMismatch(ObjectStoreError):
    """The bytes stored under a digest are not the bytes that digest names."""


def bucket(prefix: str = "irisfed", kind: str = "workspaces", user: str = DEFAULT_USER,
           peer: str | None = None) -> str:
    """The bucket of ``kind`` ("workspaces"/"outputs", or WORKSPACES/OUTPUTS) of ``user``
    for a subject prefix; with ``peer``, that user's bucket at that peer (its outputs
    from there): ``__<peer>`` appended, ``_`` escaped as ``_5F`` in every part so no two
    names meet."""
    kind = kind.removeprefix("irisfed-")
    if kind not in KINDS:
        raise ValueError(f"unknown object store kind {kind!r}: expected one of {', '.join(KINDS)}")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", prefix):
        raise ValueError(f"invalid subject prefix {prefix!r}")
    name = f"{prefix.replace('_', '_5F').replace('.', '_2E')}-{kind}"
    if user != DEFAULT_USER:
        if not _USER.fullmatch(user):
            raise ValueError(f"invalid user id {user!r}")
        name = f"{name}-{user.replace('_', '_5F')}"
    if peer is not None:
        if not _PEER.fullmatch(peer):
            raise ValueError(f"invalid peer id {peer!r}")
        name = f"{name}__{peer.replace('_', '_5F')}"
    return name


def workspace_object(digest: str) -> str:
    """The object name of a workspace digest ("sha256:<hex>" -> "sha256-<hex>")."""
    if not DIGEST_RE.fullmatch(digest):
        raise ValueError(f"not a workspace digest (sha256:<64 lowercase hex>): {digest!r}")
    return digest.replace(":", "-", 1)


def _escape(text: str, keep: str = "") -> str:
    return "".join(ch if _PLAIN.fullmatch(ch) or ch in keep else
                   "".join(f"={b:02X}" for b in ch.encode("utf-8")) for ch in text)


def _unescape(text: str) -> str:
    return _ESCAPED.sub(lambda m: bytes.fromhex(m.group(0).replace("=", "")).decode("utf-8"), text)


def output_object(job_id: str, epoch: int, task: int, name: str) -> str:
    """The object name of one output file: ``<job>/<epoch>/<task>/<name>``, escaped."""
    if not job_id:
        raise ValueError("an output needs a job id")
    if not (isinstance(epoch, int) and isinstance(task, int) and epoch >= 0 and task >= 0):
        raise ValueError(f"epoch and task must be non-negative integers, not {epoch!r} and {task!r}")
    parts = name.split("/")
    if "\0" in name or any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"an output name must be a relative path without empty, '.' or '..' parts: {name!r}")
    return f"{_escape(job_id)}/{epoch}/{task}/{_escape(name, keep='/')}"


def parse_output_object(object_name: str) -> tuple[str, int, int, str] | None:
    """(job id, epoch, task, name) of an output object name; None if it is not one."""
    parts = object_name.split("/", 3)
    if len(parts) != 4 or not (_NUMBER.fullmatch(parts[1]) and _NUMBER.fullmatch(parts[2])):
        return None
    try:
        return _unescape(parts[0]), int(parts[1]), int(parts[2]), _unescape(parts[3])
    except UnicodeDecodeError:
        return None


class _Bounded(io.RawIOBase):
    """A binary file read up to ``limit`` bytes, then at its end."""

    def __init__(self, source, limit: int) -> None:
        self._source, self._left = source, limit

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self._left <= 0:
            return 0
        view = memoryview(buffer)[:self._left]
        n = self._source.readinto(view)
        self._left -= n or 0
        return n or 0


def store_digest(raw_sha256: bytes) -> str:
    """How JetStream's object store records an object's SHA-256 (``ObjectInfo.digest``)."""
    return "SHA-256=" + base64.urlsafe_b64encode(raw_sha256).decode()


def _missing_message(name: str) -> str:
    return (f"the federation's object store (JetStream bucket {name}) is missing: JetStream must be on "
            f"in the NATS servers and the buckets created by `irisfed up` (ensure_buckets)")


# What a NATS call raises when the server does not answer (now): StoreUnavailable, retried.
NATS_AWAY = (TimeoutError, nats.errors.TimeoutError, nats.errors.ConnectionClosedError,
             nats.errors.StaleConnectionError, nats.errors.OutboundBufferLimitError)


@contextlib.contextmanager
def _boundary(what: str, bucket_name: str):
    """Translate nats errors raised while doing ``what`` into ObjectStoreError."""
    try:
        yield
    except ObjectStoreError:
        raise
    except (js_errors.BucketNotFoundError, js_errors.ServiceUnavailableError,
            js_errors.NoStreamResponseError, nats.errors.NoRespondersError) as exc:
        raise StoreMissing(_missing_message(bucket_name)) from exc
    except js_errors.NotFoundError as exc:  # ObjectNotFoundError hides a missing stream in its context
        cause = exc if getattr(exc, "err_code", None) else exc.__context__
        if getattr(cause, "err_code", None) == _STREAM_NOT_FOUND:
            raise StoreMissing(_missing_message(bucket_name)) from exc
        raise ObjectMissing(f"{what} failed: it is not in the object store (bucket {bucket_name})") from exc
    except js_errors.DigestMismatchError as exc:
        raise DigestMismatch(f"{what} failed: the stored chunks do not match their recorded digest") from exc
    except NATS_AWAY as exc:
        raise StoreUnavailable(f"{what} failed: NATS did not answer ({type(exc).__name__})") from exc
    except nats.errors.Error as exc:
        raise ObjectStoreError(f"{what} failed in the object store (bucket {bucket_name}): {exc}") from exc


def creation_refused(exc: js_errors.BadRequestError, what: str, replicas: int) -> None:
    """JetStream refused to create ``what`` (a bucket or a stream): return when a
    concurrent call created it first; StoreUnavailable when the cluster does not have
    the nodes for its replicas yet (one just started has not all of them current); else
    ``exc`` again."""
    if exc.err_code == _NO_PEERS_FOR_PLACEMENT:
        raise StoreUnavailable(f"creating {what} failed: the NATS cluster does not have {replicas} nodes ready "
                               f"for its replicas (still starting, or fewer nodes)") from exc
    if exc.err_code != _STREAM_NAME_IN_USE:
        raise exc


async def ensure_buckets(nc: Client, prefix: str = "irisfed", replicas: int = 1,
                         output_ttl_s: float = 7 * 86400, users: Iterable[str] = (),
                         wait_s: float = 0.0, peers: Iterable[str] = (), log_ttl_s: float = 7 * 86400) -> None:
    """Create the buckets of the user ``default`` and of each of ``users`` if missing
    (idempotent, safe concurrently): its workspaces, and at each of ``peers`` its
    outputs; and each peer's log stream (``logstore.py``, kept ``log_ttl_s``).
    ``replicas``: the cluster's NATS nodes, capped at
    three. An existing outputs bucket gets ``output_ttl_s`` as its max age when that
    changed. ``wait_s``: how long to keep trying while JetStream does not answer yet (a
    cluster just started has no meta leader for a few seconds); then
    :class:`StoreMissing` as at once."""
    deadline = asyncio.get_running_loop().time() + wait_s
    users, peers = list(users), list(peers)
    while True:
        try:
            await _ensure_buckets(nc, prefix, replicas, output_ttl_s, users, peers)
            from irisfed.services.common.logstore import ensure_log_streams

            return await ensure_log_streams(nc, prefix, peers, replicas, log_ttl_s)
        except (StoreMissing, StoreUnavailable):
            if asyncio.get_running_loop().time() >= deadline:
                raise
        await asyncio.sleep(0.5)  # a bounded retry of a server that is starting, not a poll of work


async def _ensure_buckets(nc: Client, prefix: str, replicas: int, output_ttl_s: float,
                          users: list[str], peers: list[str]) -> None:
    js = nc.jetstream()
    replicas = max(1, min(int(replicas), MAX_REPLICAS))
    every = dict.fromkeys([DEFAULT_USER, *users])
    wanted = [(u, "workspaces", None, None) for u in every] + [
        (u, "outputs", peer, float(output_ttl_s)) for u in every for peer in dict.fromkeys(peers)]
    for user, kind, peer, ttl in wanted:
        name = bucket(prefix, kind, user, peer)
        with _boundary(f"creating bucket {name}", name):
            try:
                info = await js.stream_info(f"OBJ_{name}")
            except js_errors.NotFoundError:
                config = api.ObjectStoreConfig(description=f"irisfed {kind} (DESIGN 3.5)", ttl=ttl,
                                               storage=api.StorageType.FILE, replicas=replicas)
                try:
                    await js.create_object_store(name, config=config)
                except js_errors.BadRequestError as exc:
                    creation_refused(exc, f"bucket {name}", replicas)
                continue
            if ttl is not None and info.config.max_age != ttl:
                info.config.max_age = ttl
                await js.update_stream(info.config)


class ObjectStore:
    """Workspaces and outputs of ``user`` in the federation under ``prefix``, over client
    ``nc``: its workspaces, and with ``peer`` its outputs from runs at that peer (outputs
    need a peer). ``timeout_s`` bounds each whole transfer (a get never waits for chunks
    forever)."""

    def __init__(self, nc: Client, prefix: str = "irisfed", *, user: str = DEFAULT_USER,
                 peer: str | None = None, timeout_s: float = 120.0) -> None:
        self._nc = nc
        self._js = None  # JetStream's context, made on first use
        self.user = user
        self.peer = peer
        self._names = {"workspaces": bucket(prefix, "workspaces", user)}
        if peer is not None:
            self._names["outputs"] = bucket(prefix, "outputs", user, peer)
        self._stores: dict[str, object] = {}
        self._timeout_s = timeout_s

    async def open(self) -> ObjectStore:
        """Open its buckets now (else on first use); StoreMissing if one is missing."""
        for kind in self._names:
            await self._store(kind)
        return self

    async def _store(self, kind: str):
        if kind not in self._names:
            raise ValueError("outputs are kept per peer: open the store with peer=<the run's peer>")
        if kind not in self._stores:
            if self._js is None:
                self._js = self._nc.jetstream()
            name = self._names[kind]
            with _boundary(f"opening bucket {name}", name):
                self._stores[kind] = await asyncio.wait_for(self._js.object_store(name), self._timeout_s)
        return self._stores[kind]

    async def _call(self, kind: str, what: str, call, size: int = 0):
        """``call(store)`` within ``timeout_s``, plus a second per MIN_RATE bytes of
        ``size`` it sends (a large put over a slow link takes as long as it must)."""
        store = await self._store(kind)
        with _boundary(what, self._names[kind]):
            return await asyncio.wait_for(call(store), self._timeout_s + size / MIN_RATE)

    async def _get(self, kind: str, what: str, object_name: str, max_bytes: int | None = None) -> bytes:
        return (await self._get_hashed(kind, what, object_name, max_bytes))[0]

    async def _get_hashed(self, kind: str, what: str, object_name: str,
                          max_bytes: int | None = None) -> tuple[bytes, bytes]:
        """An object's bytes and their SHA-256 (hashed chunk by chunk as they arrive),
        read chunk by chunk from its own stream: never through a link
        (an object pointing elsewhere is refused: a bucket's writer could aim it at a
        bucket only the reader may read), never more than its recorded size or
        ``max_bytes`` (refused before anything is read, or as soon as more arrives). Each
        chunk is one direct get (the next message on the object's chunk subject), within
        ``timeout_s``: a large object takes as long as it takes, a stalled one fails, and
        chunks that end before the recorded size are a DigestMismatch at once. No
        consumer is made: readers need no right to create one (a consumer delivers to
        any subject its creator names, docs/decisions.md "The object store's rights")."""
        source = await self._source(kind, what, object_name, max_bytes)
        with _boundary(what, self._names[kind]):
            size = source.size
            if size == 0:
                return b"", hashlib.sha256(b"").digest()
            sink = io.BytesIO()
            sha = hashlib.sha256()
            got = 0
            async for data in self._chunks(source.stream, source.subject):
                if got + len(data) > size:
                    raise DigestMismatch(f"{what} failed: the stored chunks hold more than the "
                                         f"{size:,} bytes recorded")
                got += len(data)
                sha.update(data)
                sink.write(data)
                if got == size:
                    break
            if got < size:
                raise DigestMismatch(f"{what} failed: the stored chunks end at {got:,} of the "
                                     f"{size:,} bytes recorded")
            if source.sha256 and source.sha256 != store_digest(sha.digest()):
                raise DigestMismatch(f"{what} failed: the stored chunks do not match their recorded digest")
            return sink.getvalue(), sha.digest()

    async def _source(self, kind: str, what: str, object_name: str, max_bytes: int | None) -> ChunkSource:
        """Where an object's chunks are, refused as ``_get_hashed`` says (a link; over
        ``max_bytes``; metadata naming anything but one plain token for its chunks: its
        bucket's writer wrote it, and a wildcard would take every object's)."""
        name = self._names[kind]
        store = await self._store(kind)
        with _boundary(what, name):
            info = await asyncio.wait_for(store.get_info(object_name), self._timeout_s)
        if info.is_link():
            raise ObjectMissing(f"{what} failed: the object is a link to another bucket, which is refused")
        if max_bytes is not None and (info.size or 0) > max_bytes:
            raise ObjectTooLarge(f"{what} failed: it holds {info.size:,} bytes, over the {max_bytes:,} allowed")
        if not _NUID.fullmatch(info.nuid or ""):
            raise DigestMismatch(f"{what} failed: the object names no chunks of its own")
        return ChunkSource(f"OBJ_{name}", f"$O.{name}.C.{info.nuid}", info.size or 0, info.digest or "")

    async def _chunks(self, stream: str, subject: str) -> AsyncIterator[bytes]:
        """The messages on ``subject`` of ``stream`` in order, CHUNKS_PER_GET at a time: a
        batched direct get (one request, the server sends them and then an end-of-batch
        status), so a large object costs a round trip per batch, not per chunk; each
        message within ``timeout_s``."""
        inbox = self._nc.new_inbox()
        sub = await self._nc.subscribe(inbox)
        try:
            seq = 1
            while True:
                request = json.dumps({"seq": seq, "next_by_subj": subject, "batch": CHUNKS_PER_GET}).encode()
                await self._nc.publish(f"$JS.API.DIRECT.GET.{stream}", request, reply=inbox)
                sent = 0
                while True:
                    msg = await sub.next_msg(timeout=self._timeout_s)
                    status = (msg.headers or {}).get(api.Header.STATUS)
                    if status == "204":  # end of this batch
                        break
                    if status == "404":  # nothing more on the subject
                        return
                    if status:
                        description = (msg.headers or {}).get(api.Header.DESCRIPTION, "")
                        raise ObjectStoreError(f"reading {subject} failed: {status} {description}".strip())
                    sent += 1
                    seq = int(msg.headers["Nats-Sequence"]) + 1
                    yield msg.data or b""
                if sent < CHUNKS_PER_GET:
                    return
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def put_workspace(self, data: bytes) -> tuple[str, int, bool]:
        """Store a packed workspace under its digest: (digest, size, stored_now). An object
        already there whose chunks the store recorded as these very bytes (its own
        SHA-256 of them, not only its size) is not sent again."""
        raw = hashlib.sha256(data).digest()
        digest = "sha256:" + raw.hex()
        try:
            info = await self._call("workspaces", f"looking up workspace {digest}",
                                    lambda store: store.get_info(workspace_object(digest)))
        except ObjectMissing:
            info = None
        if info is not None and info.size == len(data) and info.digest == store_digest(raw):
            return digest, len(data), False
        await self._call("workspaces", f"storing workspace {digest}",
                         lambda store: store.put(workspace_object(digest), data), len(data))
        return digest, len(data), True

    async def has_workspace(self, digest: str) -> int | None:
        """The stored size of workspace ``digest``, or None when it is not stored (a link
        to another bucket is not stored here: it is refused like a missing object)."""
        try:
            info = await self._call("workspaces", f"looking up workspace {digest}",
                                    lambda store: store.get_info(workspace_object(digest)))
        except ObjectMissing:
            return None
        return None if info.is_link() else info.size

    async def get_workspace(self, digest: str, max_bytes: int | None = None) -> bytes:
        """The bytes of workspace ``digest`` (at most ``max_bytes``), verified against it."""
        what = f"fetching workspace {digest}"
        try:
            data, raw = await self._get_hashed("workspaces", what, workspace_object(digest), max_bytes)
        except ObjectMissing:
            raise ObjectMissing(f"workspace {digest} is not in the object store") from None
        except DigestMismatch:
            raise DigestMismatch(f"workspace {digest} is corrupt in the object store: its chunks "
                                 f"do not match their recorded digest") from None
        actual = "sha256:" + raw.hex()  # hashed as the chunks came: not again, on the loop
        if actual != digest:
            raise DigestMismatch(f"the object stored as workspace {digest} holds other bytes ({actual})")
        return data

    async def workspace_source(self, digest: str, max_bytes: int | None = None) -> ChunkSource:
        """Where the chunks of workspace ``digest`` are (refused as ``get_workspace``
        refuses before reading: not stored, a link, over ``max_bytes``), for
        ``send_chunks``."""
        try:
            return await self._source("workspaces", f"fetching workspace {digest}", workspace_object(digest),
                                      max_bytes)
        except ObjectMissing:
            raise ObjectMissing(f"workspace {digest} is not in the object store") from None

    async def send_chunks(self, source: ChunkSource, reply: str, from_seq: int = 1,
                          window_bytes: int = WINDOW_BYTES) -> None:
        """Have the store send ``source``'s chunks from stream sequence ``from_seq`` on,
        at most ``window_bytes`` of them (one chunk at least), straight to ``reply``: a
        batched direct get answered there, each chunk a message with its
        ``Nats-Sequence``, then a status message: 204 (the window's end; its
        ``Nats-Num-Pending`` says how many chunks remain, ``Nats-Last-Sequence`` where it
        stopped) or 404 (no chunk at or after ``from_seq``). The bytes never pass through
        this client; the reader verifies them."""
        request = json.dumps({"seq": max(1, from_seq), "next_by_subj": source.subject, "batch": WINDOW_CHUNKS_MAX,
                              "max_bytes": window_bytes}).encode()
        with _boundary(f"sending {source.subject}", source.stream.removeprefix("OBJ_")):
            await self._nc.publish(f"$JS.API.DIRECT.GET.{source.stream}", request, reply=reply)

    async def delete_workspace(self, digest: str) -> bool:
        """Remove workspace ``digest``; False if it was not there."""
        try:
            await self._call("workspaces", f"deleting workspace {digest}",
                             lambda store: store.delete(workspace_object(digest)))
        except ObjectMissing:
            return False
        return True

    async def put_output(self, job_id: str, epoch: int, task: int, name: str, data: bytes) -> int:
        """Store one output file of a run (replacing one of the same name); its size."""
        object_name = output_object(job_id, epoch, task, name)
        await self._call("outputs", f"storing output {name!r} of job {job_id} epoch {epoch} task {task}",
                         lambda store: store.put(object_name, data), len(data))
        return len(data)

    async def put_output_file(self, job_id: str, epoch: int, task: int, name: str, path: str, size: int) -> None:
        """Store one output file from disk, at most ``size`` bytes (what was scanned: a
        file still growing is cut there), read as it is sent. The path must be a regular
        file, opened without following a link (one swapped in since the scan is refused)."""
        object_name = output_object(job_id, epoch, task, name)

        async def put(store) -> None:
            fd = await asyncio.to_thread(os.open, path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as source:
                if not stat.S_ISREG(os.fstat(source.fileno()).st_mode):
                    raise OSError(f"{name!r} is no longer a regular file")
                await store.put(object_name, _Bounded(source, size))
        await self._call("outputs", f"storing output {name!r} of job {job_id} epoch {epoch} task {task}", put,
                         size)

    async def get_output(self, job_id: str, epoch: int, task: int, name: str,
                         max_bytes: int | None = None) -> bytes:
        """The bytes of one output file (ObjectTooLarge past ``max_bytes``); ObjectMissing
        if absent or expired."""
        what = f"fetching output {name!r} of job {job_id} epoch {epoch} task {task}"
        try:
            return await self._get("outputs", what, output_object(job_id, epoch, task, name), max_bytes)
        except ObjectMissing:
            raise ObjectMissing(f"output {name!r} of job {job_id} epoch {epoch} task {task} "
                                f"is not in the object store") from None

    async def list_outputs(self, job_id: str, epoch: int | None = None,
                           task: int | None = None) -> list[tuple[int, int, str, int]]:
        """(epoch, task, name, size) of each stored output of ``job_id``, sorted: every
        object's metadata read by direct gets (no consumer), one at a time."""
        await self._store("outputs")
        name = self._names["outputs"]
        found = []
        seq = 1
        with _boundary(f"listing outputs of job {job_id}", name):
            while True:
                try:
                    msg = await asyncio.wait_for(
                        self._js.get_msg(f"OBJ_{name}", seq=seq, subject=f"$O.{name}.M.>", direct=True, next=True),
                        self._timeout_s)
                except js_errors.NotFoundError:
                    break
                seq = msg.seq + 1
                try:
                    info = api.ObjectInfo.from_response(json.loads(msg.data or b"{}"))
                except (ValueError, TypeError, KeyError):
                    continue  # not metadata this store wrote
                parsed = parse_output_object(info.name) if isinstance(info.name, str) else None
                if info.deleted or parsed is None or parsed[0] != job_id:
                    continue
                if (epoch is None or parsed[1] == epoch) and (task is None or parsed[2] == task):
                    found.append((parsed[1], parsed[2], parsed[3], info.size or 0))
        return sorted(found)
