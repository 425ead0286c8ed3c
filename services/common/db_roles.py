"""Login roles for a federation's services and peers (``irisfed db-roles``).

Migration 0003 creates the group roles and row-level security; this creates one
login role per service and per peer, maps each peer role to its peer id, and sets
random passwords that go to a 0600 file (never to logs).
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import asyncpg

from shared.config import FederationConfig


def peer_role(peer_id: str) -> str:
    return f"irisfed_peer_{peer_id}"


def login_roles(config: FederationConfig) -> dict[str, str]:
    """login role → the group role it joins."""
    roles = {"irisfed_svc_router": "irisfed_router", "irisfed_svc_tick": "irisfed_tick"}
    roles.update({peer_role(p): "irisfed_agent" for p in config.peer_ids})
    return roles


def _quote(identifier: str) -> str:
    return '"' + identifier.replace('"', '""') + '"'


async def apply_roles(conn: asyncpg.Connection, config: FederationConfig) -> dict[str, str]:
    """Create (or update) every login role with a fresh password; return the passwords."""
    passwords = {}
    async with conn.transaction():
        for role, group in login_roles(config).items():
            password = secrets.token_urlsafe(24)
            exists = await conn.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", role)
            verb = "ALTER" if exists else "CREATE"
            # Utility statements take no parameters; the password is a generated token.
            await conn.execute(f"{verb} ROLE {_quote(role)} LOGIN PASSWORD '{password}'")
            await conn.execute(f"GRANT {group} TO {_quote(role)}")
            passwords[role] = password
        for peer_id in config.peer_ids:
            await conn.execute(
                "INSERT INTO peer_roles (role_name, peer_id) VALUES ($1, $2) "
                "ON CONFLICT (role_name) DO UPDATE SET peer_id = EXCLUDED.peer_id",
                peer_role(peer_id), peer_id,
            )
    return passwords


def write_passwords(path: Path, passwords: dict[str, str]) -> None:
    path.touch()
    path.chmod(0o600)
    path.write_text(json.dumps(passwords, indent=2))
