"""``database_servers`` / ``nats_servers`` (irisfed/cli/compose_secrets.py): a server URL
compose-secrets accepts is one every driver reads the same way; anything else is refused
with a ``ConfigError`` (one line, exit 2), never a traceback.

Checked against libpq's own parser (``PQconninfoParse``): for ``dbname``, ``host``,
``hostaddr`` and ``port`` in the query libpq takes the query's value, asyncpg the
netloc's and path's (the same split the refused ``user``/``password`` make).
"""

from __future__ import annotations

import pytest

from irisfed.cli.compose_secrets import database_servers, nats_servers
from irisfed.shared.errors import ConfigError


@pytest.mark.parametrize("url", [
    "postgresql://pg-1:²/irisfed",  # str.isdigit() says yes, int() raises ValueError: a traceback
])
def test_a_port_that_is_not_a_number_is_refused_not_a_traceback(url):
    with pytest.raises(ConfigError):
        database_servers(url)


@pytest.mark.parametrize("url", [
    # libpq: port '５４３２' (refused at connect); asyncpg: int() reads it as 5432.
    "postgresql://pg-1:５４３２/irisfed",
    # An IPv6 address without brackets: asyncpg fails on port ':1:5432'.
    "postgresql://::1:5432/irisfed",
])
def test_a_port_or_host_asyncpg_and_libpq_read_differently_is_refused(url):
    with pytest.raises(ConfigError):
        database_servers(url)


@pytest.mark.parametrize("query", ["dbname=other", "host=elsewhere", "port=6432", "hostaddr=10.0.0.9",
                                   "database=other"])
def test_a_second_server_or_database_in_the_query_is_refused(query):
    """asyncpg connects to pg-1:5432/irisfed; libpq (psql, pg_dump on the admin URL) to
    what the query says."""
    with pytest.raises(ConfigError):
        database_servers(f"postgresql://pg-1:5432/irisfed?{query}")


def test_a_nats_port_0_is_refused_as_a_postgres_port_0_is():
    with pytest.raises(ConfigError):
        database_servers("postgresql://pg-1:0/irisfed")
    with pytest.raises(ConfigError):
        nats_servers("nats://nats-1:0")


@pytest.mark.parametrize("url", [
    "postgresql://[::1]:5432,[::1]:5433/irisfed?target_session_attrs=read-write",
    "postgres://pg-1:5432/irisfed?sslmode=require",
])
def test_legitimate_database_urls_are_accepted(url):
    database_servers(url)


@pytest.mark.parametrize("url", ["nats://[::1]:4222", "tls://nats-1:4222,tls://nats-2:4222"])
def test_legitimate_nats_urls_are_accepted(url):
    nats_servers(url)
