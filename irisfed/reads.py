"""The producers' read interface: one job and its history, straight from Postgres.

The wire contract has no NATS request for a job's state: Postgres is the truth. The
client reads it with the statements every service uses (``irisfed.shared.queries``:
``job_get``, ``changelog_list_for_job``), decoded into the same typed rows
(``irisfed.shared.records``), and failures classified the same way
(``irisfed.shared.postgres``: ``Unavailable`` may pass, anything else will not; a
refused login or a bad URL is a ``DatabaseConfigError``, a database not at this
irisfed's schema a ``DatabaseSchemaMismatch``). Reads only: a client changes nothing in
the database. A job id is checked as the router checks it (:func:`checked_job_id`, or
:func:`checked_stored_job_id` for a stored ``user:id``) before any of it is sent.
"""

from __future__ import annotations

import asyncpg
import msgspec

from irisfed.shared.errors import DatabaseSchemaMismatch, InvalidRequest, IrisfedError
from irisfed.shared.messages import CancelRequest, OperatorCancelRequest, decode_request, encoder
from irisfed.shared.postgres import (
    connecting,
    pool_connect,
    schema_mismatch_message,
    set_json_codecs,
    translated_errors,
)
from irisfed.shared.queries import QUERIES
from irisfed.shared.records import ChangelogEntry, JobRow, OutputRow, TaskRow

# A client's reads are single-row lookups: a small pool, a short wait for it. Every
# wait is bounded, so a primary that hangs (rather than resets) fails a read
# ``Unavailable`` instead of blocking a producer's get/wait/watch for ever.
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 15.0  # a statement, and the wait for a free connection
SHOWN_ID_CHARS = 40  # an invalid id is quoted up to this many characters
JOB_ID_RULE = "1 to 128 letters, digits, '.', '_' or '-', the first a letter or digit"


def shown_job_id(job_id: object) -> str:
    """``job_id`` quoted for a message, cut to its first characters when it is long."""
    if not isinstance(job_id, str):
        return f"a {type(job_id).__name__}"
    if len(job_id) <= SHOWN_ID_CHARS:
        return repr(job_id)
    return f"{job_id[:SHOWN_ID_CHARS]!r}... ({len(job_id)} characters)"


def checked_stored_job_id(job_id: object) -> str:
    """``job_id`` if it is a job's stored id (``alice:train-1``, or a ``default`` job's
    bare id: what operators see), else ``InvalidRequest``. Pure: no I/O."""
    try:
        return decode_request(OperatorCancelRequest, encoder.encode({"job_id": job_id})).job_id
    except (IrisfedError, TypeError, msgspec.EncodeError):
        raise InvalidRequest(f"not a job id: {shown_job_id(job_id)} (a job id is [USER:]ID, USER a configured "
                             f"user, ID {JOB_ID_RULE})") from None


def checked_job_id(job_id: object) -> str:
    """``job_id`` if the router would take it (as a cancel's, by the wire's own rule),
    else ``InvalidRequest`` quoting at most its start. Pure: no I/O.

    A string no job can have (NUL, which Postgres text cannot hold, or thousands of
    characters) never reaches Postgres.
    """
    try:
        return decode_request(CancelRequest, encoder.encode({"job_id": job_id})).job_id
    except (IrisfedError, TypeError, msgspec.EncodeError):
        raise InvalidRequest(f"not a job id: {shown_job_id(job_id)} (a job id is {JOB_ID_RULE})") from None


class JobReads:
    """A small pool on the federation's database and the two reads a producer needs."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    @classmethod
    async def connect(cls, database_url: str) -> JobReads:
        """Open the pool. ``Unavailable`` when Postgres cannot be reached;
        ``DatabaseConfigError`` when the URL cannot be parsed or the login is refused
        (the URL named, its password not). No schema check: a read the schema cannot
        answer raises ``DatabaseSchemaMismatch`` itself."""
        with connecting(database_url):
            pool = await asyncpg.create_pool(database_url, min_size=1, max_size=2, connect=pool_connect(database_url),
                                             timeout=CONNECT_TIMEOUT_S, command_timeout=READ_TIMEOUT_S,
                                             init=set_json_codecs)
        return cls(pool)

    async def job_get(self, job_id: str) -> JobRow | None:
        """The job stored as ``job_id`` (``alice:train-1``; a ``default`` job's id bare)."""
        job_id = checked_stored_job_id(job_id)
        record = await self._read("fetchrow", QUERIES["job_get"], job_id)
        return None if record is None else JobRow.from_record(record)

    async def job_tasks_list(self, job_id: str) -> list[TaskRow]:
        """A gang's tasks, newest run first (none for a single-task job)."""
        job_id = checked_stored_job_id(job_id)
        records = await self._read("fetch", QUERIES["job_tasks_list"], job_id)
        return [TaskRow.from_record(record) for record in records]

    async def job_outputs_list(self, job_id: str, epoch: int | None = None,
                               task: int | None = None) -> list[OutputRow]:
        """A job's output files of ``epoch`` (None: the newest run with any), ``task`` (None: all)."""
        job_id = checked_stored_job_id(job_id)
        records = await self._read("fetch", QUERIES["job_outputs_list"], job_id, epoch, task)
        return [OutputRow.from_record(record) for record in records]

    async def changelog_list_for_job(self, job_id: str) -> list[ChangelogEntry]:
        job_id = checked_stored_job_id(job_id)
        records = await self._read("fetch", QUERIES["changelog_list_for_job"], job_id)
        return [ChangelogEntry.from_record(record) for record in records]

    async def _read(self, method: str, query: str, *args):
        """``connection.<method>(query, *args)``, its failures translated; a schema
        mismatch also says which revision the database is at."""
        try:
            with translated_errors():
                async with self._pool.acquire(timeout=READ_TIMEOUT_S) as conn:
                    return await getattr(conn, method)(query, *args)
        except DatabaseSchemaMismatch as exc:
            found = await self._revision()
            if found is None:
                raise
            raise DatabaseSchemaMismatch(schema_mismatch_message(exc.__cause__ or exc, found),
                                         exc.error_class, exc.sqlstate) from exc.__cause__

    async def _revision(self) -> str | None:
        """Where the database's schema is, as words for a message (None: cannot tell)."""
        try:
            with translated_errors():
                async with self._pool.acquire(timeout=READ_TIMEOUT_S) as conn:
                    if not await conn.fetchval("SELECT to_regclass('alembic_version') IS NOT NULL"):
                        return "the database has no irisfed schema at all"
                    found = await conn.fetchval("SELECT max(version_num) FROM alembic_version")
        except IrisfedError:
            return None
        return f"the database is at schema revision {found}" if found else "the database has no schema revision"

    async def close(self) -> None:
        await self._pool.close()
