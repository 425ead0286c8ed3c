"""The restricted Postgres login roles as the tests use them: a URL as one of them, the
role of each service, and what Postgres answers when a role tries what it may not."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import asyncpg

from irisfed.services.common.db_roles import peer_role

# One login role per restricted service, as `irisfed db-roles` makes them.
ROLES = {"agent": peer_role("gpu-west"), "router": "irisfed_svc_router", "tick": "irisfed_svc_tick",
         "web": "irisfed_svc_web"}

# A statement a role may not run: no privilege, a guard trigger's RAISE, or an
# ALTER/DROP of an object the role does not own.
REFUSED = (asyncpg.InsufficientPrivilegeError, asyncpg.RaiseError, asyncpg.ObjectNotInPrerequisiteStateError)


def as_role(url: str, role: str) -> str:
    """``url`` logging in as ``role`` instead of its own user (no password: the test server trusts it)."""
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(parts._replace(netloc=f"{role}@{host}"))


async def refused(conn: asyncpg.Connection, sql: str, *args) -> bool:
    """Whether Postgres refused ``sql`` (one of REFUSED); any other error propagates."""
    try:
        await conn.execute(sql, *args)
    except REFUSED:
        return True
    return False
