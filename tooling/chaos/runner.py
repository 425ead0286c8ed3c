"""``irisfed chaos``: many seeded schedules on servers of their own, and the summary."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from irisfed.services.common import db as dbmod
from irisfed.tooling.chaos.result import ChaosSummary, most_live
from irisfed.tooling.chaos.schedule import Schedule
from irisfed.tooling.chaos.world import Servers, create_roles


@dataclass
class ChaosSettings:
    schedules: int = 20
    seed: int = 1
    steps: int = 8
    first: int = 0  # index of the first schedule (to replay one schedule of a seed)
    keep: bool = False  # keep the temporary folder (logs) for inspection
    # Services and agents connect as their own login roles (irisfed db-roles), not the owner.
    restricted_roles: bool = False
    # Past one machine: Patroni (a primary, a synchronous standby) and a NATS cluster of
    # three, with the faults failover_postgres and kill_nats_node.
    ha: bool = False


def run_chaos(settings: ChaosSettings, say: Callable[[str], None] = print) -> ChaosSummary:
    """Run ``settings.schedules`` schedules on servers of its own; return the summary."""
    root = Path(tempfile.mkdtemp(prefix="irisfed-chaos-"))
    os.chmod(root, 0o755)
    servers: Servers | None = None
    results = []
    try:
        servers = Servers(root / "servers", ha=settings.ha)
        template = f"chaos_template_{os.getpid()}"
        template_url = servers.database_url(template)
        asyncio.run(servers.admin(f'CREATE DATABASE "{template}"'))
        dbmod.migrate(template_url)
        passwords = asyncio.run(create_roles(template_url)) if settings.restricted_roles else {}
        for index in range(settings.first, settings.first + settings.schedules):
            folder = root / f"schedule-{index}"
            folder.mkdir()
            schedule = Schedule(servers, folder, index, settings.seed, settings.steps, template, say, passwords)
            started = time.monotonic()
            result = asyncio.run(schedule.run())
            results.append(result)
            status = "ok" if not result.violations else f"{len(result.violations)} VIOLATIONS"
            kinds = ",".join(f"{kind}:{n}" for kind, n in sorted(result.kinds.items()))
            fenced = f" fenced={result.fenced_overlaps}" if result.fenced_overlaps else ""
            full = f" quotas_full={','.join(result.quotas_reached)}" if result.quotas_reached else ""
            say(f"  schedule {index}: faults={result.faults} ({kinds}) jobs={result.jobs} runs={result.runs}"
                f" preemptions={result.preemptions} pipelines={result.pipelines} (edges={result.dependency_edges}"
                f" started={result.dependents_started} unschedulable={result.dependents_unschedulable})"
                f" arrays={result.arrays} (elements={result.array_elements}"
                f" most_live={'/'.join(map(str, most_live(result.array_peaks)))})"
                f"{fenced}{full} "
                f"{status} ({time.monotonic() - started:.1f}s, converged in {result.converge_s:.1f}s)")
            if os.environ.get("IRISFED_CHAOS_TIMING"):  # where the schedule's wall time went
                say("    " + " ".join(f"{name}={s:.2f}" for name, s in result.phases))
            for violation in result.violations:
                say(f"    {violation}")
    finally:
        if servers is not None:
            servers.close()
        failed = any(r.violations for r in results)
        if settings.keep or failed:
            say(f"  logs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    return ChaosSummary(settings.seed, results, settings.restricted_roles, settings.ha)
