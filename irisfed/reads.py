"""The producers' read interface: one job and its history, straight from Postgres.

The wire contract has no NATS request for a job's state: Postgres is the truth. The
client reads it with the statements every service uses (``irisfed.shared.queries``:
``job_get``, ``changelog_list_for_job``), decoded into the same typed rows
(``irisfed.shared.records``), and failures classified the same way
(``irisfed.shared.postgres``: ``Unavailable`` may pass, anything else will not). Reads
only: a client changes nothing in the database.
"""

from __future__ import annotations

import asyncpg

from irisfed.shared.errors import Unavailable
from irisfed.shared.postgres import set_json_codecs, translated_errors
from irisfed.shared.queries import QUERIES
from irisfed.shared.records import ChangelogEntry, JobRow

# A client's reads are single-row lookups: a small pool, a short wait for it.
CONNECT_TIMEOUT_S = 5.0


class JobReads:
    """A small pool on the federation's database and the two reads a producer needs."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    @classmethod
    async def connect(cls, database_url: str) -> JobReads:
        """Open the pool (no schema check: a read the schema cannot answer says so itself)."""
        try:
            with translated_errors():  # refused for good (a bad password...): PermanentStoreError
                pool = await asyncpg.create_pool(database_url, min_size=1, max_size=2,
                                                 timeout=CONNECT_TIMEOUT_S, init=set_json_codecs)
        except Unavailable as exc:
            raise Unavailable(f"cannot reach Postgres: {exc.__cause__ or exc}") from exc
        return cls(pool)

    async def job_get(self, job_id: str) -> JobRow | None:
        with translated_errors():
            record = await self._pool.fetchrow(QUERIES["job_get"], job_id)
        return None if record is None else JobRow.from_record(record)

    async def changelog_list_for_job(self, job_id: str) -> list[ChangelogEntry]:
        with translated_errors():
            records = await self._pool.fetch(QUERIES["changelog_list_for_job"], job_id)
        return [ChangelogEntry.from_record(record) for record in records]

    async def close(self) -> None:
        await self._pool.close()
