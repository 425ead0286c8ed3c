"""``irisfed compose-secrets``: every secret compose.yaml mounts, as files (0600).

compose.yaml runs with auth on, the way production does: one NATS user per service
(``irisfed nats-auth``'s roles) and one Postgres login role per service
(``irisfed db-roles``' roles), each service reading its own URLs from secret files
(``IRISFED_DATABASE_URL_FILE``, ``IRISFED_NATS_URL_FILE``). This writes them all into
one folder (``deploy/secrets/``, gitignored), keeping any file already there, so it
can be run again after adding a peer:

- ``postgres-password``: the database owner's (the image reads POSTGRES_PASSWORD_FILE);
- ``admin.database-url``: that owner's URL, for ``migrate`` and ``roles`` only;
- ``db-credentials.json``: each login role's password (``irisfed db-roles --passwords``
  sets exactly these);
- ``nats.conf``: the NATS server's users and permissions (``nats-server -c``);
- ``<service>.database-url`` and ``<service>.nats-url`` per service (router, tick, web,
  ``agent-<peer>``), each with that service's own role and user; ``operator.nats-url``
  for the health checks that ask a service over NATS;
- ``web-operator-token``: the dashboard's operator token.

Run as root, it gives the files irisfed's containers read to the image's user
(uid 10001); otherwise run ``sudo chown 10001 deploy/secrets/*`` afterwards except
``postgres-password`` and ``nats.conf``, which those images read as root.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

from irisfed.services.common.db_roles import login_roles, peer_role
from irisfed.services.common.nats_auth import (
    render_server_config,
    role_permissions,
    user_role,
    with_credentials,
)
from irisfed.services.common.private import write_private
from irisfed.shared.config import FederationConfig
from irisfed.shared.errors import ConfigError
from irisfed.shared.postgres import with_login

DATABASE = "irisfed"
OWNER = "irisfed"  # the database owner (the postgres image's POSTGRES_USER)
# The image's user (Dockerfile). Compose mounts file secrets as they are on the host,
# so the files irisfed containers read must belong to it (they stay 0600).
IMAGE_UID = 10001
# Read by other images' root processes (postgres, nats): left to the host's root.
NOT_OURS = ("postgres-password", "nats.conf")


def service_roles(config: FederationConfig) -> dict[str, tuple[str, str]]:
    """Service → (its Postgres login role, its NATS user)."""
    services = {"router": ("irisfed_svc_router", "router"), "tick": ("irisfed_svc_tick", "tick"),
                "web": ("irisfed_svc_web", "web")}
    services.update({f"agent-{peer}": (peer_role(peer), f"agent-{peer}") for peer in config.peer_ids})
    return services


def _keep_or_write(path: Path, make) -> str:
    """The file's text when it exists, else ``make()`` written there (0600)."""
    if path.exists():
        return path.read_text()
    text = make()
    write_private(path, text)
    return text


DEFAULT_DATABASE_URL = f"postgresql://postgres:5432/{DATABASE}"
DEFAULT_NATS_URL = "nats://nats-1:4222,nats://nats-2:4222,nats://nats-3:4222"  # compose.yaml's cluster


# In the query, libpq takes these over the URL's own login, hosts and database, asyncpg
# does not: psql on admin.database-url and the services would reach different places.
LOGIN_PARAMETERS = frozenset({"user", "password", "passfile"})
SERVER_PARAMETERS = frozenset({"host", "hostaddr", "port", "dbname", "database", "service"})
NATS_SCHEMES = ("nats", "tls", "ws", "wss")


def _one_token(url: str, what: str) -> None:
    if not url:
        raise ConfigError(f"{what} is empty: name the servers (or leave the option out for compose's own)")
    if any(c.isspace() or not c.isprintable() for c in url):
        raise ConfigError(f"{what} {url!r}: holds whitespace or a control character")


def _port_number(text: str) -> bool:
    """A TCP port written in ASCII digits (``int`` also reads ``５４３２``; libpq does not)."""
    return text.isascii() and text.isdigit() and 0 < int(text) < 65536


def database_servers(url: str, what: str = "--database-url") -> None:
    """Refuse anything but ``postgresql://host:port[,host:port...]/database[?parameters]``
    without a login (each service's file gets its own): every secret file must hold one
    URL every driver reads the same way."""
    _one_token(url, what)
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("postgresql", "postgres"):
        raise ConfigError(f"{what} {url!r}: not a Postgres URL (postgresql://host:port/database)")
    if "#" in rest:
        raise ConfigError(f"{what} {url!r}: a fragment (#...) has no meaning in a database URL")
    rest, _, query = rest.partition("?")
    netloc, _, database = rest.partition("/")
    if "@" in netloc:
        raise ConfigError(f"{what} names the servers only: leave out the user and password "
                          "(each service's file gets its own)")
    for host in netloc.split(","):
        name, _, port = host.rpartition(":")
        bare_ipv6 = ":" in name and not (name.startswith("[") and name.endswith("]"))
        if not name or bare_ipv6 or not _port_number(port):
            raise ConfigError(f"{what} {url!r}: each server as host:port (an IPv6 address in brackets), "
                              f"comma-separated (got {host!r})")
    if not database:
        raise ConfigError(f"{what} {url!r}: name the database (postgresql://host:port/irisfed)")
    keys = {k for k, _ in parse_qsl(query, keep_blank_values=True)}
    if smuggled := LOGIN_PARAMETERS & keys:
        raise ConfigError(f"{what} {url!r}: {', '.join(sorted(smuggled))} in the query: leave the login "
                          "out (each service's file gets its own)")
    if elsewhere := SERVER_PARAMETERS & keys:
        raise ConfigError(f"{what} {url!r}: {', '.join(sorted(elsewhere))} in the query: name the servers "
                          "and the database in the URL itself (libpq and asyncpg read the query differently)")


def nats_servers(url: str, what: str = "--nats-url") -> None:
    """Refuse anything but ``nats://host:port[,nats://host:port...]`` without a login."""
    _one_token(url, what)
    for member in url.split(","):
        try:
            parts = urlsplit(member)
            port = parts.port
        except ValueError:
            port = None
            parts = None
        if parts is None or parts.scheme not in NATS_SCHEMES or not parts.hostname or not port:
            raise ConfigError(f"{what} {url!r}: each server as nats://host:port, comma-separated "
                              f"(got {member!r})")
        if "@" in parts.netloc:
            raise ConfigError(f"{what} names the servers only: leave out the user and password "
                              "(each service's file gets its own)")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ConfigError(f"{what} {url!r}: a server is nats://host:port, nothing after it "
                              f"(got {member!r})")


def write_secrets(config: FederationConfig, out: Path, database: str = DEFAULT_DATABASE_URL,
                  nats: str = DEFAULT_NATS_URL, owner: int | None = None) -> list[Path]:
    """Write (or keep) every secret file of compose.yaml under ``out``; the files' paths.
    ``database`` and ``nats``: the servers every URL names, without credentials (each
    file adds its own; a multi-host Postgres URL and a NATS server list keep every
    host). ``owner``: give the files irisfed's containers read to this uid (needs root)."""
    database_servers(database)
    nats_servers(nats)
    out.mkdir(parents=True, exist_ok=True)
    out.chmod(0o700)
    before = set(out.iterdir())
    owner_password = _keep_or_write(out / "postgres-password", lambda: secrets.token_urlsafe(24)).strip()
    db_base = database  # without credentials: each file adds its own
    _keep_or_write(out / "admin.database-url", lambda: with_login(db_base, OWNER, owner_password) + "\n")

    roles = login_roles(config)
    stored = json.loads(_keep_or_write(out / "db-credentials.json", lambda: "{}"))
    if set(roles) - set(stored):  # a new peer: its role gets a password, the others keep theirs
        stored.update({role: secrets.token_urlsafe(24) for role in roles if role not in stored})
        (out / "db-credentials.json").write_text(json.dumps(stored, indent=2) + "\n")

    permissions = role_permissions(config.subject_prefix, config.peer_ids, config.user_ids)
    nats_passwords_file = out / "nats-credentials.json"
    nats_passwords = json.loads(_keep_or_write(nats_passwords_file, lambda: "{}"))
    if set(permissions) - set(nats_passwords):
        nats_passwords.update({r: secrets.token_urlsafe(24) for r in permissions if r not in nats_passwords})
        nats_passwords_file.write_text(json.dumps(nats_passwords, indent=2) + "\n")
    write_private(out / "nats.conf", render_server_config(permissions, nats_passwords))

    nats_base = nats
    users = {f"user-{u}": (None, user_role(u)) for u in config.user_ids}
    for service, (role, user) in {**service_roles(config), "operator": (None, "operator"), **users}.items():
        if role is not None:
            write_private(out / f"{service}.database-url", with_login(db_base, role, stored[role]) + "\n")
        write_private(out / f"{service}.nats-url", with_credentials(nats_base, user, nats_passwords[user]) + "\n")
    # NATS's admin: only the one-shot `buckets` service, which creates the object store's streams.
    write_private(out / "admin.nats-url", with_credentials(nats_base, "admin", nats_passwords["admin"]) + "\n")
    _keep_or_write(out / "web-operator-token", lambda: secrets.token_urlsafe(32) + "\n")
    written = sorted(set(out.iterdir()) | before)
    if owner is not None:
        for path in written:
            if path.name not in NOT_OURS:
                os.chown(path, owner, owner)
    return written

