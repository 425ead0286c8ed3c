"""A real router (real Postgres pool, real NATS connections) on an event loop of its own."""

from __future__ import annotations

import asyncio
import json
import threading
import uuid

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

    async def _request(self, verb: str, body: bytes) -> dict:
        reply = await self.client.request(f"{self.prefix}.{verb}", body, timeout=10)
        return json.loads(reply.data)

    def request(self, verb: str, body: bytes) -> dict:
        return self.run(self._request(verb, body))

    def rows(self) -> int:
        return self.run(self.pool.fetchval(
            "SELECT (SELECT count(*) FROM jobs) + (SELECT count(*) FROM federation_changelog)"))

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
