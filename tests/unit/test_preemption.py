"""Preemption (shared/preemption.py, PlacementRun with a VictimPool): who is stopped, where, and never more."""

from hypothesis import given, settings
from hypothesis import strategies as st

from irisfed.shared.bands import may_preempt
from irisfed.shared.fair_share import FairShareRun
from irisfed.shared.federation.peer import Backend, FederationPeer
from irisfed.shared.placement import PlacementRun
from irisfed.shared.preemption import (
    LOWEST_BAND,
    NO_LOWER_BAND,
    ONLY_HELD,
    STILL_NO_ROOM,
    Candidate,
    VictimPool,
    choose_victims,
)
from irisfed.shared.resources import Amount, Resources
from irisfed.shared.rooms import QueuedJob
from irisfed.shared.users import QUOTA, UserConfig, UserTable

NOW = 100.0
BATCH, INTERACTIVE, PRODUCTION = 0, 1, 2


def peer(peer_id, slots=4, backend="main", attributes=None, **resources):
    offered = {name: Amount(total, total) for name, total in resources.items()}
    return FederationPeer(peer_id, (Backend(backend, attributes or {}, total=slots, free=slots, resources=offered),),
                          last_heartbeat_at=NOW - 1, ttl_s=6)


def victim(job_id, peer_id="p", band=BATCH, since=0.0, backend="main", user="default", **resources):
    return Candidate(job_id, 3, "running", peer_id, backend, band, since, Resources(resources or None).units, user)


def usage(victims):
    """live and used per (peer, backend) of the victims (everything running)."""
    live, used = {}, {}
    for v in victims:
        key = (v.peer_id, v.backend)
        live[key] = live.get(key, 0) + 1
        into = used.setdefault(key, {})
        for name, amount in Resources(dict((n, a / 1000 if n == "cpu" else a) for n, a in v.units)).as_dict().items():
            into[name] = into.get(name, 0) + amount
    return live, used


def place(peers, running, job, extra_live=None):
    live, used = usage(running)
    for key, count in (extra_live or {}).items():
        live[key] = live.get(key, 0) + count
    run = PlacementRun(peers, live, NOW, used=used)
    run.pool = VictimPool(running)
    placements, waiting = run.place([job])
    return run, placements, waiting


def test_bands_preempt_only_strictly_lower_and_never_production():
    assert may_preempt(INTERACTIVE, BATCH) and may_preempt(PRODUCTION, INTERACTIVE)
    assert not may_preempt(INTERACTIVE, INTERACTIVE) and not may_preempt(BATCH, BATCH)
    assert not may_preempt(PRODUCTION, PRODUCTION) and not may_preempt(3, PRODUCTION)


def test_one_batch_job_makes_room_on_the_backend_where_the_job_then_runs():
    running = [victim("b1", "p", since=1, cpu=2), victim("b2", "p", since=2, cpu=2),
               victim("b3", "q", since=3, cpu=2), victim("b4", "q", since=4, cpu=2)]
    run, placements, waiting = place([peer("p", cpu=4), peer("q", cpu=4)], running,
                                     QueuedJob("j", 0, resources=Resources({"cpu": 2}), band=INTERACTIVE))
    assert not waiting
    [placed] = placements
    [stopped] = run.preempted["j"]
    # The most recently started batch job goes, on the backend the job is placed on.
    assert stopped.job_id == "b4" and (placed.peer_id, placed.backend) == ("q", "main")


def test_a_batch_job_waits_and_says_it_preempts_nothing():
    running = [victim("b1", cpu=4)]
    run, placements, waiting = place([peer("p", cpu=4)], running,
                                     QueuedJob("j", 0, resources=Resources({"cpu": 1}), band=BATCH))
    assert not placements and not run.preempted
    assert waiting[0].rule.endswith(f"cannot preempt: {LOWEST_BAND}")


def test_production_and_same_band_work_is_never_preempted():
    running = [victim("prod", band=PRODUCTION, cpu=2), victim("same", band=INTERACTIVE, cpu=2)]
    run, placements, waiting = place([peer("p", cpu=4)], running,
                                     QueuedJob("j", 0, resources=Resources({"cpu": 1}), band=INTERACTIVE))
    assert not placements and not run.preempted
    assert waiting[0].rule.endswith(f"cannot preempt: {NO_LOWER_BAND}")
    run, placements, _ = place([peer("p", cpu=4)], running,
                               QueuedJob("j", 0, resources=Resources({"cpu": 1}), band=PRODUCTION))
    assert [v.job_id for v in run.preempted["j"]] == ["same"]


def test_it_never_preempts_when_even_every_lower_job_would_not_make_room():
    running = [victim("b1", cpu=1), victim("prod", band=PRODUCTION, cpu=3)]
    run, placements, waiting = place([peer("p", cpu=4)], running,
                                     QueuedJob("j", 0, resources=Resources({"cpu": 2}), band=INTERACTIVE))
    assert not placements and not run.preempted
    assert waiting[0].rule.endswith(f"cannot preempt: {STILL_NO_ROOM}")


def test_a_single_victim_is_preferred_to_several_smaller_ones():
    # Newest first would take the two small ones; one big one is enough.
    running = [victim("big", since=1, cpu=2), victim("small1", since=5, cpu=1), victim("small2", since=6, cpu=1)]
    run, placements, _ = place([peer("p", cpu=4)], running,
                               QueuedJob("j", 0, resources=Resources({"cpu": 2}), band=INTERACTIVE))
    assert [v.job_id for v in run.preempted["j"]] == ["big"]


def test_lowest_band_goes_before_newer_work_of_a_higher_band():
    running = [victim("batch-old", band=BATCH, since=1, cpu=2), victim("inter-new", band=INTERACTIVE, since=9, cpu=2)]
    run, _, _ = place([peer("p", cpu=4)], running,
                      QueuedJob("j", 0, resources=Resources({"cpu": 2}), band=PRODUCTION))
    assert [v.job_id for v in run.preempted["j"]] == ["batch-old"]


def test_the_backend_needing_fewest_victims_wins():
    running = [victim("p1", "p", since=9, cpu=1), victim("p2", "p", since=9, cpu=1),
               victim("q1", "q", since=1, cpu=2)]
    run, placements, _ = place([peer("p", slots=2, cpu=2), peer("q", slots=1, cpu=2)], running,
                               QueuedJob("j", 0, resources=Resources({"cpu": 2}), band=INTERACTIVE))
    assert placements[0].peer_id == "q" and [v.job_id for v in run.preempted["j"]] == ["q1"]


def test_a_slot_short_backend_frees_one_slot():
    # Slots only (an agent advertising no resources): one victim frees one slot.
    running = [victim("b1", since=1), victim("b2", since=2)]
    legacy = FederationPeer("p", (Backend("main", {}, total=2, free=0),), last_heartbeat_at=NOW - 1, ttl_s=6)
    run, placements, _ = place([legacy], running, QueuedJob("j", 0, band=INTERACTIVE))
    assert [v.job_id for v in run.preempted["j"]] == ["b2"]


def test_constraints_and_pins_limit_where_it_preempts():
    running = [victim("gpu-b", "g", cpu=1, gpu=1), victim("cpu-b", "c", since=9, cpu=1)]
    peers = [peer("g", slots=1, attributes={"gpu": ["a100"]}, cpu=1, gpu=1), peer("c", slots=1, cpu=1)]
    from irisfed.shared.constraints import Constraint
    job = QueuedJob("j", 0, constraints=(Constraint("gpu", "exists"),), resources=Resources({"cpu": 1}),
                    band=INTERACTIVE)
    run, placements, _ = place(peers, running, job)
    assert placements[0].peer_id == "g" and [v.job_id for v in run.preempted["j"]] == ["gpu-b"]
    pinned = QueuedJob("k", 0, pinned_peer_id="g", resources=Resources({"cpu": 1}), band=INTERACTIVE)
    run, placements, _ = place(peers, running, pinned)
    assert placements[0].peer_id == "g" and [v.job_id for v in run.preempted["k"]] == ["gpu-b"]


def test_a_victim_is_preempted_once_for_one_room():
    running = [victim("b1", cpu=2)]
    live, used = usage(running)
    run = PlacementRun([peer("p", slots=2, cpu=2)], live, NOW, used=used)
    run.pool = VictimPool(running)
    placements, waiting = run.place([QueuedJob("j1", 0, resources=Resources({"cpu": 2}), band=INTERACTIVE),
                                     QueuedJob("j2", 0, resources=Resources({"cpu": 2}), band=INTERACTIVE)])
    assert [p.job_id for p in placements] == ["j1"] and [w.job_id for w in waiting] == ["j2"]
    assert list(run.preempted) == ["j1"]


def test_a_released_preemption_gives_its_victims_back():
    running = [victim("b1", cpu=2)]
    live, used = usage(running)
    run = PlacementRun([peer("p", slots=1, cpu=2)], live, NOW, used=used)
    run.pool = VictimPool(running)
    [placed], _ = run.place([QueuedJob("j1", 0, resources=Resources({"cpu": 2}), band=INTERACTIVE)])
    run.release(placed, {"cpu": 2})
    assert "j1" not in run.preempted
    # The room is the victim's again, and the victim may be chosen again by another job.
    [again], _ = run.place([QueuedJob("j2", 0, resources=Resources({"cpu": 2}), band=INTERACTIVE)])
    assert [v.job_id for v in run.preempted["j2"]] == ["b1"]


def test_a_backend_held_for_another_job_is_not_preempted_on():
    running = [victim("b1", cpu=2)]
    live, used = usage(running)
    run = PlacementRun([peer("p", slots=1, cpu=2)], live, NOW, used=used, reserve_after_s=10)
    # The starving job (band batch: it preempts nothing) holds the backend first.
    _, waiting = run.place([QueuedJob("old", 0, resources=Resources({"cpu": 2}), waited_s=60, band=BATCH)])
    assert waiting[0].holding == ("p", "main")
    run.pool = VictimPool(running)
    placements, waiting = run.place([QueuedJob("j", 0, resources=Resources({"cpu": 2}), band=INTERACTIVE)])
    assert not placements and waiting[0].rule.endswith(f"cannot preempt: {ONLY_HELD}")


def test_a_job_over_its_quota_preempts_nothing():
    running = [victim("b1", cpu=2, user="bob")]
    live, used = usage(running)
    placement = PlacementRun([peer("p", slots=1, cpu=2)], live, NOW, used=used)
    placement.pool = VictimPool(running)
    users = UserTable.of([UserConfig("alice", quota={"cpu": 1}), UserConfig("bob")])
    fair = FairShareRun(placement, users, {"bob": {"cpu": 2000, "slots": 1}})
    placements, waiting = fair.place({"alice": [QueuedJob("a", 0, resources=Resources({"cpu": 2}), band=INTERACTIVE)]})
    assert not placements and waiting[0].code == QUOTA and not placement.preempted


def test_fair_share_moves_the_victims_usage_to_the_preempting_user():
    running = [victim("b1", cpu=2, user="bob")]
    live, used = usage(running)
    placement = PlacementRun([peer("p", slots=1, cpu=2)], live, NOW, used=used)
    placement.pool = VictimPool(running)
    fair = FairShareRun(placement, UserTable.of([]), {"bob": {"cpu": 2000, "slots": 1}})
    placements, _ = fair.place({"alice": [QueuedJob("a", 0, resources=Resources({"cpu": 2}), band=INTERACTIVE)],
                                "carol": []})
    assert placements and fair.held["bob"] == {"cpu": 0, "slots": 0}
    assert fair.held["alice"] == {"cpu": 2000, "slots": 1}


def test_bands_go_before_fair_share():
    # Bob holds nothing (the smallest share) but alice's production job goes first.
    fair = FairShareRun(PlacementRun([peer("p", slots=1)], {}, NOW), UserTable.of([]),
                        {"alice": {"slots": 5}})
    placements, _ = fair.place({"alice": [QueuedJob("a", 0, band=PRODUCTION)],
                                "bob": [QueuedJob("b", 0, band=INTERACTIVE, waited_s=99)]})
    assert [p.job_id for p in placements] == ["a"]


unit_victims = st.lists(
    st.tuples(st.integers(0, 1), st.integers(0, 100), st.integers(1, 4), st.integers(0, 3)),
    min_size=0, max_size=7)


@settings(max_examples=300, deadline=None)
@given(unit_victims, st.integers(0, 4), st.integers(0, 3), st.integers(1, 6), st.integers(0, 4))
def test_victims_are_never_more_than_needed_and_always_enough(specs, free_cpu, free_slots, need_cpu, gpu):
    candidates = sorted((Candidate(f"v{i}", 1, "running", "p", "main", band, since, (("cpu", cpu), ("gpu", g)))
                         for i, (band, since, cpu, g) in enumerate(specs)), key=Candidate.order)
    units = (("cpu", need_cpu), ("gpu", gpu))
    free = {"cpu": free_cpu, "gpu": 0}
    chosen = choose_victims(units, free, free_slots, False, candidates)

    def fits(victims):
        cpu = free_cpu + sum(dict(v.units)["cpu"] for v in victims)
        gpus = sum(dict(v.units)["gpu"] for v in victims)
        return free_slots + len(victims) >= 1 and cpu >= need_cpu and gpus >= gpu

    if chosen is None:
        assert not fits(candidates)
        return
    assert fits(chosen)
    for v in chosen:  # none could be spared
        assert not fits([c for c in chosen if c is not v])
    if len(chosen) > 1:  # a single victim is found whenever one is enough
        assert not any(fits([c]) for c in candidates)


def test_the_worked_example_of_the_scheduling_doc():
    """docs/scheduling.md, "Bands and preemption": the same peers, jobs and answers."""
    at = {"9:50": -600, "10:01": 60, "10:02": 120, "10:03": 180, "10:05": 300}
    running = [victim("b1", "west", since=at["9:50"], cpu=2), victim("b2", "west", since=at["10:05"], cpu=2),
               victim("b3", "east", since=at["10:01"], cpu=1), victim("b4", "east", since=at["10:02"], cpu=1),
               victim("b5", "east", since=at["10:03"], cpu=2)]
    peers = [peer("west", cpu=4), peer("east", cpu=4)]
    run, placements, _ = place(peers, running, QueuedJob("j", 0, resources=Resources({"cpu": 2}), band=INTERACTIVE))
    assert placements[0].peer_id == "west" and [v.job_id for v in run.preempted["j"]] == ["b2"]
    run, placements, _ = place(peers, running, QueuedJob("j", 0, resources=Resources({"cpu": 3}), band=INTERACTIVE))
    assert placements[0].peer_id == "east" and sorted(v.job_id for v in run.preempted["j"]) == ["b4", "b5"]
