"""The error hierarchy: one root, one class per wire error code.

Errors that will repeat forever for the same input (``InvalidRequest``,
``Conflict``, ``UnknownPeer``, ``NotFound``, ``PermanentStoreError``) are the
caller's to fix; only ``Unavailable`` is worth retrying.
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    """Wire error codes (``{"error": {"code", ...}}``). Clients match on them: append only."""

    INVALID_REQUEST = "invalid_request"
    CONFLICT = "conflict"
    UNKNOWN_PEER = "unknown_peer"
    NOT_FOUND = "not_found"
    UNAVAILABLE = "unavailable"
    INTERNAL = "internal"
    CONFIG_ERROR = "config_error"
    SCHEMA_MISMATCH = "schema_mismatch"
    FORBIDDEN = "forbidden"


class IrisfedError(Exception):
    """Root of every error irisfed raises on purpose; ``code`` is its wire code."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __init_subclass__(cls, code: ErrorCode | None = None, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if code is not None:
            cls.code = code


class InvalidRequest(IrisfedError, code=ErrorCode.INVALID_REQUEST):
    """The request is malformed: bad JSON, wrong types, bad constraints, too large."""


class UnknownPeer(IrisfedError, code=ErrorCode.UNKNOWN_PEER):
    """A pin names a peer that is not in the federation's configuration."""


class Conflict(IrisfedError, code=ErrorCode.CONFLICT):
    """The job_id is already used by a job with a different spec."""


class NotFound(IrisfedError, code=ErrorCode.NOT_FOUND):
    """No job has that job_id."""


class Forbidden(IrisfedError, code=ErrorCode.FORBIDDEN):
    """A request the user may not make: an unconfigured user's subject, a band above its max_band."""


class Unavailable(IrisfedError, code=ErrorCode.UNAVAILABLE):
    """A dependency (Postgres) is down, hung or dropped the connection. Retry later.

    Raised by the store for every failure that may go away by itself; when it
    happened during a commit, the write may or may not have happened.
    """


class PermanentStoreError(IrisfedError, code=ErrorCode.INTERNAL):
    """Postgres refused a statement in a way that repeats on every retry.

    Permission denied, a violated constraint, a bad argument, a missing function:
    retrying cannot help. ``message`` is the database's; ``error_class`` names its
    kind (e.g. ``InsufficientPrivilegeError``) and ``sqlstate`` its SQLSTATE code.
    """

    def __init__(self, message: str, error_class: str = "", sqlstate: str | None = None) -> None:
        super().__init__(message)
        self.error_class = error_class
        self.sqlstate = sqlstate

    @property
    def detail(self) -> str:
        """``<error class>: <message>``, as logs show it."""
        return f"{self.error_class}: {self.message}" if self.error_class else self.message


class ConfigError(IrisfedError, code=ErrorCode.CONFIG_ERROR):
    """The TOML configuration, a service setting or a command-line flag is invalid."""


class SchemaMismatch(IrisfedError, code=ErrorCode.SCHEMA_MISMATCH):
    """The database is not at the schema revision this code was built for."""


class DatabaseConfigError(PermanentStoreError, ConfigError, code=ErrorCode.CONFIG_ERROR):
    """Postgres cannot be used with these settings, however often one tries.

    A login refused (wrong password, no such role, not allowed to log in, no
    ``pg_hba.conf`` entry), no such database, a database URL or connection parameter
    that cannot be parsed. Both a ``ConfigError`` (the settings are the user's to fix)
    and a ``PermanentStoreError`` (what a store's caller already handles).
    """


class DatabaseSchemaMismatch(PermanentStoreError, SchemaMismatch, code=ErrorCode.SCHEMA_MISMATCH):
    """A statement names a table, column or function the database does not have: the
    database is not at the schema this code was written for (not migrated, or migrated
    by another irisfed version). Also a ``PermanentStoreError``."""


RETRYABLE_CODES = frozenset({Unavailable.code})
