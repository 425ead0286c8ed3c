"""The harness itself: servers are real, each test's database is its own."""

import os

import pytest

MARK = "isolation-probe"


async def test_postgres_is_a_real_server(servers, pool):
    version = await pool.fetchval("SHOW server_version")
    assert version and version[0].isdigit()
    if servers.postgres is not None:
        os.kill(servers.postgres.pid, 0)  # our own process, alive by PID


@pytest.mark.parametrize("attempt", [1, 2])
async def test_each_test_gets_an_empty_database(pool, attempt):
    # Both runs insert the same primary key: that only works if neither sees the other's row.
    assert await pool.fetchval("SELECT count(*) FROM jobs") == 0
    await pool.execute(
        "INSERT INTO jobs (job_id, spec, spec_hash, state, disposition) "
        "VALUES ($1, '{}', 'h', 'queued', 'queue')", MARK,
    )
    assert (await pool.fetchval("SELECT current_database()")).startswith("t_")


async def test_nats_is_real_with_jetstream(nats_client, subject_prefix):
    subject = f"{subject_prefix}.echo"

    async def echo(msg):
        await msg.respond(msg.data[::-1])

    await nats_client.subscribe(subject, cb=echo)
    reply = await nats_client.request(subject, b"abc", timeout=5)
    assert reply.data == b"cba"
    info = await nats_client.jetstream().account_info()
    assert info.limits is not None
