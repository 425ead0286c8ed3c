"""The command line against a database it cannot use, and into a pipe whose reader left:
one line ``irisfed: ...`` and exit 2 for a setting no retry can fix (the password never
shown), nothing at all for a closed pipe. Real ``python -m irisfed.cli`` processes, a
real Postgres."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

ROOT = Path(__file__).resolve().parents[2]
SECRET = "pa55-never-shown"
READS = [["job", "j1"], ["jobs"], ["peers"], ["explain", "j1"]]  # `logs` reads over NATS, not Postgres


def _env(database_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("IRISFED_")}
    env.update(PYTHONPATH=str(ROOT), IRISFED_DATABASE_URL=database_url)
    return env


def cli(tmp_path: Path, database_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "irisfed.cli", *args], cwd=tmp_path, env=_env(database_url),
                          capture_output=True, text=True, timeout=60, check=False)


def _one_line(result: subprocess.CompletedProcess[str]) -> str:
    """The single ``irisfed: ...`` line a refused command prints (exit 2, nothing on stdout)."""
    lines = result.stderr.splitlines()
    assert (result.returncode, result.stdout, len(lines)) == (2, "", 1), result.stderr[-3000:]
    assert lines[0].startswith("irisfed: ") and "Traceback" not in result.stderr
    assert SECRET not in result.stderr
    return lines[0]


def _as(database_url: str, user: str) -> str:
    parts = urlsplit(database_url)
    return urlunsplit(parts._replace(netloc=f"{user}:{SECRET}@{parts.netloc.rsplit('@', 1)[-1]}"))


@pytest.mark.parametrize("command", READS, ids=lambda c: c[0])
def test_a_refused_login_is_one_line_naming_user_and_host(tmp_path, database_url, command):
    line = _one_line(cli(tmp_path, _as(database_url, "irisfed_no_such_role"), *command))
    assert "refused the connection" in line and "irisfed_no_such_role" in line
    assert urlsplit(database_url).netloc.rsplit("@", 1)[-1] in line


@pytest.mark.parametrize("url", [f"postgresql://irisfed:{SECRET}@127.0.0.1:notaport/db",
                                 f"postgresql://irisfed:{SECRET}@[::1"], ids=["port", "ipv6"])
def test_a_url_that_cannot_be_parsed_is_one_line(tmp_path, url):
    line = _one_line(cli(tmp_path, url, "job", "j1"))
    assert line.startswith("irisfed: invalid database URL postgresql://irisfed:***@")


def test_an_id_no_job_can_have_is_one_short_line(tmp_path, database_url):
    line = _one_line(cli(tmp_path, database_url, "job", "x" * 5000))
    assert line.startswith("irisfed: not a job id: 'xxxx") and "(5000 characters)" in line and len(line) < 250


@pytest.mark.parametrize("unbuffered", ["1", ""], ids=["unbuffered", "buffered"])
def test_a_reader_that_left_the_pipe_gets_silence(tmp_path, database_url, unbuffered):
    """`irisfed jobs | head -3`: once head exits, the next write fails (EPIPE), in the
    print itself (unbuffered) or in the flush of what it buffered."""
    env = _env(database_url)
    env.pop("PYTHONUNBUFFERED", None)
    if unbuffered:
        env["PYTHONUNBUFFERED"] = unbuffered
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first byte
    try:
        result = subprocess.run([sys.executable, "-m", "irisfed.cli", "jobs", "--json"], cwd=tmp_path,
                                env=env, stdout=write_end, stderr=subprocess.PIPE, text=True,
                                timeout=60, check=False)
    finally:
        os.close(write_end)
    assert (result.returncode, result.stderr) == (141, ""), result.stderr


def test_migrate_against_a_database_it_cannot_use_is_one_line(tmp_path, database_url):
    closed = f"postgresql://irisfed:{SECRET}@127.0.0.1:1/db"  # nothing listens on port 1
    line = _one_line(cli(tmp_path, closed, "migrate"))
    assert line.startswith("irisfed: cannot migrate postgresql://irisfed:***@127.0.0.1:1/db: ")
    refused = _one_line(cli(tmp_path, _as(database_url, "irisfed_no_such_role"), "migrate"))
    assert "irisfed_no_such_role" in refused
