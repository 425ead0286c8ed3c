"""A run's files beyond the peer (docs/design.md §3.5): its workspace in, its outputs out.

- In: a job's workspace is fetched through the router, chunk by chunk (only for a job
  assigned here: the agent may read no workspace bucket), into the agent's
  ``WorkspaceCache`` (workspaces.py), which copies it fresh for every run.
- Out: when a run ends (not fenced), what it left in its output directories goes to
  its user's outputs bucket in the object store and is listed in Postgres
  (``job_outputs``), before its end is reported (the job is still this peer's then);
  what is stored and what is left out, and why, is outputs.py's (pure).
- Then the run's copies of its workspace are removed: on the peer's disk they are
  only waste.

The agent (service.py) owns one ``RunFiles`` and calls it from its run path.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nats.aio.client import Client

from irisfed.services.common.log import EventLogger
from irisfed.services.common.objects import (
    ObjectMissing,
    ObjectStore,
    ObjectStoreError,
    StoreUnavailable,
    output_object,
)
from irisfed.services.common.store import Store
from irisfed.services.peer_agent.backends import WORKSPACE_FOLDER, Backend
from irisfed.services.peer_agent.outputs import MAX_LISTED, choose_outputs, scan_outputs
from irisfed.services.peer_agent.report import Run
from irisfed.services.peer_agent.workspaces import fetch_through_router
from irisfed.shared.errors import PermanentStoreError, Unavailable
from irisfed.shared.subjects import Subjects
from irisfed.shared.users import split_job_id

log = EventLogger("peer-agent")
# Workspaces fetched at once: the store sends each a window (WINDOW_BYTES) at a time, all
# into the agent's one connection, whose pending bytes nats-server caps (64 MiB by
# default) before it drops the agent as a slow consumer. The others wait their turn.
FETCHES_AT_ONCE = 4


def _remove_workspace_copies(output_dirs: list[tuple[int, Path]]) -> None:
    """A finished run's copies of its workspace (beside each task's output folder)."""
    for _task, outputs in output_dirs:
        shutil.rmtree(outputs.parent / WORKSPACE_FOLDER, ignore_errors=True)


class RunFiles:
    """Workspaces fetched for, outputs stored from, and copies removed after one peer's runs."""

    def __init__(self, nc: Client, subjects: Subjects, peer_id: str, store: Store, *,
                 max_output_bytes: int, max_workspace_bytes: int, retry_pause_s: float) -> None:
        self.nc = nc
        self.subjects = subjects
        self.peer_id = peer_id
        self.store = store
        self.max_output_bytes = max_output_bytes
        self.max_workspace_bytes = max_workspace_bytes
        self.retry_pause_s = retry_pause_s  # Postgres or the store away: the pause before trying again
        self._object_stores: dict[str, ObjectStore] = {}  # per user: each has its own buckets
        self._fetching = asyncio.Semaphore(FETCHES_AT_ONCE)

    async def fetch_workspace(self, digest: str, user: str, job: tuple[str, int] | None,
                              sink: Callable[[bytes], None]) -> str:
        """Workspace ``digest`` for run ``job``, chunk by chunk into ``sink``: sent on the
        router's word (only for a job assigned here: this agent may read no workspace
        bucket); the store's record of the chunks' SHA-256."""
        if job is None:
            raise ObjectMissing(f"workspace {digest}: no run to fetch it for")
        async with self._fetching:
            return await fetch_through_router(self.nc, self.subjects.fetch(self.peer_id), job, digest,
                                              self.max_workspace_bytes, sink)

    async def remove_copies(self, run: Run, backend: Backend | None) -> None:
        """An ended run's copies of its workspace: on the peer's disk they are only waste."""
        output_dirs = getattr(backend, "output_dirs", None)
        if output_dirs is not None:
            await asyncio.to_thread(_remove_workspace_copies, output_dirs(run.job_id, run.epoch, run.tasks))

    async def store_outputs(self, run: Run, backend: Backend) -> None:
        """Put what the run left in its output directories into the object store and
        list it in Postgres (before its end is reported: the job is still ours then).
        The store away: what is not stored yet is listed as not stored (no run's end
        waits on a store that does not answer, file after file); Postgres away: tried a
        few times, then logged."""
        output_dirs = getattr(backend, "output_dirs", None)
        if output_dirs is None:
            return
        dirs = output_dirs(run.job_id, run.epoch, run.tasks)
        found = await asyncio.to_thread(scan_outputs, dirs)
        if len(found) > MAX_LISTED:
            log.warning("outputs_not_all_listed", job_id=run.job_id, peer_id=self.peer_id, epoch=run.epoch,
                        listed=MAX_LISTED, more=len(found) - MAX_LISTED)
        outputs = choose_outputs(found, self.max_output_bytes,
                                 lambda task, name: output_object(run.job_id, run.epoch, task, name))
        store = self.objects(split_job_id(run.job_id)[0])
        rows, away = [], ""
        for out in outputs:
            stored, note = out.stored, out.note
            if stored and away:
                stored, note = False, f"not stored: {away}"
            elif stored:
                try:
                    await store.put_output_file(run.job_id, run.epoch, out.task, out.name, str(out.path), out.size)
                except StoreUnavailable as exc:
                    away = str(exc)
                    stored, note = False, f"not stored: {exc}"
                except (ObjectStoreError, OSError) as exc:
                    stored, note = False, f"not stored: {exc}"
            rows.append((run.job_id, run.epoch, out.task, out.name, out.size, stored, note))
        if rows:
            try:
                await self._retrying(lambda: self.store.job_outputs_record(self.peer_id, rows))
            except (Unavailable, PermanentStoreError) as exc:
                log.warning("outputs_not_listed", job_id=run.job_id, peer_id=self.peer_id, epoch=run.epoch,
                            error=str(exc))
            else:
                log.info("outputs_stored", job_id=run.job_id, peer_id=self.peer_id, epoch=run.epoch,
                         files=sum(1 for r in rows if r[5]), left_out=sum(1 for r in rows if not r[5]))

    def objects(self, user: str) -> ObjectStore:
        """The object store of ``user``'s outputs from this peer (a job's user: its stored id
        says)."""
        store = self._object_stores.get(user)
        if store is None:
            store = self._object_stores[user] = ObjectStore(self.nc, self.subjects.prefix, user=user,
                                                            peer=self.peer_id)
        return store

    async def _retrying(self, call: Callable[[], Any], tries: int = 3) -> Any:
        """``call()``, again after a pause while what it needs is away for now."""
        for attempt in range(tries):
            try:
                return await call()
            except (StoreUnavailable, Unavailable):
                if attempt == tries - 1:
                    raise
                await asyncio.sleep(self.retry_pause_s)
