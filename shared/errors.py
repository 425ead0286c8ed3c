"""The error hierarchy: one root, one class per wire error code.

Errors that will repeat forever for the same input (``InvalidRequest``,
``Conflict``, ``UnknownPeer``, ``NotFound``) are the caller's to fix; only
``Unavailable`` is worth retrying.
"""

from __future__ import annotations


class IrisfedError(Exception):
    """Root of every error irisfed raises on purpose; ``code`` is its wire code."""

    code = "internal"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidRequest(IrisfedError):
    """The request is malformed: bad JSON, wrong types, bad constraints, too large."""

    code = "invalid_request"


class UnknownPeer(IrisfedError):
    """A pin names a peer that is not in the federation's configuration."""

    code = "unknown_peer"


class Conflict(IrisfedError):
    """The job_id is already used by a job with a different spec."""

    code = "conflict"


class NotFound(IrisfedError):
    """No job has that job_id."""

    code = "not_found"


class Unavailable(IrisfedError):
    """A dependency (Postgres) is down; nothing was written. Retry later."""

    code = "unavailable"


class ConfigError(IrisfedError):
    """The TOML configuration or a command-line flag is invalid."""

    code = "config_error"


class SchemaMismatch(IrisfedError):
    """The database is not at the schema revision this code was built for."""

    code = "schema_mismatch"


RETRYABLE_CODES = frozenset({Unavailable.code})
