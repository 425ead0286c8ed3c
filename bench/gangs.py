"""The ``gangs`` section: what multi-task jobs (docs/design.md §3.4) cost the control
plane, each figure a ratio or bound within this run.

- *tick with gangs*: one ``Tick.run_once()`` over a queue of which every tenth job is a
  gang of 8–64 tasks, on peers advertising node groups (identical nodes counted
  together); against the same pass over the same number of single-task jobs on the
  same peers. Every job fits, so both count placements, not waiting. Runs alternate.
- *heartbeat size*: one backend of 1,000 nodes in four shapes, as a heartbeat carries it.
- *heartbeats at 1 Hz*: router and tick CPU while that many peers, each advertising
  such a backend, heartbeat once a second (what parsing node groups costs them).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

import msgspec

from irisfed.bench.deployment import Deployment
from irisfed.bench.load import median, spread
from irisfed.bench.report import Bench, Figure
from irisfed.bench.sections import KINDS, _job_resources, _node_shape, _span, heartbeat_load
from irisfed.shared.messages import BackendAd, Capacity, NodeGroup, ResourceAmount
from irisfed.shared.nodes import group_nodes

GANG_EVERY = 10  # every tenth queued job is a gang
GANG_TASKS = (8, 64)  # its tasks: from the first to the second, spread evenly
TICK_TARGET = 0.5  # gangs' assignments/s at least this much of single tasks'
HEARTBEAT_BYTES_TARGET = 8 * 1024
CPU_TARGET = 0.10  # of a core, router and tick each


def gang_tasks(i: int) -> int:
    """Job ``i``'s tasks: a gang of 8–64 for every GANG_EVERY-th job, else one."""
    if i % GANG_EVERY:
        return 1
    low, high = GANG_TASKS
    return low + (i // GANG_EVERY * 7) % (high - low + 1)


def _gang_job(i: int, gangs: bool):
    from irisfed.services.router.plan import plan_new_job, route
    from irisfed.shared.federation.router import SubmitDisposition, SubmitPlan
    from irisfed.shared.messages import SubmitRequest

    raw = {"command": ["true"], "job_id": f"q{i}", "priority": i % 5, "resources": _job_resources(i),
           "constraints": [{"key": "device_type", "op": "eq", "value": KINDS[i % 3]}]}
    if gangs and gang_tasks(i) > 1:
        raw["replicas"] = gang_tasks(i)
    request = msgspec.convert(raw, SubmitRequest)
    new, _ = plan_new_job(request, route(SubmitPlan(SubmitDisposition.QUEUE, reason="bench"), "p0", None), f"q{i}")
    return new


def _nodes_per_peer(jobs: int, peer_count: int) -> list[int]:
    """Nodes per peer: twice its share of its kind's demand with every gang's tasks
    counted (so every job fits), and never fewer than the biggest gang's tasks."""
    demand = {kind: {} for kind in KINDS}
    for i in range(jobs):
        asked = demand[KINDS[i % 3]]
        for name, amount in _job_resources(i).items():
            asked[name] = asked.get(name, 0) + amount * gang_tasks(i)
    of_kind = {kind: sum(1 for p in range(peer_count) if KINDS[p % 3] == kind) for kind in KINDS}
    nodes = []
    for p in range(peer_count):
        kind, shape = KINDS[p % 3], _node_shape(p)
        nodes.append(max(GANG_TASKS[1], *(-(-2 * total // (of_kind[kind] * shape[name]))
                                          for name, total in demand[kind].items())))
    return nodes


async def _advertise_nodes(dep: Deployment, peers, nodes: list[int]) -> None:
    """Each peer one backend of ``nodes[i]`` nodes of ``_node_shape(i)``: its totals, and
    its nodes as one group of identical nodes, as an agent advertises them."""
    for i, (peer_id, attrs, slots) in enumerate(peers):
        shape = _node_shape(i)
        amounts = {name: {"total": float(per * nodes[i]), "free": float(per * nodes[i])}
                   for name, per in shape.items()}
        groups = group_nodes([({}, {name: (per, per) for name, per in shape.items()})] * nodes[i])
        await dep.store.peer_heartbeat_upsert(
            peer_id, "bench", 1, [{"name": "simulated", "attributes": {k: [v] for k, v in attrs.items()},
                                   "capacity": {"total": slots, "free": slots}, "resources": amounts,
                                   "nodes": groups}],
            3600.0, datetime.now(UTC))


async def tick_gangs(bench: Bench, admin_url: str, nats_url: str, jobs: int, peer_count: int, gangs: bool,
                     label: str, placed: list[int], tasks_placed: list[int]) -> float:
    """Assignments per second of one ``Tick.run_once()`` over ``jobs`` queued jobs (every
    tenth a gang, with ``gangs``) on ``peer_count`` peers advertising node groups."""
    from irisfed.services.tick.service import Tick

    total_tasks = sum(gang_tasks(i) for i in range(jobs))
    peers = [(f"p{i}", {"device_type": KINDS[i % 3]}, max(1, 2 * total_tasks // peer_count + GANG_TASKS[1]))
             for i in range(peer_count)]
    dep = Deployment(bench, admin_url, nats_url, f"gangs{jobs}x{peer_count}{label}", peers)
    await dep.create()
    try:
        await _advertise_nodes(dep, peers, _nodes_per_peer(jobs, peer_count))
        for first in range(0, jobs, 5000):
            await dep.store.job_insert_batch([_gang_job(i, gangs) for i in range(first, min(jobs, first + 5000))])
        await dep.pool.execute("ANALYZE jobs")
        await dep.pool.execute("CHECKPOINT")
        tick = Tick(dep.config, dep.pool, None)
        await tick.refresh_view()
        started = time.perf_counter()
        result = await tick.run_once()
        elapsed = time.perf_counter() - started
        placed.append(len(result.assigned))
        replicas = {f"q{i}": gang_tasks(i) if gangs else 1 for i in range(jobs)}
        tasks_placed.append(sum(replicas[job_id] for job_id, _, _ in result.assigned))
        return len(result.assigned) / elapsed
    finally:
        await dep.close()


def heartbeat_ad(nodes: int = 1000) -> BackendAd:
    """A backend of ``nodes`` nodes in four shapes (one per kind of node), half of each busy."""
    shapes = [({"device_type": ["gpu"], "device_variant": ["h100"]}, {"cpu": 96, "memory_mb": 786432, "gpu": 8}),
              ({"device_type": ["gpu"], "device_variant": ["a100"]}, {"cpu": 64, "memory_mb": 524288, "gpu": 8}),
              ({"device_type": ["cpu"]}, {"cpu": 128, "memory_mb": 1048576}),
              ({"device_type": ["tpu"], "slice": ["v5e-16-a"]}, {"cpu": 24, "memory_mb": 196608, "tpu": 4})]
    singles = []
    for n in range(nodes):
        attrs, shape = shapes[n % 4]
        busy = (n // 4) % 2
        singles.append((attrs, {name: (total, 0 if busy else total) for name, total in shape.items()}))
    groups = group_nodes(singles)
    totals: dict[str, float] = {}
    for _, shape in singles:
        for name, (total, _free) in shape.items():
            totals[name] = totals.get(name, 0) + total
    return BackendAd("slurm", {"device_type": ["gpu", "cpu", "tpu"]}, Capacity(nodes * 8, nodes * 4),
                     {name: ResourceAmount(total, total / 2) for name, total in totals.items()},
                     nodes=[NodeGroup(g["count"], g["attributes"],
                                      {k: ResourceAmount(v["total"], v["free"]) for k, v in g["resources"].items()})
                            for g in groups])


async def heartbeat_nodes_bench(bench: Bench, admin_url: str, nats_url: str) -> None:
    count = bench.profile.n(200, 1000)
    ad = msgspec.to_builtins(heartbeat_ad())
    size = len(msgspec.json.encode(heartbeat_ad()))
    bench.add(Figure("gangs", "heartbeat backend of 1,000 nodes in 4 shapes", size / 1024, "KiB",
                     target="≤ 8 KiB", met=size <= HEARTBEAT_BYTES_TARGET,
                     note=f"{len(ad['nodes'])} node groups (half of each shape busy)"))
    peers = [(f"hb{i}", {"device_type": "gpu"}, 8000) for i in range(count)]
    cpu, _ = await heartbeat_load(bench, admin_url, nats_url, "heartbeatnodes", peers, lambda _slots: [ad])
    for name in ("router", "tick"):
        bench.add(Figure("gangs", f"{name} CPU with {count} peers of 1,000 nodes at 1 Hz", cpu[name] * 100,
                         "% core", target="< 10%", met=cpu[name] < CPU_TARGET))


async def gangs_section(bench: Bench, admin_url: str, nats_url: str) -> None:
    jobs, peers = bench.profile.n(10_000, 100_000), bench.profile.n(20, 100)
    single, gang, placed, gang_placed, tasks, gang_tasks_placed = [], [], [], [], [], []
    for i in range(3):
        single.append(await tick_gangs(bench, admin_url, nats_url, jobs, peers, False, f"s{i}", placed, tasks))
        gang.append(await tick_gangs(bench, admin_url, nats_url, jobs, peers, True, f"g{i}", gang_placed,
                                     gang_tasks_placed))
    ratio = median(gang) / median(single)
    gangs = jobs // GANG_EVERY
    bench.add(Figure("gangs", f"tick assignments/s, {jobs:,} queued ({gangs:,} gangs of "
                              f"{GANG_TASKS[0]}–{GANG_TASKS[1]} tasks) × {peers} peers with node groups",
                     median(gang), "jobs/s", f"single-task jobs, same peers ({median(single):,.0f}/s)", ratio,
                     f"≥ {TICK_TARGET}× single-task", ratio >= TICK_TARGET, spread(gang),
                     f"placed {_span(gang_placed)}/{jobs:,} jobs, {_span(gang_tasks_placed)} tasks "
                     f"(single: {_span(placed)} jobs)"))
    await heartbeat_nodes_bench(bench, admin_url, nats_url)
