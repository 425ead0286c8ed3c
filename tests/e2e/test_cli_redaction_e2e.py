"""The CLI never prints a credential, even when the servers in its URLs are down."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from irisfed.tooling.servers import free_port
from tests.e2e.conftest import interrupt_and_collect

ROOT = Path(__file__).resolve().parents[2]
SECRET = "pa55-do-not-print"


def cli(tmp_path: Path, *args: str, timeout: float = 90) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("IRISFED_")}
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run([sys.executable, "-m", "irisfed.cli", *args], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=timeout, check=False)
    assert result.returncode != 0, result.stdout + result.stderr
    return result.stdout + result.stderr


@pytest.fixture
def dead_urls():
    """A NATS and a Postgres URL with passwords, on ports where nothing listens."""
    return (f"nats://operator:{SECRET}@127.0.0.1:{free_port()}",
            f"postgresql://irisfed:{SECRET}@127.0.0.1:{free_port()}/irisfed")


@pytest.mark.parametrize("command", [
    ["submit", "--", "true"], ["cancel", "j1"], ["health", "router"], ["watch", "j1"], ["logs", "j1"],
])
def test_unreachable_nats_never_prints_the_password(tmp_path, dead_urls, command):
    nats_url, _ = dead_urls
    flags = ["--nats-url", nats_url, *(["--database-url", dead_urls[1]] if command[0] == "watch" else [])]
    out = cli(tmp_path, command[0], *flags, *command[1:])  # flags before `--` of submit
    assert SECRET not in out
    assert "irisfed:" in out  # a clear message, not a traceback


def test_unreachable_nats_with_a_cluster_url(tmp_path):
    url = ",".join(f"nats://operator:{SECRET}@127.0.0.1:{free_port()}" for _ in range(2))
    out = cli(tmp_path, "submit", "--nats-url", url, "--", "true")
    assert SECRET not in out and "cannot reach NATS" in out and "operator:***@" in out


@pytest.mark.parametrize("command", [["jobs"], ["job", "j1"], ["explain", "j1"], ["peers"],
                                     ["top", "--once"], ["migrate"]])
def test_unreachable_postgres_never_prints_the_password(tmp_path, dead_urls, command):
    out = cli(tmp_path, *command, "--database-url", dead_urls[1])
    assert SECRET not in out


def test_malformed_urls_never_print_the_password(tmp_path):
    out = cli(tmp_path, "submit", "--nats-url", f"nats://operator:{SECRET}@127.0.0.1:notaport", "--", "true")
    assert SECRET not in out
    out = cli(tmp_path, "jobs", "--database-url", f"postgresql://irisfed:{SECRET}@127.0.0.1:notaport/x")
    assert SECRET not in out


def test_up_with_unreachable_servers_never_prints_the_password(tmp_path, dead_urls):
    nats_url, database_url = dead_urls
    out = cli(tmp_path, "up", "--no-live", "--state-dir", str(tmp_path / "state"),
              "--nats-url", nats_url, "--database-url", database_url)
    assert SECRET not in out


async def test_up_with_your_servers_prints_no_password(tmp_path, empty_database_url, servers):
    """`irisfed up --database-url ... --nats-url ...` says where it runs without the passwords."""
    # The test Postgres trusts local connections, so any password will do; NATS checks its own.
    database_url = empty_database_url.replace("://postgres@", f"://postgres:{SECRET}@")
    assert SECRET in database_url
    nats_url = servers.nats_url_for("admin")
    env = {k: v for k, v in os.environ.items() if not k.startswith("IRISFED_")}
    env["PYTHONPATH"] = str(ROOT)
    up = subprocess.Popen(
        [sys.executable, "-m", "irisfed.cli", "up", "--no-live", "--state-dir", str(tmp_path / "state"),
         "--database-url", database_url, "--nats-url", nats_url],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines: list[str] = []
    try:
        for line in up.stdout:
            lines.append(line)
            if "logs in" in line:
                break
    finally:
        rest = interrupt_and_collect(up)
    out = "".join(lines) + rest
    assert "irisfed up: ready" in out, out
    assert "***@" in out  # it still says where
    assert SECRET not in out
    password = nats_url.split("://", 1)[1].split("@", 1)[0].split(":", 1)[1]
    assert password not in out
