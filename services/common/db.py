"""Postgres at the edge: pools, migrations, and the start-up schema check.

Every service calls :func:`connect` at start; it refuses to run on a database
that is not at the schema head this code was built for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
import msgspec
from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory

from migrations import MIGRATIONS_DIR
from shared.errors import SchemaMismatch, Unavailable

# Errors that mean "Postgres is not there right now", as opposed to a bug or bad data.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    asyncpg.exceptions.ConnectionDoesNotExistError,
    asyncpg.exceptions.CannotConnectNowError,
    asyncpg.exceptions.ConnectionFailureError,
    asyncpg.exceptions.InterfaceError,
    asyncpg.exceptions.AdminShutdownError,
    asyncpg.exceptions.TooManyConnectionsError,
    asyncpg.exceptions.PostgresConnectionError,
    # A connection that broke in the middle of a statement (e.g. a server restart).
    asyncpg.exceptions.InternalClientError,
    ConnectionError,
    asyncio.TimeoutError,
)


# A submit waiting on a dead database should fail fast with `unavailable`, not hang.
CONNECT_TIMEOUT_S = 5.0


def alembic_config(database_url: str) -> Config:
    """An Alembic config for our migrations pointed at ``database_url``."""
    config = Config(str(MIGRATIONS_DIR / "alembic.ini"))
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # Alembic's ini parser treats '%' as interpolation.
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return config


def schema_head() -> str:
    """The newest migration revision: the schema this code was built for."""
    script = ScriptDirectory(str(MIGRATIONS_DIR))
    return script.get_current_head()


def migrate(database_url: str, revision: str = "head") -> None:
    """Upgrade the database to ``revision``. Blocking: call outside the event loop."""
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str = "base") -> None:
    """Downgrade the database to ``revision``. Blocking: call outside the event loop."""
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


async def _init_connection(conn: asyncpg.Connection) -> None:
    for type_name in ("jsonb", "json"):
        await conn.set_type_codec(
            type_name,
            encoder=lambda value: msgspec.json.encode(value).decode(),
            decoder=msgspec.json.decode,
            schema="pg_catalog",
        )


async def _release_as_is(conn: asyncpg.Connection) -> None:
    """Pool release without asyncpg's reset query (one round trip per release).

    irisfed keeps no session state (no SET, LISTEN, advisory locks or cursors), and
    asyncpg still rolls back a transaction left open before calling this.
    """


async def connect(
    database_url: str, *, min_size: int = 1, max_size: int = 10, check: bool = True
) -> asyncpg.Pool:
    """A pool with our codecs; with ``check``, verify the schema head first."""
    try:
        pool = await asyncpg.create_pool(
            database_url, min_size=min_size, max_size=max_size, init=_init_connection,
            reset=_release_as_is, timeout=CONNECT_TIMEOUT_S,
        )
    except CONNECTION_ERRORS as exc:
        raise Unavailable(f"cannot reach Postgres: {exc}") from exc
    if check:
        try:
            async with pool.acquire() as conn:
                await check_schema(conn)
        except BaseException:
            await pool.close()
            raise
    return pool


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
