"""The router's check of a submit's workspace (docs/design.md §3.5): it must be stored.

A submit naming ``workspace: {digest, size}`` is accepted only when the submitting
user's own workspaces bucket holds that digest with that size (another user's digest
is not this user's to name), and the size is within ``max_workspace_mb``; else
``invalid_request`` naming the digest, before anything is written. Dry runs are
checked the same way. A digest once seen stored is remembered (bounded), so a
thousand jobs sharing one workspace cost one lookup; one deleted afterwards is the
agent's to find (the job fails naming it, never runs something else). Jobs without a
workspace never reach this module.

Then, when the job's peer starts it, that peer's agent asks the router for the
workspace (``WorkspaceRelay``): agents may read no workspace bucket, so the router,
which checks the job is that peer's now, has the store send it to that agent.
"""

from __future__ import annotations

import re
import time
from collections import OrderedDict
from collections.abc import Callable

import msgspec
from nats.aio.client import Client

from irisfed.services.common.log import EventLogger
from irisfed.services.common.nats_auth import AGENT_ROLE_PREFIX, SERVICE_ROLES
from irisfed.services.common.objects import (
    WINDOW_BYTES,
    DigestMismatch,
    ObjectMissing,
    ObjectStore,
    ObjectStoreError,
    ObjectTooLarge,
    StoreMissing,
)
from irisfed.shared.errors import (
    ErrorCode,
    Forbidden,
    InvalidRequest,
    IrisfedError,
    NotFound,
    Unavailable,
)
from irisfed.shared.lifecycle import JobState
from irisfed.shared.messages import (
    FETCH_PART,
    FetchEnd,
    FetchRequest,
    Workspace,
    decode_internal,
    encoder,
    error_reply,
)
from irisfed.shared.nats_urls import DEFAULT_INBOX_PREFIX, inbox_prefix
from irisfed.shared.records import JobRow
from irisfed.shared.users import STORED_JOB_ID_PATTERN, USER_ROLE_PREFIX

REMEMBERED = 4096  # digests known stored, most recently used kept
REMEMBERED_STORES = 256  # users whose bucket handle the relay keeps open
END = {FETCH_PART: "end"}
# Windows of a workspace a peer may have the store send (WindowBudget): 512 MiB/s on
# average at 8 MiB a window, above what an agent unpacks, and twice that at once.
WINDOWS_PER_S_PER_PEER = 64.0
WINDOWS_AT_ONCE_PER_PEER = 128.0
MAX_FETCH_REQUEST_BYTES = 1024  # a job id and an epoch
STORED_JOB_ID_RE = re.compile(STORED_JOB_ID_PATTERN)
log = EventLogger("router.workspaces")


class WorkspaceCheck:
    """Is a submit's workspace stored? One per router, over its NATS client."""

    def __init__(self, nc: Client, prefix: str, max_bytes: int, timeout_s: float = 5.0) -> None:
        self.nc, self.prefix, self.timeout_s = nc, prefix, timeout_s
        self.stores: dict[str, ObjectStore] = {}  # per user, opened on its first submit with a workspace
        self.max_bytes = max_bytes
        self.known: OrderedDict[tuple[str, str, int], None] = OrderedDict()
        self.lookups = 0  # object store lookups made (the bench and tests read it)

    async def check(self, workspace: Workspace, user: str) -> None:
        """Raise InvalidRequest (not stored, another size, over the cap) or Unavailable
        (the store cannot answer now); return when the submit may go on."""
        if workspace.size > self.max_bytes:
            raise InvalidRequest(
                f"workspace: {workspace.size / 2**20:,.1f} MiB is over this federation's max_workspace_mb "
                f"({self.max_bytes // 2**20:,} MiB)")
        key = (user, workspace.digest, workspace.size)
        if key in self.known:
            self.known.move_to_end(key)
            return
        self.lookups += 1
        store = self.stores.get(user)
        if store is None:
            store = self.stores[user] = ObjectStore(self.nc, self.prefix, user=user, timeout_s=self.timeout_s)
        try:
            stored = await store.has_workspace(workspace.digest)
        except StoreMissing as exc:
            raise Unavailable(f"workspace: {exc}") from None
        except ObjectStoreError as exc:
            raise Unavailable(f"workspace: cannot look up {workspace.digest} now ({exc}); retry") from None
        if stored is None:
            raise InvalidRequest(f"workspace: {workspace.digest} is not in the federation's object store; "
                                 f"store it first (irisfed submit --workspace DIR does)")
        if stored != workspace.size:
            raise InvalidRequest(f"workspace: {workspace.digest} is stored with {stored:,} bytes, "
                                 f"not the {workspace.size:,} the submit says")
        self.known[key] = None
        if len(self.known) > REMEMBERED:
            self.known.popitem(last=False)


# A fetch's reply subject: one subject, all of its tokens plain (no wildcard, nothing of
# a stream's), below an inbox prefix that is not another role's.
_PLAIN_SUBJECT_RE = re.compile(r"[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)+")
_OTHERS_INBOXES = tuple(inbox_prefix(role) for role in (*SERVICE_ROLES, AGENT_ROLE_PREFIX, USER_ROLE_PREFIX))


def fetch_inbox(reply: str, peer_id: str) -> bool:
    """Whether ``reply`` may receive ``peer_id``'s workspace. The store sends the chunks
    wherever the router's direct get names, unchecked by the server, so: an inbox
    (``_INBOX...``), all its tokens plain, and not one of another role's (another
    agent's, a user's, a service's): with NATS users each role reads only its own
    prefix, and the asking agent's own, ``_INBOX_agent-<peer>``, is taken; a deployment
    whose agents use another NATS user (its own choice) gets its inbox served too."""
    if _PLAIN_SUBJECT_RE.fullmatch(reply) is None or not reply.startswith(DEFAULT_INBOX_PREFIX):
        return False
    if reply.startswith(f"{inbox_prefix(f'{AGENT_ROLE_PREFIX}{peer_id}')}."):
        return True
    return not reply.startswith(_OTHERS_INBOXES)


def fetch_refusal(row: JobRow | None, peer_id: str, epoch: int) -> str | None:
    """Why ``peer_id`` may not have the workspace of ``row`` for its run of ``epoch``
    (None: it may). Only the peer the job is assigned to, or running on, under that very
    epoch: an agent's NATS rights read no workspace, so this check is what keeps one
    peer from reading the workspaces of jobs it was never given."""
    if row is None:
        return "no such job"
    if row.owner_peer_id != peer_id or row.epoch != epoch or row.state not in (JobState.ASSIGNED,
                                                                             JobState.RUNNING):
        return f"job {row.job_id} is not assigned to {peer_id} under epoch {epoch}"
    workspace = (row.spec or {}).get("workspace")
    if not isinstance(workspace, dict) or not isinstance(workspace.get("digest"), str):
        return f"job {row.job_id} has no workspace"
    return None


class WindowBudget:
    """How many windows each peer may have the store send: ``rate`` a second on average,
    ``burst`` at once (a token bucket per peer). A window costs the router one small
    request but the store and the network up to WINDOW_BYTES, so a peer asking again and
    again (a hostile agent) is told to wait rather than served without end."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self.left: dict[str, tuple[float, float]] = {}  # peer -> (windows left, when counted)

    def take(self, peer_id: str) -> bool:
        """Spend one of ``peer_id``'s windows; False when it has none left now."""
        now = self.clock()
        left, then = self.left.get(peer_id, (self.burst, now))
        left = min(self.burst, left + (now - then) * self.rate)
        if left < 1:
            self.left[peer_id] = (left, now)
            return False
        self.left[peer_id] = (left - 1, now)
        return True


class WorkspaceRelay:
    """Has the object store send a job's workspace to the agent of the job's peer, on
    the inbox that agent named (docs/design.md §3.5): agents may read no workspace
    bucket, so the router, which checks the job is that peer's now, asks the store to
    send it there, a window at a time (``ObjectStore.send_chunks``: the bytes go from
    the NATS servers to the agent and never through the router, which reads only the
    object's info). The agent asks for each next window the same way, checked again."""

    def __init__(self, nc: Client, prefix: str, db, max_bytes: int, timeout_s: float = 30.0) -> None:
        self.nc, self.prefix, self.db = nc, prefix, db
        self.max_bytes, self.timeout_s = max_bytes, timeout_s
        self.window_bytes = WINDOW_BYTES  # what the store sends for one request
        self.budget = WindowBudget(WINDOWS_PER_S_PER_PEER, WINDOWS_AT_ONCE_PER_PEER)
        self.relays = 0  # windows the store was asked to send (tests and the bench read it)
        self.stores: OrderedDict[str, ObjectStore] = OrderedDict()  # per user, most recently used kept

    def _store(self, user: str) -> ObjectStore:
        store = self.stores.pop(user, None) or ObjectStore(self.nc, self.prefix, user=user, timeout_s=self.timeout_s)
        self.stores[user] = store
        if len(self.stores) > REMEMBERED_STORES:
            self.stores.popitem(last=False)
        return store

    async def answer(self, peer_id: str, data: bytes, reply: str) -> None:
        """Answer ``peer_id``'s fetch request ``data`` on ``reply`` (an inbox: the
        caller's check): a window of chunks from the store and, of our own, the end (a
        FetchEnd, or an ErrorReply saying in one line why not)."""
        try:
            if len(data) > MAX_FETCH_REQUEST_BYTES:
                raise InvalidRequest(f"fetch: the request is over {MAX_FETCH_REQUEST_BYTES} bytes")
            request = decode_internal(FetchRequest, data)
            if not STORED_JOB_ID_RE.fullmatch(request.job_id):
                raise InvalidRequest("fetch: job_id is not a job id")
            if request.from_seq < 0:
                raise InvalidRequest("fetch: from_seq must be 0 or more")
            end = encoder.encode(await self.relay(peer_id, request, reply))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            end = error_reply(ErrorCode.INVALID_REQUEST, f"fetch: {exc}")
        except IrisfedError as exc:
            end = error_reply(exc.code, exc.message)
        except Exception as exc:  # noqa: BLE001 - every request gets an answer
            log.error("fetch_failed", peer_id=peer_id, exc_info=True)
            end = error_reply(ErrorCode.INTERNAL, f"fetch: internal error: {exc!r}")
        await self.end(reply, end)

    async def end(self, reply: str, body: bytes) -> None:
        """A fetch's end message (the asker times out and asks again if it is lost)."""
        try:
            await self.nc.publish(reply, body, headers=END)
        except Exception as exc:  # noqa: BLE001 - the asker times out and asks again
            log.warning("fetch_end_not_sent", error=repr(exc))

    async def relay(self, peer_id: str, request: FetchRequest, reply: str) -> FetchEnd:
        """Have the store send the window from ``request.from_seq`` to ``reply``; the end
        message is the caller's. Raise Forbidden (not this peer's job now), NotFound (the
        workspace is gone from the store), InvalidRequest (over the cap) or Unavailable
        (retry later)."""
        row = await self.db.job_get(request.job_id)
        why = fetch_refusal(row, peer_id, request.epoch)
        if why is not None:
            raise Forbidden(f"fetch: {why}")
        digest = row.spec["workspace"]["digest"]
        if not self.budget.take(peer_id):
            raise Unavailable(f"fetch: {peer_id} asked for more than {WINDOWS_PER_S_PER_PEER:g} windows a second; "
                              f"retry")
        store = self._store(row.user_id)
        try:
            source = await store.workspace_source(digest, self.max_bytes)
            await store.send_chunks(source, reply, request.from_seq, self.window_bytes)
        except ObjectMissing as exc:
            raise NotFound(f"fetch: {exc}") from None
        except (DigestMismatch, ObjectTooLarge) as exc:
            raise InvalidRequest(f"fetch: {exc}") from None
        except ObjectStoreError as exc:
            raise Unavailable(f"fetch: {exc}") from None
        self.relays += 1
        return FetchEnd(request.job_id, digest, source.size, source.sha256)
