"""A real router (real Postgres pool, real NATS connections) on an event loop of its own."""

from __future__ import annotations

import asyncio
import json
import threading
import uuid

import nats.errors

from irisfed.services.common import db as dbmod
from irisfed.services.common.bus import connect_client
from irisfed.services.router.service import Router
from tests.infra.factories import make_config


class RouterThread:
    """A router on its own event loop, so sync (hypothesis) tests can call it."""

    def __init__(self, database_url: str, nats_url: str, prefix: str | None = None, **config) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.prefix = prefix or f"h{uuid.uuid4().hex[:10]}"
        self.config = config  # make_config overrides (e.g. users)
        self.run(self._start(database_url, nats_url))

    def run(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self, database_url: str, nats_url: str) -> None:
        self.pool = await dbmod.connect(database_url)
        self.service_nc = await connect_client(nats_url)
        self.client = await connect_client(nats_url)
        self.router = Router(make_config(subject_prefix=self.prefix, **self.config), self.pool, self.service_nc)
        await self.router.start()
        await self.heard()

    async def heard(self) -> None:
        """Wait until the router answers on its subjects (as the e2e tests' ``wait_router``):
        a cancel of a job that never was, answered ``not_found``."""
        body = json.dumps({"job_id": "readiness-probe"}).encode()
        for _ in range(600):
            try:
                await self.client.request(f"{self.prefix}.cancel", body, timeout=5)
                return
            except nats.errors.NoRespondersError:
                await asyncio.sleep(0.05)
        raise AssertionError(f"the router of {self.prefix} never answered")

    async def _reply(self, subject: str, data: bytes, timeout: float) -> bytes:
        return (await self.client.request(f"{self.prefix}.{subject}", data, timeout=timeout)).data

    def request(self, verb: str, body: bytes) -> dict:
        """The decoded reply to the raw ``body`` on ``<prefix>.<verb>``."""
        return json.loads(self.run(self._reply(verb, body, 10)))

    def reply_to(self, subject: str, body: dict, timeout: float = 20) -> bytes:
        """The raw reply to ``body`` (sent as JSON) on ``<prefix>.<subject>`` (``submit.alice`` ...)."""
        return self.run(self._reply(subject, json.dumps(body).encode(), timeout))

    def ask(self, subject: str, body: dict, timeout: float = 20) -> dict:
        """The decoded reply to ``body`` (sent as JSON) on ``<prefix>.<subject>``."""
        return json.loads(self.reply_to(subject, body, timeout))

    def rows(self) -> int:
        """How many jobs and changelog rows the database holds."""
        return self.run(self.pool.fetchval(
            "SELECT (SELECT count(*) FROM jobs) + (SELECT count(*) FROM federation_changelog)"))

    def written(self) -> tuple[int, ...]:
        """How many rows every table a submit (or a tick) writes holds."""
        return tuple(self.run(self.pool.fetchval(f"SELECT count(*) FROM {table}")) for table in (
            "jobs", "federation_changelog", "job_explanations", "job_listing", "federation_sync_state"))

    def __enter__(self) -> RouterThread:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        async def stop() -> None:
            await self.router.close()
            await self.client.close()
            await self.service_nc.close()
            await self.pool.close()
        self.run(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()
