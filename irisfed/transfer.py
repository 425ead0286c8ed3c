"""What travels with a job and comes home (docs/design.md §3.5), for the client and CLI.

- ``store_workspace``: pack a folder (``shared.workspace.pack_workspace``), store it in
  the federation's object store under its digest (not sent again when there), and
  return the submit's ``workspace`` field. A folder that cannot travel raises
  :class:`InvalidRequestError` naming the file, before anything is stored.
- ``Output`` and ``download_outputs``: a run's output files as Postgres lists them,
  and their bytes from the store written under a local folder (names checked: nothing
  lands outside it).
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path, PurePosixPath

from irisfed.errors import InvalidRequestError, NotFoundError, UnavailableError
from irisfed.services.common.objects import ObjectMissing, ObjectStore, ObjectStoreError
from irisfed.shared.config import DEFAULT_MAX_WORKSPACE_MB
from irisfed.shared.messages import Workspace
from irisfed.shared.users import DEFAULT_USER, split_job_id
from irisfed.shared.workspace import WorkspaceError, pack_workspace


@dataclass(frozen=True)
class Output:
    """One file a run left in ``IRISFED_OUTPUT_DIR``: stored (fetch it with
    ``download_outputs``) or left out (``note`` says why)."""

    epoch: int
    task: int
    name: str
    size: int
    stored: bool
    note: str
    peer_id: str
    stored_at: datetime


def output_views(rows) -> list[Output]:
    return [Output(r.epoch, r.task_index, r.name, r.size, r.stored, r.note, r.peer_id, r.stored_at) for r in rows]


async def store_workspace(nc, prefix: str, folder: str | os.PathLike[str],
                          max_mb: int = DEFAULT_MAX_WORKSPACE_MB,
                          user: str = DEFAULT_USER) -> tuple[Workspace, bool]:
    """Pack ``folder`` and store it in ``user``'s bucket: (the submit's workspace field,
    sent now?)."""
    try:
        packed = await asyncio.to_thread(pack_workspace, Path(folder), max_mb * 1024 * 1024)
    except WorkspaceError as exc:
        raise InvalidRequestError(f"workspace: {exc}") from None
    try:
        digest, size, sent = await ObjectStore(nc, prefix, user=user).put_workspace(packed.data)
    except ObjectStoreError as exc:
        raise UnavailableError(f"workspace: {exc}") from None
    return Workspace(digest=digest, size=size), sent


def local_path(dest: Path, output: Output, by_task: bool) -> Path:
    """Where ``output`` is written under ``dest`` (``task-<i>/`` first for a gang's):
    its name must be relative and stay below (a hostile name raises InvalidRequestError)."""
    parts = PurePosixPath(output.name).parts
    if (not parts or output.name.startswith("/") or any(p in ("..", ".", "") for p in parts)
            or any(ch in output.name for ch in "\x00\\")):
        raise InvalidRequestError(f"output name {output.name!r} is not a relative path below the run's folder")
    base = dest / f"task-{output.task}" if by_task else dest
    target = base.joinpath(*parts)
    # Where a part is a drive or a root of its own (``D:`` on Windows), the join leaves dest.
    if target.drive != dest.drive or target.parts[:len(base.parts)] != base.parts:
        raise InvalidRequestError(f"output name {output.name!r} is not a relative path below the run's folder")
    return target


async def download_outputs(nc, prefix: str, job_id: str, outputs: list[Output], dest: Path,
                           by_task: bool = False) -> list[Path]:
    """Fetch each stored output of ``job_id`` (its stored id: its user's buckets, at the
    peer each run's row names) into ``dest`` (``by_task``, a gang's: under
    ``task-<i>/``); the paths written."""
    user = split_job_id(job_id)[0]
    stores: dict[str, ObjectStore] = {}
    written = []
    for output in outputs:
        if not output.stored:
            continue
        path = local_path(dest, output, by_task)
        store = stores.get(output.peer_id) or stores.setdefault(
            output.peer_id, ObjectStore(nc, prefix, user=user, peer=output.peer_id))
        try:
            data = await store.get_output(job_id, output.epoch, output.task, output.name)
        except ObjectMissing:
            raise NotFoundError(f"output {output.name!r} of job {job_id} is no longer in the object store "
                                f"(kept output_retention_days)") from None
        except ObjectStoreError as exc:
            raise UnavailableError(str(exc)) from None

        def write(path: Path = path, data: bytes = data) -> None:
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.is_symlink():
                path.unlink()
            path.write_bytes(data)
        await asyncio.to_thread(write)
        written.append(path)
    return written
