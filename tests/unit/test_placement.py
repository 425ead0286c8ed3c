from shared.constraints import Constraint, ConstraintOp
from shared.federation.peer import Backend, FederationPeer
from shared.placement import QueuedJob, assign_queued, free_slots

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


def test_free_slots_never_negative():
    assert free_slots([make_peer("a", total=1)], {("a", "main"): 5}) == {("a", "main"): 0}


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
