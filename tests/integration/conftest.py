"""Fixtures shared by the integration tests."""

import pytest

from services.common.db_roles import apply_roles
from tests.infra.factories import make_config


@pytest.fixture
async def roles(pool):
    """Every login role of the default test federation (``irisfed db-roles``): their passwords."""
    return await apply_roles(pool, make_config())
