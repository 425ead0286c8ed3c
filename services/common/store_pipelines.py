"""The store's actions on pipelines (docs/design.md §3.8): ``job_dependencies`` (jobs
waiting for jobs) and ``job_arrays`` (one submit, many jobs), over the named queries of
``shared/sql/job_dependencies.sql`` and ``job_arrays.sql``. Mixed into ``Store``, whose
runners (``_fetch``, ``_all``, ``_execute``) they use."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from irisfed.shared.records import ArrayRow, DependencyRow

# Postgres notifies it, at commit, when a job's end made queued jobs claimable (a last
# dependency met, an array's slot freed: migrations 0019 and 0020).
RELEASED_CHANNEL = "irisfed_released"


class ReleaseListener:
    """A pool connection held to listen on RELEASED_CHANNEL; ``alive`` until it is lost."""

    def __init__(self, pool: Any, conn: Any, callback: Callable[..., None]) -> None:
        self._pool, self._conn, self._callback = pool, conn, callback

    def alive(self) -> bool:
        """False once its connection is lost (terminated, Postgres restarted or failed
        over): the pool may have taken the connection back already."""
        try:
            return not self._conn.is_closed()
        except Exception:  # noqa: BLE001 - a proxy asyncpg detached from its connection
            return False

    async def close(self) -> None:
        with contextlib.suppress(Exception):  # a lost connection has nothing left to undo
            await self._conn.remove_listener(RELEASED_CHANNEL, self._callback)
        with contextlib.suppress(Exception):
            await self._pool.release(self._conn)


class PipelineQueries:
    """Dependencies and arrays: part of ``Store``."""

    # ------------------------------------------------------------ dependencies

    async def job_dependencies_lock(self, job_ids: Sequence[str]) -> dict[str, str]:
        """The states of ``job_ids`` (stored ids; absent: no such job), locked until the end
        of this store's transaction."""
        return {r["job_id"]: r["state"] for r in await self._fetch("job_dependencies_lock", list(job_ids))}

    async def job_dependencies_insert(self, job_id: str, edges: Sequence[tuple[str, str]], pending: int) -> None:
        """``job_id`` waits for (stored id, condition) each, ``pending`` of them not ended yet."""
        await self._execute("job_dependencies_insert", job_id, [e[0] for e in edges], [e[1] for e in edges], pending)

    async def job_dependencies_insert_edges(self, edges: Sequence[tuple[str, str, str]]) -> None:
        """Edges (job, needs, condition) of many jobs; their pending counts are the caller's."""
        if edges:
            await self._execute("job_dependencies_insert_edges", *[list(c) for c in zip(*edges, strict=True)])

    async def job_dependencies_of(self, job_id: str) -> list[DependencyRow]:
        return await self._all("job_dependencies_of", DependencyRow, job_id)

    async def job_dependents_of(self, job_id: str) -> list[DependencyRow]:
        return await self._all("job_dependents_of", DependencyRow, job_id)

    async def job_released_listen(self, on_release: Callable[[], None]) -> ReleaseListener:
        """Call ``on_release`` whenever a commit released queued jobs, on a pool connection
        held until the listener is closed."""
        def callback(*_: Any) -> None:
            on_release()

        async with self._translated():
            conn = await self.db.acquire()
            try:
                await conn.add_listener(RELEASED_CHANNEL, callback)
            except BaseException:
                await self.db.release(conn)
                raise
        return ReleaseListener(self.db, conn, callback)

    # ------------------------------------------------------------ arrays

    async def job_array_insert(self, array_id: str, user: str, size: int, parallel: int | None,
                               spec_hash: str, reply: bytes) -> bool:
        """Record a new array; False when ``array_id`` names one already."""
        return await self._fetchval("job_array_insert", array_id, user, size, parallel, spec_hash,
                                    reply.decode()) is not None

    async def job_array_get(self, array_id: str) -> ArrayRow | None:
        return await self._one("job_array_get", ArrayRow, array_id)

    async def job_array_mark(self, array_id: str, elements: Sequence[tuple[str, int, bool, int]],
                             held_reason: str) -> None:
        """Tie ``elements`` (job, index, held, pending dependencies) to ``array_id``; a held
        element counts one more pending and, waiting on nothing else, says ``held_reason``."""
        ids, indexes, held, pending = ([e[0] for e in elements], [e[1] for e in elements],
                                       [e[2] for e in elements], [e[3] + int(e[2]) for e in elements])
        await self._execute("job_array_mark", ids, array_id, indexes, held, pending, held_reason)

    async def job_array_elements(self, array_ids: Sequence[str], lock: bool = False) -> dict[str, list[tuple[str, str]]]:
        """Each array's elements (stored id, state) in order; ``lock``: FOR SHARE until the
        end of this store's transaction. Arrays without elements (none such) are absent."""
        rows = await self._fetch("job_array_elements_lock" if lock else "job_array_elements", list(array_ids))
        elements: dict[str, list[tuple[str, str]]] = {}
        for row in rows:
            elements.setdefault(row["array_id"], []).append((row["job_id"], row["state"]))
        return elements

    async def job_array_request_cancel(self, array_id: str) -> None:
        await self._execute("job_array_request_cancel", array_id)

    async def job_array_kill_queued(self, array_id: str, requested_by: str, reason: str,
                                    reason_ran_before: str) -> list[tuple[str, int]]:
        """Cancel every queued job of ``array_id`` in one statement: (job, epoch) of each."""
        rows = await self._fetch("job_array_kill_queued", array_id, requested_by, reason, reason_ran_before)
        return [(r["job_id"], r["epoch"]) for r in rows]

    async def job_array_counts(self, array_id: str) -> dict[str, int]:
        """How many elements of ``array_id`` are in each state."""
        return {r["state"]: r["jobs"] for r in await self._fetch("job_array_counts", array_id)}
