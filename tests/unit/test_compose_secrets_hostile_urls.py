"""``irisfed compose-secrets --database-url/--nats-url`` given hostile or mistaken input.

Every secret file it writes is one line: a URL a service reads with
``IRISFED_DATABASE_URL_FILE``/``IRISFED_NATS_URL_FILE``. Whatever the operator passes,
the command either refuses it with one clear line (exit 2, no traceback) and writes
NOTHING, or writes files each holding exactly one well-formed URL with the service's
own login and no other: never a file of two lines, never a URL a driver cannot parse or
would log in with someone else's credentials from.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from irisfed.cli import main
from irisfed.tooling.federation import Peer, write_config

GOOD_DB = "postgresql://pg-1:5432,pg-2:5432/irisfed?target_session_attrs=read-write"
GOOD_NATS = "nats://nats-1:4222,nats://nats-2:4222,nats://nats-3:4222"

HOSTILE_DATABASE_URLS = {
    "newline": "postgresql://pg-1:5432/irisfed\nIRISFED_EXTRA=1",
    "carriage-return": "postgresql://pg-1:5432/irisfed\rX",
    "space-in-host": "postgresql://pg 1:5432/irisfed",
    "not-a-url": "not a url",
    "query-smuggles-user": "postgresql://pg-1:5432/irisfed?user=postgres",
    "query-smuggles-password": "postgresql://pg-1:5432/irisfed?password=hunter2",
    "query-smuggles-both": "postgresql://pg-1:5432/irisfed?target_session_attrs=read-write&user=postgres&password=x",
    "not-postgres-scheme": "http://pg-1:5432/irisfed",
    "port-not-a-number": "postgresql://pg-1:abc/irisfed",
    "trailing-comma-host": "postgresql://pg-1:5432,/irisfed",
    "fragment": "postgresql://pg-1:5432/irisfed#x",
}

HOSTILE_NATS_URLS = {
    "newline": "nats://nats-1:4222\nX",
    "space-in-host": "nats://nats 1:4222",
    "not-a-url": "not a url",
    "no-scheme-host-list": "nats-1:4222,nats-2:4222",
    "trailing-comma": "nats://nats-1:4222,",
    "empty-member": "nats://nats-1:4222,,nats://nats-2:4222",
    "query-smuggles-credentials": "nats://nats-1:4222?user=admin&pass=x",
    "not-nats-scheme": "http://nats-1:4222",
}


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "federation.toml"
    write_config(path, [Peer("home"), Peer("gpu-west")], local_cluster="home")
    return path


def _run(config: Path, out: Path, *flags: str) -> int:
    return main(["compose-secrets", "--config", str(config), "--out", str(out), *flags])


def _written(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir()) if out.exists() else []


def _check_refused_or_sound(code: int, out: Path, err: str, what: str, kind: str) -> None:
    """Refused (exit 2, one line, no traceback, nothing written) or every URL file sound."""
    if code != 0:
        assert code == 2, (what, code, err)
        assert "Traceback" not in err, f"{what}: a traceback instead of a clear error:\n{err[-1500:]}"
        assert err.strip().count("\n") == 0 and err.startswith("irisfed: "), (what, err)
        assert _written(out) == [], f"{what}: refused, but left files behind: {_written(out)}"
        return
    for path in sorted(out.glob(f"*.{kind}-url")):
        _check_sound_url_file(path, what, kind)


def _check_sound_url_file(path: Path, what: str, kind: str) -> None:
    text = path.read_text()
    assert text.endswith("\n") and text.count("\n") == 1 and "\r" not in text, (
        f"{what}: {path.name} is not one line: {text!r}")
    url = text.strip()
    assert not any(c.isspace() for c in url), f"{what}: {path.name} holds whitespace: {url!r}"
    if kind == "database":
        scheme, _, rest = url.partition("://")
        assert scheme in ("postgresql", "postgres"), f"{what}: {path.name}: not a Postgres URL: {url!r}"
        netloc = rest.split("/", 1)[0].split("?", 1)[0]
        login, _, hosts = netloc.rpartition("@")
        assert login.count(":") == 1, f"{what}: {path.name}: login {login!r}"
        for host in hosts.split(","):
            name, _, port = host.rpartition(":")
            assert name and port.isdigit(), f"{what}: {path.name}: host {host!r} in {url!r}"
        query = parse_qs(urlsplit(url).query)
        assert not ({"user", "password", "passfile"} & set(query)), (
            f"{what}: {path.name} names a second login in its query (libpq takes the query's, asyncpg the "
            f"userinfo's): {url!r}")
        assert "#" not in url, f"{what}: {path.name}: {url!r}"
    else:
        for member in url.split(","):
            parts = urlsplit(member)
            assert parts.scheme in ("nats", "tls", "ws", "wss"), f"{what}: {path.name}: member {member!r}"
            assert parts.hostname and parts.port, f"{what}: {path.name}: member {member!r} of {url!r}"
            assert "@" in parts.netloc and not parts.query, f"{what}: {path.name}: member {member!r}"


def _run_refused_or_sound(config: Path, tmp_path: Path, capsys, flag: str, url: str, kind: str) -> None:
    """``compose-secrets FLAG URL`` is refused, or writes sound ``kind`` URL files."""
    out = tmp_path / "secrets"
    code = _run(config, out, flag, url)
    _check_refused_or_sound(code, out, capsys.readouterr().err, f"{flag} {url!r}", kind)


@pytest.mark.parametrize("url", list(HOSTILE_DATABASE_URLS.values()), ids=list(HOSTILE_DATABASE_URLS))
def test_a_hostile_database_url_is_refused_or_written_soundly(config, tmp_path, capsys, url):
    _run_refused_or_sound(config, tmp_path, capsys, "--database-url", url, "database")


@pytest.mark.parametrize("url", list(HOSTILE_NATS_URLS.values()), ids=list(HOSTILE_NATS_URLS))
def test_a_hostile_nats_url_is_refused_or_written_soundly(config, tmp_path, capsys, url):
    _run_refused_or_sound(config, tmp_path, capsys, "--nats-url", url, "nats")


@pytest.mark.parametrize("flag", ["--database-url", "--nats-url"])
def test_an_empty_url_is_refused_not_silently_replaced_by_the_default(config, tmp_path, capsys, flag):
    """``--database-url "$PG_URL"`` with PG_URL unset: the operator named a URL (an empty
    one), and quietly getting compose's single-server default instead points every
    production service at a host called ``postgres``."""
    out = tmp_path / "secrets"
    code = _run(config, out, flag, "")
    err = capsys.readouterr().err
    assert code == 2, f"{flag} '' was taken (exit {code}); files written: {_written(out)}"
    assert "Traceback" not in err and _written(out) == [], (err, _written(out))


def test_a_refused_url_on_a_second_run_leaves_the_existing_secrets_as_they_were(config, tmp_path, capsys):
    """Run again (after adding a peer, say) with a bad URL: refused and every file as it
    was, or every file still sound."""
    for name, url in HOSTILE_DATABASE_URLS.items():
        out = tmp_path / f"secrets-{name}"
        assert _run(config, out, "--database-url", GOOD_DB, "--nats-url", GOOD_NATS) == 0
        before = {p.name: p.read_bytes() for p in out.iterdir()}
        code = _run(config, out, "--database-url", url, "--nats-url", GOOD_NATS)
        capsys.readouterr()
        after = {p.name: p.read_bytes() for p in out.iterdir()}
        if code != 0:
            changed = sorted(n for n in after if after[n] != before.get(n))
            assert changed == [], f"--database-url {url!r} refused on a second run, but changed {changed}"
        else:
            for path in sorted(out.glob("*.database-url")):
                _check_sound_url_file(path, f"second run, --database-url {url!r}", "database")


def test_a_good_multi_host_url_is_written_into_every_service_file(config, tmp_path):
    out = tmp_path / "secrets"
    assert _run(config, out, "--database-url", GOOD_DB, "--nats-url", GOOD_NATS) == 0
    for path in sorted(out.glob("*.database-url")):
        _check_sound_url_file(path, "good", "database")
        assert path.read_text().strip().endswith("@pg-1:5432,pg-2:5432/irisfed?target_session_attrs=read-write")
    for path in sorted(out.glob("*.nats-url")):
        _check_sound_url_file(path, "good", "nats")
        assert path.read_text().count(",") == 2
