
import pytest

from irisfed.shared.constraints import Constraint, ConstraintOp
from irisfed.shared.errors import ConfigError, UnknownPeer
from irisfed.shared.federation.peer import FederationPeer, build_peers
from irisfed.shared.federation.router import PeerRouter, RoutingRequest, SubmitDisposition

NOW = 1_000_000.0
GPU = [Constraint("device_type", ConstraintOp.EQ, "gpu")]


def clock():
    return NOW


def make_router(*entries) -> PeerRouter:
    return PeerRouter(build_peers(list(entries)), clock=clock)


def peer(peer_id, age=0.0, ttl_s=6.0, **attributes):
    entry = {"id": peer_id, "ttl_s": ttl_s}
    if age is not None:
        entry["last_heartbeat_at"] = NOW - age
    if attributes:
        entry["attributes"] = attributes
    return entry


def test_prefers_local_when_feasible_even_with_a_matching_peer():
    router = make_router(peer("gpu-west", device_type="gpu"))
    plan = router.classify(RoutingRequest(GPU, local_feasible=True))
    assert plan.disposition is SubmitDisposition.LOCAL
    assert plan.pinned_peer_id == ""


def test_queue_when_local_infeasible_and_a_peer_can_host():
    router = make_router(peer("home", device_type="cpu"), peer("gpu-west", device_type="gpu"))
    plan = router.classify(RoutingRequest(GPU, local_feasible=False))
    assert plan.disposition is SubmitDisposition.QUEUE
    assert plan.pinned_peer_id == ""
    assert {v.peer_id: v.code for v in plan.verdicts} == {"home": "value_mismatch", "gpu-west": "match"}


def test_reject_when_no_peer_can_host():
    router = make_router(peer("home", device_type="cpu"), peer("tpu", device_type="tpu"))
    plan = router.classify(RoutingRequest(GPU, local_feasible=False))
    assert plan.disposition is SubmitDisposition.REJECT
    assert "home" in plan.reason and "tpu" in plan.reason
    assert all(v.code == "value_mismatch" for v in plan.verdicts)


def test_reject_when_only_matching_peer_is_stale():
    router = make_router(peer("gpu-west", age=6.5, ttl_s=6.0, device_type="gpu"))
    plan = router.classify(RoutingRequest(GPU, local_feasible=False))
    assert plan.disposition is SubmitDisposition.REJECT
    assert plan.verdicts[0].code == "unreachable"
    assert "unreachable since 1970-01-12T13:46:39Z" in plan.reason  # NOW - 6.5 + 6


def test_peer_never_heard_from_is_unreachable():
    router = make_router(peer("gpu-west", age=None, device_type="gpu"))
    plan = router.classify(RoutingRequest(GPU))
    assert plan.disposition is SubmitDisposition.REJECT
    assert "no heartbeat" in plan.reason


def test_reachability_boundary_is_strict():
    fresh = FederationPeer("p", last_heartbeat_at=NOW - 5.999, ttl_s=6.0)
    stale = FederationPeer("p", last_heartbeat_at=NOW - 6.0, ttl_s=6.0)
    assert fresh.is_reachable(NOW) and not stale.is_reachable(NOW)


def test_pin_queues_pinned_even_when_locally_feasible():
    router = make_router(peer("home", device_type="cpu"), peer("gpu-west", device_type="gpu"))
    plan = router.classify(RoutingRequest([], local_feasible=True, cluster_pin="gpu-west"))
    assert plan.disposition is SubmitDisposition.QUEUE
    assert plan.pinned_peer_id == "gpu-west"


def test_pin_to_a_peer_advertising_nothing_still_queues():
    router = make_router(peer("bare", age=None))
    plan = router.classify(RoutingRequest(GPU, cluster_pin="bare"))
    assert (plan.disposition, plan.pinned_peer_id) == (SubmitDisposition.QUEUE, "bare")


def test_gpu_job_goes_to_peer_with_matching_variant():
    router = make_router(
        peer("a100-farm", device_type="gpu", device_variant="a100"),
        peer("h100-farm", device_type="gpu", device_variant="h100"),
    )
    wanted = GPU + [Constraint("device_variant", ConstraintOp.EQ, "H100")]
    plan = router.classify(RoutingRequest(wanted))
    assert plan.disposition is SubmitDisposition.QUEUE
    matched = [v.peer_id for v in plan.verdicts if v.code == "match"]
    assert matched == ["h100-farm"]


def test_gpu_job_rejected_when_peers_advertise_no_device_attributes():
    router = make_router(peer("plain", region="eu"), peer("nothing"))
    plan = router.classify(RoutingRequest(GPU))
    assert plan.disposition is SubmitDisposition.REJECT
    codes = {v.peer_id: v.code for v in plan.verdicts}
    assert codes == {"plain": "missing_attribute", "nothing": "no_backends"}
    assert "missing attribute 'device_type'" in plan.reason


def test_pin_to_unknown_peer_is_a_clear_error():
    router = make_router(peer("home"))
    with pytest.raises(UnknownPeer, match="'mars' is not a peer of this federation"):
        router.classify(RoutingRequest([], local_feasible=True, cluster_pin="mars"))


def test_reject_with_no_peers_says_so():
    plan = PeerRouter([], clock=clock).classify(RoutingRequest(GPU))
    assert plan.disposition is SubmitDisposition.REJECT
    assert "no peers" in plan.reason


def test_multi_backend_peer_matches_on_any_backend():
    peers = build_peers([{"id": "mixed", "last_heartbeat_at": NOW, "backends": [
        {"name": "cpu", "attributes": {"device_type": "cpu"}},
        {"name": "gpu", "attributes": {"device_type": "gpu"}, "capacity": {"total": 8, "free": 2}},
    ]}])
    assert peers[0].backends[1].total == 8 and peers[0].backends[1].free == 2
    plan = PeerRouter(peers, clock=clock).classify(RoutingRequest(GPU))
    assert plan.disposition is SubmitDisposition.QUEUE


@pytest.mark.parametrize("bad", [[{"id": "a.b"}], [{"id": ""}], [{"name": "x"}], [{"id": "a"}, {"id": "a"}], ["a"]])
def test_build_peers_rejects_bad_config(bad):
    with pytest.raises(ConfigError):
        build_peers(bad)


def test_build_peers_accepts_whole_config_mapping():
    assert [p.peer_id for p in build_peers({"peers": [{"id": "a"}, {"id": "b"}]})] == ["a", "b"]


def test_reasons_and_explanations_stay_bounded_in_a_large_federation():
    # Every job stores its reason and explanation: their size must not grow with the federation.
    from irisfed.shared.explain import MAX_EXPLAINED_PEERS, explanation

    many = [peer(f"g{i:03}", device_type="gpu") for i in range(300)] + [peer("home", device_type="cpu")]
    plan = make_router(*many).classify(RoutingRequest(GPU, local_feasible=False))
    assert plan.disposition is SubmitDisposition.QUEUE
    assert plan.reason.endswith("and 290 more") and "g009" in plan.reason and "g010" not in plan.reason
    doc = explanation("router", plan.reason, plan.verdicts)
    assert len(doc["peers"]) == MAX_EXPLAINED_PEERS
    assert doc["more"] == {"match": 300 - MAX_EXPLAINED_PEERS, "value_mismatch": 1}

    rejected = make_router(*many).classify(RoutingRequest([Constraint("device_type", ConstraintOp.EQ, "tpu")],
                                                          local_feasible=False))
    assert rejected.disposition is SubmitDisposition.REJECT
    assert len(rejected.verdicts) == 301  # the reply still says why for every peer
    assert rejected.reason.endswith("and 291 more") and len(rejected.reason) < 1000


def test_small_explanations_are_complete():
    from irisfed.shared.explain import explanation

    plan = make_router(peer("home", device_type="cpu"), peer("gpu-west", device_type="gpu")).classify(
        RoutingRequest(GPU, local_feasible=False))
    doc = explanation("router", plan.reason, plan.verdicts)
    assert [p["peer_id"] for p in doc["peers"]] == ["home", "gpu-west"] and "more" not in doc


# ---------------------------------------------------------------- resources (docs/design.md §3.1)


def sized(peer_id, age=0.0, name="main", resources=None, **attributes):
    backend = {"name": name, "attributes": attributes, "capacity": {"total": 4, "free": 0}}
    if resources is not None:
        backend["resources"] = resources
    return {"id": peer_id, "last_heartbeat_at": NOW - age, "backends": [backend]}


def test_reject_names_the_resource_the_asked_amount_and_the_most_on_offer():
    router = make_router(sized("gpu-west", name="slurm", resources={"cpu": 64, "gpu": 4}, device_type="gpu"))
    plan = router.classify(RoutingRequest(GPU, resources={"gpu": 8, "cpu": 2}))
    assert plan.disposition is SubmitDisposition.REJECT
    verdict = plan.verdicts[0]
    assert verdict.code == "insufficient_resources"
    assert verdict.detail == "gpu: asked 8, at most 4 (backend slurm)"
    assert [tuple(s) for s in verdict.shortfalls] == [("gpu", 8, 4, "slurm")]
    assert "gpu-west: gpu: asked 8, at most 4 (backend slurm)" in plan.reason


def test_a_busy_peer_big_enough_queues_the_job():
    # Totals decide at submit, not what is free now: busy peers queue work.
    router = make_router(sized("gpu-west", resources={"cpu": {"total": 64, "free": 0}, "gpu": {"total": 8, "free": 0}}))
    plan = router.classify(RoutingRequest((), resources={"gpu": 8, "cpu": 64}))
    assert plan.disposition is SubmitDisposition.QUEUE
    assert plan.verdicts[0].code == "match"


def test_every_short_resource_and_backend_is_named():
    peers = build_peers([{"id": "mixed", "last_heartbeat_at": NOW, "backends": [
        {"name": "small", "attributes": {}, "resources": {"cpu": 2, "memory_mb": 1024}},
        {"name": "gpu", "attributes": {"device_type": "gpu"}, "resources": {"cpu": 4, "memory_mb": 4096}},
        {"name": "other", "attributes": {"device_type": "tpu"}, "resources": {"cpu": 64, "memory_mb": 65536}},
    ]}])
    plan = PeerRouter(peers, clock=clock).classify(RoutingRequest((), resources={"cpu": 8, "memory_mb": 2048}))
    assert plan.disposition is SubmitDisposition.QUEUE  # "other" could hold it
    plan = PeerRouter(peers, clock=clock).classify(RoutingRequest(GPU, resources={"cpu": 8, "memory_mb": 8192}))
    assert plan.disposition is SubmitDisposition.REJECT
    # Only backends matching the constraints are measured against the request.
    assert plan.verdicts[0].detail == "cpu: asked 8, at most 4; memory: asked 8.0 GiB, at most 4.0 GiB (backend gpu)"


def test_a_backend_lists_everything_it_has():
    # Advertising resources without cpu means no cpu: even the default job (one cpu) cannot go there.
    router = make_router(sized("gpu-only", resources={"gpu": 8}))
    plan = router.classify(RoutingRequest(()))
    assert plan.disposition is SubmitDisposition.REJECT
    assert plan.verdicts[0].detail == "cpu: asked 1, at most 0 (backend main)"
    assert router.classify(RoutingRequest((), resources={"cpu": 0, "gpu": 2})).disposition is SubmitDisposition.QUEUE


def test_legacy_peers_without_resources_are_judged_by_attributes_only():
    router = make_router(peer("old", device_type="gpu"))
    plan = router.classify(RoutingRequest(GPU, resources={"gpu": 64, "memory_mb": 10**6}))
    assert plan.disposition is SubmitDisposition.QUEUE


def test_attribute_mismatch_still_explains_before_size():
    router = make_router(sized("cpu-farm", resources={"cpu": 1}, device_type="cpu"))
    plan = router.classify(RoutingRequest(GPU, resources={"cpu": 8}))
    assert plan.verdicts[0].code == "value_mismatch"


def test_pin_and_local_rules_are_unchanged_by_resources():
    router = make_router(sized("tiny", resources={"cpu": 1}))
    pinned = router.classify(RoutingRequest((), cluster_pin="tiny", resources={"cpu": 99}))
    assert (pinned.disposition, pinned.pinned_peer_id) == (SubmitDisposition.QUEUE, "tiny")
    local = router.classify(RoutingRequest((), local_feasible=True, resources={"cpu": 99}))
    assert local.disposition is SubmitDisposition.LOCAL


def test_local_feasibility_helper_judges_the_local_shape():
    from irisfed.shared.federation.router import backend_can_hold
    from irisfed.shared.resources import Resources

    local = build_peers([sized("home", resources={"cpu": {"total": 8, "free": 0}, "memory_mb": 16384})])[0]
    backend = local.backends[0]
    assert backend_can_hold(backend, Resources({"cpu": 8, "memory_mb": 16384}))  # busy, but big enough
    assert not backend_can_hold(backend, Resources({"cpu": 9}))
    legacy = build_peers([peer("old", device_type="cpu")])[0].backends[0]
    assert backend_can_hold(legacy, Resources({"cpu": 1000}))


def test_routing_request_takes_a_resources_value_or_a_mapping():
    from irisfed.shared.resources import ResourceError, Resources

    router = make_router(sized("a", resources={"cpu": 4}))
    assert router.classify(RoutingRequest((), False, "", Resources({"cpu": 4}))).disposition is SubmitDisposition.QUEUE
    assert router.classify(RoutingRequest((), resources={"cpu": 5})).disposition is SubmitDisposition.REJECT
    with pytest.raises(ResourceError):
        router.classify(RoutingRequest((), resources={"cpu": -1}))


def test_build_peers_reads_backend_resources():
    from irisfed.shared.resources import Amount

    peers = build_peers([{"id": "a", "backends": [
        {"name": "main", "capacity": {"total": 8, "free": 8}, "resources": {"cpu": 8, "gpu": {"total": 2, "free": 1}}}]}])
    assert peers[0].backends[0].resources == {"cpu": Amount(8.0, 8.0), "gpu": Amount(2.0, 1.0)}
    assert build_peers([{"id": "b", "attributes": {"x": "y"}}])[0].backends[0].resources == {}
    for bad in ({"GPU": 1}, {"gpu": -2}, {"slots": 3}):
        with pytest.raises(ConfigError):
            build_peers([{"id": "a", "backends": [{"name": "main", "resources": bad}]}])


def test_a_rejected_duplicate_repeats_every_verdict_from_the_stored_decision():
    # The reply of a rejected job names all 301 peers; its stored explanation only 10.
    # A duplicate is rebuilt from what the row keeps (the decision's verdicts, stored
    # once with its explanation) and must equal the first reply but `duplicate`.
    import msgspec

    from irisfed.services.router.plan import original_reply, plan_new_job, route
    from irisfed.shared.messages import SubmitRequest
    from irisfed.shared.records import SubmittedJob

    many = [peer(f"g{i:03}", device_type="gpu") for i in range(300)] + [peer("home", device_type="cpu")]
    plan = make_router(*many).classify(RoutingRequest([Constraint("device_type", ConstraintOp.EQ, "tpu")],
                                                      local_feasible=False))
    routed = route(plan, "home", None)
    request = msgspec.json.decode(b'{"command": ["true"], "job_id": "r"}', type=SubmitRequest)
    job, first = plan_new_job(request, routed, "r")
    stored = SubmittedJob("r", job.spec_hash, job.disposition, job.pinned_peer_id, job.state, job.owner_peer_id,
                          job.reason, msgspec.json.decode(job.explanation.verdicts))
    assert original_reply(stored) == first.replace(b'"duplicate":false', b'"duplicate":true')
    assert len(msgspec.json.decode(first)["verdicts"]) == 301
    # Same decision, same stored row; another decision, another key.
    assert route(plan, "home", None).explanation.key == routed.explanation.key
    queued = make_router(*many).classify(RoutingRequest(GPU, local_feasible=False))
    assert route(queued, "home", None).explanation.key != routed.explanation.key


def test_the_spliced_first_reply_is_the_encoded_reply():
    # first_reply splices the job_id into bytes built once per decision; it must be
    # exactly what encoding the whole reply gives, for every kind of decision.
    from irisfed.services.router.plan import first_reply, route, submit_reply

    for plan in (make_router(peer("gpu-west", device_type="gpu")).classify(RoutingRequest(GPU, local_feasible=False)),
                 make_router(peer("home", device_type="cpu")).classify(RoutingRequest(GPU, local_feasible=False)),
                 make_router(peer("home")).classify(RoutingRequest([], local_feasible=True))):
        routed = route(plan, "home", None)
        for job_id in ("a", "x.y-z_1", "q" * 128):
            assert first_reply(routed, job_id) == submit_reply(
                job_id, plan.disposition.value, routed.state.value, routed.peer_id, plan.reason, routed.verdicts)
