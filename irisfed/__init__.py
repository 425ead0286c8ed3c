"""irisfed for producers: :mod:`irisfed.client` submits, cancels and follows jobs.

>>> from irisfed import Client, SyncClient   # the same as from irisfed.client

The services, the command line and the federation's internals live in ``services``,
``shared`` and ``tooling``; this package is the part a producer's code imports.
"""

from irisfed.client import (
    Client,
    ConfigurationError,
    ConflictError,
    InternalError,
    InvalidRequestError,
    IrisfedClientError,
    Job,
    NotFoundError,
    Retry,
    SyncClient,
    UnavailableError,
    UnknownPeerError,
)

__all__ = [
    "Client",
    "ConfigurationError",
    "ConflictError",
    "InternalError",
    "InvalidRequestError",
    "IrisfedClientError",
    "Job",
    "NotFoundError",
    "Retry",
    "SyncClient",
    "UnavailableError",
    "UnknownPeerError",
]
