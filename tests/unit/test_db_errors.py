"""Which database errors are waited out (transient) and which are set aside (permanent),
and how the store's boundary names them (``Unavailable`` / ``PermanentStoreError``)."""

import asyncpg
import pytest

from irisfed.shared.errors import PermanentStoreError, Unavailable
from irisfed.shared.postgres import is_transient, translate, translated_errors


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


@pytest.mark.parametrize("exc", [
    ConnectionResetError("reset"), TimeoutError(), asyncpg.exceptions.ConnectionDoesNotExistError("gone"),
    asyncpg.exceptions.QueryCanceledError("canceling statement due to statement timeout"),
    asyncpg.exceptions.InterfaceError("connection is closed"),
])
def test_transient_driver_errors_become_unavailable(exc):
    translated = translate(exc)
    assert isinstance(translated, Unavailable) and translated.code == "unavailable"
    expected = "the database did not answer in time" if isinstance(exc, TimeoutError) else f"database unavailable: {exc}"
    assert translated.message == expected


def test_permanent_driver_errors_become_permanent_store_errors():
    exc = asyncpg.InsufficientPrivilegeError("permission denied for table jobs")
    translated = translate(exc)
    assert isinstance(translated, PermanentStoreError)
    assert (translated.message, translated.error_class, translated.sqlstate) == (
        "permission denied for table jobs", "InsufficientPrivilegeError", "42501")
    assert translated.detail == "InsufficientPrivilegeError: permission denied for table jobs"
    assert isinstance(translate(asyncpg.exceptions.DataError("bad argument")), PermanentStoreError)


def test_our_own_errors_and_bugs_pass_through_untouched():
    for exc in (ValueError("bug"), KeyError("bug"), Unavailable("down")):
        assert translate(exc) is exc
    with pytest.raises(ValueError, match="bug"), translated_errors():
        raise ValueError("bug")
    with pytest.raises(Unavailable) as caught, translated_errors():
        raise asyncpg.exceptions.AdminShutdownError("shutdown")
    assert isinstance(caught.value.__cause__, asyncpg.exceptions.AdminShutdownError)
