"""The client's exceptions: one root, :class:`IrisfedClientError`, and a subclass per wire
error code (README, "Wire contract v1"), so callers catch what they can act on::

    try:
        reply = await client.submit(["echo", "hi"], job_id="nightly-2024-05-01")
    except ConflictError:
        ...  # that id already names a different job
    except IrisfedClientError as exc:
        print(exc.code, exc.message)
"""

from __future__ import annotations

from irisfed.shared.errors import ErrorCode, IrisfedError
from irisfed.shared.redact import redact

__all__ = [
    "ConfigurationError",
    "ConflictError",
    "ForbiddenError",
    "InternalError",
    "InvalidRequestError",
    "IrisfedClientError",
    "NotFoundError",
    "SchemaMismatchError",
    "UnavailableError",
    "UnknownPeerError",
    "error_for",
    "translated",
]

class IrisfedClientError(IrisfedError):
    """irisfed answered with an error, or could not be reached; ``code`` says which.

    ``code`` is an :class:`~shared.errors.ErrorCode` (a ``str``: compare it with
    ``"conflict"`` or ``ErrorCode.CONFLICT``); a code this client does not know yet
    stays a plain string. ``message`` is irisfed's own explanation.
    """

    code: ErrorCode | str = ErrorCode.INTERNAL

    def __init__(self, message: str, code: ErrorCode | str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = _as_code(code)

    @property
    def retryable(self) -> bool:
        """Only ``unavailable`` may go away by itself; every other code repeats for the same input."""
        return self.code == ErrorCode.UNAVAILABLE

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class InvalidRequestError(IrisfedClientError, code=ErrorCode.INVALID_REQUEST):
    """The request is malformed (bad types, bad constraints, bad resources, too large)."""


class ConflictError(IrisfedClientError, code=ErrorCode.CONFLICT):
    """The job_id already names a job with a different spec."""


class UnknownPeerError(IrisfedClientError, code=ErrorCode.UNKNOWN_PEER):
    """``cluster_pin`` names a peer that is not in the federation's configuration."""


class NotFoundError(IrisfedClientError, code=ErrorCode.NOT_FOUND):
    """No job has that job_id."""


class ForbiddenError(IrisfedClientError, code=ErrorCode.FORBIDDEN):
    """A request this user may not make: a band above its ``max_band``, or a user the
    federation does not configure."""


class UnavailableError(IrisfedClientError, code=ErrorCode.UNAVAILABLE):
    """No answer (no router, a timeout, NATS or Postgres away) after every retry."""


class InternalError(IrisfedClientError, code=ErrorCode.INTERNAL):
    """irisfed failed in a way retrying will not fix (or answered something unreadable)."""


class ConfigurationError(IrisfedClientError, code=ErrorCode.CONFIG_ERROR):
    """A setting is missing or wrong, and no retry will fix it: no NATS URL, no database
    URL for reads, a bad config file, a database URL that cannot be parsed, a login
    Postgres refuses (wrong user or password, no such database)."""


class SchemaMismatchError(ConfigurationError, code=ErrorCode.SCHEMA_MISMATCH):
    """The database is not at the schema this irisfed needs (not migrated, or migrated by
    another irisfed version): run ``irisfed migrate``. A :class:`ConfigurationError`."""


_BY_CODE: dict[str, type[IrisfedClientError]] = {
    kind.code: kind
    for kind in (InvalidRequestError, ConflictError, UnknownPeerError, NotFoundError, ForbiddenError,
                 UnavailableError, InternalError, ConfigurationError, SchemaMismatchError)
}


def _as_code(code: ErrorCode | str) -> ErrorCode | str:
    try:
        return ErrorCode(code)
    except ValueError:
        return code


def error_for(code: str, message: str) -> IrisfedClientError:
    """The exception for an error reply ``{"error": {"code", "message"}}``.

    >>> error_for("conflict", "job x exists with another spec").__class__.__name__
    'ConflictError'
    """
    kind = _BY_CODE.get(code)
    return kind(message) if kind is not None else IrisfedClientError(message, code)


def translated(exc: IrisfedError) -> IrisfedClientError:
    """One of irisfed's own errors (raised in this process) as the client's error."""
    if isinstance(exc, IrisfedClientError):
        return exc
    return error_for(str(exc.code), redact(exc.message))

