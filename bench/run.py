"""``irisfed bench``: irisfed against raw NATS and Postgres, measured in the same run.

Every figure stands beside a baseline from the same run, as a ratio, because
absolute numbers drift on shared machines. Servers are started here (Postgres
with fsync on, NATS), like the tests do. The parts: ``baselines``,
``sections`` (irisfed's figures), ``preemption`` (what preempting costs a job and a
tick pass), ``pipelines`` (what job dependencies cost), ``pgqueuer`` (the local queue a team might use
instead, beside dispatch and submit), ``engines`` (real Slurm and Ray), ``web`` (the
dashboard), ``ha`` (a synchronous standby and failovers under Patroni), ``deployment``
(a database and services per figure), ``load`` (closed and open loop), ``report``
(figures, table, JSON).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
from pathlib import Path

from irisfed.bench.baselines import nats_baseline, postgres_baselines
from irisfed.bench.engines import engines_section
from irisfed.bench.gangs import gangs_section
from irisfed.bench.ha import ha_section
from irisfed.bench.logs import logs_section
from irisfed.bench.pgqueuer import missing as pgqueuer_missing
from irisfed.bench.pgqueuer import pgqueuer_section
from irisfed.bench.pipelines import pipelines_section
from irisfed.bench.preemption import preemption_section
from irisfed.bench.report import Bench, Figure, Profile, judge, print_table, write_json
from irisfed.bench.sections import (
    dispatch_bench,
    heartbeat_bench,
    scale_section,
    submit_bench,
    tick_section,
)
from irisfed.bench.stops import stops_section
from irisfed.bench.web import web_section
from irisfed.bench.workspaces import workspaces_section
from irisfed.tooling.federation import Supervisor
from irisfed.tooling.servers import start_nats, start_postgres

# Section name → (what it prints as it starts, the section), in the order they run.
SECTIONS = {
    "pgqueuer": ("pgqueuer (peer baseline: enqueue → start, concurrent enqueues)", pgqueuer_section),
    "submit": ("submit", submit_bench),
    "dispatch": ("dispatch", dispatch_bench),
    "tick": ("tick", tick_section),
    "heartbeat": ("heartbeat fan-in", heartbeat_bench),
    "scale": ("scale curve", scale_section),
    "preemption": ("preemption (dispatch and a tick pass, each preempting batch work)",
                   preemption_section),
    "gangs": ("gangs (a tick pass with gangs on node groups; heartbeats of 1,000 nodes)", gangs_section),
    "workspaces": ("workspaces (pack and store, fetch and unpack, cache hits, one workspace for many jobs)",
                   workspaces_section),
    "logs": ("logs (follow lag and shipping CPU, shipping throughput, a user's reads over NATS)", logs_section),
    "stops": ("stops (cancel → SIGTERM against cancel → kill; the agent's device bookkeeping CPU)", stops_section),
    "pipelines": ("pipelines (a chain's links, one job's many dependents, a tick pass with jobs waiting)",
                  pipelines_section),
    "engines": ("engines (real Slurm and Ray)", engines_section),
    "web": ("web dashboard (jobs page, live viewers)", web_section),
    "ha": ("ha (Patroni with a synchronous standby: submits, dispatch, failovers)", ha_section),
}
# Left out of a --quick run that names no sections (CI's smoke run): they need root,
# Slurm and Ray, or Patroni and etcd, and take minutes. `--quick --sections engines,ha`
# runs them at quick sizes.
NOT_IN_QUICK_DEFAULT = {"engines", "ha"}
# What pgqueuer is compared with: choosing either brings it along, like the baselines.
BESIDE_PGQUEUER = {"submit", "dispatch"}


async def _run(bench: Bench, admin_url: str, nats_url: str, sections: set[str]) -> None:
    print("baselines", flush=True)
    await nats_baseline(bench, nats_url)
    await postgres_baselines(bench, admin_url)
    for name, (title, section) in SECTIONS.items():
        if name in sections:
            print(title, flush=True)
            await section(bench, admin_url, nats_url)


def chosen_sections(quick: bool, sections: set[str]) -> set[str]:
    """The sections to run: all of ``sections``, except that a --quick run of every
    section (no --sections given) leaves out NOT_IN_QUICK_DEFAULT; ``pgqueuer`` too
    when ``submit`` or ``dispatch`` runs, as their same-run peer baseline."""
    chosen = set(sections)
    if quick and chosen == set(SECTIONS):
        chosen -= NOT_IN_QUICK_DEFAULT
    if chosen & BESIDE_PGQUEUER:
        chosen.add("pgqueuer")
    return chosen


def run_bench(quick: bool, out: Path | None, sections: set[str]) -> list[Figure]:
    chosen = chosen_sections(quick, sections)
    if sections - chosen:
        left_out = ",".join(sorted(sections - chosen))
        print(f"--quick leaves out {left_out} (irisfed bench --quick --sections {left_out} runs it)", flush=True)
    if "pgqueuer" in chosen - sections:
        print("pgqueuer runs too: submit and dispatch are compared with it", flush=True)
    sections = chosen
    if "pgqueuer" in sections and (reason := pgqueuer_missing()) is not None:
        # A clear stop before any server starts, not a table silently short of its peer rows.
        raise SystemExit(f"irisfed bench: {reason}; the pgqueuer section, and submit and dispatch "
                         "beside it, need it")
    # The bench's own pools ride the ha section's failovers: asyncpg's warnings while it
    # reconnects them are not figures, and would fill the table's terminal with tracebacks.
    logging.getLogger("asyncpg.pool").setLevel(logging.ERROR)
    folder = Path(tempfile.mkdtemp(prefix="irisfed-bench-"))
    os.chmod(folder, 0o755)
    bench = Bench(Profile(quick), folder, load_at_start=os.getloadavg())
    servers = Supervisor(folder)
    try:
        # JetStream only for the sections that store bytes: the others measure plain NATS.
        nats_server = servers.add_server(start_nats(folder / "nats", jetstream=bool({"workspaces", "logs"} & sections)))
        postgres = servers.add_server(start_postgres(folder / "pg", durable=True))  # fsync on: the real cost of a commit
        asyncio.run(_run(bench, postgres.url, nats_server.url, sections))
        judge(bench)
    finally:
        servers.close()
        shutil.rmtree(folder, ignore_errors=True)
    print_table(bench)
    if out is not None:
        write_json(bench, out)
    return bench.figures
