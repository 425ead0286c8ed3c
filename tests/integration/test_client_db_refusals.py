"""Databases no retry can fix, against a real Postgres: the producers' client
(``Client.get``/``wait``) and the pools of the services and the CLI (``db.connect``) say
what is wrong, once, and never as an internal error.

A database without irisfed's schema, or at an older revision, is a schema mismatch
("run `irisfed migrate`"); a login Postgres refuses (no such role; no such database) a
configuration error naming the user and the host, never the password. The test server
trusts every local login, so a wrong password cannot be provoked here:
tests/unit/test_db_errors.py classifies asyncpg's own ``InvalidPasswordError``.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit, urlunsplit

import pytest

from irisfed.client import (
    Client,
    ConfigurationError,
    InternalError,
    SchemaMismatchError,
)
from irisfed.services.common import db as dbmod
from irisfed.shared.errors import DatabaseConfigError, PermanentStoreError

SECRET = "pa55-never-shown"


@pytest.fixture
def connect(servers, subject_prefix):
    """``await connect(database_url)``: a client on the session's NATS and that database."""
    return lambda database_url: Client.connect(servers.nats_url, database_url, prefix=subject_prefix)


def _as(database_url: str, user: str, password: str = SECRET, database: str | None = None) -> str:
    parts = urlsplit(database_url)
    host = parts.netloc.rsplit("@", 1)[-1]
    path = parts.path if database is None else f"/{database}"
    return urlunsplit(parts._replace(netloc=f"{user}:{password}@{host}", path=path))


async def _refused(read, kind):
    async with asyncio.timeout(15):  # refused for good: never waited out
        with pytest.raises(kind) as caught:
            await read
    assert not isinstance(caught.value, InternalError) and not caught.value.retryable
    return caught.value


async def test_reads_of_a_database_without_the_schema_say_run_migrate(empty_database_url, connect):
    client = await connect(empty_database_url)
    try:
        for read in (client.get("j1"), client.wait("j1")):
            error = await _refused(read, SchemaMismatchError)
            assert isinstance(error, ConfigurationError) and error.code == "schema_mismatch"
            assert "not at the schema this irisfed needs" in error.message
            assert "no irisfed schema" in error.message and "run `irisfed migrate`" in error.message
    finally:
        await client.close()


async def test_reads_of_a_database_at_an_older_revision_name_it(empty_database_url, connect):
    await asyncio.to_thread(dbmod.migrate, empty_database_url, "0007")
    client = await connect(empty_database_url)
    try:
        error = await _refused(client.get("j1"), SchemaMismatchError)
        assert "schema revision 0007" in error.message and "run `irisfed migrate`" in error.message
    finally:
        await client.close()


async def test_a_refused_login_names_the_user_and_host_never_the_password(database_url, connect):
    url = _as(database_url, "irisfed_no_such_role")
    host = urlsplit(database_url).netloc.rsplit("@", 1)[-1]
    client = await connect(url)
    try:
        for read in (client.get("j1"), client.wait("j1")):
            error = await _refused(read, ConfigurationError)
            assert type(error) is ConfigurationError and error.code == "config_error"
            assert "irisfed_no_such_role" in error.message and host in error.message
            assert "refused the connection" in error.message and SECRET not in error.message
    finally:
        await client.close()
    # The services and the CLI open their pools the same way: the same words, a ConfigError.
    with pytest.raises(DatabaseConfigError) as caught:
        await dbmod.connect(url, max_size=1)
    assert isinstance(caught.value, PermanentStoreError) and caught.value.sqlstate == "28000"
    assert "irisfed_no_such_role" in caught.value.message and SECRET not in caught.value.message


async def test_no_such_database_is_a_configuration_error(database_url, connect):
    user = urlsplit(database_url).username or "postgres"
    url = _as(database_url, user, database="irisfed_no_such_database")
    client = await connect(url)
    try:
        error = await _refused(client.get("j1"), ConfigurationError)
        assert "irisfed_no_such_database" in error.message and SECRET not in error.message
    finally:
        await client.close()
    with pytest.raises(DatabaseConfigError, match="irisfed_no_such_database"):
        await dbmod.connect(url, max_size=1)
