"""The federation's log streams (docs/design.md §3.6; layout in ``shared/logs.py``):
one JetStream stream per peer, ``<prefix>-logs__<peer>`` (named like the buckets,
:func:`irisfed.services.common.objects.bucket`), kept ``log_retention_days``.

``LogStore`` is every read and write of them: an agent publishes a run's pieces
(each acknowledged, ids making a retried publish stored once), finds where it
stopped (the subject's last message), and purges a subject's oldest pieces; the
router reads pieces in order, a batch at a time (direct gets: no consumer, as for the
object store). Errors are ``ObjectStoreError``s of ``objects.py`` (one sentence each):
``StoreMissing`` for a stream never created, ``StoreUnavailable`` when NATS does not
answer.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable
from datetime import UTC, datetime

import nats.errors
from nats.aio.client import Client
from nats.js import api
from nats.js import errors as js_errors

from irisfed.services.common.objects import (
    MAX_REPLICAS,
    NATS_AWAY,
    ObjectStoreError,
    StoreMissing,
    StoreUnavailable,
    bucket,
    creation_refused,
)
from irisfed.shared.logs import END_HEADER, OFFSET_HEADER, Piece, peer_logs_subjects
from irisfed.shared.users import DEFAULT_USER

DUPLICATE_WINDOW_S = 600.0  # a publish retried within this is stored once (ids are subject + offset)
PIECES_PER_GET = 64


def log_stream(prefix: str, peer: str) -> str:
    """The stream holding ``peer``'s logs."""
    return bucket(prefix, "logs", DEFAULT_USER, peer)


async def ensure_log_streams(nc: Client, prefix: str, peers: Iterable[str], replicas: int = 1,
                             ttl_s: float = 7 * 86400) -> None:
    """Create each peer's log stream if missing (idempotent, safe concurrently); an
    existing one gets ``ttl_s`` as its max age when that changed."""
    js = nc.jetstream()
    replicas = max(1, min(int(replicas), MAX_REPLICAS))
    for peer in dict.fromkeys(peers):
        name = log_stream(prefix, peer)
        try:
            try:
                info = await js.stream_info(name)
            except js_errors.NotFoundError:
                config = api.StreamConfig(
                    name=name, description="irisfed logs (DESIGN 3.6)", subjects=[peer_logs_subjects(prefix, peer)],
                    storage=api.StorageType.FILE, num_replicas=replicas, max_age=float(ttl_s),
                    duplicate_window=DUPLICATE_WINDOW_S, allow_direct=True, discard=api.DiscardPolicy.OLD)
                try:
                    await js.add_stream(config)
                except js_errors.BadRequestError as exc:
                    creation_refused(exc, f"log stream {name}", replicas)
                continue
            if info.config.max_age != float(ttl_s):
                info.config.max_age = float(ttl_s)
                await js.update_stream(info.config)
        except (js_errors.ServiceUnavailableError, js_errors.NoStreamResponseError,
                nats.errors.NoRespondersError) as exc:
            raise StoreMissing(f"JetStream is not enabled on the NATS server (creating stream {name})") from exc
        except (TimeoutError, nats.errors.TimeoutError) as exc:
            raise StoreUnavailable(f"creating log stream {name} failed: NATS did not answer") from exc


def _time(stamp: str | None) -> float:
    if not stamp:
        return 0.0
    whole, _, rest = stamp.rstrip("Z").partition(".")
    moment = datetime.fromisoformat(whole).replace(tzinfo=UTC).timestamp()
    return moment + (float(f"0.{rest}") if rest.isdigit() else 0.0)


def _piece(msg) -> Piece:
    headers = msg.headers or {}
    end = headers.get(END_HEADER)
    return Piece(seq=int(headers.get("Nats-Sequence", 0)), offset=int(headers.get(OFFSET_HEADER, 0) or 0),
                 data=msg.data or b"", time=_time(headers.get("Nats-Time-Stamp")),
                 end=int(end) if end is not None else None)


class LogStore:
    """One peer's log stream, over client ``nc``: ``timeout_s`` bounds each call."""

    def __init__(self, nc: Client, prefix: str, peer: str, timeout_s: float = 10.0) -> None:
        self.nc, self.prefix, self.peer, self.timeout_s = nc, prefix, peer, timeout_s
        self.stream = log_stream(prefix, peer)
        self._js = None  # JetStream's context, made on first publish

    async def publish(self, subject: str, offset: int, data: bytes, end: int | None = None) -> int | None:
        """Store one piece (or, with ``end``, the end message); its stream sequence, or
        None when a piece of that subject and offset was stored already (a retried
        publish: what is stored may be shorter than ``data``; read the subject again)."""
        headers = {OFFSET_HEADER: str(offset), "Nats-Msg-Id": f"{subject}@{offset}{'/end' if end is not None else ''}"}
        if end is not None:
            headers[END_HEADER] = str(end)
        if self._js is None:
            self._js = self.nc.jetstream(timeout=self.timeout_s)
        try:
            ack = await self._js.publish(subject, data, stream=self.stream, headers=headers)
        except (js_errors.NoStreamResponseError, nats.errors.NoRespondersError) as exc:
            raise StoreMissing(f"log stream {self.stream} is missing (irisfed up creates it)") from exc
        except NATS_AWAY as exc:
            raise StoreUnavailable(f"shipping to {self.stream} failed: NATS did not answer") from exc
        except nats.errors.Error as exc:
            raise ObjectStoreError(f"shipping to {self.stream} failed: {exc}") from exc
        return None if ack.duplicate else ack.seq

    async def last(self, subject: str) -> Piece | None:
        """The newest message of ``subject`` (None: there is none)."""
        pieces = await self._direct({"last_by_subj": subject}, batch=False)
        return pieces[0] if pieces else None

    async def read(self, subject: str, seq: int = 1, since: float | None = None,
                   limit: int = PIECES_PER_GET, max_bytes: int = 1 << 20) -> list[Piece]:
        """``subject``'s messages from stream sequence ``seq`` (or, with ``since``, from that
        time), oldest first: at most ``limit`` of them and about ``max_bytes``."""
        request: dict = {"next_by_subj": subject, "batch": limit, "max_bytes": max_bytes}
        if since is not None:
            request["start_time"] = datetime.fromtimestamp(since, UTC).isoformat().replace("+00:00", "Z")
        else:
            request["seq"] = max(1, seq)
        return await self._direct(request, batch=True)

    async def tail(self, subject: str, nbytes: int) -> tuple[list[Piece], int]:
        """The pieces holding the last ``nbytes`` of ``subject``'s file, oldest first, and
        the file's size as shipped: the piece covering that offset is found by a binary
        search over stream sequences (each probe one direct get), then read forward."""
        last = await self.last(subject)
        if last is None:
            return [], 0
        end = last.end if last.end is not None else last.offset + len(last.data)
        target = max(0, end - nbytes)
        if last.end is None and last.offset <= target:
            return [last], end
        low, high = 1, last.seq  # the piece found at ``low`` starts at or before ``target``
        first = await self.read(subject, low, limit=1)
        if not first or first[0].offset >= target:
            low = first[0].seq if first else last.seq
        else:
            while high - low > 1:
                mid = (low + high) // 2
                probe = await self.read(subject, mid, limit=1)
                if probe and probe[0].end is None and probe[0].offset <= target:
                    low = probe[0].seq
                else:
                    high = mid
        pieces: list[Piece] = []
        seq = low
        while batch := await self.read(subject, seq, max_bytes=max(nbytes, 1 << 16)):
            pieces += batch
            seq = batch[-1].seq + 1
            if batch[-1].seq >= last.seq:
                break
        return pieces, end

    async def purge_below(self, subject: str, seq: int) -> None:
        """Drop ``subject``'s messages older than stream sequence ``seq``."""
        request = json.dumps({"filter": subject, "seq": seq}).encode()
        await self._api(f"$JS.API.STREAM.PURGE.{self.stream}", request)

    async def _api(self, api_subject: str, body: bytes) -> dict:
        try:
            msg = await self.nc.request(api_subject, body, timeout=self.timeout_s)
        except nats.errors.NoRespondersError as exc:
            raise StoreMissing("JetStream is not enabled on the NATS server") from exc
        except (TimeoutError, nats.errors.TimeoutError, nats.errors.ConnectionClosedError) as exc:
            raise StoreUnavailable(f"{api_subject} failed: NATS did not answer") from exc
        answer = json.loads(msg.data or b"{}")
        error = answer.get("error")
        if error:
            if error.get("err_code") == 10059:  # stream not found
                raise StoreMissing(f"log stream {self.stream} is missing (irisfed up creates it)")
            raise ObjectStoreError(f"{api_subject} failed: {error.get('description', error)}")
        return answer

    async def _direct(self, request: dict, batch: bool) -> list[Piece]:
        """Pieces a direct get answers ``request`` with (a batch ends with status 204)."""
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        pieces: list[Piece] = []
        try:
            await self.nc.publish(f"$JS.API.DIRECT.GET.{self.stream}", json.dumps(request).encode(), reply=inbox)
            while True:
                try:
                    msg = await sub.next_msg(timeout=self.timeout_s)
                except (TimeoutError, nats.errors.TimeoutError) as exc:
                    raise StoreUnavailable(f"reading {self.stream} failed: NATS did not answer") from exc
                status = (msg.headers or {}).get(api.Header.STATUS)
                if status in ("404", "408"):  # nothing (more) to read
                    return pieces
                if status == "204":
                    return pieces
                if status == "503":
                    raise StoreMissing(f"log stream {self.stream} is missing (irisfed up creates it)")
                if status:
                    description = (msg.headers or {}).get(api.Header.DESCRIPTION, "")
                    raise ObjectStoreError(f"reading {self.stream} failed: {status} {description}".strip())
                pieces.append(_piece(msg))
                if not batch:
                    return pieces
        except nats.errors.NoRespondersError as exc:
            raise StoreMissing(f"log stream {self.stream} is missing (irisfed up creates it)") from exc
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
