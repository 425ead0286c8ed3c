"""``irisfed bench``: irisfed against raw NATS and Postgres, measured in the same run.

Every figure stands beside a baseline from the same run, as a ratio, because
absolute numbers drift on shared machines. Servers are started here (Postgres
with fsync on, NATS), like the tests do. The parts: ``baselines``,
``sections`` (irisfed's figures), ``deployment`` (a database and services per
figure), ``load`` (closed and open loop), ``report`` (figures, table, JSON).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path

from bench.baselines import nats_baseline, postgres_baselines
from bench.report import Bench, Figure, Profile, print_table, write_json
from bench.sections import (
    dispatch_bench,
    heartbeat_bench,
    scale_section,
    submit_bench,
    tick_section,
)
from tooling.federation import Supervisor
from tooling.servers import start_nats, start_postgres

# Section name → (what it prints as it starts, the section), in the order they run.
SECTIONS = {
    "submit": ("submit", submit_bench),
    "dispatch": ("dispatch", dispatch_bench),
    "tick": ("tick", tick_section),
    "heartbeat": ("heartbeat fan-in", heartbeat_bench),
    "scale": ("scale curve", scale_section),
}


async def _run(bench: Bench, admin_url: str, nats_url: str, sections: set[str]) -> None:
    print("baselines", flush=True)
    await nats_baseline(bench, nats_url)
    await postgres_baselines(bench, admin_url)
    for name, (title, section) in SECTIONS.items():
        if name in sections:
            print(title, flush=True)
            await section(bench, admin_url, nats_url)


def run_bench(quick: bool, out: Path | None, sections: set[str]) -> list[Figure]:
    folder = Path(tempfile.mkdtemp(prefix="irisfed-bench-"))
    os.chmod(folder, 0o755)
    bench = Bench(Profile(quick), folder)
    servers = Supervisor(folder)
    try:
        nats_server = servers.add_server(start_nats(folder / "nats", jetstream=False))
        postgres = servers.add_server(start_postgres(folder / "pg", durable=True))  # fsync on: the real cost of a commit
        asyncio.run(_run(bench, postgres.url, nats_server.url, sections))
    finally:
        servers.close()
        shutil.rmtree(folder, ignore_errors=True)
    print_table(bench)
    if out is not None:
        write_json(bench, out)
    return bench.figures
