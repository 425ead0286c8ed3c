from __future__ import annotations

import pytest

from tests.infra.listeners import CountingListener


@pytest.fixture
def listeners():
    """Two counting listeners: (database, NATS)."""
    db, nats = CountingListener(), CountingListener()
    yield db, nats
    db.close()
    nats.close()
