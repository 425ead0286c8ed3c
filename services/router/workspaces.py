"""The router's check of a submit's workspace (docs/design.md §3.5): it must be stored.

A submit naming ``workspace: {digest, size}`` is accepted only when the submitting
user's own workspaces bucket holds that digest with that size (another user's digest
is not this user's to name), and the size is within ``max_workspace_mb``; else
``invalid_request`` naming the digest, before anything is written. Dry runs are
checked the same way. A digest once seen stored is remembered (bounded), so a
thousand jobs sharing one workspace cost one lookup; one deleted afterwards is the
agent's to find (the job fails naming it, never runs something else). Jobs without a
workspace never reach this module.
"""

from __future__ import annotations

from collections import OrderedDict

from nats.aio.client import Client

from irisfed.services.common.objects import ObjectStore, ObjectStoreError, StoreMissing
from irisfed.shared.errors import InvalidRequest, Unavailable
from irisfed.shared.messages import Workspace

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
