"""How CLI commands reach the servers: the URLs (flags, environment, ``.irisfed/
connect.json``, as services find them), a NATS client as the URL's user, and a store."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import msgspec

from irisfed.services.common.startup import database_url, federation_config, nats_url
from irisfed.settings import DEFAULT_STATE_DIR, user_of_url
from irisfed.shared.config import NATS_URL_ENV
from irisfed.shared.errors import ConfigError, Unavailable
from irisfed.shared.redact import redact
from irisfed.shared.subjects import Subjects
from irisfed.shared.users import DEFAULT_USER, USER_ENV, validate_user_id


def _asked_user(args: argparse.Namespace) -> str | None:
    user = getattr(args, "user", None) or os.environ.get(USER_ENV) or None
    return None if user is None else validate_user_id(user, "--user")


def client_nats_url(args: argparse.Namespace) -> str:
    """The NATS URL a user's command connects with: the flags' or the environment's,
    unless ``--user ID`` (not ``default``) names another user than that URL's
    ``user-<id>``: then ``.irisfed/users/ID.json`` (what ``irisfed up`` wrote)."""
    user = _asked_user(args)
    explicit = (getattr(args, "nats_url", None) or getattr(args, "nats_url_file", None)
                or os.environ.get(NATS_URL_ENV) or os.environ.get(f"{NATS_URL_ENV}_FILE"))
    url = nats_url(args) if explicit else None
    if user in (None, DEFAULT_USER) or (url is not None and user_of_url(url) == user):
        return url or nats_url(args)
    own = Path(DEFAULT_STATE_DIR) / "users" / f"{user}.json"
    try:
        return json.loads(own.read_text())["nats_url"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if url is not None and user_of_url(url) is None:
        return url  # an operator's or admin's URL, or a server without auth: the server decides
    holder = f"the NATS URL is {user_of_url(url)!r}'s" if url is not None else f"there is no {own}"
    raise ConfigError(f"--user {user}: {holder}; use {user}'s credentials (eval \"$(irisfed env --user "
                      f"{user})\" while `irisfed up` runs, or --nats-url with them)")


def cli_user(args: argparse.Namespace) -> str:
    """The user a command speaks for: ``--user``, else ``IRISFED_USER``, else the NATS
    URL's ``user-<id>``, else ``default``."""
    return _asked_user(args) or user_of_url(client_nats_url(args)) or DEFAULT_USER


def subjects(args: argparse.Namespace) -> Subjects:
    if getattr(args, "prefix", None):
        return Subjects(args.prefix)
    config = federation_config(args, required=False)
    return config.subjects if config else Subjects()


async def nats_client(args: argparse.Namespace, **options):
    """A NATS connection as the URL's user, with that user's own inbox prefix.

    Failures become a clear ``Unavailable`` that names the server but never its password.
    """
    from irisfed.services.common.bus import connect_client

    url = client_nats_url(args)

    async def quiet(exc: Exception) -> None:  # nats-py would print a traceback per attempt
        pass

    options.setdefault("max_reconnect_attempts", 1)
    try:
        return await connect_client(url, connect_timeout=3, error_cb=quiet, **options)
    except Exception as exc:  # noqa: BLE001 - any failure to connect is "unreachable" to a user
        raise Unavailable(f"cannot reach NATS at {redact(url)}: {redact(exc)}") from None


async def open_store(args: argparse.Namespace):
    """A small pool of its own and a Store on it; the caller closes the pool."""
    from irisfed.services.common import db
    from irisfed.services.common.store import Store

    pool = await db.connect(database_url(args), max_size=2)
    return pool, Store(pool)


async def with_store(args: argparse.Namespace, action):
    """``await action(store)`` on a store of its own, closed afterwards: Postgres when a
    database URL is given (an operator's view of every job), else the user's own reads
    over NATS (``irisfed.remote_reads``: its jobs only, by the ids it submitted)."""
    try:
        database_url(args)
    except ConfigError:
        if not _nats_given(args):
            raise
        from irisfed.remote_reads import RemoteReads

        reads = RemoteReads(await nats_client(args), subjects(args).prefix, cli_user(args),
                            timeout=getattr(args, "timeout", None) or 10.0, own_connection=True)
        try:
            return await action(reads)
        finally:
            await reads.close()
    pool, store = await open_store(args)
    try:
        return await action(store)
    finally:
        await pool.close()


def _nats_given(args: argparse.Namespace) -> bool:
    try:
        client_nats_url(args)
    except ConfigError:
        return False
    return True


def scoped_job_id(args: argparse.Namespace, job_id: str) -> str:
    """The stored id a command's ``job_id`` names: a configured user's own id (``train-3``
    read as ``nlp:train-3`` when the command speaks for ``nlp``), a stored id as it is."""
    if ":" in job_id:
        return job_id
    try:
        user = cli_user(args)
    except ConfigError:
        return job_id
    return job_id if user == DEFAULT_USER else f"{user}:{job_id}"


def _plain(value: Any) -> Any:
    """Rows (msgspec structs, dataclasses) as their fields; anything else JSON does not know
    as a string."""
    if isinstance(value, msgspec.Struct):
        return msgspec.structs.asdict(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return str(value)


def print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, default=_plain))
