"""Login roles for a federation's services and peers (``irisfed db-roles``).

Migrations 0003 (services, agents) and 0007 (the read-only dashboard) create the
group roles and row-level security; this creates one
login role per service and per peer, maps each peer role to its peer id, and sets
random passwords that go to a 0600 file (never to logs). The statements are the
store's (``Store.login_roles_apply``); this module decides which roles there are.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

from irisfed.services.common.private import write_private
from irisfed.services.common.store import Store
from irisfed.shared.config import FederationConfig


def peer_role(peer_id: str) -> str:
    return f"irisfed_peer_{peer_id}"


def login_roles(config: FederationConfig) -> dict[str, str]:
    """login role → the group role it joins."""
    roles = {"irisfed_svc_router": "irisfed_router", "irisfed_svc_tick": "irisfed_tick",
             "irisfed_svc_web": "irisfed_web"}
    roles.update({peer_role(p): "irisfed_agent" for p in config.peer_ids})
    return roles


async def apply_roles(conn: Any, config: FederationConfig, given: dict[str, str] | None = None) -> dict[str, str]:
    """Create (or update) every login role with its password (``given``'s, else a fresh
    one); return the passwords.

    ``conn``: a connection (or pool) of ``irisfed.services.common.db`` with the right to create roles.
    """
    roles = login_roles(config)
    given = given or {}
    passwords = {role: given.get(role) or secrets.token_urlsafe(24) for role in roles}
    await Store(conn).login_roles_apply(roles, passwords, {peer_role(p): p for p in config.peer_ids})
    return passwords


def write_passwords(path: Path, passwords: dict[str, str]) -> None:
    write_private(path, json.dumps(passwords, indent=2))
