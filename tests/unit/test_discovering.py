"""An engine backend that has not said what it has yet is "discovering": its shape is
unknown, not empty (docs/engines.md, Discovery at start). The router queues what it
might hold instead of rejecting it (a reject is final for the job id), and the tick
places nothing on it until its shape is advertised."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec

from irisfed.cli.views import backend_resources
from irisfed.services.common.peer_view import backends_from_wire
from irisfed.services.router.plan import local_backend_for
from irisfed.services.web.present import peer_cards
from irisfed.shared.constraints import Constraint, ConstraintOp
from irisfed.shared.explain import PEER_CODES
from irisfed.shared.federation.peer import Backend, FederationPeer, build_peers
from irisfed.shared.federation.router import (
    PeerRouter,
    RoutingRequest,
    SubmitDisposition,
    judge_peer,
)
from irisfed.shared.messages import (
    BackendAd,
    Capacity,
    Heartbeat,
    ResourceAmount,
    decode_internal,
    encoder,
)
from irisfed.shared.placement import QueuedJob, assign_queued
from irisfed.shared.resources import Amount, as_resources

NOW = 1_000.0
GPU = (Constraint("device_type", ConstraintOp.EQ, "gpu"),)
ASKING = Backend("slurm", {}, total=8, free=8, discovering=True)
KNOWN = Backend("slurm", {"device_type": ("gpu",)}, total=8, free=8,
                resources={"cpu": Amount(32, 32), "gpu": Amount(4, 4)})
CPU_ONLY = Backend("main", {"device_type": ("cpu",)}, total=2, free=2, resources={"cpu": Amount(2, 2)})


def _peer(peer_id: str, *backends: Backend) -> FederationPeer:
    return FederationPeer(peer_id, backends, last_heartbeat_at=NOW - 1, ttl_s=6)


def _router(*peers: FederationPeer) -> PeerRouter:
    return PeerRouter(peers, clock=lambda: NOW)


def test_a_peer_whose_engine_has_not_answered_queues_what_it_might_hold():
    router = _router(_peer("home", CPU_ONLY), _peer("gpu-west", ASKING))
    plan = router.classify(RoutingRequest(GPU, resources={"gpu": 2}))
    assert plan.disposition is SubmitDisposition.QUEUE, plan
    verdicts = {v.peer_id: v for v in plan.verdicts}
    assert verdicts["gpu-west"].code == "discovering"
    assert "has not said what it has yet" in verdicts["gpu-west"].detail
    assert "once their engines answer: gpu-west" in plan.reason
    assert "discovering" in PEER_CODES


def test_once_the_engine_answers_the_same_job_is_judged_by_its_shape():
    too_big = RoutingRequest(GPU, resources={"gpu": 8})
    assert _router(_peer("gpu-west", ASKING)).classify(too_big).disposition is SubmitDisposition.QUEUE
    plan = _router(_peer("gpu-west", KNOWN)).classify(too_big)
    assert plan.disposition is SubmitDisposition.REJECT
    assert plan.verdicts[0].code == "insufficient_resources"


def test_a_backend_that_surely_matches_wins_over_one_still_asking():
    both = _peer("gpu-west", ASKING, Backend("other", {"device_type": ("gpu",)}, total=1, free=1))
    assert judge_peer(both, GPU, NOW, as_resources({"gpu": 1})).code == "match"
    # An unreachable peer's stale discovering backend queues nothing.
    gone = FederationPeer("gpu-west", (ASKING,), last_heartbeat_at=NOW - 100, ttl_s=6)
    plan = _router(gone).classify(RoutingRequest(GPU))
    assert plan.disposition is SubmitDisposition.REJECT
    assert plan.verdicts[0].code == "unreachable"


def test_a_local_backend_still_asking_is_never_local_feasible():
    # It advertises no resources yet: judged by attributes alone it would take anything.
    assert local_backend_for((), [ASKING], as_resources({"gpu": 2})) is None
    assert local_backend_for((), [ASKING, CPU_ONLY], as_resources({"cpu": 1})) is CPU_ONLY


def test_the_tick_places_nothing_on_a_backend_still_asking_and_says_why():
    peers = [_peer("gpu-west", ASKING)]
    job = QueuedJob(job_id="j1", epoch=0, constraints=(), resources={"cpu": 1})
    placed, waiting = assign_queued([job], peers, {}, NOW)
    assert placed == []
    assert [v.code for v in waiting[0].verdicts] == ["discovering"]
    assert "has not heard from its engine yet" in waiting[0].reason
    # Pinned there: still nothing until the shape is known.
    pinned = QueuedJob(job_id="j2", epoch=0, constraints=(), pinned_peer_id="gpu-west")
    assert assign_queued([pinned], peers, {}, NOW)[0] == []
    placed, _ = assign_queued([job, pinned], [_peer("gpu-west", KNOWN)], {}, NOW)
    assert sorted(p.job_id for p in placed) == ["j1", "j2"]


def test_the_flag_survives_the_wire_postgres_and_the_config_and_is_shown():
    ad = BackendAd("slurm", {}, Capacity(8, 8), {}, discovering=True)
    heartbeat = decode_internal(Heartbeat, encoder.encode(Heartbeat("gpu-west", 1, datetime.now(UTC), 6.0, [ad])))
    assert heartbeat.backends[0].discovering is True
    old_agent = decode_internal(Heartbeat, b'{"peer_id":"p","seq":1,"sent_at":"2026-12-01T00:00:00Z",'
                                          b'"ttl_s":6,"backends":[{"name":"m","attributes":{},'
                                          b'"capacity":{"total":1,"free":1}}]}')
    assert old_agent.backends[0].discovering is False
    stored = msgspec.to_builtins([ad, BackendAd("main", {}, Capacity(2, 2), {"cpu": ResourceAmount(2, 2)})])
    assert [b.discovering for b in backends_from_wire(stored)] == [True, False]
    (peer,) = build_peers([{"id": "p", "backends": [{"name": "m", "discovering": True}]}])
    assert peer.backends[0].discovering is True
    assert backend_resources(stored) == "slurm: discovering; main: cpu 2/2"
    (card,) = peer_cards([_peer("gpu-west", ASKING)], NOW)
    assert card.backends[0].discovering is True
