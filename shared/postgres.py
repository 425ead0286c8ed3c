"""What every Postgres client of ours agrees on, without opening a connection.

Which driver errors mean "not now" (retry: Postgres away, restarting, hung, the
connection lost) and which mean "never" (refused for good), how each is told, and how
JSON columns are read. Two kinds of "never" are the user's settings rather than a
statement, and are told as such: ``DatabaseConfigError`` (a login refused, no such
database, a URL that cannot be parsed) and ``DatabaseSchemaMismatch`` (a table, column
or function the database does not have: it is not at this irisfed's schema). The services' pools (``irisfed.services.common.db``) and the
producers' client reads (``irisfed.reads``) both go through these, so a failure is
classified one way everywhere.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import quote

import asyncpg
import msgspec

from irisfed.shared.errors import (
    DatabaseConfigError,
    DatabaseSchemaMismatch,
    IrisfedError,
    PermanentStoreError,
    Unavailable,
)
from irisfed.shared.redact import _PASSWORD_PARAM, _USERINFO, redact

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
# a session ended for idling in a transaction, and a write refused by a read-only
# server (a standby: the primary moved in a failover, the next connection finds it).
TRANSIENT_SQLSTATES = ("08", "53", "57", "40001", "40P01", "55P03", "25P03", "25006")

# SQLSTATEs that no retry fixes and that say the settings are wrong, not a statement:
# invalid authorization (a wrong password, no such role, a role that may not log in,
# no pg_hba.conf entry for this host, user and database) and no such database.
CONFIGURATION_SQLSTATES = ("28", "3D000")

# A statement naming what the database does not have: an undefined table, column or
# function. Our statements are written for one schema revision, so the database is not
# at it (never migrated, migrated by an older or newer irisfed, or not ours at all).
SCHEMA_SQLSTATES = ("42P01", "42703", "42883")

MIGRATE_HINT = "run `irisfed migrate` (or use the irisfed version that matches the database)"


def with_database(server_url: str, name: str) -> str:
    """``server_url`` with its database replaced by ``name``, its login, hosts and query
    (``target_session_attrs`` of a multi-host URL) kept as they were."""
    scheme, netloc, _, query = _url_parts(server_url)
    return f"{scheme}://{netloc}/{name}{query}"


def with_login(database_url: str, user: str, password: str) -> str:
    """``database_url`` logging in as ``user`` with ``password`` (any login it named
    replaced). One login for every host of a multi-host URL: libpq's form,
    ``postgresql://user:password@h1:5432,h2:5432/db``."""
    scheme, netloc, path, query = _url_parts(database_url)
    hosts = netloc.rsplit("@", 1)[-1]
    return f"{scheme}://{quote(user, safe='')}:{quote(password, safe='')}@{hosts}{path}{query}"


def _url_parts(url: str) -> tuple[str, str, str, str]:
    """A libpq URL's scheme, login and hosts, ``/database`` ("" when none) and ``?query``
    ("" when none). Split by hand: a multi-host netloc is not one ``host:port``."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"not a database URL: {url!r}")
    rest, mark, query = rest.partition("?")
    netloc, slash, path = rest.partition("/")
    return scheme, netloc, slash + path, mark + query


def one_url_per_host(database_url: str) -> list[str]:
    """A multi-host URL (``postgresql://login@h1:5432,h2:5432/db?...``) as one URL per
    host, in its order, each with the same login, database and query; a one-host URL
    as itself. An empty host (``h1,/db``) raises ``ClientConfigurationError``: split,
    it would name no host and reach whatever Postgres runs on this machine."""
    scheme, netloc, path, query = _url_parts(database_url)
    login, at, hosts = netloc.rpartition("@")
    listed = hosts.split(",")
    if len(listed) > 1 and not all(listed):
        raise asyncpg.exceptions.ClientConfigurationError(
            "the database URL lists an empty host (a stray comma?)")
    return [f"{scheme}://{login}{at}{host}{path}{query}" for host in listed]


class HostByHost:
    """asyncpg's ``connect`` for a pool on a multi-host URL: each host tried in turn
    within a connect timeout of its own, the host that served last tried first.

    asyncpg gives the whole timeout to the first host: one that swallows the attempt
    (its machine black-holed, not reset) leaves nothing for the next, and after a
    failover every connection would go on timing out on it. Moving on from a host:
    unreachable, silent, starting up, or not what ``target_session_attrs`` asks for
    (a standby); any other answer (a refused login, no such database) is kept and
    raised if no host serves, since it says what is wrong. The next attempt starts
    past a host while it is being tried: a pool that gives up on a connect sooner
    than the host's timeout (its acquire wait) must not start on that host again."""

    def __init__(self, database_url: str) -> None:
        self.database_url = database_url
        self.urls: list[str] = []
        self.first = 0

    async def __call__(self, dsn: str | None = None, **kwargs) -> asyncpg.Connection:
        """``kwargs``: what the pool passes ``asyncpg.connect`` (its ``timeout`` is each host's)."""
        del dsn  # one URL per host instead
        # Split at the first connect, so a bad URL is raised where the pool opens
        # (``connecting`` names it), not where the pool object is made.
        self.urls = self.urls or one_url_per_host(self.database_url)
        count = len(self.urls)
        order = [(self.first + step) % count for step in range(count)]
        answered: Exception | None = None
        unreachable: Exception | None = None
        for index in order:
            self.first = (index + 1) % count  # where the next attempt starts if this one is cut short
            try:
                conn = await asyncpg.connect(self.urls[index], **kwargs)
            except CONNECTION_ERRORS as exc:  # with a standby's TargetServerAttributeNotMatched
                unreachable = exc
                continue
            except asyncpg.PostgresError as exc:
                answered = answered or exc
                continue
            self.first = index
            return conn
        raise answered or unreachable or OSError("no host in the database URL")


def pool_connect(database_url: str) -> HostByHost | None:
    """The pool's ``connect`` for ``database_url``: host by host when it names several.
    Not with ``PGHOST``/``PGPORT`` lists (libpq's hosts and ports from the environment):
    asyncpg matches a ``PGPORT`` list against every URL's hosts, a one-host URL's too,
    so those are left to asyncpg's own multi-host connect."""
    if "," in os.environ.get("PGPORT", "") + os.environ.get("PGHOST", ""):
        return None
    try:
        _, netloc, _, _ = _url_parts(database_url)
    except ValueError:
        return None  # asyncpg says what is wrong with it
    return HostByHost(database_url) if "," in netloc.rpartition("@")[2] else None


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` may go away by itself (retry later) rather than on every retry.

    Transient: Postgres unreachable or restarting, the connection lost, a timeout.
    Everything else a statement raises (permission denied, a constraint, a bad
    argument, a bug) fails again the same way and must not be retried forever.
    """
    if isinstance(exc, asyncpg.exceptions.DataError):  # a bad argument (an InterfaceError)
        return False
    if isinstance(exc, asyncpg.exceptions.ClientConfigurationError):  # a bad connection parameter
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

    Transient (``is_transient``) → ``Unavailable``; refused for good → a
    ``PermanentStoreError`` naming the database's error class and SQLSTATE: a
    ``DatabaseConfigError`` when the login or a connection parameter is wrong, a
    ``DatabaseSchemaMismatch`` when the database lacks what a statement names, the
    plain class for anything else (permission denied, a constraint, a bad argument).
    """
    if isinstance(exc, IrisfedError):
        return exc
    if is_transient(exc):
        return Unavailable(unavailable_message(exc))
    if not isinstance(exc, (asyncpg.PostgresError, asyncpg.InterfaceError)):
        return exc
    sqlstate = getattr(exc, "sqlstate", None)
    named = {"error_class": type(exc).__name__, "sqlstate": sqlstate}
    if isinstance(exc, asyncpg.exceptions.ClientConfigurationError):
        return DatabaseConfigError(f"invalid database connection setting: {redact(exc)}", **named)
    if (sqlstate or "").startswith(CONFIGURATION_SQLSTATES):
        return DatabaseConfigError(f"Postgres refused the connection: {redact(exc)}", **named)
    if (sqlstate or "").startswith(SCHEMA_SQLSTATES):
        return DatabaseSchemaMismatch(schema_mismatch_message(exc), **named)
    return PermanentStoreError(str(exc), **named)


def schema_mismatch_message(cause: BaseException, found: str = "") -> str:
    """What a ``DatabaseSchemaMismatch`` says: the statement's error, where the
    database's schema is when known (``found``), and what to do."""
    seen = f"{cause}; {found}" if found else str(cause)
    return f"the database is not at the schema this irisfed needs ({seen}); {MIGRATE_HINT}"


def connect_error(exc: Exception, database_url: str) -> Exception:
    """The irisfed error for a failure to open a connection (or pool) to ``database_url``.

    As :func:`translate`, with the server named (its URL without the password) and two
    more kinds of "never": a URL the driver cannot parse (it raises ``ValueError`` or
    ``OverflowError`` before any I/O) is a ``DatabaseConfigError`` too. Anything else
    that is not a driver error is returned as it is.
    """
    if isinstance(exc, IrisfedError):
        return exc
    where = redact(database_url)
    if isinstance(exc, (ValueError, OverflowError)):  # asyncpg's ClientConfigurationError too
        why = _scrubbed(exc, database_url)
        if "***" in why:  # the driver quoted a piece of the password back: it split the URL
            why += " (percent-encode any ':', '/', '?', '#', '[', ']' or '@' in the password)"
        return DatabaseConfigError(f"invalid database URL {where}: {why}", error_class=type(exc).__name__)
    if is_transient(exc):
        why = "no answer in time" if isinstance(exc, TimeoutError) else redact(exc) or type(exc).__name__
        return Unavailable(f"cannot reach Postgres at {where}: {why}")
    translated = translate(exc)
    if isinstance(translated, DatabaseConfigError):
        return DatabaseConfigError(
            f"Postgres at {where} refused the connection: {redact(exc)} (check the user, password and "
            "database name in the database URL)", error_class=translated.error_class,
            sqlstate=translated.sqlstate)
    return translated


@contextmanager
def connecting(database_url: str) -> Iterator[None]:
    """Open connections to ``database_url`` inside the block; failures raise as
    :func:`connect_error` says (the driver's error as the cause)."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - translated, or raised again as it was
        translated = connect_error(exc, database_url)
        if translated is exc:
            raise
        raise translated from exc


def _scrubbed(exc: BaseException, database_url: str) -> str:
    """``exc``'s text without the URL's password, not even a piece of it.

    A password with an unescaped ``/``, ``#`` or ``?`` splits the URL in odd places,
    and the driver may then quote part of it back as a host or a port.
    """
    text = redact(exc) or type(exc).__name__
    secrets = [m["password"] for m in _USERINFO.finditer(database_url)]
    secrets += [m["password"] for m in _PASSWORD_PARAM.finditer(database_url)]
    secrets = [secret for secret in secrets if secret]
    if not secrets:
        return text

    def quoted(match: re.Match[str]) -> str:
        inner = match[2]
        return f"{match[1]}***{match[1]}" if inner and any(inner in s for s in secrets) else match[0]

    text = re.sub(r"""(['"])(.*?)\1""", quoted, text)
    for secret in secrets:
        if len(secret) >= 3:
            text = text.replace(secret, "***")
    return text


@contextmanager
def translated_errors() -> Iterator[None]:
    """Raise driver errors inside the block as :func:`translate` says (``Unavailable`` /
    ``PermanentStoreError`` or one of its two named kinds)."""
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
