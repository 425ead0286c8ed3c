"""The router's side of a workspace fetch for the ``workspaces`` section, as a process
of its own (a router runs beside the agents, not on their event loop):
``python -m irisfed.bench.relay NATS_URL PREFIX PEER`` answers ``PREFIX.fetch.PEER``
with ``WorkspaceRelay`` and prints ``ready``. The relay's job check reads no Postgres
here: a job ``bench-<64 hex>`` is taken as assigned to PEER under epoch 1, naming
workspace ``sha256:<hex>`` of the user ``default`` (a row read, not what this section
times)."""

from __future__ import annotations

import asyncio
import sys
from datetime import UTC, datetime

from irisfed.services.common.bus import connect_client
from irisfed.services.common.objects import ObjectStore
from irisfed.services.router.workspaces import WorkspaceRelay
from irisfed.shared.lifecycle import JobState
from irisfed.shared.records import JobRow
from irisfed.shared.subjects import Subjects

JOB_PREFIX = "bench-"


class BenchJobs:
    """``job_get`` for the relay: ``bench-<hex>`` jobs, each assigned to ``peer``."""

    def __init__(self, store: ObjectStore, peer: str) -> None:
        self.store, self.peer = store, peer

    async def job_get(self, job_id: str) -> JobRow | None:
        digest = "sha256:" + job_id.removeprefix(JOB_PREFIX)
        size = await self.store.has_workspace(digest) if job_id.startswith(JOB_PREFIX) else None
        if size is None:
            return None
        now = datetime.now(UTC)
        spec = {"command": ["true"], "workspace": {"digest": digest, "size": size}}
        return JobRow(job_id, spec, "", JobState.RUNNING, "queue", None, self.peer, "main", 1, 0, 0, 0, [],
                      now, now, None, None, None, None, None, None, "", None, False, None)


async def serve(nats_url: str, prefix: str, peer: str) -> None:
    nc = await connect_client(nats_url)
    relay = WorkspaceRelay(nc, prefix, BenchJobs(ObjectStore(nc, prefix), peer), max_bytes=1 << 30)

    async def answer(msg) -> None:
        await relay.answer(peer, msg.data, msg.reply)
    await nc.subscribe(Subjects(prefix).fetch(peer), cb=answer)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.Event().wait()  # until killed


if __name__ == "__main__":
    asyncio.run(serve(*sys.argv[1:4]))
