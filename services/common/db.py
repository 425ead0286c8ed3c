"""Postgres at the edge: pools, migrations, the start-up schema check, driver errors.

Every service calls :func:`connect` at start; it refuses to run on a database
that is not at the schema head this code was built for. This module and
``store.py`` are the only ones that know the driver: :func:`translated_errors`
turns its errors into ``Unavailable`` (may go away by itself: retry) or
``PermanentStoreError`` (will fail the same way again), and ``connecting`` does the
same for opening a pool, a refused login or a bad URL becoming a
``DatabaseConfigError``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import asyncpg

from irisfed.migrations import MIGRATIONS_DIR, head_revision
from irisfed.shared.errors import SchemaMismatch, Unavailable
from irisfed.shared.postgres import (
    CONNECTION_ERRORS,
    connecting,
    pool_connect,
    set_json_codecs,
    translated_errors,
)

# A submit waiting on a dead database should fail fast with `unavailable`, not hang.
CONNECT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class DbTimeouts:
    """How long anything may wait on Postgres, in seconds (0: no limit).

    A Postgres that hangs, rather than resetting connections, otherwise hangs every
    caller for ever. Client-side limits are what unblock a service; server-side ones
    are the backstop for a client that can no longer even cancel (its connection is
    the one that hangs), so the server frees its locks by itself. Defaults suit the
    services' statements, which all take milliseconds: the largest (the tick's
    1000-job claim, the queue-depth scan) take well under a second on 1M rows.
    Migrations run through Alembic's own connection and get none of these.
    """

    connect_s: float = CONNECT_TIMEOUT_S  # open a connection: TCP, start-up, authentication
    command_s: float = 15.0  # each statement, client side (asyncpg command_timeout)
    acquire_s: float = 15.0  # wait for a free connection of the pool (and to release it)
    statement_s: float = 60.0  # server side statement_timeout
    # Server side: a session idle inside an open transaction this long is ended, and
    # its row locks released. The tick's claim transactions are the longest-lived
    # (idle while a batch is placed in Python and the batch before commits: under a
    # second, and never more than command_s), so this stays well above them.
    idle_in_transaction_s: float = 60.0

    def server_settings(self) -> dict[str, str]:
        return {"statement_timeout": f"{int(self.statement_s * 1000)}",
                "idle_in_transaction_session_timeout": f"{int(self.idle_in_transaction_s * 1000)}"}


DEFAULT_TIMEOUTS = DbTimeouts()


class TimedPool(asyncpg.Pool):
    """asyncpg's pool whose ``acquire`` (and so ``release``) waits at most ``acquire_s``.

    asyncpg has no pool-wide default for it, and every ``async with pool.acquire()``
    (and ``pool.fetch``...) in the services would otherwise wait for ever for a free
    connection while all of them hang.
    """

    __slots__ = ("acquire_timeout",)

    def __init__(self, *args: Any, acquire_timeout: float | None = None, **kwargs: Any) -> None:
        self.acquire_timeout = acquire_timeout
        super().__init__(*args, **kwargs)

    def acquire(self, *, timeout: float | None = None):
        return super().acquire(timeout=timeout if timeout is not None else self.acquire_timeout)


# Alembic (and SQLAlchemy under it) is imported only to migrate: every service checks
# the schema at start, and importing them costs each process a large part of a second.


def alembic_config(database_url: str):
    """An Alembic config for our migrations pointed at ``database_url``."""
    from alembic.config import Config

    config = Config(str(MIGRATIONS_DIR / "alembic.ini"))
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # Alembic's ini parser treats '%' as interpolation.
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return config


def schema_head() -> str:
    """The newest migration revision: the schema this code was built for."""
    return head_revision()


def migrate(database_url: str, revision: str = "head") -> None:
    """Upgrade the database to ``revision``. Blocking: call outside the event loop."""
    from alembic import command

    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str = "base") -> None:
    """Downgrade the database to ``revision``. Blocking: call outside the event loop."""
    from alembic import command

    command.downgrade(alembic_config(database_url), revision)


async def current_revision(conn: asyncpg.Connection) -> str | None:
    exists = await conn.fetchval("SELECT to_regclass('alembic_version') IS NOT NULL")
    if not exists:
        return None
    return await conn.fetchval("SELECT version_num FROM alembic_version")


async def check_schema(conn: asyncpg.Connection) -> None:
    """Raise SchemaMismatch unless the database is exactly at :func:`schema_head`."""
    head = schema_head()
    found = await current_revision(conn)
    if found == head:
        return
    if found is None:
        raise SchemaMismatch(
            f"the database has no irisfed schema (this irisfed needs revision {head}); "
            "run `irisfed migrate` first"
        )
    raise SchemaMismatch(
        f"the database is at schema revision {found} but this irisfed needs {head}; "
        "run `irisfed migrate` (or deploy the irisfed version that matches the database)"
    )


async def _release_as_is(conn: asyncpg.Connection) -> None:
    """Pool release without asyncpg's reset query (one round trip per release).

    irisfed keeps no session state (no SET, LISTEN, advisory locks or cursors), and
    asyncpg still rolls back a transaction left open before calling this.
    """


async def connect(
    database_url: str, *, min_size: int = 1, max_size: int = 10, check: bool = True,
    timeouts: DbTimeouts = DEFAULT_TIMEOUTS,
) -> asyncpg.Pool:
    """A pool with our codecs and ``timeouts``; with ``check``, verify the schema head first."""
    pool = TimedPool(
        database_url, connection_class=asyncpg.Connection, record_class=asyncpg.Record,
        init_size=None, min_size=min_size, max_size=max_size, max_queries=50_000,
        max_inactive_connection_lifetime=300.0, connect=pool_connect(database_url), setup=None, loop=None,
        init=set_json_codecs, reset=_release_as_is,
        timeout=timeouts.connect_s or None, command_timeout=timeouts.command_s or None,
        server_settings=timeouts.server_settings(), acquire_timeout=timeouts.acquire_s or None,
    )
    # Unreachable: Unavailable; a refused login, no such database, a URL that cannot be
    # parsed: DatabaseConfigError (a ConfigError: one line, exit 2, never retried).
    with connecting(database_url):
        await pool
    if check:
        try:
            with translated_errors():
                async with pool.acquire() as conn:
                    await check_schema(conn)
        except BaseException:
            await pool.close()
            raise
    return pool


async def ensure_database(admin_url: str, name: str) -> None:
    """Create database ``name`` on the server of ``admin_url`` unless it exists."""
    with connecting(admin_url):
        conn = await asyncpg.connect(admin_url)
    with translated_errors():
        try:
            if not await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name):
                await conn.execute(f'CREATE DATABASE "{name.replace(chr(34), chr(34) * 2)}"')
        finally:
            await conn.close()


async def with_retry(
    action: Callable[[], Awaitable[Any]],
    *,
    attempts: int | None = None,
    base_delay: float = 0.2,
    max_delay: float = 5.0,
    on_retry: Callable[[BaseException, float], None] | None = None,
) -> Any:
    """Run ``action`` until it succeeds, backing off while Postgres is unreachable."""
    delay = base_delay
    tries = 0
    while True:
        try:
            return await action()
        except (Unavailable, *CONNECTION_ERRORS) as exc:
            tries += 1
            if attempts is not None and tries >= attempts:
                raise
            if on_retry is not None:
                on_retry(exc, delay)
            await asyncio.sleep(delay)
            delay = min(max_delay, delay * 2)
