"""irisfed for producers: :mod:`irisfed.client` submits, cancels and follows jobs.

>>> from irisfed import Client, SyncClient   # the same as from irisfed.client

This is also the one name the distribution installs: the federation's pure rules are
``irisfed.shared``, the services ``irisfed.services``, the command line ``irisfed.cli``
(the repository keeps them in its top-level folders; setup.py maps them here). The
client's names load on first use, so a service importing ``irisfed.shared`` does not
pay for the client.
"""

import importlib

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


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("irisfed.client"), name)
    raise AttributeError(f"module 'irisfed' has no attribute {name!r}")
