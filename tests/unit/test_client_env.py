"""``irisfed env``: the exports a shell gets from what ``irisfed up`` wrote (what a real
shell has after ``eval`` of them is tests/integration/test_client_env_shell.py)."""

from __future__ import annotations

import pytest

from irisfed.cli import main
from irisfed.cli.env import env_lines, split_credentials
from irisfed.shared.errors import ConfigError
from tests.infra.up_state import up_state


def test_a_url_without_credentials_exports_no_user(tmp_path):
    lines = env_lines("producer", up_state(tmp_path, "nats://127.0.0.1:4222"))
    assert not any("NATS_USER" in line or "NATS_PASSWORD" in line for line in lines[:-1])
    assert "--user" not in lines[-1] and "--inbox-prefix _INBOX " in lines[-1]


def test_credentials_come_off_every_server_of_a_cluster_list():
    assert split_credentials("nats://u:p%40ss@a:4222,nats://u:p%40ss@b:4222") == (
        "nats://a:4222,nats://b:4222", "u", "p@ss")
    assert split_credentials("nats://a:4222") == ("nats://a:4222", None, None)


def test_without_irisfed_up_it_says_what_to_do(tmp_path, capsys):
    with pytest.raises(ConfigError, match="irisfed up"):
        env_lines("producer", tmp_path / ".irisfed")
    assert main(["env", "--state-dir", str(tmp_path / ".irisfed")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "irisfed up" in captured.err


def test_the_command_prints_the_exports(tmp_path, capsys):
    state = up_state(tmp_path)
    assert main(["env", "--state-dir", str(state), "--role", "operator"]) == 0
    out = capsys.readouterr().out
    assert "export IRISFED_DATABASE_URL=" in out and "export NATS_USER=operator" in out


def test_a_users_exports_are_its_own_credentials_and_name_it(tmp_path, capsys):
    import json
    import os

    state = up_state(tmp_path)
    (state / "users").mkdir()
    (state / "users" / "alice.json").write_text(json.dumps(
        {"nats_url": "nats://user-alice:s3cret@127.0.0.1:4222", "config": "/x/f.toml", "user": "alice"}))
    os.chmod(state / "users" / "alice.json", 0o600)
    lines = env_lines("producer", state, user="alice")
    assert "export IRISFED_NATS_URL=nats://user-alice:s3cret@127.0.0.1:4222" in lines
    assert "export NATS_USER=user-alice" in lines and "export IRISFED_USER=alice" in lines
    assert "--inbox-prefix _INBOX_user-alice " in lines[-1]
    assert main(["env", "--state-dir", str(state), "--user", "alice"]) == 0
    assert "export IRISFED_USER=alice" in capsys.readouterr().out


@pytest.mark.parametrize("user", ["bob", "../producer", "Alice", "a.b"])
def test_a_user_without_credentials_or_no_user_at_all_is_refused(tmp_path, capsys, user):
    state = up_state(tmp_path)
    assert main(["env", "--state-dir", str(state), "--user", user]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and ("irisfed up" in captured.err or "invalid" in captured.err)
