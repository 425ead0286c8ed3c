"""Fixtures shared by the integration tests."""

import asyncpg
import pytest

from irisfed.services.common.db_roles import apply_roles, peer_role
from tests.infra.db_roles import ROLES, as_role
from tests.infra.factories import make_config
from tests.infra.probes import kill_group
from tests.infra.routers import RouterThread
from tests.infra.secured_nats import SECURED_PEERS, secured_server


@pytest.fixture
async def roles(pool):
    """Every login role of the default test federation (``irisfed db-roles``): their passwords."""
    return await apply_roles(pool, make_config())


@pytest.fixture
async def conns(database_url, roles):
    """One connection per restricted role (ROLES)."""
    opened = {name: await asyncpg.connect(as_role(database_url, role)) for name, role in ROLES.items()}
    yield opened
    for conn in opened.values():
        await conn.close()


@pytest.fixture
async def gpu(database_url, roles):
    """A connection as gpu-west's own login role: what a peer holding its credentials can do."""
    conn = await asyncpg.connect(as_role(database_url, peer_role("gpu-west")))
    yield conn
    await conn.close()


@pytest.fixture
def router(database_url, servers):
    """A started router on its own event loop (:class:`RouterThread`), stopped after the test."""
    running = RouterThread(database_url, servers.nats_url)
    yield running
    running.close()


@pytest.fixture
def launched():
    """Process groups launched through a backend, killed by PID if a test leaves one."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        kill_group(pid)


@pytest.fixture
def secured_nats(tmp_path):
    """``(auth, server)``: a nats-server of its own with irisfed's users and permissions
    (peers ``SECURED_PEERS``), stopped after the test."""
    with secured_server(tmp_path, SECURED_PEERS) as secured:
        yield secured
