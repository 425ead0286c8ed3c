"""The router's check of a submit's workspace (docs/design.md §3.5): it must be stored.

A submit naming ``workspace: {digest, size}`` is accepted only when the submitting
user's own workspaces bucket holds that digest with that size (another user's digest
is not this user's to name), and the size is within ``max_workspace_mb``; else
``invalid_request`` naming the digest, before anything is written. Dry runs are
checked the same way. A digest once seen stored is remembered (bounded), so a
thousand jobs sharing one workspace cost one lookup; one deleted afterwards is the
agent's to find (the job fails naming it, never runs something else). Jobs without a
workspace never reach this module.

Then, when the job's peer starts it, that peer's agent asks for the workspace to be
staged at its peer (``WorkspaceStaging``): an agent reads only its own peer's buckets,
so the router, which checks the job is that peer's now, is the one to copy it there.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from nats.aio.client import Client

from irisfed.services.common.objects import (
    DigestMismatch,
    ObjectMissing,
    ObjectStore,
    ObjectStoreError,
    ObjectTooLarge,
    StoreMissing,
)
from irisfed.shared.errors import Forbidden, InvalidRequest, NotFound, Unavailable
from irisfed.shared.lifecycle import JobState
from irisfed.shared.messages import StageReply, StageRequest, Workspace
from irisfed.shared.records import JobRow

REMEMBERED = 4096  # digests known stored, most recently used kept


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


def stage_refusal(row: JobRow | None, peer_id: str, epoch: int) -> str | None:
    """Why ``peer_id`` may not have the workspace of ``row`` staged for its run of
    ``epoch`` (None: it may). Only the peer the job is assigned to, or running on, under
    that very epoch: an agent's NATS rights read only what was staged at its own peer,
    so this check is what keeps one peer from reading the workspaces of jobs it was
    never given."""
    if row is None:
        return "no such job"
    if row.owner_peer_id != peer_id or row.epoch != epoch or row.state not in (JobState.ASSIGNED,
                                                                             JobState.RUNNING):
        return f"job {row.job_id} is not assigned to {peer_id} under epoch {epoch}"
    workspace = (row.spec or {}).get("workspace")
    if not isinstance(workspace, dict) or not isinstance(workspace.get("digest"), str):
        return f"job {row.job_id} has no workspace"
    return None


class WorkspaceStaging:
    """Copies a job's workspace from its user's bucket into that user's bucket at the
    job's peer, when that peer's agent asks for a job assigned to it (docs/design.md
    §3.5). A copy already staged is not made again; concurrent asks for one copy share
    it; at most ``concurrency`` copies run at once (each holds the workspace in memory,
    at most ``max_bytes``)."""

    def __init__(self, nc: Client, prefix: str, db, max_bytes: int, timeout_s: float = 120.0,
                 concurrency: int = 2) -> None:
        self.nc, self.prefix, self.db = nc, prefix, db
        self.max_bytes, self.timeout_s = max_bytes, timeout_s
        self.copying: dict[tuple[str, str, str], asyncio.Future] = {}
        self.slots = asyncio.Semaphore(concurrency)
        self.copies = 0  # copies made (tests and the bench read it)

    async def stage(self, peer_id: str, request: StageRequest) -> StageReply:
        """Raise Forbidden (not this peer's job now), NotFound (the workspace is gone from
        the store), InvalidRequest (corrupt there, or over the cap) or Unavailable (retry
        later)."""
        row = await self.db.job_get(request.job_id)
        why = stage_refusal(row, peer_id, request.epoch)
        if why is not None:
            raise Forbidden(f"stage: {why}")
        digest, size, user = row.spec["workspace"]["digest"], int(row.spec["workspace"].get("size", 0)), row.user_id
        key = (user, digest, peer_id)
        shared = self.copying.get(key)
        if shared is None:
            shared = self.copying[key] = asyncio.ensure_future(self.copy(user, digest, peer_id))
            shared.add_done_callback(lambda done: (self.copying.pop(key, None),
                                                   done.cancelled() or done.exception()))
        await asyncio.shield(shared)
        return StageReply(request.job_id, digest, size)

    async def close(self) -> None:
        """Cancel the copies still running (their askers get no answer: they ask again)."""
        for copying in list(self.copying.values()):
            copying.cancel()
        await asyncio.gather(*self.copying.values(), return_exceptions=True)

    async def copy(self, user: str, digest: str, peer_id: str) -> None:
        """The copy itself (no job checked: ``stage`` checks first): nothing when the
        peer's bucket holds the digest already."""
        staged = ObjectStore(self.nc, self.prefix, user=user, peer=peer_id, timeout_s=self.timeout_s)
        try:
            if await staged.has_workspace(digest) is not None:
                return
            async with self.slots:
                source = ObjectStore(self.nc, self.prefix, user=user, timeout_s=self.timeout_s)
                data = await source.get_workspace(digest, self.max_bytes)
                await staged.put_workspace(data)
                self.copies += 1
        except ObjectMissing as exc:
            raise NotFound(f"stage: {exc}") from None
        except (DigestMismatch, ObjectTooLarge) as exc:
            raise InvalidRequest(f"stage: {exc}") from None
        except ObjectStoreError as exc:
            raise Unavailable(f"stage: {exc}") from None
