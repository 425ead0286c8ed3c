"""An engine backend that has not said what it has yet is "discovering": its shape is
unknown, not empty (docs/engines.md, Discovery at start). The router queues what it
might hold instead of rejecting it (a reject is final for the job id), and the tick
places nothing on it until its shape is advertised."""

from __future__ import annotations

import contextlib
import io
from datetime import UTC, datetime

import msgspec
import pytest
from rich.console import Console

from irisfed.cli import views
from irisfed.cli.views import backend_resources
from irisfed.services.common.log import EventLogger
from irisfed.services.common.peer_view import PeerView, backends_from_wire
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
from irisfed.shared.holds import explain_waiting
from irisfed.shared.messages import (
    BackendAd,
    Capacity,
    Heartbeat,
    ResourceAmount,
    decode_internal,
    encoder,
)
from irisfed.shared.placement import assign_queued
from irisfed.shared.resources import Amount, as_resources
from irisfed.shared.rooms import QueuedJob
from tests.infra import rows
from tests.infra.factories import make_config

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


# What a legitimate but hostile peer can do with the flag (forge it, flip it every
# heartbeat, send it as the wrong JSON type, hold pinned jobs with it, give its backend a
# hostile name) must cost nothing beyond the jobs that wait for it, each explained: it
# gets no work placed on it, never thrashes the plan cache, and its names reach no
# terminal unescaped.

EAST = (Constraint("site", ConstraintOp.EQ, "east"),)


def _hb_bytes(peer_id: str, seq: int, discovering: str) -> bytes:
    return (f'{{"peer_id":"{peer_id}","seq":{seq},"sent_at":"2026-12-01T00:00:00Z","ttl_s":1,'
            f'"backends":[{{"name":"slurm","attributes":{{}},"capacity":{{"total":8,"free":8}},'
            f'"discovering":{discovering}}}]}}').encode()


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# ------------------------------------------------------------ forged and flipping flags


@pytest.mark.parametrize("forged", ['"true"', "1", "null", "0", '"false"', "[]"])
def test_a_discovering_flag_of_the_wrong_json_type_from_nats_drops_the_heartbeat(forged):
    view = PeerView(make_config(), clock=_Clock())
    heartbeat, change = view.receive(view.config.subjects.heartbeat("gpu-west"), _hb_bytes("gpu-west", 1, forged),
                                     EventLogger("test"))
    assert heartbeat is None and not change.recorded
    assert view.reachable_ids() == [] and view.version == 0
    # The same peer's well-formed heartbeat is heard as usual.
    heartbeat, change = view.receive(view.config.subjects.heartbeat("gpu-west"), _hb_bytes("gpu-west", 2, "true"),
                                     EventLogger("test"))
    assert change.recorded and heartbeat.backends[0].discovering is True


@pytest.mark.parametrize("forged", ["true", 1, None, "yes", 0])
def test_a_discovering_flag_of_the_wrong_type_in_a_stored_row_skips_the_row(forged):
    view = PeerView(make_config(), clock=_Clock())
    bad = {"name": "slurm", "attributes": {}, "capacity": {"total": 8, "free": 8}, "discovering": forged}
    assert view.apply_rows([rows.peer_heartbeat_row(peer_id="gpu-west", backends=[bad])]) is False
    assert view.reachable_ids() == []
    # The CLI reads only a real ``true`` as discovering: the rest is shown by its resources.
    assert views.backend_resources([bad]) == "-"


def test_a_peer_discovering_forever_does_not_thrash_the_plan_cache_or_the_tick():
    clock = _Clock()
    view = PeerView(make_config(), clock=clock)
    ad = BackendAd("slurm", {}, Capacity(8, 8), {}, discovering=True)

    def beat(seq: int, backend: BackendAd):
        clock.now += 0.1
        return view.apply_heartbeat(Heartbeat("gpu-west", seq, datetime.now(UTC), 1.0, [backend], run_id="r"))

    first = beat(1, ad)
    assert first.recorded and first.placeable
    version = view.version
    # The same advertisement again and again: recorded, but no routing decision is redone
    # and no placement is woken.
    for seq in range(2, 50):
        change = beat(seq, ad)
        assert change.recorded and not change.placeable
    assert view.version == version
    # Flipping every heartbeat redoes decisions once per flip (any change of shape does:
    # a peer could already change its totals every heartbeat) and never places anything.
    known = BackendAd("slurm", {"device_type": ["gpu"]}, Capacity(8, 8), {"gpu": ResourceAmount(4, 4)})
    flips = [beat(seq, known if seq % 2 else ad) for seq in range(51, 61)]
    assert view.version == version + 10 and all(c.placeable for c in flips)
    # Last advertised: discovering. Nothing is placed on it, pinned or not.
    assert view.peers()[1].backends[0].discovering is True
    jobs = [QueuedJob("j1", 0, GPU, resources={"gpu": 1}), QueuedJob("j2", 0, (), pinned_peer_id="gpu-west")]
    placed, waiting = assign_queued(jobs, view.peers(), {}, clock.now)
    assert placed == [] and len(waiting) == 2


def test_a_discovering_peer_turns_rejects_into_queues_but_the_job_is_explained_until_its_deadline():
    # Accepted by design (docs/scheduling.md): a reject is final, a wait is not. The job
    # waits, explained as `discovering`, and never lands on the hostile peer.
    hostile = _peer("gpu-west", Backend("slurm", {}, total=8, free=8, discovering=True))
    honest = _peer("home", Backend("main", {"device_type": ("cpu",)}, total=2, free=2,
                                   resources={"cpu": Amount(2, 2)}))
    quantum = (Constraint("device_type", ConstraintOp.EQ, "quantum"),)
    plan = PeerRouter([honest, hostile], clock=lambda: NOW).classify(RoutingRequest(quantum))
    assert plan.disposition is SubmitDisposition.QUEUE
    waiting = explain_waiting(QueuedJob("j", 0, quantum), [honest, hostile], {("home", "main"): 2}, NOW)
    assert {v.peer_id: v.code for v in waiting.verdicts} == {"home": "value_mismatch", "gpu-west": "discovering"}


# ------------------------------------------------------------ pins, constraints, the local cluster


def test_a_job_pinned_to_a_discovering_peer_is_explained_as_discovering():
    peers = [_peer("home", Backend("main", {}, total=2, free=2)),
             _peer("gpu-west", Backend("slurm", {}, total=8, free=8, discovering=True))]
    job = QueuedJob("j", 0, GPU, pinned_peer_id="gpu-west")
    placed, (waiting,) = assign_queued([job], peers, {}, NOW)
    assert placed == []
    assert {v.peer_id: v.code for v in waiting.verdicts} == {"home": "not_pinned_peer", "gpu-west": "discovering"}
    # Not "waiting for it to be reachable with a free slot": it is reachable; its engine
    # has not answered.
    assert "reachable with" not in waiting.reason
    assert "pinned to gpu-west" in waiting.reason and "engine" in waiting.reason


def test_a_configured_attribute_that_rules_the_job_out_is_a_mismatch_even_while_discovering():
    # `--attr site=west` overrides whatever the engine will say (service.advertisement):
    # a job asking site=east can never run there, discovering or not.
    west = _peer("gpu-west", Backend("slurm", {"site": ("west",)}, total=8, free=8, discovering=True))
    verdict = judge_peer(west, EAST, NOW)
    assert verdict.code == "value_mismatch", verdict
    plan = PeerRouter([west], clock=lambda: NOW).classify(RoutingRequest(EAST))
    assert plan.disposition is SubmitDisposition.REJECT, plan
    # A constraint on what only the engine will say still waits for it.
    assert judge_peer(west, GPU, NOW).code == "discovering"
    both = (Constraint("site", ConstraintOp.EQ, "west"),) + GPU
    assert PeerRouter([west], clock=lambda: NOW).classify(RoutingRequest(both)).disposition is SubmitDisposition.QUEUE


def test_a_local_cluster_whose_only_backend_is_discovering_assigns_nothing_locally():
    config_only = Backend("slurm", {"device_type": ("gpu",)}, total=8, free=8,
                          resources={"gpu": Amount(4, 4)}, discovering=True)
    # Even with its configured resources and attributes matching: nothing LOCAL before the shape.
    assert local_backend_for(GPU, [config_only], as_resources({"gpu": 1})) is None
    assert local_backend_for((), [config_only]) is None
    plan = PeerRouter([_peer("home", config_only)], clock=lambda: NOW).classify(
        RoutingRequest(GPU, local_feasible=False, resources=as_resources({"gpu": 1})))
    assert plan.disposition is SubmitDisposition.QUEUE
    placed, (waiting,) = assign_queued([QueuedJob("j", 0, GPU, resources={"gpu": 1})],
                                       [_peer("home", config_only)], {}, NOW)
    assert placed == [] and [v.code for v in waiting.verdicts] == ["discovering"]


# ------------------------------------------------------------ hostile backend names in the CLI

HOSTILE_NAME = "[bold]x[/]:smile:\x1b[31mred\u202eevil"


def test_a_discovering_backends_hostile_name_is_shown_literally_by_irisfed_peers():
    backends = [{"name": HOSTILE_NAME, "attributes": {}, "capacity": {"total": 8, "free": 8}, "discovering": True},
                {"name": "main", "attributes": {}, "capacity": {"total": 1, "free": 1}}]
    out = Console(file=io.StringIO(), width=500, force_terminal=True, color_system="truecolor")
    out.print(views.peers_table([rows.peer_heartbeat_row(peer_id="gpu-west", backends=backends)], width=500))
    shown = out.file.getvalue()
    assert "[bold]x[/]:smile:" in shown and "😄" not in shown
    assert "\x1b[31mred" not in shown and "\\x1b[31mred" in shown
    assert "\u202e" not in shown and "\\u202eevil: discovering" in shown
    # Plain and tsv output: the same escapes, on one line.
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        views.Out("plain").grid(views.peers_grid([rows.peer_heartbeat_row(peer_id="gpu-west", backends=backends)]))
    assert "\x1b" not in buffer.getvalue() and "\u202e" not in buffer.getvalue()
    assert "\\u202eevil: discovering; main: -" in buffer.getvalue()
    assert encoder.encode(backends)  # --json prints the stored row as JSON (escaped by the encoder)
