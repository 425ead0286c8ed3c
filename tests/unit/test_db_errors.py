"""Which database errors are waited out (transient) and which are set aside (permanent),
and how the store's boundary names them (``Unavailable`` / ``PermanentStoreError``)."""

import asyncpg
import pytest

from irisfed.shared.errors import PermanentStoreError, Unavailable
from irisfed.shared.postgres import is_transient, translate, translated_errors, with_database


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


# ---------------------------------------------------------------- refused for good: the settings, not a statement

SECRET = "s3cret-pw"
URL = f"postgresql://irisfed_svc_web:{SECRET}@db.example:5432/irisfed"


@pytest.mark.parametrize("exc", [
    asyncpg.exceptions.InvalidPasswordError('password authentication failed for user "irisfed_svc_web"'),
    asyncpg.exceptions.InvalidAuthorizationSpecificationError('role "nobody" does not exist'),
    asyncpg.exceptions.InvalidCatalogNameError('database "nosuchdb" does not exist'),
    asyncpg.exceptions.ClientConfigurationError("`sslmode` parameter must be one of: disable, allow, ..."),
])
def test_a_refused_login_or_a_bad_setting_is_a_configuration_error_never_retried(exc):
    from irisfed.shared.errors import ConfigError, DatabaseConfigError

    assert not is_transient(exc)
    translated = translate(exc)
    assert isinstance(translated, DatabaseConfigError)
    assert isinstance(translated, ConfigError) and isinstance(translated, PermanentStoreError)
    assert translated.code == "config_error" and translated.error_class == type(exc).__name__
    assert str(exc).split(":")[0] in translated.message


@pytest.mark.parametrize("exc", [
    asyncpg.exceptions.UndefinedTableError('relation "jobs" does not exist'),
    asyncpg.exceptions.UndefinedColumnError('column j.explanation_key does not exist'),
    asyncpg.exceptions.UndefinedFunctionError("function agent_finish_batch(text[]) does not exist"),
])
def test_what_the_database_does_not_have_is_a_schema_mismatch(exc):
    from irisfed.shared.errors import DatabaseSchemaMismatch, SchemaMismatch

    translated = translate(exc)
    assert isinstance(translated, DatabaseSchemaMismatch)
    assert isinstance(translated, SchemaMismatch) and isinstance(translated, PermanentStoreError)
    assert translated.code == "schema_mismatch" and translated.sqlstate == exc.sqlstate
    assert str(exc) in translated.message and "run `irisfed migrate`" in translated.message
    assert "not at the schema this irisfed needs" in translated.message


def test_a_refused_login_names_the_user_and_the_host_never_the_password():
    from irisfed.shared.errors import DatabaseConfigError
    from irisfed.shared.postgres import connect_error

    exc = asyncpg.exceptions.InvalidPasswordError('password authentication failed for user "irisfed_svc_web"')
    refused = connect_error(exc, URL)
    assert isinstance(refused, DatabaseConfigError) and refused.sqlstate == "28P01"
    assert "irisfed_svc_web" in refused.message and "db.example:5432" in refused.message
    assert "password authentication failed" in refused.message and SECRET not in refused.message


def test_unreachable_at_connect_names_the_server_without_its_password():
    from irisfed.shared.postgres import connect_error

    away = connect_error(ConnectionRefusedError(111, "Connect call failed"), URL)
    assert isinstance(away, Unavailable) and "cannot reach Postgres at" in away.message
    assert "db.example:5432" in away.message and SECRET not in away.message


def test_a_port_out_of_range_is_a_configuration_error():
    from irisfed.shared.errors import DatabaseConfigError
    from irisfed.shared.postgres import connect_error

    url = f"postgresql://u:{SECRET}@127.0.0.1:99999/db"  # the socket's connect() refuses it
    refused = connect_error(OverflowError("connect(): port must be 0-65535."), url)
    assert isinstance(refused, DatabaseConfigError) and "port must be 0-65535" in refused.message
    assert SECRET not in refused.message


BAD_URLS = [
    f"postgresql://u:{SECRET}@[::1",  # an IPv6 host never closed
    f"postgresql://u:{SECRET}@127.0.0.1:notaport/db",
    f"postgresql://u:{SECRET}@127.0.0.1:5432/db?sslmode=bogus",
    f"mysql://u:{SECRET}@127.0.0.1/db",
    "postgresql://u:ab#cd-s3cret-pw@127.0.0.1/db",  # an unescaped '#' splits the password: 'ab' as a port
]


@pytest.mark.parametrize("url", BAD_URLS)
async def test_a_url_the_driver_cannot_parse_is_refused_before_any_socket(url):
    """Both ways in (the client's reads and the services' pools): a DatabaseConfigError,
    the password out of it, and no socket opened (the unit layer's guard would fail it)."""
    from irisfed.reads import JobReads
    from irisfed.services.common import db
    from irisfed.shared.errors import DatabaseConfigError

    for connect in (JobReads.connect, db.connect):
        with pytest.raises(DatabaseConfigError) as refused:
            await connect(url)
        message = refused.value.message
        assert message.startswith("invalid database URL") and "u:***@" in message, message
        assert SECRET not in message and "ab#" not in message and "'ab'" not in message, message


def test_with_database_keeps_every_host_and_the_query() -> None:
    url = "postgresql://postgres@10.0.0.1:5432,10.0.0.2:5433/postgres?target_session_attrs=read-write"
    assert with_database(url, "irisfed") == (
        "postgresql://postgres@10.0.0.1:5432,10.0.0.2:5433/irisfed?target_session_attrs=read-write")
    assert with_database("postgresql://u@h:5432/postgres", "bench_x") == "postgresql://u@h:5432/bench_x"


def test_with_login_puts_one_login_before_every_host() -> None:
    from irisfed.shared.postgres import with_login

    url = "postgresql://old:pw@10.0.0.1:5432,10.0.0.2:5433/irisfed?target_session_attrs=read-write"
    assert with_login(url, "irisfed_svc_tick", "p@ss/word") == (
        "postgresql://irisfed_svc_tick:p%40ss%2Fword@10.0.0.1:5432,10.0.0.2:5433/irisfed"
        "?target_session_attrs=read-write")
    assert with_login("postgresql://h:5432/db", "u", "p") == "postgresql://u:p@h:5432/db"
    assert with_login("postgresql://h", "u", "p") == "postgresql://u:p@h"
    with pytest.raises(ValueError, match="not a database URL"):
        with_login("h:5432/db", "u", "p")


def test_with_database_on_a_url_without_a_database_keeps_its_host() -> None:
    assert with_database("postgresql://u@h:5432", "irisfed") == "postgresql://u@h:5432/irisfed"
    assert with_database("postgresql://h1,h2?target_session_attrs=read-write", "x") == (
        "postgresql://h1,h2/x?target_session_attrs=read-write")
