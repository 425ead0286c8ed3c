"""Bands and preemption at their edges, with no servers: the pure rule's edge cases
(zero-resource jobs, victims holding what the job does not ask, slot-only backends,
assigned victims, backends over their advertised totals), forged submit fields, and
what an agent does with replayed or forged cancel notices (epochs).

Integration counterparts (Postgres): tests/integration/test_preemption_edges.py.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from irisfed.services.peer_agent.report import Run
from irisfed.services.peer_agent.service import PeerAgent
from irisfed.shared.errors import InvalidRequest
from irisfed.shared.federation.peer import Backend, FederationPeer
from irisfed.shared.messages import CancelNotice, SubmitRequest, decode_request, encoder
from irisfed.shared.placement import PlacementRun
from irisfed.shared.preemption import Candidate, VictimPool, choose_victims
from irisfed.shared.resources import Amount, Resources, as_resources
from irisfed.shared.rooms import QueuedJob

NOW = 100.0
BATCH, INTERACTIVE, PRODUCTION = 0, 1, 2


def victim(job_id, peer_id="p", band=BATCH, since=0.0, state="running", **resources):
    return Candidate(job_id, 3, state, peer_id, "main", band, since, Resources(resources or None).units)


def zero_victim(job_id, since):
    """A live job that asked for nothing but a slot (``resources: {"cpu": 0}``)."""
    return Candidate(job_id, 3, "running", "p", "main", BATCH, since, as_resources({"cpu": 0}).units)


def peer(peer_id="p", slots=4, **totals):
    offered = {name: Amount(total, total) for name, total in totals.items()}
    return FederationPeer(peer_id, (Backend("main", {}, total=slots, free=slots, resources=offered),),
                          last_heartbeat_at=NOW - 1, ttl_s=6)


def place(peers, running, job, live, used):
    """One placement run with ``running`` as the victim pool; ``live`` / ``used`` per
    (peer, backend) as the tick reads them from Postgres (every live job counted)."""
    run = PlacementRun(peers, live, NOW, used=used)
    run.pool = VictimPool(running)
    placements, waiting = run.place([job])
    return run, placements, waiting


# ---------------------------------------------------------------- the pure rule's edges


def test_a_job_asking_for_nothing_but_a_slot_stops_one_job_the_newest():
    units = as_resources({"cpu": 0}).units
    assert units == ()  # zero amounts are dropped: only a slot is asked
    found = [victim("old", since=1, cpu=2), victim("new", since=5, cpu=1)]
    found.sort(key=Candidate.order)
    assert [v.job_id for v in choose_victims(units, {"cpu": 0}, 0, False, found)] == ["new"]
    # A free slot is all it needs: it fits already, nobody goes, whatever the cpu.
    assert choose_victims(units, {"cpu": 0}, 1, False, found) == ()


def test_zero_resource_victims_free_slots_only():
    # Slots are free but the cpu is all held by production work: slot-only victims cannot help.
    found = sorted([zero_victim("z1", 1), zero_victim("z2", 2)], key=Candidate.order)
    assert choose_victims(Resources({"cpu": 1}).units, {"cpu": 0}, 3, False, found) is None
    # Short of a slot only: one of them is enough, the newest.
    assert [v.job_id for v in choose_victims((), {"cpu": 0}, 0, False, found)] == ["z2"]


def test_what_a_victim_holds_beyond_what_the_job_asks_earns_it_nothing():
    # J asks one gpu. The newest victim holds lots of cpu and memory but no gpu: stopping
    # it frees nothing J needs, so only the (older) gpu holder goes, alone.
    found = sorted([victim("gpu-holder", since=1, cpu=1, gpu=1),
                    victim("cpu-hog", since=9, cpu=8, memory_mb=65536)], key=Candidate.order)
    chosen = choose_victims(Resources({"cpu": 1, "gpu": 1}).units, {"cpu": 1000, "gpu": 0}, 4, False, found)
    assert [v.job_id for v in chosen] == ["gpu-holder"]


def test_a_victim_holding_a_resource_its_backend_no_longer_advertises_is_handled():
    # The backend now advertises only cpu; the victim still holds memory it asked before.
    # Preempting it gives back what the room knows of; a failed commit gives it all back.
    running = [victim("v", since=1, cpu=1, memory_mb=512)]
    run, placements, _ = place([peer(slots=1, cpu=2)], running,
                               QueuedJob("j", 0, resources=Resources({"cpu": 1}), band=INTERACTIVE),
                               {("p", "main"): 1}, {("p", "main"): {"cpu": 1, "memory_mb": 512}})
    assert [v.job_id for v in run.preempted["j"]] == ["v"]
    room = run.rooms[("p", "main")]
    assert (room.slots, room.free) == (0, {"cpu": 1000})
    run.release(placements[0], Resources({"cpu": 1}))  # its CAS lost: nothing was preempted
    assert (room.slots, room.free, run.preempted) == (0, {"cpu": 1000}, {})
    assert [v.job_id for v in run.pool.on(("p", "main"), INTERACTIVE)] == ["v"]


def test_on_a_slot_only_backend_resources_never_count():
    legacy = FederationPeer("p", (Backend("main", {}, total=2, free=0),), last_heartbeat_at=NOW - 1, ttl_s=6)
    running = [victim("big", since=1, cpu=64, gpu=8), victim("tiny", since=2)]
    run, placements, _ = place([legacy], running,
                               QueuedJob("j", 0, resources=Resources({"cpu": 32, "gpu": 4}), band=INTERACTIVE),
                               {("p", "main"): 2}, {})
    assert placements and [v.job_id for v in run.preempted["j"]] == ["tiny"]  # one slot, the newest


def test_an_assigned_victim_is_chosen_like_a_running_one_and_keeps_its_state_for_the_cas():
    running = [victim("started", since=1, cpu=1), victim("only-assigned", since=2, state="assigned", cpu=1)]
    run, _, _ = place([peer(cpu=2)], running, QueuedJob("j", 0, resources=Resources({"cpu": 1}), band=INTERACTIVE),
                      {("p", "main"): 2}, {("p", "main"): {"cpu": 2}})
    [chosen] = run.preempted["j"]
    assert (chosen.job_id, chosen.state) == ("only-assigned", "assigned")


# A backend can hold more than it advertises: LOCAL jobs are assigned to the local
# backend at submit by its totals, not its free room (they queue at the agent), and an
# engine's totals shrink under live work (a Ray node leaves, a Slurm node drains, an
# agent restarts with fewer --slots). What it is over is a debt the victims must pay
# too: preemption either makes real room or stops nobody.


def test_preemption_on_a_backend_over_its_slots_frees_enough_slots_or_none():
    # 2 slots, 3 live jobs (LOCAL work queued at the agent, or the agent shrank).
    legacy = FederationPeer("p", (Backend("main", {}, total=2, free=0),), last_heartbeat_at=NOW - 1, ttl_s=6)
    running = [victim(f"b{i}", since=float(i)) for i in range(3)]
    run, placements, _ = place([legacy], running, QueuedJob("j", 0, band=INTERACTIVE), {("p", "main"): 3}, {})
    stopped = len(run.preempted.get("j", ()))
    assert not placements or 3 - stopped + 1 <= 2, f"placed after stopping {stopped}: still over its slots"


def test_preemption_on_a_backend_over_its_cpu_frees_enough_cpu_or_none():
    # 4 cpu advertised, 6 held: b1 (4 cpu, older) and b2 (2 cpu, newer). J asks 2 cpu:
    # stopping b2 leaves 4 + 2 = 6 held on 4; only stopping b1 makes room (2 + 2 = 4).
    running = [victim("b1", since=1.0, cpu=4), victim("b2", since=2.0, cpu=2)]
    run, placements, _ = place([peer(slots=8, cpu=4)], running,
                               QueuedJob("j", 0, resources=Resources({"cpu": 2}), band=INTERACTIVE),
                               {("p", "main"): 2}, {("p", "main"): {"cpu": 6}})
    assert placements
    assert [v.job_id for v in run.preempted["j"]] == ["b1"]


# ---------------------------------------------------------------- forged submit fields


@pytest.mark.parametrize("extra", [
    {"band": 1}, {"band": True}, {"band": None}, {"band": ["batch"]}, {"band": {"name": "batch"}},
    {"band": "urgent"}, {"band": "Batch"}, {"band": " batch"}, {"band": "batch\n"}, {"band": ""},
    {"band": "[red]production[/red]"}, {"band": "production\x1b[31m"},
    {"max_preemptions": -1}, {"max_preemptions": 10_001}, {"max_preemptions": 2**63}, {"max_preemptions": 2**64},
    {"max_preemptions": 1.0}, {"max_preemptions": 1.5}, {"max_preemptions": True}, {"max_preemptions": False},
    {"max_preemptions": "5"}, {"max_preemptions": None},
    {"dry_run": "true"}, {"dry_run": 1}, {"dry_run": 0}, {"dry_run": None}, {"dry_run": "false"},
    {"dry_run": True, "band": "urgent"}, {"dry_run": True, "max_preemptions": -5},
])
def test_forged_band_and_preemption_fields_are_invalid_requests(extra):
    body = json.dumps({"command": ["true"], "job_id": "j1", **extra}).encode()
    with pytest.raises(InvalidRequest) as refused:
        decode_request(SubmitRequest, body)
    field = next(iter(set(extra) - {"dry_run"}), "dry_run")
    assert str(refused.value).startswith(f"{field} "), str(refused.value)  # a sentence naming the field


def test_the_limits_themselves_are_accepted_and_are_part_of_the_job():
    for value in (0, 10_000):
        request = decode_request(SubmitRequest, encoder.encode({"command": ["true"], "max_preemptions": value}))
        assert request.max_preemptions == value
        assert json.loads(request.canonical_spec())["max_preemptions"] == value  # stored as an int
    plain = decode_request(SubmitRequest, b'{"command": ["true"]}')
    dry = decode_request(SubmitRequest, b'{"command": ["true"], "dry_run": true}')
    assert dry.spec_hash() == plain.spec_hash()  # a dry run is not part of what a job is


# ---------------------------------------------------------------- replayed or forged cancel notices


class _Handle:
    def __init__(self) -> None:
        self.kills = 0

    async def kill(self, grace_s: float) -> None:
        self.kills += 1


class _Tasks:
    """Runs what the agent spawns at once, so a test sees its kills."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def spawn(self, coro, name: str):
        self.names.append(name)
        return asyncio.ensure_future(coro)


def _agent(runs: dict[str, Run], pending: dict | None = None) -> PeerAgent:
    """A PeerAgent with only what ``on_cancel`` uses (no backends, store or NATS)."""
    agent = PeerAgent.__new__(PeerAgent)
    agent.peer_id = "gpu-west"
    agent.runs = runs
    agent.pending = pending or {}
    agent.lock = asyncio.Lock()
    agent.reconcile_wanted = asyncio.Event()
    agent.tasks = _Tasks()
    agent.settings = SimpleNamespace(kill_grace_s=0.0)
    return agent


def _notice(job_id: str, epoch: int) -> SimpleNamespace:
    return SimpleNamespace(data=encoder.encode(CancelNotice(job_id, "gpu-west", epoch)), subject="p.cancel.gpu-west")


async def test_a_replayed_preemption_notice_of_an_older_epoch_never_stops_the_jobs_new_run():
    # The job was preempted at epoch 3 (the notice said "3"), placed back here and runs at 5.
    handle = _Handle()
    run = Run("bob:train", 5, "main", handle=handle)
    agent = _agent({"bob:train": run})
    for old in (0, 1, 3, 4):
        await agent.on_cancel(_notice("bob:train", old))
    await asyncio.sleep(0)
    assert (handle.kills, run.fenced, run.cancel_requested) == (0, False, False)
    assert agent.reconcile_wanted.is_set()  # it asks Postgres instead of trusting the message


async def test_a_notice_past_the_runs_epoch_fences_it_and_one_at_its_epoch_is_a_cancel():
    preempted, cancelled, other = _Handle(), _Handle(), _Handle()
    agent = _agent({"a": Run("a", 2, "main", handle=preempted), "b": Run("b", 2, "main", handle=cancelled),
                    "c": Run("c", 2, "main", handle=other)})
    await agent.on_cancel(_notice("a", 3))  # preempted: the new epoch
    await agent.on_cancel(_notice("b", 2))  # a user's cancel: the run's own epoch
    await agent.on_cancel(_notice("zzz", 9))  # a job this agent does not run
    await asyncio.sleep(0)
    assert (preempted.kills, agent.runs["a"].fenced, agent.runs["a"].cancel_requested) == (1, True, False)
    assert (cancelled.kills, agent.runs["b"].fenced, agent.runs["b"].cancel_requested) == (1, False, True)
    assert other.kills == 0
    # Told twice, killed once each (a duplicate notice is a no-op).
    await agent.on_cancel(_notice("a", 3))
    await agent.on_cancel(_notice("b", 2))
    await asyncio.sleep(0)
    assert (preempted.kills, cancelled.kills) == (1, 1)


async def test_a_garbled_cancel_notice_is_ignored():
    handle = _Handle()
    agent = _agent({"a": Run("a", 2, "main", handle=handle)})
    for data in (b"", b"null", b"{}", b'{"job_id": "a", "peer_id": "gpu-west", "epoch": "3"}',
                 b'{"job_id": "a", "peer_id": "gpu-west", "epoch": 3.5}', b"12345"):
        await agent.on_cancel(SimpleNamespace(data=data, subject="p.cancel.gpu-west"))
    await asyncio.sleep(0)
    assert handle.kills == 0 and not agent.runs["a"].fenced
