"""``irisfed env``: the exports a shell gets from what ``irisfed up`` wrote."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from irisfed.cli import main
from irisfed.cli.env import env_lines, split_credentials
from irisfed.shared.errors import ConfigError

ODD_PASSWORD = "p'a\"ss $(touch /tmp/never) `x` w0rd"


def _state(tmp_path, producer_url="nats://producer:pw1@127.0.0.1:4222"):
    state = tmp_path / ".irisfed"
    state.mkdir()
    (state / "producer.json").write_text(json.dumps({"nats_url": producer_url, "config": "/x/federation.toml"}))
    (state / "connect.json").write_text(json.dumps({
        "nats_url": "nats://operator:pw2@127.0.0.1:4222", "database_url": "postgresql://postgres@127.0.0.1:5/irisfed",
        "config": "/x/federation.toml"}))
    return state


def _evaluated(lines: list[str], *names: str) -> dict[str, str]:
    """What a shell has after ``eval`` of these lines."""
    script = "\n".join(lines) + "\n" + "".join(f'printf "%s\\0" "${name}"\n' for name in names)
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True,
                            env={"PATH": os.environ["PATH"]})
    return dict(zip(names, result.stdout.split("\0")[:-1], strict=True))


def test_producer_exports_its_nats_user_for_irisfed_and_for_other_nats_tools(tmp_path):
    lines = env_lines("producer", _state(tmp_path))
    values = _evaluated(lines, "IRISFED_NATS_URL", "NATS_URL", "NATS_USER", "NATS_PASSWORD", "IRISFED_CONFIG",
                        "IRISFED_DATABASE_URL")
    assert values == {"IRISFED_NATS_URL": "nats://producer:pw1@127.0.0.1:4222", "NATS_URL": "nats://127.0.0.1:4222",
                      "NATS_USER": "producer", "NATS_PASSWORD": "pw1", "IRISFED_CONFIG": "/x/federation.toml",
                      "IRISFED_DATABASE_URL": ""}
    assert lines[0].startswith("# irisfed producer environment")
    assert lines[-1].startswith("#") and "nats context save irisfed-producer" in lines[-1]
    assert "--inbox-prefix _INBOX_producer" in lines[-1]


def test_operator_adds_the_database(tmp_path):
    lines = env_lines("operator", _state(tmp_path))
    values = _evaluated(lines, "IRISFED_NATS_URL", "NATS_USER", "IRISFED_DATABASE_URL")
    assert values == {"IRISFED_NATS_URL": "nats://operator:pw2@127.0.0.1:4222", "NATS_USER": "operator",
                      "IRISFED_DATABASE_URL": "postgresql://postgres@127.0.0.1:5/irisfed"}
    assert "--inbox-prefix _INBOX_operator" in lines[-1]


def test_values_are_shell_quoted(tmp_path):
    from urllib.parse import quote

    url = f"nats://producer:{quote(ODD_PASSWORD, safe='')}@127.0.0.1:4222"
    values = _evaluated(env_lines("producer", _state(tmp_path, url)), "NATS_PASSWORD", "IRISFED_NATS_URL")
    assert values == {"NATS_PASSWORD": ODD_PASSWORD, "IRISFED_NATS_URL": url}
    assert not os.path.exists("/tmp/never")


def test_a_url_without_credentials_exports_no_user(tmp_path):
    lines = env_lines("producer", _state(tmp_path, "nats://127.0.0.1:4222"))
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
    state = _state(tmp_path)
    assert main(["env", "--state-dir", str(state), "--role", "operator"]) == 0
    out = capsys.readouterr().out
    assert "export IRISFED_DATABASE_URL=" in out and "export NATS_USER=operator" in out
