"""Gangs in routing and placement (docs/design.md §3.4; docs/scheduling.md, "Gangs"):
all tasks on distinct nodes of one backend of one peer, sharing a ``group_by`` value,
or none; rejected at submit when no backend could ever hold them; held for when they
wait too long; preempting whole gangs only where the whole gang then fits. Pure."""

from __future__ import annotations

from irisfed.shared.federation.peer import Backend, FederationPeer
from irisfed.shared.federation.router import PeerRouter, RoutingRequest, SubmitDisposition
from irisfed.shared.nodes import parse_node_groups
from irisfed.shared.placement import PlacementRun
from irisfed.shared.preemption import Candidate, VictimPool
from irisfed.shared.resources import Amount, Resources
from irisfed.shared.rooms import QueuedJob

NOW = 1000.0
BATCH, INTERACTIVE = 0, 1


def node_groups(*entries):
    """(count, {resource: total}, {attr: value}) each, every node empty."""
    return parse_node_groups([
        {"count": count, "attributes": {k: [v] for k, v in (attrs or {}).items()},
         "resources": {name: {"total": t, "free": t} for name, t in resources.items()}}
        for count, resources, attrs in entries])


def backend(name="main", slots=64, attributes=None, *entries):
    nodes = node_groups(*entries)
    totals: dict[str, float] = {}
    for c in nodes:
        for res, amount in c.total:
            totals[res] = totals.get(res, 0) + (amount / 1000 if res == "cpu" else amount) * c.count
    return Backend(name, attributes or {}, total=slots, free=slots,
                   resources={k: Amount(v, v) for k, v in totals.items()}, nodes=nodes)


def peer(peer_id, *backends):
    return FederationPeer(peer_id, tuple(backends), last_heartbeat_at=NOW - 1, ttl_s=6)


def gang(job_id, replicas, group_by="", band=INTERACTIVE, **resources):
    return QueuedJob(job_id, 0, resources=Resources(resources or {"cpu": 1}), replicas=replicas,
                     group_by=group_by, band=band)


def single(job_id, band=INTERACTIVE, **resources):
    return QueuedJob(job_id, 0, resources=Resources(resources or {"cpu": 1}), band=band)


TWO_SLICES = (4, {"cpu": 8, "gpu": 4}, {"slice": "v5e-a"}), (4, {"cpu": 8, "gpu": 4}, {"slice": "v5e-b"})


# ---------------------------------------------------------------- routing


def classify(peers, replicas, group_by="", **resources):
    return PeerRouter(peers, clock=lambda: NOW).classify(
        RoutingRequest((), False, "", Resources(resources or {"cpu": 1}), replicas, group_by))


def test_a_gang_no_backend_could_ever_hold_is_rejected_naming_nodes():
    peers = [peer("gpu-west", backend("slurm", 64, None, (4, {"cpu": 96, "gpu": 8}, None),
                                      (12, {"cpu": 96, "gpu": 4}, None)))]
    plan = classify(peers, 8, gpu=8)
    assert plan.disposition is SubmitDisposition.REJECT
    [verdict] = plan.verdicts
    assert verdict.code == "insufficient_nodes"
    assert verdict.detail == "gang: needs 8 nodes with cpu 1, gpu 8, at most 4 (backend slurm)"
    assert classify(peers, 4, gpu=8).disposition is SubmitDisposition.QUEUE


def test_a_five_task_gang_on_four_nodes_or_a_slice_of_four_is_rejected():
    four = [peer("p", backend("main", 64, None, (4, {"cpu": 8}, None)))]
    assert classify(four, 5).disposition is SubmitDisposition.REJECT
    assert classify(four, 4).disposition is SubmitDisposition.QUEUE
    sliced = [peer("tpu", backend("main", 64, None, *TWO_SLICES))]
    assert classify(sliced, 5).disposition is SubmitDisposition.QUEUE  # 8 nodes in all
    rejected = classify(sliced, 5, "slice")
    assert rejected.disposition is SubmitDisposition.REJECT
    assert "sharing one slice, at most 4" in rejected.reason


def test_a_gang_needs_a_backend_that_advertises_nodes_and_a_slot_per_task():
    legacy = [peer("old", Backend("main", {}, total=64, free=64, resources={"cpu": Amount(64, 64)}))]
    plan = classify(legacy, 2)
    assert plan.disposition is SubmitDisposition.REJECT and "advertises no nodes" in plan.reason
    assert classify(legacy, 1).disposition is SubmitDisposition.QUEUE  # single tasks as ever
    few_slots = [peer("p", backend("main", 3, None, (8, {"cpu": 8}, None)))]
    plan = classify(few_slots, 4)
    assert plan.disposition is SubmitDisposition.REJECT and "needs 4 slots, at most 3" in plan.reason


def test_a_single_task_bigger_than_any_node_is_rejected_though_the_total_would_hold_it():
    peers = [peer("p", backend("main", 8, None, (2, {"cpu": 8, "gpu": 8}, None)))]
    plan = classify(peers, 1, gpu=12)
    assert plan.disposition is SubmitDisposition.REJECT
    assert plan.verdicts[0].code == "insufficient_nodes"
    assert "needs 1 node with cpu 1, gpu 12, at most 0" in plan.verdicts[0].detail


# ---------------------------------------------------------------- placement


def test_a_gang_goes_all_on_one_backend_of_one_peer_on_distinct_nodes_or_waits():
    peers = [peer("a", backend("main", 64, None, (3, {"cpu": 8}, None))),
             peer("b", backend("main", 64, None, (3, {"cpu": 8}, None)))]
    run = PlacementRun(peers, {}, NOW)
    placed, waiting = run.place([gang("g4", 4, cpu=8)])
    assert placed == [] and [w.job_id for w in waiting] == ["g4"]  # 6 nodes in all, never 3 + 1
    assert "needs 4 free nodes" not in waiting[0].reason or "3 free now" in waiting[0].reason
    placed, _ = run.place([gang("g3", 3, cpu=8)])
    [p] = placed
    assert (p.tasks, sum(n for _, n in p.nodes)) == (3, 3)
    # Its nodes are full now: a single task needing a whole node goes to the other peer.
    placed, _ = run.place([single("s", cpu=8)])
    assert placed[0].peer_id != p.peer_id


def test_group_by_places_a_gang_on_one_slice_or_none():
    run = PlacementRun([peer("tpu", backend("main", 64, None, *TWO_SLICES))], {}, NOW)
    placed, _ = run.place([gang("g1", 4, "slice", cpu=8)])
    assert {dict(key[0])["slice"] for key, _ in placed[0].nodes} == {("v5e-a",)}
    placed, _ = run.place([gang("g2", 4, "slice", cpu=8)])
    assert {dict(key[0])["slice"] for key, _ in placed[0].nodes} == {("v5e-b",)}
    placed, waiting = run.place([gang("g3", 2, "slice", cpu=1)])
    assert placed == [] and "sharing one slice" in waiting[0].reason


def test_a_gang_takes_a_slot_and_its_share_of_every_resource_per_task():
    run = PlacementRun([peer("p", backend("main", 5, None, (8, {"cpu": 8}, None)))], {}, NOW)
    placed, _ = run.place([gang("g", 4, cpu=2)])
    room = run.rooms[("p", "main")]
    assert len(placed) == 1 and room.slots == 1 and room.free["cpu"] == 64_000 - 8_000
    placed, waiting = run.place([gang("h", 2, cpu=1)])  # one slot left: no
    assert placed == [] and "1 free slots" in waiting[0].reason


def test_a_gang_whose_commit_failed_gives_back_its_nodes_and_slots():
    run = PlacementRun([peer("p", backend("main", 8, None, (4, {"cpu": 8}, None)))], {}, NOW)
    [placement], _ = run.place([gang("g", 4, cpu=8)])
    run.release(placement, Resources({"cpu": 8}))
    room = run.rooms[("p", "main")]
    assert room.slots == 8 and room.nodes.most_nodes(
        __import__("irisfed.shared.nodes", fromlist=["Gang"]).Gang(4, Resources({"cpu": 8}).units), False) == 4
    assert run.place([gang("again", 4, cpu=8)])[0]


def test_a_held_gang_is_not_starved_by_single_tasks():
    """The gang has waited past reserve_after_s: it holds the backend, and later single
    tasks land only on nodes it could not use (its own nodes drain for it)."""
    # Two of the four big nodes run a one-cpu task each: the gang of 4 × 4 cpu waits.
    nodes = parse_node_groups([
        {"count": 2, "resources": {"cpu": {"total": 4, "free": 3}}},
        {"count": 2, "resources": {"cpu": {"total": 4, "free": 4}}},
        {"count": 4, "resources": {"cpu": {"total": 1, "free": 1}}}])
    b = Backend("main", {}, total=64, free=62, resources={"cpu": Amount(20, 18)}, nodes=nodes)
    run = PlacementRun([peer("p", b)], {("p", "main"): 2}, NOW, used={("p", "main"): {"cpu": 2}},
                       reserve_after_s=60)
    hungry = gang("hungry", 4, cpu=4)._replace(waited_s=3600)
    _, waiting = run.place([hungry])
    assert waiting[0].holding == ("p", "main")
    # A later one-cpu task goes on a small node, never on a big one the gang needs.
    placed, _ = run.place([single("small", cpu=1)])
    assert [dict(key[1]) for key, _ in placed[0].nodes] == [{"cpu": 1000}]
    # Three cpu fit on a big node running a one-cpu task, but that node drains for the gang.
    placed, waiting = run.place([single("big", cpu=3)])
    assert placed == [] and waiting[0].verdicts[0].code == "held"


def victim(job_id, since, tasks=1, band=BATCH, **resources):
    return Candidate(job_id, 1, "running", "p", "main", band, since, Resources(resources).units, tasks=tasks)


def test_preemption_evicts_whole_gangs_only_where_the_whole_gang_then_fits():
    # 4 nodes of 8 cpu, all taken by one batch gang of 4 × 8; an interactive gang of 4 × 8.
    b = backend("main", 16, None, (4, {"cpu": 8}, None))
    full = parse_node_groups([{"count": 4, "resources": {"cpu": {"total": 8, "free": 0}}}])
    b = Backend(b.name, b.attributes, b.total, b.free, b.resources, nodes=full)
    run = PlacementRun([peer("p", b)], {("p", "main"): 4}, NOW, used={("p", "main"): {"cpu": 32}})
    run.pool = VictimPool([victim("batch-gang", 10.0, tasks=4, cpu=8)])
    placed, _ = run.place([gang("urgent", 4, cpu=8)])
    assert [p.job_id for p in placed] == ["urgent"]
    assert [v.job_id for v in run.preempted["urgent"]] == ["batch-gang"]  # the whole gang, once


def test_no_preemption_for_a_gang_that_would_still_not_have_its_nodes():
    # Two nodes of 8 cpu; a batch job holds 4 cpu on each. A gang of 3 × 8 can never fit
    # here (two nodes): it is not even a candidate; a gang of 2 × 8 needs both victims.
    full = parse_node_groups([{"count": 2, "resources": {"cpu": {"total": 8, "free": 4}}}])
    b = Backend("main", {}, total=8, free=8, resources={"cpu": Amount(16, 16)}, nodes=full)
    run = PlacementRun([peer("p", b)], {("p", "main"): 2}, NOW, used={("p", "main"): {"cpu": 8}})
    run.pool = VictimPool([victim("v1", 1.0, cpu=4), victim("v2", 2.0, cpu=4)])
    placed, _ = run.place([gang("two", 2, cpu=8)])
    assert [p.job_id for p in placed] == ["two"]
    assert sorted(v.job_id for v in run.preempted["two"]) == ["v1", "v2"]
