"""Fixtures shared by the integration tests."""

import asyncpg
import pytest

from irisfed.services.common.db_roles import apply_roles, peer_role
from tests.infra.factories import make_config
from tests.integration.test_db_roles import as_role

# One login role per restricted service, as `irisfed db-roles` makes them.
ROLES = {"agent": peer_role("gpu-west"), "router": "irisfed_svc_router", "tick": "irisfed_svc_tick",
         "web": "irisfed_svc_web"}


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
