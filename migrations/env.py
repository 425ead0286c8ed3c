"""Alembic environment: runs migrations over an async SQLAlchemy engine on asyncpg."""

from __future__ import annotations

import asyncio
import os

from alembic import context
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

config = context.config


PLAIN_SCHEMES = ("postgresql://", "postgres://")


def _given_url() -> str:
    url = (
        context.get_x_argument(as_dictionary=True).get("url")
        or config.get_main_option("sqlalchemy.url")
        or os.environ.get("IRISFED_DATABASE_URL")
    )
    if not url:
        raise SystemExit("no database URL: set IRISFED_DATABASE_URL or pass -x url=...")
    return url


def _database_url() -> str:
    url = _given_url()
    for plain in PLAIN_SCHEMES:
        if url.startswith(plain):
            return "postgresql+asyncpg://" + url[len(plain):]
    return url


def _engine():
    url = _given_url()
    if url.startswith(PLAIN_SCHEMES):
        # libpq's URL, as every service takes it: asyncpg parses it itself, so several
        # hosts (h1:p1,h2:p2) and target_session_attrs work here as they do there;
        # SQLAlchemy's URL parser refuses a second host.
        import asyncpg

        return create_async_engine("postgresql+asyncpg://", poolclass=NullPool,
                                   async_creator=lambda: asyncpg.connect(url))
    return create_async_engine(url, poolclass=NullPool)


def _run(connection) -> None:
    context.configure(connection=connection, target_metadata=None, transaction_per_migration=True)
    with context.begin_transaction():
        context.run_migrations()


async def _run_online() -> None:
    engine = _engine()
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_run)
            await connection.commit()
    finally:
        await engine.dispose()


if context.is_offline_mode():
    context.configure(url=_database_url(), literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    asyncio.run(_run_online())
