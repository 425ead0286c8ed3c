"""compose.yaml's secrets work against a real Postgres: `irisfed db-roles --passwords`
sets the passwords `irisfed compose-secrets` wrote, and a service reads its URL from
the file IRISFED_DATABASE_URL_FILE names."""

from __future__ import annotations

import argparse
import asyncio
import json
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from irisfed.cli import main
from irisfed.cli.compose_secrets import service_roles, write_secrets
from irisfed.services.common.startup import database_url as url_from
from irisfed.shared.config import load_config
from irisfed.shared.errors import ConfigError
from irisfed.tooling.federation import Peer, write_config


def write_test_config(path):
    write_config(path, [Peer("home"), Peer("gpu-west")], local_cluster="home")
    return path


def _without_credentials(url: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[-1]))


async def test_db_roles_sets_the_passwords_compose_secrets_wrote(database_url, tmp_path, monkeypatch):
    config_path = write_test_config(tmp_path / "federation.toml")
    config = load_config(config_path)
    write_secrets(config, tmp_path / "secrets", database=_without_credentials(database_url))
    assert await asyncio.to_thread(main, [  # the CLI runs its own event loop
        "db-roles", "--config", str(config_path), "--database-url", database_url,
        "--passwords", str(tmp_path / "secrets" / "db-credentials.json"), "--out", str(tmp_path / "unused.json")]) == 0
    assert not (tmp_path / "unused.json").exists()  # nothing new to write: the passwords were given

    for service, (role, _user) in service_roles(config).items():
        monkeypatch.setenv("IRISFED_DATABASE_URL_FILE", str(tmp_path / "secrets" / f"{service}.database-url"))
        monkeypatch.delenv("IRISFED_DATABASE_URL", raising=False)
        url = url_from(argparse.Namespace(database_url=None))
        conn = await asyncpg.connect(url)
        try:
            assert await conn.fetchval("SELECT session_user") == role
        finally:
            await conn.close()


def test_a_missing_or_empty_url_file_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("IRISFED_DATABASE_URL", raising=False)
    monkeypatch.setenv("IRISFED_DATABASE_URL_FILE", str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="cannot read the database URL from .*nope"):
        url_from(argparse.Namespace(database_url=None))
    (tmp_path / "empty").write_text("\n")
    monkeypatch.setenv("IRISFED_DATABASE_URL_FILE", str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="is empty"):
        url_from(argparse.Namespace(database_url=None))


def test_db_roles_refuses_a_bad_passwords_file(tmp_path, database_url):
    config_path = write_test_config(tmp_path / "federation.toml")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"irisfed_svc_router": ""}))
    assert main(["db-roles", "--config", str(config_path), "--database-url", database_url,
                 "--passwords", str(bad)]) != 0
