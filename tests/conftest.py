"""Session-wide real servers; per-test isolated database and subject prefix."""

from __future__ import annotations

import contextlib
import os
import signal
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
from tests.infra.groups import GroupSuffixes
from tests.infra.provision import Servers, provision_servers, with_database
from tests.infra.reports import pytest_runtest_makereport  # noqa: F401 - a hook for the whole suite

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


# With parallel workers (`-n 4`; pytest-xdist, `--dist loadgroup`: pyproject.toml), tests
# needing a session engine run on one worker per engine, so each engine starts once a run
# (the tests of one group also run one at a time: they share the engine's nodes).
ENGINE_GROUPS = {"slurm_cluster": "slurm", "ray_head": "ray", "chromium": "browser", "patroni": "patroni"}
# A fixture named ``...engine`` parametrised ``["slurm", "ray"]`` reaches its engine's
# fixture at run time (tests/infra/engine_peers.py's ``engine_for``, which checks the
# group), out of sight of ``fixturenames``.
ENGINE_PARAMS = {"slurm": "slurm", "ray": "ray"}


def engine_group(item) -> str | None:
    """The xdist group of the session engine ``item`` uses, if any."""
    group = next((ENGINE_GROUPS[name] for name in ENGINE_GROUPS if name in item.fixturenames), None)
    if group is None and hasattr(item, "callspec"):
        group = next((ENGINE_PARAMS[value] for name, value in item.callspec.params.items()
                      if name.endswith("engine") and isinstance(value, str) and value in ENGINE_PARAMS), None)
    return group


def pytest_configure(config):
    """The engines and processes the tests start get SIGINT and SIGQUIT at their defaults.
    A shell starting pytest in the background without job control hands it both ignored,
    and every child inherits an ignore: Ray workers then never see the SIGINT of Ray's
    polite cancel, so a stopped gang's tasks would get no SIGTERM and no grace."""
    for sig, handler in ((signal.SIGINT, signal.default_int_handler), (signal.SIGQUIT, signal.SIG_DFL)):
        if signal.getsignal(sig) == signal.SIG_IGN:
            signal.signal(sig, handler)
    config.pluginmanager.register(GroupSuffixes(), "irisfed-group-suffixes")


@pytest.hookimpl(tryfirst=True)  # the groups marked before xdist's own hook reads them
def pytest_collection_modifyitems(config, items):
    for item in items:
        group = engine_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
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


async def _as_admin(servers: Servers, *statements: str) -> None:
    """Run ``statements`` as the servers' admin, on a connection of their own."""
    conn = await asyncpg.connect(servers.database_url)
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()


@pytest.fixture(scope="session")
def template_database(servers: Servers) -> str:
    """A database migrated to head once per session; each test clones it."""
    import asyncio

    name = f"irisfed_template_{os.getpid()}"

    asyncio.run(_as_admin(servers, f'DROP DATABASE IF EXISTS "{name}"', f'CREATE DATABASE "{name}"'))
    dbmod.migrate(with_database(servers.database_url, name))
    yield name
    try:
        asyncio.run(_as_admin(servers, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    except Exception:  # noqa: BLE001 - the server may already be gone
        pass


@contextlib.asynccontextmanager
async def _scratch_database(servers: Servers, prefix: str, template: str | None = None):
    """A database of its own for one test (a clone of ``template``, else empty), dropped after."""
    name = f"{prefix}_{uuid.uuid4().hex[:16]}"
    clause = f' TEMPLATE "{template}"' if template else ""
    await _as_admin(servers, f'CREATE DATABASE "{name}"{clause}')
    try:
        yield with_database(servers.database_url, name)
    finally:
        await _as_admin(servers, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


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
