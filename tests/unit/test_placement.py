from irisfed.shared.constraints import Constraint, ConstraintOp
from irisfed.shared.federation.peer import Backend, FederationPeer
from irisfed.shared.placement import assign_queued
from irisfed.shared.rooms import QueuedJob, free_slots

NOW = 500.0
GPU = (Constraint("device_type", ConstraintOp.EQ, "gpu"),)


def make_peer(peer_id, total=2, reachable=True, name="main", **attributes):
    attrs = {k: (v,) for k, v in attributes.items()}
    return FederationPeer(
        peer_id, (Backend(name, attrs, total=total, free=total),),
        last_heartbeat_at=NOW - (1 if reachable else 100), ttl_s=6,
    )


def make_job(job_id="j", **overrides):
    fields = {"job_id": job_id, "epoch": 0, "constraints": ()}
    fields.update(overrides)
    return QueuedJob(**fields)


def test_unpinned_job_goes_to_matching_reachable_peer():
    peers = [make_peer("cpu", device_type="cpu"), make_peer("gpu", device_type="gpu")]
    placed, waiting = assign_queued([make_job(constraints=GPU)], peers, {}, NOW)
    assert [(p.peer_id, p.backend) for p in placed] == [("gpu", "main")]
    assert waiting == []


def test_capacity_is_accounted_within_one_tick():
    peers = [make_peer("gpu", total=3, device_type="gpu")]
    jobs = [make_job(f"j{i}", constraints=GPU) for i in range(5)]
    placed, waiting = assign_queued(jobs, peers, {("gpu", "main"): 1}, NOW)
    assert [p.job_id for p in placed] == ["j0", "j1"]
    assert [w.job_id for w in waiting] == ["j2", "j3", "j4"]
    assert "full" in waiting[0].reason
    assert [v.code for v in waiting[0].verdicts] == ["no_free_capacity"]


def test_spreads_to_the_peer_with_most_free_slots():
    peers = [make_peer("a", total=4), make_peer("b", total=4)]
    placed, _ = assign_queued([make_job(f"j{i}") for i in range(4)], peers, {("a", "main"): 2}, NOW)
    assert [p.peer_id for p in placed] == ["b", "b", "a", "b"]


def test_unreachable_peer_gets_no_unpinned_work():
    peers = [make_peer("gpu", reachable=False, device_type="gpu")]
    placed, waiting = assign_queued([make_job(constraints=GPU)], peers, {}, NOW)
    assert placed == [] and "unreachable" in waiting[0].reason
    assert waiting[0].verdicts[0].code == "unreachable"


def test_pinned_job_only_on_its_pin_skipping_capabilities():
    peers = [make_peer("gpu", device_type="gpu"), make_peer("cpu", device_type="cpu")]
    tpu = (Constraint("device_type", ConstraintOp.EQ, "tpu"),)
    placed, _ = assign_queued([make_job(constraints=tpu, pinned_peer_id="gpu")], peers, {}, NOW)
    assert [p.peer_id for p in placed] == ["gpu"]


def test_pinned_job_waits_while_its_peer_is_away():
    peers = [make_peer("gpu", reachable=False), make_peer("cpu")]
    placed, waiting = assign_queued([make_job(pinned_peer_id="gpu")], peers, {}, NOW)
    assert placed == []
    assert "unreachable" in waiting[0].reason
    assert {v.peer_id: v.code for v in waiting[0].verdicts} == {"gpu": "unreachable", "cpu": "not_pinned_peer"}


def test_pinned_job_waits_when_its_peer_is_full_or_bare():
    full = [make_peer("gpu", total=1)]
    _, waiting = assign_queued([make_job(pinned_peer_id="gpu")], full, {("gpu", "main"): 1}, NOW)
    assert waiting[0].rule.startswith("pinned to gpu")
    assert [v.code for v in waiting[0].verdicts] == ["no_free_capacity"]
    bare = [FederationPeer("gpu", (), NOW, 6)]
    _, waiting = assign_queued([make_job(pinned_peer_id="gpu")], bare, {}, NOW)
    assert waiting[0].verdicts[0].code == "no_backends"


def test_avoided_peer_is_a_last_resort():
    peers = [make_peer("a"), make_peer("b", total=1)]
    placed, _ = assign_queued([make_job(avoid_peers=frozenset({"a"}))], peers, {}, NOW)
    assert placed[0].peer_id == "b"
    # b is full but matches: wait for b rather than go back to a.
    _, waiting = assign_queued([make_job(avoid_peers=frozenset({"a"}))], peers, {("b", "main"): 1}, NOW)
    assert {v.peer_id: v.code for v in waiting[0].verdicts} == {"a": "avoided", "b": "no_free_capacity"}
    # Only avoided peers match: better to run there again than never.
    placed, _ = assign_queued([make_job(avoid_peers=frozenset({"a", "b"}))], peers, {}, NOW)
    assert placed[0].peer_id == "a"


def test_a_backend_over_its_slots_owes_them_before_anything_fits():
    assert free_slots([make_peer("a", total=1)], {("a", "main"): 5}) == {("a", "main"): -4}
    placed, waiting = assign_queued([make_job()], [make_peer("a", total=1)], {("a", "main"): 5}, NOW)
    assert placed == [] and [w.job_id for w in waiting] == ["j"]
    # Four of the five ending still leave it full: its one slot is taken.
    placed, _ = assign_queued([make_job()], [make_peer("a", total=1)], {("a", "main"): 1}, NOW)
    assert placed == []
    placed, _ = assign_queued([make_job()], [make_peer("a", total=1)], {("a", "main"): 0}, NOW)
    assert [p.peer_id for p in placed] == ["a"]


def test_waiting_explains_missing_attributes_and_mismatches():
    peers = [make_peer("cpu", device_type="cpu"), make_peer("plain")]
    plain = FederationPeer("plain", (Backend("main", {"region": ("eu",)}, 1, 1),), NOW, 6)
    _, waiting = assign_queued([make_job(constraints=GPU)], [peers[0], plain], {}, NOW)
    codes = {v.peer_id: v.code for v in waiting[0].verdicts}
    assert codes == {"cpu": "value_mismatch", "plain": "missing_attribute"}
    assert waiting[0].rule.startswith("no reachable peer matches")


def test_heap_placement_agrees_with_a_linear_scan():
    """The fast path must choose exactly what 'most free slots, then ids' says."""
    import random

    rng = random.Random(7)
    peers = [make_peer(f"p{i:02d}", total=rng.randint(0, 6)) for i in range(30)]
    live = {(p.peer_id, "main"): rng.randint(0, 3) for p in peers}
    jobs = [make_job(f"j{i}") for i in range(120)]
    placed, waiting = assign_queued(jobs, peers, live, NOW)
    slots = {(p.peer_id, "main"): max(0, p.backends[0].total - live[(p.peer_id, "main")]) for p in peers}
    expected = []
    for _ in jobs:
        options = [(-free, key) for key, free in slots.items() if free > 0]
        if not options:
            break
        _, key = min(options)
        slots[key] -= 1
        expected.append(key[0])
    assert [p.peer_id for p in placed] == expected
    assert len(placed) + len(waiting) == len(jobs)


# ---------------------------------------------------------------- resources (docs/design.md §3.1, docs/scheduling.md)

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from irisfed.shared.holds import explain_waiting  # noqa: E402
from irisfed.shared.resources import Amount, Resources  # noqa: E402
from irisfed.shared.rooms import Hold, add_usage  # noqa: E402


def sized_peer(peer_id, name="main", slots=100, reachable=True, attributes=None, **resources):
    """A peer with one backend advertising ``resources`` (name → total, or (total, free))."""
    offered = {k: Amount(*v) if isinstance(v, tuple) else Amount(v, v) for k, v in resources.items()}
    attrs = {k: (v,) for k, v in (attributes or {}).items()}
    return FederationPeer(peer_id, (Backend(name, attrs, total=slots, free=slots, resources=offered),),
                          last_heartbeat_at=NOW - (1 if reachable else 100), ttl_s=6)


def job(job_id, resources=None, **overrides):
    return make_job(job_id, resources=Resources(resources) if resources is not None else Resources(), **overrides)


def test_places_only_where_every_resource_fits_and_accounts_within_the_run():
    peers = [sized_peer("a", cpu=4, memory_mb=8192)]
    jobs = [job(f"j{i}", {"cpu": 1, "memory_mb": 4096}) for i in range(3)]
    placed, waiting = assign_queued(jobs, peers, {}, NOW)
    assert [p.job_id for p in placed] == ["j0", "j1"]
    verdict = waiting[0].verdicts[0]
    assert verdict.code == "no_free_capacity"
    assert verdict.detail == "matches but is short now: memory: asked 4.0 GiB, 0 free (backend main)"
    assert [tuple(s) for s in verdict.shortfalls] == [("memory_mb", 4096, 0, "main")]
    assert waiting[0].rule == "matching peers are full; waiting for free memory_mb"


def test_a_resource_the_backend_does_not_list_counts_as_none():
    peers = [sized_peer("cpu-box", cpu=64)]
    placed, waiting = assign_queued([job("g", {"gpu": 1})], peers, {}, NOW)
    assert placed == []
    assert waiting[0].verdicts[0].code == "insufficient_resources"
    assert waiting[0].verdicts[0].detail == "gpu: asked 1, at most 0 (backend main)"
    assert waiting[0].rule.startswith("no reachable matching backend can ever hold it")


def test_slots_still_cap_a_backend_with_resources():
    peers = [sized_peer("a", slots=2, cpu=64)]
    placed, waiting = assign_queued([job(f"j{i}") for i in range(3)], peers, {("a", "main"): 1}, NOW)
    assert len(placed) == 1
    assert waiting[0].verdicts[0].detail == "matches but has no free slot"


def test_fractional_cpu_adds_up_exactly():
    peers = [sized_peer("a", cpu=1)]
    placed, waiting = assign_queued([job(f"j{i}", {"cpu": 0.1}) for i in range(11)], peers, {}, NOW)
    assert len(placed) == 10 and [w.job_id for w in waiting] == ["j10"]


def test_free_comes_from_used_when_given_else_from_the_advertisement():
    peers = [sized_peer("a", cpu=(8, 2))]  # advertises 2 of 8 free
    placed, _ = assign_queued([job(f"j{i}") for i in range(8)], peers, {}, NOW)
    assert len(placed) == 2
    placed, _ = assign_queued([job(f"j{i}") for i in range(8)], peers, {}, NOW, used={("a", "main"): {"cpu": 3}})
    assert len(placed) == 5


def test_pack_picks_the_best_fit_and_spread_the_most_free():
    peers = [sized_peer("a", cpu=8), sized_peer("b", cpu=8), sized_peer("c", cpu=4)]
    used = {("a", "main"): {"cpu": 5}, ("b", "main"): {"cpu": 1}}  # free: a 3, b 7, c 4
    packed, _ = assign_queued([job("j", {"cpu": 3})], peers, {}, NOW, used=used)
    assert packed[0].peer_id == "a"  # leaves a empty: 0/8
    spread, _ = assign_queued([job("j", {"cpu": 3})], peers, {}, NOW, used=used, policy="spread")
    assert spread[0].peer_id == "b"  # leaves 4/8, more than c's 1/4
    # Normalised per resource: b and c keep one cpu each, but that is 1/8 of b and 1/4 of c.
    used = {("b", "main"): {"cpu": 6}, ("c", "main"): {"cpu": 2}}
    packed, _ = assign_queued([job("j")], peers[1:], {}, NOW, used=used)
    assert packed[0].peer_id == "b"
    spread, _ = assign_queued([job("j")], peers[1:], {}, NOW, used=used, policy="spread")
    assert spread[0].peer_id == "c"


def test_pack_fills_one_backend_before_the_next():
    peers = [sized_peer("a", cpu=4), sized_peer("b", cpu=4)]
    placed, _ = assign_queued([job(f"j{i}") for i in range(6)], peers, {}, NOW, used={("b", "main"): {"cpu": 1}})
    assert [p.peer_id for p in placed] == ["b", "b", "b", "a", "a", "a"]
    placed, _ = assign_queued([job(f"j{i}") for i in range(6)], peers, {}, NOW, used={("b", "main"): {"cpu": 1}},
                              policy="spread")
    # Equal shares left: the most free slots, then ids, break the tie.
    assert [p.peer_id for p in placed] == ["a", "b", "a", "b", "a", "b"]


def test_pack_keeps_scarce_resources_free_for_the_jobs_that_need_them():
    # Both empty: a cpu job packs onto the box without GPUs, whose free GPUs would count as left over.
    peers = [sized_peer("gpu-box", cpu=16, gpu=4), sized_peer("cpu-box", cpu=16)]
    placed, _ = assign_queued([job("c"), job("g", {"gpu": 1})], peers, {}, NOW)
    assert [(p.job_id, p.peer_id) for p in placed] == [("c", "cpu-box"), ("g", "gpu-box")]


def test_unknown_policy_is_an_error():
    with pytest.raises(ValueError, match="unknown placement policy 'fifo'"):
        assign_queued([], [], {}, NOW, policy="fifo")


def test_preferences_rank_before_fit_and_never_reject():
    zone_b = (Constraint("zone", ConstraintOp.EQ, "b"),)
    peers = [sized_peer("a", cpu=8, attributes={"zone": "a"}), sized_peer("b", cpu=8, attributes={"zone": "b"})]
    used = {("a", "main"): {"cpu": 7}}  # pack alone would choose a
    placed, _ = assign_queued([job("j", preferences=zone_b)], peers, {}, NOW, used=used)
    assert placed[0].peer_id == "b"
    # More preferences satisfied wins; none satisfiable still places.
    two = zone_b + (Constraint("ssd", ConstraintOp.EXISTS),)
    peers.append(sized_peer("c", cpu=8, attributes={"zone": "b", "ssd": "yes"}))
    placed, _ = assign_queued([job("j", preferences=two)], peers, {}, NOW, used=used)
    assert placed[0].peer_id == "c"
    nowhere = (Constraint("zone", ConstraintOp.EQ, "mars"),)
    placed, waiting = assign_queued([job("j", preferences=nowhere)], peers, {}, NOW, used=used)
    assert placed[0].peer_id == "a" and waiting == []


def test_preferences_apply_to_legacy_backends_too():
    peers = [make_peer("a", total=4, zone="a"), make_peer("b", total=1, zone="b")]
    placed, _ = assign_queued([job("j", preferences=(Constraint("zone", ConstraintOp.EQ, "b"),))], peers, {}, NOW)
    assert placed[0].peer_id == "b"


def test_legacy_heartbeats_still_place_alongside_resource_backends():
    legacy = make_peer("old", total=2)
    modern = sized_peer("new", cpu=1)
    placed, waiting = assign_queued([job(f"j{i}") for i in range(4)], [legacy, modern], {}, NOW)
    # The backend whose shape is known first, then the older agent by its slots.
    assert [p.peer_id for p in placed] == ["new", "old", "old"]
    assert [v.code for v in waiting[0].verdicts] == ["no_free_capacity", "no_free_capacity"]
    # An older agent's shape is unknown: any request takes just a slot there.
    placed, _ = assign_queued([job("big", {"gpu": 8, "memory_mb": 10**6})], [legacy], {}, NOW)
    assert placed[0].peer_id == "old"


def test_pinned_job_needs_room_on_its_pin():
    peers = [sized_peer("tiny", cpu=2), sized_peer("big", cpu=64)]
    placed, waiting = assign_queued([job("p", {"cpu": 4}, pinned_peer_id="tiny")], peers, {}, NOW)
    assert placed == []
    assert waiting[0].rule == "pinned to tiny, whose backends can never hold it as advertised; waiting for more"
    assert {v.peer_id: v.code for v in waiting[0].verdicts} == {"tiny": "insufficient_resources",
                                                               "big": "not_pinned_peer"}
    _, waiting = assign_queued([job("p", {"cpu": 2}, pinned_peer_id="tiny")], peers, {}, NOW,
                               used={("tiny", "main"): {"cpu": 1}})
    assert waiting[0].rule == "pinned to tiny; waiting for it to be reachable with free cpu"
    placed, _ = assign_queued([job("p", {"cpu": 2}, pinned_peer_id="tiny")], peers, {}, NOW)
    assert placed[0].peer_id == "tiny"


def test_avoided_peers_are_a_last_resort_only_when_no_other_could_ever_hold_it():
    peers = [sized_peer("a", cpu=8), sized_peer("b", cpu=2)]
    placed, _ = assign_queued([job("j", {"cpu": 4}, avoid_peers=frozenset({"a"}))], peers, {}, NOW)
    assert placed[0].peer_id == "a"  # b can never hold 4 cpus
    _, waiting = assign_queued([job("j", {"cpu": 2}, avoid_peers=frozenset({"a"}))], peers, {}, NOW,
                               used={("b", "main"): {"cpu": 1}})
    assert {v.peer_id: v.code for v in waiting[0].verdicts} == {"a": "avoided", "b": "no_free_capacity"}


def test_waiting_explanations_distinguish_too_small_full_and_unreachable():
    peers = [sized_peer("small", cpu=2), sized_peer("busy", cpu=16), sized_peer("gone", cpu=64, reachable=False)]
    _, waiting = assign_queued([job("j", {"cpu": 8})], peers, {}, NOW, used={("busy", "main"): {"cpu": 12}})
    by_peer = {v.peer_id: v for v in waiting[0].verdicts}
    assert by_peer["small"].code == "insufficient_resources"
    assert by_peer["small"].detail == "cpu: asked 8, at most 2 (backend main)"
    assert by_peer["busy"].code == "no_free_capacity"
    assert by_peer["busy"].detail == "matches but is short now: cpu: asked 8, 4 free (backend main)"
    assert by_peer["gone"].code == "unreachable"
    assert waiting[0].rule == "matching peers are full; waiting for free cpu"


def test_explain_waiting_keeps_its_signature():
    why = explain_waiting(make_job(), [make_peer("a", total=1)], {("a", "main"): 0}, NOW)
    assert [v.code for v in why.verdicts] == ["no_free_capacity"]
    why = explain_waiting(job("j", {"cpu": 4}), [sized_peer("a", cpu=8)], {("a", "main"): 3}, NOW,
                          used={("a", "main"): {"cpu": 6}})
    assert why.verdicts[0].detail == "matches but is short now: cpu: asked 4, 2 free (backend main)"


def test_add_usage_keeps_used_in_step_with_placements():
    used: dict = {}
    add_usage(used, ("a", "main"), Resources({"cpu": 0.5, "gpu": 1}))
    add_usage(used, ("a", "main"), Resources({"cpu": 0.5, "gpu": 1}))
    add_usage(used, ("a", "main"), Resources({"cpu": 0.5, "gpu": 1}), sign=-1)
    assert used == {("a", "main"): {"cpu": 0.5, "gpu": 1}}


# ---------------------------------------------------------------- anti-starvation


def test_a_starving_job_holds_the_backend_where_it_would_fit_soonest():
    peers = [sized_peer("a", cpu=8), sized_peer("b", cpu=8), sized_peer("small", cpu=2)]
    used = {("a", "main"): {"cpu": 6}, ("b", "main"): {"cpu": 3}, ("small", "main"): {"cpu": 1}}
    jobs = [job("big", {"cpu": 8}, waited_s=400)] + [job(f"s{i}") for i in range(6)]
    placed, waiting = assign_queued(jobs, peers, {}, NOW, used=used)
    # b lacks 3 of 8 cpus, a 6 of 8: b is held. Small jobs go to a and small, never to b.
    assert waiting[0].job_id == "big" and waiting[0].holding == ("b", "main")
    assert "backend main of b is held for it (waiting 300s or more)" in waiting[0].rule
    assert {p.peer_id for p in placed} == {"a", "small"}
    assert len(placed) == 3
    held = {v.peer_id: v for v in waiting[-1].verdicts}["b"]
    assert held.code == "held" and held.detail == "backend main held for big, waiting longer"


def test_no_hold_before_the_threshold_or_when_disabled():
    peers = [sized_peer("a", cpu=8)]
    used = {("a", "main"): {"cpu": 4}}
    jobs = [job("big", {"cpu": 8}, waited_s=299), job("s")]
    placed, waiting = assign_queued(jobs, peers, {}, NOW, used=used)
    assert [p.job_id for p in placed] == ["s"] and waiting[0].holding is None
    jobs = [job("big", {"cpu": 8}, waited_s=10**6), job("s")]
    placed, _ = assign_queued(jobs, peers, {}, NOW, used=used, reserve_after_s=None)
    assert [p.job_id for p in placed] == ["s"]
    placed, _ = assign_queued(jobs, peers, {}, NOW, used=used, reserve_after_s=60)
    assert placed == []


def test_a_hold_lets_through_work_that_leaves_the_held_job_its_share():
    # The big job lacks GPUs on the held backend; cpu-only work may still use the cpus it does not need.
    peers = [sized_peer("a", cpu=16, gpu=4)]
    used = {("a", "main"): {"cpu": 2, "gpu": 2}}
    jobs = [job("big", {"cpu": 8, "gpu": 4}, waited_s=1000), job("c1", {"cpu": 4}), job("c2", {"cpu": 4}),
            job("g", {"cpu": 1, "gpu": 1})]
    placed, waiting = assign_queued(jobs, peers, {}, NOW, used=used)
    assert [p.job_id for p in placed] == ["c1"]  # 14 free - 4 = 10 ≥ 8; c2 would leave 6 < 8
    assert [w.job_id for w in waiting] == ["big", "c2", "g"]
    assert {v.code for w in waiting[1:] for v in w.verdicts} == {"held"}


def test_one_hold_per_backend_the_longest_waiting_job_keeps_it():
    peers = [sized_peer("a", cpu=8), sized_peer("b", cpu=8)]
    used = {("a", "main"): {"cpu": 2}, ("b", "main"): {"cpu": 4}}
    jobs = [job("big1", {"cpu": 8}, waited_s=900), job("big2", {"cpu": 8}, waited_s=800),
            job("big3", {"cpu": 8}, waited_s=700), job("s")]
    placed, waiting = assign_queued(jobs, peers, {}, NOW, used=used)
    assert [w.holding for w in waiting] == [("a", "main"), ("b", "main"), None, None]
    assert placed == []


def test_holds_carry_across_the_batches_of_one_run():
    peers = [sized_peer("a", cpu=8)]
    used = {("a", "main"): {"cpu": 4}}
    held: dict = {}
    _, waiting = assign_queued([job("big", {"cpu": 8}, waited_s=1000)], peers, {}, NOW, used=used,
                               reservations=held)
    assert held == {("a", "main"): Hold("big", {"cpu": 8000})}
    placed, waiting = assign_queued([job("s")], peers, {}, NOW, used=used, reservations=held)
    assert placed == [] and waiting[0].verdicts[0].code == "held"
    assert waiting[0].rule == "matching peers are held for jobs that have waited longer; waiting"


def test_a_pinned_starving_job_holds_on_its_pin():
    peers = [sized_peer("a", cpu=8), sized_peer("b", cpu=8)]
    used = {("a", "main"): {"cpu": 6}}
    jobs = [job("big", {"cpu": 8}, pinned_peer_id="a", waited_s=1000), job("s1", {"cpu": 2}),
            job("s2", {"cpu": 2}, pinned_peer_id="a")]
    placed, waiting = assign_queued(jobs, peers, {}, NOW, used=used)
    assert waiting[0].holding == ("a", "main")
    assert [(p.job_id, p.peer_id) for p in placed] == [("s1", "b")]
    assert waiting[1].job_id == "s2" and waiting[1].verdicts[0].code == "held"


def simulate(reserve_after_s, runs=30):
    """A big job (4 cpus) at the head of the queue, a stream of small ones (1 cpu) behind it.

    The farm has 8 cpus, all busy with small jobs finishing two a run; each run (60 s
    apart) two new small jobs arrive, and each small job runs four runs. The queue is
    placed oldest first. Returns the run the big job was placed in (None: never).
    """
    peers = [sized_peer("farm", cpu=8)]
    one = Resources({"cpu": 1})
    running = [1 + k // 2 for k in range(8)]  # the run each finishes in
    queue = [("big", 0.0, Resources({"cpu": 4}))]
    arrived = 0
    for run in range(1, runs + 1):
        now_s = run * 60.0
        running = [finish for finish in running if finish > run]
        for _ in range(2):
            queue.append((f"s{arrived}", now_s, one))
            arrived += 1
        used: dict = {}
        for _ in running:
            add_usage(used, ("farm", "main"), one)
        jobs = [make_job(job_id, resources=res, waited_s=now_s - since) for job_id, since, res in queue]
        placed, waiting = assign_queued(jobs, peers, {("farm", "main"): len(running)}, NOW, used=used,
                                        reserve_after_s=reserve_after_s)
        done = {p.job_id for p in placed}
        if "big" in done:
            return run
        running += [run + 4 for job_id in done]
        queue = [entry for entry in queue if entry[0] not in done]
    return None


def test_a_big_job_is_starved_by_a_stream_of_small_ones_without_holds():
    assert simulate(reserve_after_s=None) is None


def test_a_big_job_behind_a_stream_of_small_ones_runs_once_its_backend_drains():
    # Waiting 300 s at run 5, it holds the farm: the small jobs that finish are not
    # replaced, and at run 6 four cpus are free for it.
    assert simulate(reserve_after_s=300) == 6


# ---------------------------------------------------------------- properties


RESOURCE_NAMES = ("cpu", "memory_mb", "gpu")
KIND_CONSTRAINTS = ((), GPU, (Constraint("zone", ConstraintOp.EQ, "a"),))


@st.composite
def federations(draw):
    peers, live, used = [], {}, {}
    for i in range(draw(st.integers(1, 6))):
        attrs = {"device_type": (draw(st.sampled_from(["gpu", "cpu"])),), "zone": (draw(st.sampled_from("ab")),)}
        backends = []
        for b in range(draw(st.integers(1, 2))):
            slots = draw(st.integers(0, 6))
            legacy = draw(st.integers(0, 3)) == 0
            resources = {} if legacy else {
                name: Amount(total, draw(st.integers(0, total)))
                for name in draw(st.lists(st.sampled_from(RESOURCE_NAMES), unique=True, max_size=3))
                for total in [draw(st.integers(0, 16))]
            }
            backends.append(Backend(f"b{b}", attrs, total=slots, free=slots, resources=resources))
            live[(f"p{i}", f"b{b}")] = draw(st.integers(0, 3))
            if resources and draw(st.booleans()):
                used[(f"p{i}", f"b{b}")] = {name: draw(st.integers(0, 20)) for name in resources}
        peers.append(FederationPeer(f"p{i}", tuple(backends), last_heartbeat_at=NOW - draw(st.sampled_from([1, 100])),
                                    ttl_s=6))
    return peers, live, used


@st.composite
def queues(draw, peer_ids):
    jobs = []
    for i in range(draw(st.integers(0, 25))):
        shape = draw(st.dictionaries(st.sampled_from(RESOURCE_NAMES + ("tpu",)),
                                     st.integers(0, 6), max_size=3))
        if "cpu" in shape and draw(st.booleans()):
            shape["cpu"] = shape["cpu"] / 4
        jobs.append(make_job(
            f"j{i}", resources=Resources(shape), constraints=draw(st.sampled_from(KIND_CONSTRAINTS)),
            pinned_peer_id=draw(st.sampled_from([None, None, None, *peer_ids])),
            avoid_peers=frozenset(draw(st.lists(st.sampled_from(peer_ids), max_size=1))),
            preferences=draw(st.sampled_from([(), (Constraint("zone", ConstraintOp.EQ, "b"),)])),
            waited_s=draw(st.sampled_from([0, 1000])),
        ))
    return jobs


def reachable_offers(peers):
    """``((peer, backend), backend, offered)`` of each backend of a peer reachable at NOW,
    ``offered`` its units per resource (name → (total, free))."""
    from irisfed.shared.resources import offer_units

    for peer in peers:
        if peer.is_reachable(NOW):
            for b in peer.backends:
                yield (peer.peer_id, b.name), b, offer_units(b.resources)


def free_at_start(peers, live, used):
    """Per (peer, backend): free slots, and free units per resource (None: the backend advertises none)."""
    from irisfed.shared.resources import to_units

    free = {}
    for key, b, offered in reachable_offers(peers):
        if not offered:
            units = None
        elif used is not None:  # what live jobs use (none when not named) comes off the totals
            units = {n: max(0, t - to_units(n, used.get(key, {}).get(n, 0))) for n, (t, _) in offered.items()}
        else:
            units = {n: f for n, (_, f) in offered.items()}
        free[key] = (max(0, b.total - live.get(key, 0)), units)
    return free


def draw_placement(data):
    """A federation, its queue and a policy, and what live jobs use or None (not named)."""
    peers, live, used = data.draw(federations())
    jobs = data.draw(queues([p.peer_id for p in peers]))
    policy = data.draw(st.sampled_from(["pack", "spread"]))
    return peers, live, used if data.draw(st.booleans()) else None, jobs, policy


def assert_within_free(placements, by_id, free):
    """Per backend, ``placements`` take no more slots, nor units of any resource, than ``free``."""
    taken: dict = {}
    for p in placements:
        key = (p.peer_id, p.backend)
        assert key in free, "placed on an unreachable or unknown backend"
        slots_taken, units_taken = taken.setdefault(key, [0, {}])
        taken[key][0] += 1
        for name, amount in by_id[p.job_id].resources.units:
            units_taken[name] = units_taken.get(name, 0) + amount
    for key, (slots_taken, units_taken) in taken.items():
        slots_free, units_free = free[key]
        assert slots_taken <= slots_free
        if units_free is not None:
            for name, amount in units_taken.items():
                assert amount <= units_free.get(name, 0), (key, name)


@given(st.data())
@settings(max_examples=100, deadline=None)
def test_placements_never_exceed_what_is_free_in_any_dimension(data):
    peers, live, used, jobs, policy = draw_placement(data)
    placed, waiting = assign_queued(jobs, peers, live, NOW, used=used, policy=policy)
    assert sorted([p.job_id for p in placed] + [w.job_id for w in waiting]) == sorted(j.job_id for j in jobs)
    free = free_at_start(peers, live, used)
    by_id = {j.job_id: j for j in jobs}
    assert_within_free(placed, by_id, free)
    for p in placed:
        j = by_id[p.job_id]
        backend = next(b for peer in peers if peer.peer_id == p.peer_id for b in peer.backends if b.name == p.backend)
        if j.pinned_peer_id:
            assert p.peer_id == j.pinned_peer_id
        else:
            assert all(c.holds_for(backend.attributes) for c in j.constraints)


def reference_placement(jobs, peers, live, used, policy):
    """A slow, obvious implementation of the documented ranking (no holds), to check the heaps against."""
    from irisfed.shared.resources import to_units

    sign = 1.0 if policy == "pack" else -1.0
    state = {}
    for key, b, offered in reachable_offers(peers):
        total = {n: t for n, (t, _) in offered.items()}
        free = ({n: t - to_units(n, used.get(key, {}).get(n, 0)) for n, t in total.items()}
                if used is not None else {n: f for n, (_, f) in offered.items()})
        state[key] = {"b": b, "slots": max(0, b.total - live.get(key, 0)), "total": total, "free": free,
                      "legacy": not offered}
    out = []
    for j in jobs:
        units = j.resources.units
        best = None
        for key, s in state.items():
            b = s["b"]
            if not all(c.holds_for(b.attributes) for c in j.constraints):
                continue
            if not s["legacy"] and any(s["total"].get(n, 0) < u for n, u in units):
                continue
            if s["slots"] <= 0 or (not s["legacy"] and any(s["free"].get(n, 0) < u for n, u in units)):
                continue
            inv = tuple((n, 1.0 / t) for n, t in s["total"].items() if t > 0)
            left = 0.0
            for n, i in inv:
                left += s["free"][n] * i
            ask = sum(u * dict(inv).get(n, 0.0) for n, u in units)
            fit = sign * (left - ask) if not s["legacy"] else 0.0
            prefs = -sum(1 for p in j.preferences if p.holds_for(b.attributes))
            rank = (prefs, s["legacy"], fit, -s["slots"], key[0], key[1])
            if best is None or rank < best[0]:
                best = (rank, key)
        if best is None:
            continue
        s = state[best[1]]
        s["slots"] -= 1
        if not s["legacy"]:
            for n, u in units:
                s["free"][n] -= u
        out.append((j.job_id, *best[1]))
    return out


@given(st.data())
@settings(max_examples=100, deadline=None)
def test_heaps_choose_exactly_what_the_documented_ranking_says(data):
    peers, live, used = data.draw(federations())
    jobs = [j._replace(pinned_peer_id=None, avoid_peers=frozenset())
            for j in data.draw(queues([p.peer_id for p in peers]))]
    policy = data.draw(st.sampled_from(["pack", "spread"]))
    use_used = data.draw(st.booleans())
    placed, _ = assign_queued(jobs, peers, live, NOW, used=used if use_used else None, policy=policy,
                              reserve_after_s=None)
    expected = reference_placement(jobs, peers, live, used if use_used else None, policy)
    assert [(p.job_id, p.peer_id, p.backend) for p in placed] == expected


def test_explanations_carry_the_shortfalls_for_explain():
    import json

    from irisfed.shared.explain import PEER_CODES, explanation

    peers = [sized_peer("small", name="slurm", cpu=64, gpu=4), sized_peer("busy", cpu=64, gpu=8)]
    _, waiting = assign_queued([job("j", {"gpu": 8})], peers, {}, NOW, used={("busy", "main"): {"gpu": 6}})
    doc = explanation("tick", waiting[0].rule, waiting[0].verdicts)
    json.dumps(doc)
    assert doc["peers"] == [
        {"peer_id": "small", "code": "insufficient_resources", "detail": "gpu: asked 8, at most 4 (backend slurm)",
         "short": [{"resource": "gpu", "asked": 8, "available": 4, "backend": "slurm"}]},
        {"peer_id": "busy", "code": "no_free_capacity",
         "detail": "matches but is short now: gpu: asked 8, 2 free (backend main)",
         "short": [{"resource": "gpu", "asked": 8, "available": 2, "backend": "main"}]},
    ]
    assert {"insufficient_resources", "held"} <= set(PEER_CODES)
    plain = explanation("tick", "r", [waiting[0].verdicts[0].__class__("p", "unreachable", "gone")])
    assert "short" not in plain["peers"][0]


def test_a_job_is_never_blocked_by_its_own_hold():
    # A caller reusing reservations beyond one run must not lock the held job out.
    peers = [sized_peer("a", cpu=8)]
    held = {("a", "main"): Hold("big", {"cpu": 8000})}
    placed, _ = assign_queued([job("big", {"cpu": 8}, waited_s=1000), job("s")], peers, {}, NOW, reservations=held)
    assert [p.job_id for p in placed] == ["big"]
    _, waiting = assign_queued([job("big", {"cpu": 8}, waited_s=1000)], peers, {}, NOW, reservations=held,
                               used={("a", "main"): {"cpu": 1}})
    assert waiting[0].holding == ("a", "main") and len(held) == 1


# ---------------------------------------------------------------- one run, many batches (PlacementRun)

from irisfed.shared.placement import PlacementRun  # noqa: E402
from irisfed.shared.rooms import Placement  # noqa: E402


def split(draw, jobs):
    """``jobs`` cut into consecutive batches at drawn points (empty batches included)."""
    cuts = sorted(draw(st.lists(st.integers(0, len(jobs)), max_size=4)))
    return [jobs[a:b] for a, b in zip([0, *cuts], [*cuts, len(jobs)], strict=True)]


@given(st.data())
@settings(max_examples=80, deadline=None)
def test_a_run_placed_in_batches_places_exactly_what_one_call_does(data):
    peers, live, used, jobs, policy = draw_placement(data)
    held_once: dict = {}
    placed, waiting = assign_queued(jobs, peers, live, NOW, used=used, policy=policy, reservations=held_once)
    held_run: dict = {}
    run = PlacementRun(peers, live, NOW, used=used, policy=policy, reservations=held_run)
    placed_run, waiting_run = [], []
    for batch in split(data.draw, jobs):
        p, w = run.place(batch)
        placed_run += p
        waiting_run += w
    assert placed_run == placed
    assert waiting_run == waiting  # rules, verdicts and holds too
    assert held_run == held_once


def test_a_run_never_reads_live_or_used_again():
    peers = [sized_peer("a", slots=3, cpu=4)]
    live, used = {("a", "main"): 1}, {("a", "main"): {"cpu": 1}}
    run = PlacementRun(peers, live, NOW, used=used)
    placed, _ = run.place([job("j0", {"cpu": 2})])
    assert [p.job_id for p in placed] == ["j0"] and run.has_room()
    assert live == {("a", "main"): 1} and used == {("a", "main"): {"cpu": 1}}  # not written
    placed, waiting = run.place([job("j1", {"cpu": 2}), job("j2", {"cpu": 1})])
    assert [p.job_id for p in placed] == ["j2"]  # 1 cpu left after j0: j1 waits
    assert waiting[0].verdicts[0].detail == "matches but is short now: cpu: asked 2, 1 free (backend main)"
    assert not run.has_room()  # 3 slots: 1 live, j0, j2


def test_release_gives_the_room_back_to_later_batches():
    peers = [sized_peer("a", slots=2, cpu=4), sized_peer("b", slots=5, cpu=2)]
    run = PlacementRun(peers, {}, NOW, used={})
    first, _ = run.place([job("big", {"cpu": 4}), job("s1")])
    assert [(p.job_id, p.peer_id) for p in first] == [("big", "a"), ("s1", "b")]
    # a is out of cpus: a job of the same kind waits, its kind's heap drops a, its wait is explained.
    _, waiting = run.place([job("big2", {"cpu": 4})])
    assert waiting[0].rule == "matching peers are full; waiting for free cpu"
    run.release(first[0], Resources({"cpu": 4}))  # big's compare-and-set lost
    placed, waiting = run.place([job("big3", {"cpu": 4}), job("big4", {"cpu": 4})])
    assert [(p.job_id, p.peer_id) for p in placed] == [("big3", "a")]
    assert waiting[0].job_id == "big4" and waiting[0].verdicts[0].code == "no_free_capacity"
    # Slots come back too (a legacy backend counts only slots).
    legacy = PlacementRun([make_peer("old", total=1)], {}, NOW)
    one, _ = legacy.place([job("x")])
    assert not legacy.has_room()
    legacy.release(one[0])
    assert legacy.has_room()
    assert [p.job_id for p in legacy.place([job("y")])[0]] == ["y"]
    # A placement on a backend the run does not know (gone since) is ignored.
    legacy.release(Placement("z", 0, "nowhere", "main"))


def test_release_lets_a_held_backend_take_its_job():
    peers = [sized_peer("a", cpu=8)]
    run = PlacementRun(peers, {}, NOW, used={})
    small, _ = run.place([job("s", {"cpu": 6})])
    _, waiting = run.place([job("big", {"cpu": 8}, waited_s=1000)])
    assert waiting[0].holding == ("a", "main")
    run.release(small[0], Resources({"cpu": 6}))
    # The hold stays for the run; released room fits the held job (here, one requeued in a later batch).
    placed, _ = run.place([job("other", {"cpu": 1}), job("big", {"cpu": 8}, waited_s=1000)])
    assert [p.job_id for p in placed] == ["big"]


def apply(placements, jobs, live, used):
    """``live`` and ``used`` with ``placements`` added, as the tick counted them before PlacementRun."""
    live, used = dict(live), {key: dict(amounts) for key, amounts in used.items()}
    by_id = {j.job_id: j for j in jobs}
    for p in placements:
        key = (p.peer_id, p.backend)
        live[key] = live.get(key, 0) + 1
        add_usage(used, key, by_id[p.job_id].resources)
    return live, used


@given(st.data())
@settings(max_examples=80, deadline=None)
def test_after_releases_a_batch_places_as_a_fresh_run_with_what_was_kept(data):
    # A run that gave back some placements places the next batch exactly as a fresh
    # call that counts only the kept ones as live (the holds carried over).
    peers, live, used = data.draw(federations())
    ids = [p.peer_id for p in peers]
    first = data.draw(queues(ids))
    second = [j._replace(job_id=f"next-{j.job_id}") for j in data.draw(queues(ids))]
    policy = data.draw(st.sampled_from(["pack", "spread"]))
    held: dict = {}
    run = PlacementRun(peers, live, NOW, used=used, policy=policy, reservations=held)
    placed, _ = run.place(first)
    lost = data.draw(st.lists(st.sampled_from(placed), unique=True)) if placed else []
    by_id = {j.job_id: j for j in first}
    for p in lost:
        run.release(p, by_id[p.job_id].resources)
    kept_live, kept_used = apply([p for p in placed if p not in lost], first, live, used)
    expected = assign_queued(second, peers, kept_live, NOW, used=kept_used, policy=policy,
                             reservations=dict(held))
    got = run.place(second)
    assert got[0] == expected[0]
    assert [(w.job_id, w.holding) for w in got[1]] == [(w.job_id, w.holding) for w in expected[1]]
    if lost:  # explanations are recomputed after a release, so they agree too
        assert got[1] == expected[1]


@given(st.data())
@settings(max_examples=100, deadline=None)
def test_placements_never_exceed_what_is_free_across_batches_and_releases(data):
    peers, live, used, jobs, policy = draw_placement(data)
    run = PlacementRun(peers, live, NOW, used=used, policy=policy)
    free = free_at_start(peers, live, used)
    by_id = {j.job_id: j for j in jobs}
    kept: list = []
    for batch in split(data.draw, jobs):
        placed, waiting = run.place(batch)
        assert sorted([p.job_id for p in placed] + [w.job_id for w in waiting]) == sorted(j.job_id for j in batch)
        kept += placed
        if kept and data.draw(st.booleans()):
            lost = data.draw(st.sampled_from(kept))
            run.release(lost, by_id[lost.job_id].resources)
            kept.remove(lost)
        assert_within_free(kept, by_id, free)
    assert run.has_room() == any(slots - sum(1 for p in kept if (p.peer_id, p.backend) == key) > 0
                                 for key, (slots, _) in free.items())
