"""Keep credentials out of every message: the one redaction helper.

Server URLs carry passwords (``postgresql://user:PASSWORD@host/db``,
``nats://agent-x:PASSWORD@host:4222``, comma-separated NATS cluster lists,
``?password=`` in a libpq URL, a bare NATS token ``nats://TOKEN@host``). Any
text that may contain one — an error, a log line, a traceback, a status line —
goes through :func:`redact` before anyone sees it. The user name and host stay,
so the message still says where.
"""

from __future__ import annotations

import re

MASK = "***"

# scheme://user:password@  (also the scheme-less "user:password@" after a comma in a
# NATS server list). A password may hold odd characters ('@', '/', ','), so it runs
# greedily to the last '@' before whitespace, a quote, or the next "scheme://" of a
# list: better to hide a host than to show part of a password.
_USERINFO = re.compile(
    r"(?P<lead>\b[A-Za-z][A-Za-z0-9+.-]*://|(?<=,))"
    r"(?P<user>[^:@/\s,\"'<>]*):"
    r"(?P<password>(?:(?!,\s*[A-Za-z][A-Za-z0-9+.-]*://)[^\s\"'<>])*)@"
)
# A NATS URL whose only userinfo is a token: the token is the secret.
_TOKEN = re.compile(r"(?P<lead>\b(?:nats|tls|ws|wss)://)(?P<token>[^:@/\s,\"'<>]+)@")
# libpq keyword in a URL query or a DSN string: password=...
_PASSWORD_PARAM = re.compile(r"(?P<lead>(?:[?&\s]|^)password=)(?P<password>[^&\s\"']*)", re.IGNORECASE)


def redact(text: object) -> str:
    """``text`` with every password, token or ``password=`` value replaced by ``***``."""
    value = text if isinstance(text, str) else str(text)
    if "@" not in value and "password" not in value.lower():
        return value  # the common case: nothing to hide, no regex work
    value = _USERINFO.sub(lambda m: f"{m['lead']}{m['user']}:{MASK}@", value)
    value = _TOKEN.sub(lambda m: f"{m['lead']}{MASK}@", value)
    return _PASSWORD_PARAM.sub(lambda m: f"{m['lead']}{MASK}", value)
