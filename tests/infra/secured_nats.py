"""A nats-server with irisfed's users and their permissions (``start_secured_nats``), and
clients connected to it as one of its roles, every permission error the server sends
them kept in a list (tests/integration/conftest.py's ``secured_nats``;
tests/integration/test_security.py, test_inbox_permissions.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path

import nats

from irisfed.tooling.servers import start_secured_nats

# The peers of tests/integration/conftest.py's ``secured_nats`` (an agent user each).
SECURED_PEERS = ("home", "gpu-west", "tpu-east")


@contextlib.contextmanager
def secured_server(folder: Path, peers, **options):
    """``(auth, server)``: a secured nats-server (subject prefix ``irisfed``) for ``peers``,
    its files under ``folder``; stopped at the end."""
    server, auth = start_secured_nats(folder / "nats", "irisfed", peers, auth_dir=folder / "auth", **options)
    try:
        yield auth, server
    finally:
        server.stop()


async def connect_as(auth, server, role: str, errors: list[str], **options):
    """A client of ``server`` as ``role`` that never reconnects; the errors the server
    sends it (permission violations) are appended to ``errors``."""
    async def on_error(exc):
        errors.append(str(exc))
    return await nats.connect(auth.url(server.url, role), error_cb=on_error, allow_reconnect=False, **options)


@contextlib.asynccontextmanager
async def connected(secured, *roles: str):
    """``(errors, client, ...)``: a ``connect_as`` client of ``secured`` (``(auth, server)``)
    per role, all their errors in one list; closed at the end."""
    auth, server = secured
    errors: list[str] = []
    clients = []
    try:
        for role in roles:
            clients.append(await connect_as(auth, server, role, errors))
        yield errors, *clients
    finally:
        for client in clients:
            await client.close()


async def until(predicate: Callable[[], object], timeout: float = 30.0,
                what: Callable[[], object] | None = None) -> None:
    """Poll ``predicate()`` every 20 ms until it is true; after ``timeout`` seconds an
    ``AssertionError`` that shows ``what()`` (what was seen so far)."""
    async def poll():
        while not predicate():
            await asyncio.sleep(0.02)
    try:
        await asyncio.wait_for(poll(), timeout)
    except TimeoutError:
        seen = what() if what is not None else None
        raise AssertionError(f"not true after {timeout:.0f} s; seen: {seen!r}") from None
