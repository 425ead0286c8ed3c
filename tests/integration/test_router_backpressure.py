"""A Postgres that hangs (no reset) and a router under more submits than it can write.

Every submit gets an answer: `unavailable` when its commit cannot finish within the
router's submit timeout or when the submit queue is full; the producer retries
with the same job_id, which is safe (one job, one row).
"""

from __future__ import annotations

import asyncio
import json

import pytest

from irisfed.services.common import db as dbmod
from irisfed.services.common import metrics
from irisfed.services.common.bus import connect_client
from irisfed.services.router.service import Router, RouterSettings
from irisfed.tooling.proxy import proxy_for
from tests.infra.factories import make_config
from tests.infra.routers import RouterThread


class ProxiedRouter(RouterThread):
    """A router whose Postgres connections go through a proxy that can stall."""

    def __init__(self, database_url: str, nats_url: str, settings: RouterSettings | None = None) -> None:
        self.direct_url = database_url
        self.proxy = proxy_for(database_url)
        self.settings = settings
        super().__init__(self.proxy.url_for(database_url), nats_url)

    async def _start(self, database_url: str, nats_url: str) -> None:
        self.pool = await dbmod.connect(database_url)
        self.service_nc = await connect_client(nats_url)
        self.client = await connect_client(nats_url)
        config = make_config(subject_prefix=self.prefix)
        self.router = (Router(config, self.pool, self.service_nc) if self.settings is None
                       else Router(config, self.pool, self.service_nc, self.settings))
        await self.router.start()
        await self.heard()

    async def submit(self, body: dict, timeout: float = 30) -> dict:
        reply = await self.client.request(f"{self.prefix}.submit", json.dumps(body).encode(), timeout=timeout)
        return json.loads(reply.data)

    async def submit_until_accepted(self, body: dict) -> dict:
        for _ in range(100):
            reply = await self.submit(body)
            if reply.get("error", {}).get("code") != "unavailable":
                return reply
            await asyncio.sleep(0.2)
        raise AssertionError(f"still unavailable: {reply}")

    async def rows_of(self, job_id: str) -> tuple[int, int]:
        """(jobs rows, changelog creation rows) for ``job_id``, read past the proxy."""
        import asyncpg

        conn = await asyncpg.connect(self.direct_url)
        try:
            return (await conn.fetchval("SELECT count(*) FROM jobs WHERE job_id = $1", job_id),
                    await conn.fetchval("SELECT count(*) FROM federation_changelog "
                                        "WHERE job_id = $1 AND from_state IS NULL", job_id))
        finally:
            await conn.close()

    def close(self) -> None:
        self.proxy.restore(drop=True)
        try:
            super().close()
        finally:
            self.proxy.close()


@pytest.fixture
def make_router(database_url, servers):
    made = []

    def make(settings: RouterSettings | None = None) -> ProxiedRouter:
        made.append(ProxiedRouter(database_url, servers.nats_url, settings))
        return made[-1]

    yield make
    for router in made:
        router.close()


@pytest.mark.parametrize("resume", [True, False], ids=["stall-resumes", "stall-ends-in-reset"])
def test_a_submit_while_postgres_hangs_is_answered_unavailable_and_its_retry_is_safe(make_router, resume):
    # Default timeouts: whatever they are, a hang must not mean no answer. One writer,
    # so the stalled submit meets the connection the first one opened (a hang in the
    # middle of a statement, not a connect that times out).
    router = make_router(RouterSettings(writers=1))
    warm = router.run(router.submit({"job_id": "warm", "command": ["true"]}))
    assert "error" not in warm, warm

    router.proxy.stall()  # Postgres hangs: connections stay open, nothing moves, no reset
    body = {"job_id": "during-stall", "command": ["true"]}
    reply = router.run(router.submit(body), timeout=60)
    assert reply.get("error", {}).get("code") == "unavailable", reply
    assert "same job_id" in reply["error"]["message"]

    router.proxy.restore(drop=not resume)
    # The held INSERT may still commit once the bytes flow again: the retry under the
    # same job_id is then a duplicate. Either way, one job and one creation row.
    again = router.run(router.submit_until_accepted(body), timeout=60)
    assert again["job_id"] == "during-stall" and "error" not in again, again
    assert router.run(router.rows_of("during-stall")) == (1, 1)
    fresh = router.run(router.submit_until_accepted({"job_id": "after-stall", "command": ["true"]}), timeout=60)
    assert fresh["duplicate"] is False


def test_a_full_submit_queue_answers_unavailable_at_once(make_router):
    shed = metrics.SUBMIT_SHED.labels("queue_full")
    shed_before = shed._value.get()
    # One writer, two places in the queue, and a submit timeout longer than the test.
    router = make_router(RouterSettings(writers=1, max_queue=2, submit_timeout_s=60.0))
    assert "error" not in router.run(router.submit({"job_id": "warm", "command": ["true"]}))

    async def scenario() -> dict[str, dict]:
        router.proxy.stall()
        stuck = asyncio.ensure_future(router.submit({"job_id": "q0", "command": ["true"]}))
        while router.router.queue.qsize() or router.router.writer_busy == 0:  # q0 is in the writer
            await asyncio.sleep(0.02)
        later = {f"q{i}": asyncio.ensure_future(router.submit({"job_id": f"q{i}", "command": ["true"]}))
                 for i in range(1, 6)}
        # Two wait in the queue; the other three are refused without waiting for anything.
        refused = []
        while len(refused) < 3:
            done, _ = await asyncio.wait([f for f in later.values() if f not in refused], timeout=10,
                                         return_when=asyncio.FIRST_COMPLETED)
            assert done, "queue-full submits were not answered while Postgres hung"
            refused.extend(done)
        assert router.router.queue.qsize() == 2
        router.proxy.restore()
        replies = {"q0": await stuck}
        for job_id, future in later.items():
            replies[job_id] = await future
        return replies

    replies = router.run(scenario(), timeout=120)
    unavailable = sorted(j for j, r in replies.items() if r.get("error", {}).get("code") == "unavailable")
    accepted = sorted(j for j, r in replies.items() if "error" not in r)
    assert len(unavailable) == 3 and len(accepted) == 3, replies
    assert "q0" in accepted
    assert shed._value.get() - shed_before == 3
    # Their producers retry with the same job_id: each becomes exactly one job.
    for job_id in unavailable:
        again = router.run(router.submit_until_accepted({"job_id": job_id, "command": ["true"]}))
        assert again["duplicate"] is False, again
    for job_id in replies:
        assert router.run(router.rows_of(job_id)) == (1, 1)


def test_a_cancel_while_postgres_hangs_is_answered_unavailable_and_its_retry_works(make_router):
    router = make_router(RouterSettings(writers=1, submit_timeout_s=1.0))
    assert "error" not in router.run(router.submit({"job_id": "c1", "command": ["true"]}))
    assert "outcome" in router.request("cancel", b'{"job_id": "c1"}')  # leaves an idle pool connection

    async def cancel() -> dict:
        reply = await router.client.request(f"{router.prefix}.cancel", b'{"job_id": "c1"}', timeout=30)
        return json.loads(reply.data)

    router.proxy.stall()
    reply = router.run(cancel(), timeout=60)
    assert reply.get("error", {}).get("code") == "unavailable", reply
    router.proxy.restore()

    async def until_answered() -> dict:
        for _ in range(100):
            answer = await cancel()
            if answer.get("error", {}).get("code") != "unavailable":
                return answer
            await asyncio.sleep(0.2)
        raise AssertionError(answer)

    again = router.run(until_answered(), timeout=60)
    assert again["outcome"] in {"already_finished", "already_requested"}, again


def test_writers_survive_their_connection_being_closed_under_them(make_router):
    # Postgres ends the writer's idle connection (a restart, an admin, a timeout): asyncpg
    # gives it back to the pool, and any call on it raises. The writer takes a new one.
    router = make_router(RouterSettings(writers=1))
    assert "error" not in router.run(router.submit({"job_id": "before", "command": ["true"]}))

    async def terminate_router_backends() -> None:
        import asyncpg

        conn = await asyncpg.connect(router.direct_url)
        try:
            await conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                               "WHERE datname = current_database() AND pid <> pg_backend_pid()")
        finally:
            await conn.close()

    router.run(terminate_router_backends())
    for i in range(3):
        reply = router.run(router.submit_until_accepted({"job_id": f"after-{i}", "command": ["true"]}), timeout=60)
        assert "error" not in reply, reply
    writers = [t for t in asyncio.all_tasks(router.loop) if t.get_name().startswith("router-writer")]
    assert len(writers) == 1 and not writers[0].done()
