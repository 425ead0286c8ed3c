"""An agent's log shipping for the ``logs`` section, as a process of its own (so its CPU
is its own): ``python -m irisfed.bench.shipper NATS_URL PREFIX PEER FOLDER RUNS``
ships ``FOLDER/job-<i>/epoch-1/stdout`` (i < RUNS) with ``LogShipper``, a pass every
0.25 s as the agent does, and prints ``ready``."""

from __future__ import annotations

import asyncio
import sys

from irisfed.services.common.bus import connect_client
from irisfed.services.common.logstore import LogStore
from irisfed.services.peer_agent.logs import LogShipper
from irisfed.services.peer_agent.service import LOG_PASS_S


async def serve(nats_url: str, prefix: str, peer: str, folder: str, runs: int) -> None:
    nc = await connect_client(nats_url)
    shipper = LogShipper(LogStore(nc, prefix, peer), prefix, peer, max_bytes=64 << 20, interval_s=LOG_PASS_S)
    for i in range(runs):
        shipper.follow(f"job-{i}", 1, 1, f"{folder}/job-{i}/epoch-1", fresh=True)
    print("ready", flush=True)
    await shipper.run()  # until killed


if __name__ == "__main__":
    asyncio.run(serve(*sys.argv[1:5], int(sys.argv[5])))
