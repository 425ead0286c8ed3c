"""Which database errors an agent waits out (transient) and which it sets aside (permanent)."""

import asyncpg
import pytest

from services.common.db import is_transient
from shared.errors import Unavailable


@pytest.mark.parametrize("exc", [
    ConnectionResetError("reset"), OSError("unreachable"), TimeoutError(),
    asyncpg.exceptions.ConnectionDoesNotExistError("gone"), asyncpg.exceptions.CannotConnectNowError("starting"),
    asyncpg.exceptions.AdminShutdownError("shutdown"), asyncpg.exceptions.TooManyConnectionsError("full"),
    asyncpg.exceptions.InterfaceError("connection is closed"), asyncpg.exceptions.QueryCanceledError("timeout"),
    asyncpg.exceptions.SerializationError("retry"), asyncpg.exceptions.DeadlockDetectedError("retry"),
    asyncpg.exceptions.LockNotAvailableError("lock timeout"), Unavailable("down"),
    asyncpg.exceptions.IdleInTransactionSessionTimeoutError("idle too long"),
])
def test_transient(exc):
    assert is_transient(exc)


@pytest.mark.parametrize("exc", [
    asyncpg.InsufficientPrivilegeError("permission denied"), asyncpg.exceptions.RaiseError("boom"),
    asyncpg.exceptions.CheckViolationError("bad state"), asyncpg.exceptions.UndefinedFunctionError("missing"),
    asyncpg.exceptions.DataError("bad argument"), ValueError("bug"), KeyError("bug"),
])
def test_permanent(exc):
    assert not is_transient(exc)
