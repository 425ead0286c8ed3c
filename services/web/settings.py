"""``WebSettings``: every default of ``irisfed web``, checked when built; and the
operator token, read once at start and never shown."""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from irisfed.services.common.log import EventLogger
from irisfed.shared.errors import ConfigError
from irisfed.shared.settings import require_count, require_port, require_seconds

log = EventLogger("web")

OPERATOR_TOKEN_ENV = "IRISFED_WEB_OPERATOR_TOKEN"
DEFAULT_OPERATOR_TOKEN_FILE = Path(".irisfed") / "web-operator-token"
# The dashboard's own first path segments: a --root-path must not start with one, or a
# request could mean either (the app accepts paths with or without the prefix).
OWN_PATHS = ("jobs", "users", "charts", "api", "events", "login", "logout", "healthz", "static")
# A browser's setTimeout holds at most ~24.8 days (2**31 - 1 ms) and fires at once
# beyond: a longer wait for a refused stream would ask again at once, in a loop.
MAX_REFUSED_RETRY_S = 24 * 3600
# ... and a wait of a few milliseconds is the same loop (every refused tab asking again
# and again; under 0.5 ms the page even read 0 and fell back to 30 s, while Retry-After
# said 1): at least the one second Retry-After can say.
MIN_REFUSED_RETRY_S = 1
# Shorter tokens can be guessed through the login form; `irisfed up` writes 32 random bytes.
MIN_TOKEN_CHARS = 16


class Secret:
    """A string that never shows in a repr, a log line or an f-string."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret(***)"

    __str__ = __repr__


@dataclass(frozen=True)
class WebSettings:
    """How ``irisfed web`` serves (defaults here and nowhere else; checked when built)."""

    host: str = "127.0.0.1"
    port: int = 8080  # 0: any free port (tests)
    root_path: str = ""  # the path prefix a reverse proxy serves it under ("" or "/prefix")
    operator_token: Secret | None = field(default=None, repr=False)  # None: view-only
    page_size: int = 50  # jobs per page of the job list
    # Postgres polling: every poll_s while NATS is away (the live fallback), and every
    # live_poll_s while it is up (a message lost on NATS still reaches the pages).
    poll_s: float = 2.0
    live_poll_s: float = 10.0
    snapshot_s: float = 1.0  # the federation page's live counts are shared this long by every viewer
    totals_s: float = 15.0  # the all-time counts per state (a scan of every job) this long
    charts_s: float = 10.0  # the charts this long
    # Server-sent events: changes are gathered and sent to every viewer at most once per
    # flush_s; a viewer more than queue_batches batches behind is dropped to one "resync".
    flush_s: float = 0.5
    queue_batches: int = 16
    max_viewers: int = 200  # concurrent /events streams; more are answered 503
    # ... and per client address (behind a proxy: the X-Forwarded-For uvicorn trusts,
    # from FORWARDED_ALLOW_IPS, default 127.0.0.1); more are answered 429.
    viewers_per_client: int = 8
    # A browser refused a stream (429/503) polls its page instead, and asks for a stream
    # again this long after (also the refusal's Retry-After, rounded up to whole seconds).
    refused_retry_s: float = 30.0
    keepalive_s: float = 15.0
    log_tail_bytes: int = 64 * 1024  # of each of a job's stdout and stderr
    cancel_timeout_s: float = 5.0  # for the router's reply
    output_timeout_s: float = 60.0  # a download's read of the object store
    session_ttl_s: float = 12 * 3600  # an operator's login

    def __post_init__(self) -> None:
        require_port("web", "port", self.port, least=0, flag="--port")
        if not self.host:
            raise ConfigError("web setting host (--host) must not be empty")
        root = self.root_path
        if root and (not root.startswith("/") or root.endswith("/") or "//" in root
                     or any(c in root for c in "?#\\\"'<> ") or not root.isprintable()):
            raise ConfigError(f"web setting root_path (--root-path) must look like /prefix, got {root!r}")
        if root and root.split("/")[1] in OWN_PATHS:
            raise ConfigError(f"web setting root_path (--root-path) must not start with one of the dashboard's "
                              f"own paths ({', '.join(OWN_PATHS)}), got {root!r}")
        for name in ("page_size", "queue_batches", "max_viewers", "viewers_per_client", "log_tail_bytes"):
            require_count("web", name, getattr(self, name))
        for name in ("poll_s", "live_poll_s", "snapshot_s", "totals_s", "charts_s", "flush_s", "keepalive_s",
                     "cancel_timeout_s", "output_timeout_s", "session_ttl_s"):
            require_seconds("web", name, getattr(self, name))
        require_seconds("web", "refused_retry_s", self.refused_retry_s, flag="--refused-retry")
        if not MIN_REFUSED_RETRY_S <= self.refused_retry_s <= MAX_REFUSED_RETRY_S:
            raise ConfigError(f"web setting refused_retry_s (--refused-retry) must be {MIN_REFUSED_RETRY_S} to "
                              f"{MAX_REFUSED_RETRY_S} seconds, got {self.refused_retry_s!r}")


def load_operator_token(path: str | None, env: Mapping[str, str] = os.environ) -> Secret | None:
    """The operator token: from ``path`` when given (it must exist), else from
    ``$IRISFED_WEB_OPERATOR_TOKEN``, else from ``.irisfed/web-operator-token`` when it
    exists; None (view-only) when none is there.
    """
    if path:
        return Secret(_read_token(Path(path)))
    if env.get(OPERATOR_TOKEN_ENV):
        token = env[OPERATOR_TOKEN_ENV].strip()
        _check(token, f"${OPERATOR_TOKEN_ENV}")
        return Secret(token)
    if DEFAULT_OPERATOR_TOKEN_FILE.exists():
        return Secret(_read_token(DEFAULT_OPERATOR_TOKEN_FILE))
    return None


def _read_token(path: Path) -> str:
    try:
        mode = path.stat().st_mode
        token = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the operator token file {path}: {exc.__class__.__name__}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("operator_token_file_open_to_others", path=str(path), mode=oct(mode & 0o777))
    _check(token, str(path))
    return token


def _check(token: str, where: str) -> None:
    if len(token) < MIN_TOKEN_CHARS or not token.isprintable():
        raise ConfigError(f"the operator token in {where} must be at least {MIN_TOKEN_CHARS} printable "
                          "characters (e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
