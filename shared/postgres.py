"""What every Postgres client of ours agrees on, without opening a connection.

Which driver errors mean "not now" (retry: Postgres away, restarting, hung, the
connection lost) and which mean "never" (refused for good), how each is told, and how
JSON columns are read. The services' pools (``irisfed.services.common.db``) and the
producers' client reads (``irisfed.reads``) both go through these, so a failure is
classified one way everywhere.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

import asyncpg
import msgspec

from irisfed.shared.errors import IrisfedError, PermanentStoreError, Unavailable

# Errors that mean "Postgres is not there right now", as opposed to a bug or bad data.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    asyncpg.exceptions.ConnectionDoesNotExistError,
    asyncpg.exceptions.CannotConnectNowError,
    asyncpg.exceptions.ConnectionFailureError,
    asyncpg.exceptions.InterfaceError,
    asyncpg.exceptions.AdminShutdownError,
    asyncpg.exceptions.TooManyConnectionsError,
    asyncpg.exceptions.PostgresConnectionError,
    # A connection that broke in the middle of a statement (e.g. a server restart).
    asyncpg.exceptions.InternalClientError,
    ConnectionError,
    # A Postgres that hangs: our own timeouts (client side: TimeoutError; server
    # side: statement_timeout cancels the statement, idle_in_transaction ends the session).
    asyncio.TimeoutError,
    asyncpg.exceptions.QueryCanceledError,
    asyncpg.exceptions.IdleInTransactionSessionTimeoutError,
)


# SQLSTATEs (classes and codes) that mean "not now", not "never": connection
# exceptions, insufficient resources, operator intervention (shutdown, starting up,
# statement timeout or cancel), serialization failure and deadlock, lock timeout,
# a session ended for idling in a transaction.
TRANSIENT_SQLSTATES = ("08", "53", "57", "40001", "40P01", "55P03", "25P03")


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` may go away by itself (retry later) rather than on every retry.

    Transient: Postgres unreachable or restarting, the connection lost, a timeout.
    Everything else a statement raises (permission denied, a constraint, a bad
    argument, a bug) fails again the same way and must not be retried forever.
    """
    if isinstance(exc, asyncpg.exceptions.DataError):  # a bad argument (an InterfaceError)
        return False
    if isinstance(exc, (Unavailable, *CONNECTION_ERRORS)):
        return True
    return isinstance(exc, asyncpg.PostgresError) and (exc.sqlstate or "").startswith(TRANSIENT_SQLSTATES)


def unavailable_message(exc: BaseException) -> str:
    """How a transient failure is told to whoever waits on it (a producer, a log line)."""
    if isinstance(exc, TimeoutError):
        return "the database did not answer in time"
    return f"database unavailable: {exc}"


def translate(exc: Exception) -> Exception:
    """The irisfed error for a driver (or network) error; anything else is returned as it is.

    Transient (``is_transient``) → ``Unavailable``; a statement Postgres refused for
    good → ``PermanentStoreError`` naming the database's error class and SQLSTATE.
    """
    if isinstance(exc, IrisfedError):
        return exc
    if is_transient(exc):
        return Unavailable(unavailable_message(exc))
    if isinstance(exc, (asyncpg.PostgresError, asyncpg.InterfaceError)):
        return PermanentStoreError(str(exc), error_class=type(exc).__name__,
                                   sqlstate=getattr(exc, "sqlstate", None))
    return exc


@contextmanager
def translated_errors() -> Iterator[None]:
    """Raise driver errors inside the block as ``Unavailable`` / ``PermanentStoreError``."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - translated, or raised again as it was
        translated = translate(exc)
        if translated is exc:
            raise
        raise translated from exc


async def set_json_codecs(conn: asyncpg.Connection) -> None:
    """jsonb and json columns in and out as Python values, through msgspec."""
    for type_name in ("jsonb", "json"):
        await conn.set_type_codec(
            type_name,
            encoder=lambda value: msgspec.json.encode(value).decode(),
            decoder=msgspec.json.decode,
            schema="pg_catalog",
        )
