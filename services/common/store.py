"""The Postgres adapter: domain actions over named queries (``sql/*.sql``).

Each method is named like the SQL block it runs (``job_move`` runs ``-- job_move --``).
Services call these actions and never see SQL; this module never decides policy.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

import asyncpg
import msgspec

from shared.lifecycle import JobState, check_transition
from shared.records import Move, NewJob

SQL_DIR = Path(__file__).resolve().parent / "sql"
_BLOCK = re.compile(r"^-- ([a-z_]+) --\s*$", re.MULTILINE)


def load_queries(folder: Path = SQL_DIR) -> dict[str, str]:
    """Every ``-- name --`` block of every ``.sql`` file in ``folder``, by name."""
    queries: dict[str, str] = {}
    for path in sorted(folder.glob("*.sql")):
        parts = _BLOCK.split(path.read_text())
        for name, body in zip(parts[1::2], parts[2::2], strict=True):
            if name in queries:
                raise ValueError(f"query {name} is defined twice")
            queries[name] = body.strip()
    return queries


Q = load_queries()
_encoder = msgspec.json.Encoder()


def _json(value: object) -> str:
    return _encoder.encode(value).decode()


class Store:
    """Domain actions on the four tables, over one asyncpg pool (or connection)."""

    def __init__(self, db: asyncpg.Pool | asyncpg.Connection) -> None:
        self.db = db

    # ------------------------------------------------------------ jobs

    async def job_insert_batch(self, conn: asyncpg.Connection, jobs: Sequence[NewJob],
                               statement_timeout_s: float | None = None) -> set[str]:
        """Insert ``jobs`` (skipping existing ids); return the ids actually created."""
        rows = await conn.fetch(Q["job_insert_batch"], _encoder.encode(jobs).decode(),
                                timeout=statement_timeout_s)
        return {r["job_id"] for r in rows}

    async def job_get_submitted(self, conn: asyncpg.Connection, job_ids: Sequence[str],
                                statement_timeout_s: float | None = None) -> dict[str, asyncpg.Record]:
        rows = await conn.fetch(Q["job_get_submitted"], list(job_ids), timeout=statement_timeout_s)
        return {r["job_id"]: r for r in rows}

    async def job_get(self, job_id: str) -> asyncpg.Record | None:
        return await self.db.fetchrow(Q["job_get"], job_id)

    async def job_get_for_update(self, conn: asyncpg.Connection, job_id: str) -> asyncpg.Record | None:
        return await conn.fetchrow(Q["job_get_for_update"], job_id)

    async def job_list(self, state: str | None = None, limit: int = 100) -> list[asyncpg.Record]:
        return await self.db.fetch(Q["job_list"], state, limit)

    async def job_count_by_state(self) -> dict[str, int]:
        return {r["state"]: r["jobs"] for r in await self.db.fetch(Q["job_count_by_state"])}

    async def job_move(self, move: Move, conn: asyncpg.Connection | None = None) -> int | None:
        """Apply ``move`` if the job is still in (from_state, epoch); return its changelog seq."""
        check_transition(move.from_state, move.to_state)
        return await (conn or self.db).fetchval(
            Q["job_move"], move.job_id, move.from_state.value, move.epoch, move.to_state.value,
            move.epoch if move.new_epoch is None else move.new_epoch, move.owner_peer_id,
            move.reason, move.exit_code, move.actor, move.log_dir, move.avoid_peer,
        )

    async def job_start_batch(
        self, conn: asyncpg.Connection, peer_id: str, starts: Sequence[tuple[str, int, str | None, str]]
    ) -> dict[str, asyncpg.Record]:
        """Accept (job_id, epoch, log_dir, reason) for ``peer_id``; return what moved (spec, backend)."""
        job_ids, epochs, log_dirs, reasons = (list(c) for c in zip(*starts, strict=True))
        rows = await conn.fetch(Q["job_start_batch"], peer_id, job_ids, epochs, log_dirs, reasons)
        return {r["job_id"]: r for r in rows}

    async def job_finish_batch(
        self, conn: asyncpg.Connection, peer_id: str, endings: Sequence[tuple[str, int, int, bool]]
    ) -> dict[str, asyncpg.Record]:
        """Report (job_id, epoch, exit_code, cancelled) for ``peer_id``; return what moved."""
        job_ids, epochs, codes, cancelled = (list(c) for c in zip(*endings, strict=True))
        rows = await conn.fetch(Q["job_finish_batch"], peer_id, job_ids, epochs, codes, cancelled)
        return {r["job_id"]: r for r in rows}

    async def job_end_run(
        self, peer_id: str, job_id: str, epoch: int, to_state: JobState, reason: str,
        exit_code: int | None = None, conn: asyncpg.Connection | None = None,
    ) -> int | None:
        """``peer_id`` ends its running job other than by its exit: queued (handed back,
        epoch + 1, no owner), failed or killed. Returns the changelog seq; None: CAS lost."""
        check_transition(JobState.RUNNING, to_state)
        return await (conn or self.db).fetchval(
            Q["job_end_run"], peer_id, job_id, epoch, to_state.value, reason, exit_code)

    async def job_request_cancel(self, conn: asyncpg.Connection, job_id: str) -> None:
        await conn.execute(Q["job_request_cancel"], job_id)

    async def job_claim_queued(
        self, conn: asyncpg.Connection, limit: int,
        after: tuple[int, datetime, str] | None = None,
    ) -> list[asyncpg.Record]:
        neg_priority, submitted_at, job_id = after if after else (None, None, None)
        return await conn.fetch(Q["job_claim_queued"], limit, neg_priority, submitted_at, job_id)

    async def job_live_counts(self, conn: asyncpg.Connection | None = None) -> dict[tuple[str, str | None], int]:
        rows = await (conn or self.db).fetch(Q["job_live_counts"])
        return {(r["owner_peer_id"], r["backend"]): r["live"] for r in rows}

    async def job_assign_batch(
        self, conn: asyncpg.Connection, assignments: Sequence[tuple[str, int, str, str]]
    ) -> list[asyncpg.Record]:
        """Commit (job_id, epoch, peer_id, backend) placements; return what actually moved."""
        if not assignments:
            return []
        job_ids, epochs, peers, backends = (list(c) for c in zip(*assignments, strict=True))
        return await conn.fetch(Q["job_assign_batch"], job_ids, epochs, peers, backends)

    async def job_explain_batch(
        self, conn: asyncpg.Connection, explained: Sequence[tuple[str, dict, str]]
    ) -> None:
        """Store (job_id, explanation, reason) for jobs left queued."""
        if not explained:
            return
        job_ids, docs, reasons = zip(*explained, strict=True)
        await conn.execute(Q["job_explain_batch"], list(job_ids), [_json(d) for d in docs], list(reasons))

    async def job_expire_deadlines(self, limit: int = 1000) -> list[asyncpg.Record]:
        return await self.db.fetch(Q["job_expire_deadlines"], limit)

    async def job_queue_depth(self, classes: int) -> list[asyncpg.Record]:
        return await self.db.fetch(Q["job_queue_depth"], classes)

    async def job_live_for_owner(self, peer_id: str) -> list[asyncpg.Record]:
        return await self.db.fetch(Q["job_live_for_owner"], peer_id)

    async def job_stale_on_peers(
        self, conn: asyncpg.Connection, lost: Sequence[str], limit: int = 1000
    ) -> list[asyncpg.Record]:
        """Up to ``limit`` unpinned live jobs owned by the ``lost`` peers, locked (SKIP LOCKED)."""
        return await conn.fetch(Q["job_stale_on_peers"], list(lost), limit)

    async def job_states_all(self) -> list[asyncpg.Record]:
        return await self.db.fetch(Q["job_states_all"])

    # ------------------------------------------------------------ changelog

    async def changelog_for_job(self, job_id: str) -> list[asyncpg.Record]:
        return await self.db.fetch(Q["changelog_for_job"], job_id)

    async def changelog_all(self) -> list[asyncpg.Record]:
        return await self.db.fetch(Q["changelog_all"])

    async def changelog_last_for_job(self, job_id: str) -> asyncpg.Record | None:
        return await self.db.fetchrow(Q["changelog_last_for_job"], job_id)

    # ------------------------------------------------------------ sync state

    async def sync_state_upsert(
        self, job_id: str, peer_id: str, changelog_seq: int, epoch: int,
        conn: asyncpg.Connection | None = None, note: str = "",
    ) -> None:
        await (conn or self.db).execute(Q["sync_state_upsert"], job_id, peer_id, changelog_seq, epoch, note)

    async def sync_state_get(self, job_id: str) -> list[asyncpg.Record]:
        return await self.db.fetch(Q["sync_state_get"], job_id)

    # ------------------------------------------------------------ peer heartbeats

    async def peer_heartbeat_upsert(
        self, peer_id: str, run_id: str, seq: int, backends: list, ttl_s: float, sent_at: datetime
    ) -> None:
        await self.db.execute(Q["peer_heartbeat_upsert"], peer_id, run_id, seq, backends, ttl_s, sent_at)

    async def peer_heartbeat_upsert_batch(self, heartbeats: Sequence) -> None:
        """Write many heartbeats (``shared.messages.Heartbeat``) in one statement."""
        if not heartbeats:
            return
        await self.db.execute(
            Q["peer_heartbeat_upsert_batch"],
            [h.peer_id for h in heartbeats], [h.run_id for h in heartbeats], [h.seq for h in heartbeats],
            [_json(h.backends) for h in heartbeats], [h.ttl_s for h in heartbeats],
            [h.sent_at for h in heartbeats],
        )

    async def peer_heartbeat_list(self) -> list[asyncpg.Record]:
        return await self.db.fetch(Q["peer_heartbeat_list"])
