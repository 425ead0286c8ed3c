"""``irisfed env``: shell exports for a role, from the files a running ``irisfed up`` wrote.

``eval "$(irisfed env)"`` gives a shell the ``producer`` user's NATS URL
(``.irisfed/producer.json``); ``--role operator`` the CLI's own servers
(``.irisfed/connect.json``: the operator's NATS user and the database). Besides irisfed's
variables it exports the ones other NATS tools read: ``NATS_URL`` (the servers, without
credentials), ``NATS_USER`` and ``NATS_PASSWORD`` (the ``nats`` CLI reads all three;
clients such as the npm ``nats`` package take them as options), and it prints, as a
comment, the ``nats context save`` command for that user's reply inbox.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

from irisfed.shared.config import CONFIG_ENV, DATABASE_URL_ENV, NATS_URL_ENV
from irisfed.shared.errors import ConfigError
from irisfed.shared.nats_urls import inbox_prefix_for_url
from irisfed.shared.users import USER_ENV, validate_user_id

ROLE_FILES = {"producer": "producer.json", "operator": "connect.json"}


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"no {path}: run `irisfed up` first (or pass --state-dir where it keeps its state)") \
            from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict) or not data.get("nats_url"):
        raise ConfigError(f"{path} holds no nats_url: run `irisfed up` again")
    return data


def split_credentials(url: str) -> tuple[str, str | None, str | None]:
    """``nats://u:p@h:4222,nats://u:p@h2:4222`` → (``nats://h:4222,nats://h2:4222``, u, p).

    The user and password of the first server that has them (NATS clients take one
    user for the whole list)."""
    servers, user, password = [], None, None
    for part in url.split(","):
        parts = urlsplit(part.strip())
        if parts.username is not None and user is None:
            user = unquote(parts.username)
            password = unquote(parts.password) if parts.password is not None else None
        servers.append(urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[-1])))
    return ",".join(servers), user, password


def user_file(state_dir: Path, user_id: str) -> Path:
    """Where ``irisfed up`` keeps configured user ``user_id``'s NATS credentials (0600)."""
    return state_dir / "users" / f"{validate_user_id(user_id, 'user')}.json"


def env_lines(role: str, state_dir: Path, user: str | None = None) -> list[str]:
    """The lines ``irisfed env`` prints: comments and ``export NAME=VALUE`` (shell-quoted).
    With ``user``: that configured user's credentials (``role`` is then its name)."""
    irisfed_user = user
    source = user_file(state_dir, user) if user else state_dir / ROLE_FILES[role]
    if user:
        role = f"user-{user}"
    data = _read(source)
    nats_url = data["nats_url"]
    servers, user, password = split_credentials(nats_url)
    exports = {NATS_URL_ENV: nats_url}
    if role == "operator" and data.get("database_url"):
        exports[DATABASE_URL_ENV] = data["database_url"]
    if data.get("config"):
        exports[CONFIG_ENV] = data["config"]
    exports["NATS_URL"] = servers
    if user is not None:
        exports["NATS_USER"] = user
    if password is not None:
        exports["NATS_PASSWORD"] = password
    inbox = inbox_prefix_for_url(nats_url)
    context = [f"nats context save irisfed-{role}", '--server "$NATS_URL"']
    if user is not None:
        context.append('--user "$NATS_USER"')
    if password is not None:
        context.append('--password "$NATS_PASSWORD"')
    context += [f"--inbox-prefix {inbox}", "--select"]
    if irisfed_user:
        exports[USER_ENV] = irisfed_user
    lines = [f"# irisfed {role} environment, from {source} (written by `irisfed up`)"]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in exports.items()]
    lines.append(f"# replies to this user arrive under {inbox}; for the nats CLI: {' '.join(context)}")
    return lines


def cmd_env(args: argparse.Namespace) -> int:
    user = getattr(args, "user", None)
    lines = env_lines(args.role, Path(args.state_dir).resolve(), user)
    print("\n".join(lines))
    if sys.stdout.isatty():  # printed for a person: say how it is meant to be used
        flag = f" --user {user}" if user else "" if args.role == "producer" else f" --role {args.role}"
        print(f"# (this prints secrets for a shell to read: eval \"$(irisfed env{flag})\")", file=sys.stderr)
    return 0
