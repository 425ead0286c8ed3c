"""Session-wide real servers; per-test isolated database and subject prefix."""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path

import asyncpg
import pytest
from hypothesis import HealthCheck, settings

from irisfed.services.common import db as dbmod
from irisfed.services.common.bus import connect_client
from tests.engines.fixtures import (  # noqa: F401 - session engines for every test folder
    chromium,
    ray_head,
    slurm_cluster,
    slurm_time_limited_run,
)
from tests.infra.provision import Servers, provision_servers, with_database

# Shared, noisy machines: no per-example deadlines, no "generation is slow" failures.
settings.register_profile(
    "irisfed", deadline=None,
    # function-scoped fixtures in @given tests are shared by all examples on purpose.
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile("irisfed")

TESTS = Path(__file__).parent
# Each folder is a layer (pyproject.toml registers the markers): `pytest -m unit` runs one.
LAYERS = ("unit", "integration", "e2e", "engines", "browser", "chaos")


def pytest_collection_modifyitems(config, items):
    for item in items:
        try:
            folder = item.path.relative_to(TESTS).parts[0]
        except ValueError:  # a test outside tests/ (given on the command line)
            continue
        if folder in LAYERS:
            item.add_marker(folder)


@pytest.fixture(scope="session")
def servers() -> Servers:
    provided = provision_servers()
    try:
        yield provided
    finally:
        provided.close()


async def _admin(servers: Servers) -> asyncpg.Connection:
    return await asyncpg.connect(servers.database_url)


@pytest.fixture(scope="session")
def template_database(servers: Servers) -> str:
    """A database migrated to head once per session; each test clones it."""
    import asyncio

    name = f"irisfed_template_{os.getpid()}"

    async def create() -> None:
        conn = await _admin(servers)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
            await conn.execute(f'CREATE DATABASE "{name}"')
        finally:
            await conn.close()

    asyncio.run(create())
    dbmod.migrate(with_database(servers.database_url, name))
    yield name

    async def drop() -> None:
        conn = await _admin(servers)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()

    try:
        asyncio.run(drop())
    except Exception:  # noqa: BLE001 - the server may already be gone
        pass


@contextlib.asynccontextmanager
async def _scratch_database(servers: Servers, prefix: str, template: str | None = None):
    """A database of its own for one test (a clone of ``template``, else empty), dropped after."""
    name = f"{prefix}_{uuid.uuid4().hex[:16]}"
    clause = f' TEMPLATE "{template}"' if template else ""
    conn = await _admin(servers)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"{clause}')
    finally:
        await conn.close()
    try:
        yield with_database(servers.database_url, name)
    finally:
        conn = await _admin(servers)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()


@pytest.fixture
async def database_url(servers: Servers, template_database: str) -> str:
    """A fresh database at schema head, private to this test."""
    async with _scratch_database(servers, "t", template_database) as url:
        yield url


@pytest.fixture
async def empty_database_url(servers: Servers) -> str:
    """A fresh database with no schema at all (for migration tests)."""
    async with _scratch_database(servers, "e") as url:
        yield url


@pytest.fixture
async def pool(database_url: str):
    pool = await dbmod.connect(database_url)
    yield pool
    await pool.close()


@pytest.fixture
def subject_prefix() -> str:
    """A prefix no other test uses, so tests never see each other's messages."""
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def nats_client(servers: Servers):
    client = await connect_client(servers.nats_url)  # its user's own inbox prefix, like every client
    yield client
    if not client.is_closed:
        await client.drain()
