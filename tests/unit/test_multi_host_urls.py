"""``HostByHost`` / ``one_url_per_host`` (shared/postgres.py): a multi-host URL tried host
by host must reach every host asyncpg itself would reach, and a host that swallows a
connection must not starve the others however the pool bounds its wait.

No server: asyncpg's own URL parser (``connect_utils._parse_connect_arguments``, no I/O)
tells which addresses a URL names, and ``asyncpg.connect`` is replaced by a fake.
"""

from __future__ import annotations

import asyncio

import pytest
from asyncpg import connect_utils
from asyncpg.exceptions import ClientConfigurationError

from irisfed.shared import postgres
from irisfed.shared.postgres import HostByHost, one_url_per_host


def _addresses(url: str) -> list:
    """The (host, port) pairs (or socket paths) asyncpg would try for ``url``."""
    addrs, _, _ = connect_utils._parse_connect_arguments(
        dsn=url, host=None, port=None, user=None, password=None, passfile=None, database=None,
        command_timeout=None, statement_cache_size=100, max_cached_statement_lifetime=300,
        max_cacheable_statement_size=15 * 1024, ssl=None, direct_tls=None, server_settings=None,
        target_session_attrs=None, krbsrvname=None, gsslib=None, service=None, servicefile=None)
    return list(addrs)


@pytest.mark.parametrize("url", [
    "postgresql://u:pw@h1:5432,h2:5433/db?target_session_attrs=read-write",
    "postgresql://u:pw@[::1]:5432,[::1]:5433/db",
    "postgres://u:p%40w%2C@%2Ftmp,h2:5433/db?sslmode=disable",
    "postgresql://u:pw@h1,h2/db",
])
def test_per_host_urls_name_the_same_addresses_as_the_whole_url(url):
    whole = _addresses(url)
    parts = [addr for part in one_url_per_host(url) for addr in _addresses(part)]
    assert parts == whole


def test_pgport_lists_are_left_to_asyncpgs_own_multi_host_connect(monkeypatch):
    """libpq and asyncpg take PGPORT=5432,5433 as one port per host, and asyncpg matches
    the list against any URL's hosts, a one-host URL's too: split URLs would each be
    refused ('could not match 2 port numbers to 1 hosts'), so no splitting then."""
    monkeypatch.setenv("PGPORT", "5432,5433")
    url = "postgresql://u:pw@h1,h2/db"
    assert _addresses(url) == [("h1", 5432), ("h2", 5433)]
    assert postgres.pool_connect(url) is None
    monkeypatch.delenv("PGPORT")
    assert isinstance(postgres.pool_connect(url), HostByHost)


def test_an_empty_host_in_the_list_is_refused_not_a_url_without_a_host():
    """``h1,`` (a trailing comma) split would give a URL naming no host, and asyncpg
    then tries the local default sockets and localhost: a typo silently connecting to
    whatever Postgres runs on this machine."""
    with pytest.raises(ClientConfigurationError, match="empty host"):
        one_url_per_host("postgresql://u:pw@h1,/db")


async def test_an_empty_host_is_refused_when_the_pool_connects():
    connect = postgres.pool_connect("postgresql://u:pw@h1,/db")
    with pytest.raises(ClientConfigurationError):
        await connect(timeout=1)


async def test_a_connect_cut_short_by_the_pool_wait_does_not_pin_a_hung_host(monkeypatch):
    """The pool's wait for a connection (``--db-timeout`` / ``acquire_s``; the client's
    15 s) cancels a connect that is still on a host that swallows it. ``first`` is only
    moved on success, so every later connect starts on the same hung host again and is
    cancelled again: the never-recovers failure HostByHost was written to end, whenever
    the pool waits less than the hung hosts' connect timeouts add up to (e.g.
    ``--db-timeout 4`` with the 5 s connect timeout)."""
    tried: list[str] = []

    async def fake_connect(url, **kwargs):
        tried.append(url)
        if "@hung" in url:
            # A black-holed primary: never answers; asyncpg gives up after ``timeout``.
            await asyncio.wait_for(asyncio.sleep(3600), kwargs["timeout"])
        return object()

    monkeypatch.setattr(postgres.asyncpg, "connect", fake_connect)
    connect = HostByHost("postgresql://u:pw@hung:5432,good:5432/db?target_session_attrs=read-write")
    per_host_timeout, pool_wait = 0.5, 0.2  # connect_s 5 s vs --db-timeout 2 s, scaled down
    outcomes = []
    for _ in range(3):
        try:
            await asyncio.wait_for(connect(timeout=per_host_timeout), pool_wait)
            outcomes.append("connected")
        except TimeoutError:
            outcomes.append("timed out")
    assert "connected" in outcomes, (outcomes, tried)
