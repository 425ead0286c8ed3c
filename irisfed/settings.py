"""Where a client connects and how it retries: :class:`Servers` (:func:`resolve_servers`)
and :class:`Retry`. Pure, apart from reading the files ``irisfed up`` writes."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from irisfed.errors import ConfigurationError
from irisfed.shared.config import CONFIG_ENV, DATABASE_URL_ENV, NATS_URL_ENV, load_config
from irisfed.shared.errors import IrisfedError
from irisfed.shared.redact import redact
from irisfed.shared.subjects import Subjects
from irisfed.shared.users import DEFAULT_USER, USER_ENV, USER_ROLE_PREFIX, validate_user_id

__all__ = ["CONNECT_FILE", "DEFAULT_PREFIX", "DEFAULT_STATE_DIR", "Retry", "Servers", "resolve_servers"]

DEFAULT_STATE_DIR = ".irisfed"
CONNECT_FILE = "connect.json"  # what `irisfed up` writes in its state folder (the operator's URLs)
DEFAULT_PREFIX = "irisfed"


@dataclass(frozen=True)
class Retry:
    """How requests are retried when irisfed is unavailable.

    ``attempts`` tries in all (1: never retry). Before retry ``n`` (1 = the first) the
    client sleeps ``min(cap_s, base_s * 2 ** (n - 1))`` scaled by a random factor in
    [0.5, 1] (jitter, so many clients that lost the same router do not come back in
    step). The defaults ride out a router restart (about 10 s in all, plus each try's
    ``timeout``).
    """

    attempts: int = 6
    base_s: float = 0.25
    cap_s: float = 4.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("Retry.attempts must be at least 1")
        if self.base_s < 0 or self.cap_s < 0:
            raise ValueError("Retry delays must not be negative")

    def delay(self, retry: int, rand: Callable[[], float] = random.random) -> float:
        """Seconds to sleep before retry number ``retry`` (1-based)."""
        full = min(self.cap_s, self.base_s * 2 ** max(0, retry - 1))
        return full * (0.5 + 0.5 * rand())


@dataclass(frozen=True)
class Servers:
    """Where a client connects (see :func:`resolve_servers`)."""

    nats_url: str
    database_url: str | None
    prefix: str
    user: str = DEFAULT_USER  # the user requests speak for (its subjects; docs/design.md §3.2)

    def __repr__(self) -> str:  # never show a password
        return (f"Servers(nats_url={redact(self.nats_url)!r}, "
                f"database_url={redact(self.database_url) if self.database_url else None!r}, "
                f"prefix={self.prefix!r}, user={self.user!r})")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ConfigurationError(f"cannot read {path}: {exc}") from None
    return data if isinstance(data, dict) else {}


def user_of_url(nats_url: str) -> str | None:
    """The configured user whose NATS user (``user-<id>``) the URL carries, if any."""
    first = nats_url.split(",", 1)[0].strip()
    try:
        name = urlsplit(first if "://" in first else f"nats://{first}").username
    except ValueError:
        return None
    if name and name.startswith(USER_ROLE_PREFIX):
        candidate = unquote(name)[len(USER_ROLE_PREFIX):]
        try:
            return validate_user_id(candidate)
        except IrisfedError:
            return None
    return None


def resolve_servers(nats_url: str | None = None, database_url: str | None = None, *,
                    prefix: str | None = None, state_dir: str | os.PathLike[str] = DEFAULT_STATE_DIR,
                    environ: Mapping[str, str] | None = None, user: str | None = None) -> Servers:
    """The servers and subject prefix a client uses, as documented in the module.

    Each setting: the argument, else the environment (``IRISFED_NATS_URL``,
    ``IRISFED_DATABASE_URL``; the prefix from the config file ``IRISFED_CONFIG``), else
    ``<state_dir>/connect.json`` written by ``irisfed up``. Only the NATS URL is
    required; a missing database URL is ``None`` (``get``/``wait``/``watch`` then say
    how to give one).

    The user: ``user``, else ``IRISFED_USER``, else the URL's NATS user ``user-<id>``,
    else ``default``. A user other than ``default`` with no URL given or in the
    environment takes ``<state_dir>/users/<id>.json`` (its own credentials).
    """
    env = os.environ if environ is None else environ
    user = user or env.get(USER_ENV) or None
    if user is not None:
        try:
            validate_user_id(user, "user")
        except IrisfedError as exc:
            raise ConfigurationError(exc.message) from None
        if user != DEFAULT_USER and not nats_url and not env.get(NATS_URL_ENV):
            own = Path(state_dir) / "users" / f"{user}.json"
            if not own.exists():
                raise ConfigurationError(
                    f"no NATS credentials for user {user!r}: pass its nats_url, eval \"$(irisfed env --user "
                    f"{user})\" while `irisfed up` runs, or add it to the federation's [[users]] and restart")
            nats_url = _read_json(own).get("nats_url")
    read: list[dict[str, Any]] = []

    def connect() -> dict[str, Any]:  # read only when a setting is missing
        if not read:
            read.append(_read_json(Path(state_dir) / CONNECT_FILE))
        return read[0]

    nats_url = nats_url or env.get(NATS_URL_ENV) or connect().get("nats_url")
    if not nats_url:
        raise ConfigurationError(
            f"no NATS server: pass nats_url=, set {NATS_URL_ENV} (eval \"$(irisfed env)\" sets it "
            f"while `irisfed up` runs), or run from the folder where `irisfed up` runs")
    database_url = database_url or env.get(DATABASE_URL_ENV) or connect().get("database_url") or None
    if prefix is None:
        config_path = env.get(CONFIG_ENV) or connect().get("config")
        if config_path:
            try:
                prefix = load_config(config_path).subject_prefix
            except IrisfedError as exc:
                raise ConfigurationError(exc.message) from None
        else:
            prefix = DEFAULT_PREFIX
    try:
        Subjects(prefix)
    except IrisfedError as exc:
        raise ConfigurationError(exc.message) from None
    if user is None:
        user = user_of_url(nats_url) or DEFAULT_USER
    return Servers(nats_url=nats_url, database_url=database_url, prefix=prefix, user=user)


