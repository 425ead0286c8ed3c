import subprocess
import sys
from pathlib import Path

import pytest

from shared.constraints import Constraint, ConstraintOp
from shared.errors import ConfigError, UnknownPeer
from shared.federation.peer import FederationPeer, build_peers
from shared.federation.router import PeerRouter, RoutingRequest, SubmitDisposition

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


def test_seed_example_runs_unchanged():
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, str(root / "examples" / "seed_example.py")],
        capture_output=True, text=True, cwd=root, env={"PYTHONPATH": str(root)}, check=True,
    )
    assert result.stdout.startswith("queue - ")
    assert "gpu-west" in result.stdout


def test_reasons_and_explanations_stay_bounded_in_a_large_federation():
    # Every job stores its reason and explanation: their size must not grow with the federation.
    from shared.explain import MAX_EXPLAINED_PEERS, explanation

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
    from shared.explain import explanation

    plan = make_router(peer("home", device_type="cpu"), peer("gpu-west", device_type="gpu")).classify(
        RoutingRequest(GPU, local_feasible=False))
    doc = explanation("router", plan.reason, plan.verdicts)
    assert [p["peer_id"] for p in doc["peers"]] == ["home", "gpu-west"] and "more" not in doc
