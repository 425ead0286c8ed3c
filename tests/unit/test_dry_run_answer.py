"""The dry run's pure half (services/router/dry_run.py): the job as the tick would see
it, and an answer whose routing fields are the real submit's reply."""

from __future__ import annotations

import json

import msgspec
import pytest

from irisfed.services.router.dry_run import dry_run_reply, local_placement, queued_job, would_place
from irisfed.services.router.plan import (
    first_reply,
    plan_new_job,
    quota_rejected,
    route,
    waiting_for_quota,
)
from irisfed.shared.constraints import Constraint, ConstraintOp
from irisfed.shared.fair_share import FairShareRun
from irisfed.shared.federation.peer import Backend, FederationPeer
from irisfed.shared.federation.router import PeerVerdict, SubmitDisposition, SubmitPlan
from irisfed.shared.holds import Waiting
from irisfed.shared.messages import DryRunPlacement, SubmitReply, SubmitRequest, decode_request
from irisfed.shared.placement import PlacementRun
from irisfed.shared.preemption import NO_LOWER_BAND, Candidate, VictimPool
from irisfed.shared.resources import Amount, Resources
from irisfed.shared.users import QUOTA, UserConfig, UserTable

NOW = 100.0
HOME = Backend("main", {"device_type": ["cpu"]}, total=4, free=4)


def request(**fields) -> SubmitRequest:
    return decode_request(SubmitRequest, json.dumps({"command": ["true"], **fields}).encode())


def peer(peer_id, slots=1, **resources):
    offered = {name: Amount(total, total) for name, total in resources.items()}
    return FederationPeer(peer_id, (Backend("main", {}, total=slots, free=slots, resources=offered),),
                          last_heartbeat_at=NOW - 1, ttl_s=6)


def victim(job_id, peer_id, band=0, since=0.0, user="default"):
    return Candidate(job_id, 1, "running", peer_id, "main", band, since, Resources(None).units, user)


def real(reply: bytes) -> SubmitReply:
    return msgspec.json.decode(reply, type=SubmitReply)


def same_fields(answer, reply: bytes) -> None:
    expected = real(reply)
    assert (answer.job_id, answer.disposition, answer.state, answer.peer_id, answer.reason, answer.verdicts,
            answer.duplicate) == (expected.job_id, expected.disposition, expected.state, expected.peer_id,
                                  expected.reason, expected.verdicts, expected.duplicate)


def test_a_rejected_job_answers_the_real_reply_and_nothing_more():
    verdicts = (PeerVerdict("gpu-west", "value_mismatch", "device_type is gpu"),)
    routed = route(SubmitPlan(SubmitDisposition.REJECT, reason="no peer", verdicts=verdicts), "home", None)
    answer = dry_run_reply(first_reply(routed, "r1"), "batch")
    same_fields(answer, first_reply(routed, "r1"))
    assert answer.verdicts[0].peer_id == "gpu-west" and answer.state == "rejected"
    assert (answer.band, answer.placement, answer.waiting, answer.dry_run) == ("batch", None, "", True)


def test_over_the_whole_quota_is_the_real_rejection():
    routed = quota_rejected("quota: the job asks 8 gpu; user alice's quota allows 4 in all")
    answer = dry_run_reply(first_reply(routed, "q"), "interactive")
    assert (answer.disposition, answer.state) == ("reject", "rejected")
    assert answer.reason == "quota: the job asks 8 gpu; user alice's quota allows 4 in all"


def test_a_local_job_names_the_local_backend():
    routed = route(SubmitPlan(SubmitDisposition.LOCAL, reason="local"), "home", HOME)
    answer = dry_run_reply(first_reply(routed, "l1"), "interactive", local_placement(routed))
    same_fields(answer, first_reply(routed, "l1"))
    assert answer.placement == DryRunPlacement("home", "main", [])
    queued = route(SubmitPlan(SubmitDisposition.QUEUE, reason="q"), "home", None)
    assert local_placement(queued) is None


def test_a_local_job_over_its_quota_now_answers_what_its_real_submit_would():
    routed = route(SubmitPlan(SubmitDisposition.LOCAL, reason="local"), "home", HOME)
    why = "quota: this job's 1 slots would take alice over its quota of 2 slots"
    job, _ = plan_new_job(request(job_id="l2"), routed, "l2", "alice")
    _, waiting_reply = waiting_for_quota(job, why)
    answer = dry_run_reply(waiting_reply, "interactive", Waiting("alice:l2", why, code=QUOTA))
    same_fields(answer, waiting_reply)
    assert (answer.disposition, answer.state, answer.reason) == ("local", "queued", why)
    assert (answer.placement, answer.waiting, answer.waiting_code) == (None, why, "quota")


def test_the_queued_job_is_the_request_as_the_tick_claims_it():
    gpu = {"key": "device_type", "op": "eq", "value": "gpu"}
    fast = {"key": "variant", "op": "eq", "value": "h100"}
    body = request(constraints=[gpu], preferences=[fast], resources={"gpu": 2}, band="production",
                   cluster_pin="gpu-west")
    routed = route(SubmitPlan(SubmitDisposition.QUEUE, pinned_peer_id="gpu-west", reason="pinned"), "home", None)
    job = queued_job(body, routed, "bob:p1")
    assert (job.job_id, job.band, job.pinned_peer_id, job.waited_s, job.avoid_peers) == (
        "bob:p1", 2, "gpu-west", 0.0, frozenset())
    assert job.constraints == (Constraint("device_type", ConstraintOp.EQ, "gpu"),)
    assert job.preferences == (Constraint("variant", ConstraintOp.EQ, "h100"),)
    assert job.resources == Resources({"gpu": 2})
    assert queued_job(request(), route(SubmitPlan(SubmitDisposition.QUEUE), "home", None), "x").band == 1


ALICE = UserTable.of([UserConfig("alice")])


def _placed(peers, running, body, user="alice", users=ALICE, held=None):
    live = {}
    for v in running:
        live[(v.peer_id, v.backend)] = live.get((v.peer_id, v.backend), 0) + 1
    run = PlacementRun(peers, live, NOW)
    routed = route(SubmitPlan(SubmitDisposition.QUEUE), "home", None)
    job = queued_job(body, routed, f"{user}:j")
    if job.band > 0:
        run.pool = VictimPool(running, job.band)
    placements, waiting = FairShareRun(run, users, held or {}).place({user: [job]})
    return would_place(job.job_id, placements, waiting, run.preempted)


def test_a_free_backend_is_named_and_nothing_preempted():
    outcome = _placed([peer("gpu-west"), peer("tpu-east")], [victim("b1", "gpu-west")], request())
    assert outcome == DryRunPlacement("tpu-east", "main", [])


def test_a_full_federation_names_the_victim_the_tick_would_stop():
    running = [victim("b-old", "gpu-west", since=1.0), victim("b-new", "tpu-east", since=2.0)]
    outcome = _placed([peer("gpu-west"), peer("tpu-east")], running, request())
    # The most recently started batch job goes (it wins over peer order).
    assert outcome == DryRunPlacement("tpu-east", "main", ["b-new"])


def test_with_nothing_lower_to_stop_it_says_why_it_waits():
    running = [victim("i1", "gpu-west", band=1)]
    outcome = _placed([peer("gpu-west")], running, request())
    assert isinstance(outcome, Waiting)
    assert outcome.rule.endswith(f"; cannot preempt: {NO_LOWER_BAND}")
    answer = dry_run_reply(first_reply(route(SubmitPlan(SubmitDisposition.QUEUE), "home", None), "j"),
                           "interactive", outcome)
    assert answer.placement is None and answer.waiting == outcome.rule and answer.waiting_code == ""
    assert [v.peer_id for v in answer.waiting_verdicts] == ["gpu-west"]


def test_a_user_over_its_quota_waits_on_it_and_preempts_nobody():
    users = UserTable.of([UserConfig("alice", quota={"slots": 1})])
    running = [victim("b1", "gpu-west")]
    outcome = _placed([peer("gpu-west")], running, request(), users=users, held={"alice": {"slots": 1}})
    assert isinstance(outcome, Waiting) and outcome.code == QUOTA
    assert outcome.rule == "quota: this job's 1 slots would take alice over its quota of 1 slots"
    # The same job, quota free: it would preempt.
    assert _placed([peer("gpu-west")], running, request(), users=users) == DryRunPlacement("gpu-west", "main",
                                                                                            ["b1"])


def test_a_job_the_run_never_saw_is_a_bug_not_an_answer():
    with pytest.raises(ValueError):
        would_place("j", [], [], {})
