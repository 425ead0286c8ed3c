"""What a NATS URL means to us: its list of servers, and the reply inbox its user may read;
and the guard every NATS client of ours puts on its connection (``guard_headers``).

Rules shared by every NATS client of ours (services, the CLI, the producers' client):
each user reads replies only on ``_INBOX_<user>.>`` (the server's permissions say
so), so a client must ask nats-py for that inbox prefix.
"""

from __future__ import annotations

import os
import re
from urllib.parse import urlsplit

# The NATS default; used when a URL names no user (or one that is not a plain subject token).
DEFAULT_INBOX_PREFIX = "_INBOX"
# Overrides the derived prefix, for NATS servers whose users follow another scheme.
INBOX_PREFIX_ENV = "IRISFED_NATS_INBOX_PREFIX"
_SUBJECT_TOKEN = re.compile(r"[A-Za-z0-9_-]+")


def inbox_prefix(user: str) -> str:
    """The inbox prefix of NATS user ``user``: its replies arrive on ``_INBOX_<user>.>``."""
    return f"{DEFAULT_INBOX_PREFIX}_{user}"


def inbox_prefix_for_url(url: str) -> str:
    """The inbox prefix a client connecting with ``url`` must use.

    ``$IRISFED_NATS_INBOX_PREFIX`` when set; else ``_INBOX_<user>`` when the first
    server's URL carries ``user:password``; else the NATS default ``_INBOX`` (no
    auth, or a token: a secret never becomes part of a subject).
    """
    override = os.environ.get(INBOX_PREFIX_ENV)
    if override:
        return override
    first = url.split(",", 1)[0].strip()
    try:
        parts = urlsplit(first if "://" in first else f"nats://{first}")
        user, password = parts.username, parts.password
    except ValueError:
        return DEFAULT_INBOX_PREFIX
    if user and password is not None and _SUBJECT_TOKEN.fullmatch(user):
        return inbox_prefix(user)
    return DEFAULT_INBOX_PREFIX


def server_list(url: str) -> list[str]:
    """``nats://a:4222,nats://b:4222`` → every server of a NATS cluster."""
    return [part.strip() for part in url.split(",") if part.strip()]


# What a message whose header could not be read is given instead (``guard_headers``): a
# status, so every handler drops it (services.common.bus.from_jetstream) and a fetch
# refuses it.
MALFORMED_HEADERS = {"Status": "malformed"}


def guard_headers(nc) -> None:
    """Keep a header no one can read from stopping ``nc`` (a nats-py client) for good.

    nats-py 2.16 decodes a message's header outside its own error handling: a status
    line that is not UTF-8 raises out of the connection's read loop, which then stops
    reading, while the connection looks alive until its pings time out, minutes later.
    Anyone who may publish on a subject the client hears (a user on its own submit
    subject; a stored message answered onto any subject by a direct get) could so
    deafen a router, tick, agent or dashboard. Such a message reads as
    ``MALFORMED_HEADERS`` instead."""
    process = nc._process_headers

    async def guarded(headers):
        try:
            return await process(headers)
        except Exception:  # noqa: BLE001 - whatever it is, the read loop must go on
            return dict(MALFORMED_HEADERS)
    nc._process_headers = guarded
