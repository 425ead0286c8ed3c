"""Bands at submit (docs/design.md §3.3): what the router stores, whom it refuses, and
what a job's spec hash covers — plus the wire shapes of the dry-run answer."""

from __future__ import annotations

import hashlib
import json

import msgspec
import pytest

from irisfed.errors import ForbiddenError, error_for
from irisfed.services.common.store import _jobs_encoder
from irisfed.services.router.plan import band_allowed, max_band_ranks, plan_new_job, route
from irisfed.shared.errors import ErrorCode, Forbidden, InvalidRequest
from irisfed.shared.federation.router import SubmitDisposition, SubmitPlan
from irisfed.shared.messages import (
    WIRE_MESSAGES,
    DryRunPlacement,
    DryRunReply,
    PeerVerdictMsg,
    SubmitReply,
    SubmitRequest,
    decode_reply,
    decode_request,
    encoder,
    json_schemas,
)
from irisfed.shared.users import UserConfig

QUEUED = route(SubmitPlan(SubmitDisposition.QUEUE, reason="queued"), "home", None)
RANKS = max_band_ranks([UserConfig("alice"), UserConfig("bob", max_band="production"),
                        UserConfig("carol", max_band="batch")])


def request(**fields) -> SubmitRequest:
    return decode_request(SubmitRequest, json.dumps({"command": ["echo", "hi"], **fields}).encode())


# ---------------------------------------------------------------- the spec hash


def test_a_v1_submit_keeps_its_spec_and_hash():
    # What a v1 job's spec was before bands existed, byte for byte: its hash must not move,
    # or every resubmission of an old job would become a conflict.
    v1 = request(job_id="old", priority=3, labels={"team": "ml"})
    assert v1.canonical_spec() == b'{"command":["echo","hi"],"labels":{"team":"ml"},"priority":3}'
    assert v1.spec_hash() == hashlib.sha256(
        b'{"command":["echo","hi"],"labels":{"team":"ml"},"priority":3}').hexdigest()
    job, _ = plan_new_job(v1, QUEUED, "old")
    assert job.spec_hash == v1.spec_hash()


def test_the_default_band_and_max_preemptions_spelled_out_are_the_same_job():
    plain = request().spec_hash()
    assert request(band="interactive").spec_hash() == plain
    assert request(max_preemptions=100).spec_hash() == plain


def test_another_band_or_max_preemptions_is_another_job():
    plain = request().spec_hash()
    hashes = {request(band="batch").spec_hash(), request(band="production").spec_hash(),
              request(max_preemptions=3).spec_hash()}
    assert plain not in hashes and len(hashes) == 3
    assert b'"band":"batch"' in request(band="batch").canonical_spec()


def test_dry_run_is_not_part_of_the_job():
    assert request(dry_run=True).spec_hash() == request().spec_hash()
    assert b"dry_run" not in request(dry_run=True, band="batch").canonical_spec()


@pytest.mark.parametrize("body", [{"band": "urgent"}, {"band": "Batch"}, {"band": 2}, {"band": None},
                                  {"max_preemptions": -1}, {"max_preemptions": 10_001},
                                  {"dry_run": "yes"}, {"dry_run": 1}])
def test_bad_band_fields_are_invalid_requests(body):
    with pytest.raises(InvalidRequest):
        request(**body)


# ---------------------------------------------------------------- the row and the refusal


@pytest.mark.parametrize("band, rank", [(None, 1), ("batch", 0), ("interactive", 1), ("production", 2)])
def test_the_row_stores_the_bands_rank(band, rank):
    fields = {} if band is None else {"band": band}
    job, _ = plan_new_job(request(**fields), QUEUED, "j", "bob")
    assert job.band == rank
    assert json.loads(_jobs_encoder.encode([job]))[0]["band"] == rank  # what job_insert_batch reads


def test_a_band_above_the_users_max_band_is_forbidden_naming_both():
    with pytest.raises(Forbidden) as refused:
        band_allowed("alice", "production", RANKS)
    assert refused.value.code == ErrorCode.FORBIDDEN
    assert refused.value.message == "user alice may submit at most band interactive; this job asks production"
    assert band_allowed("alice", "interactive", RANKS) == 1
    assert band_allowed("alice", "batch", RANKS) == 0
    assert band_allowed("bob", "production", RANKS) == 2


def test_an_unconfigured_default_user_has_the_default_max_band():
    assert band_allowed("default", "interactive", RANKS) == 1
    with pytest.raises(Forbidden, match="user default may submit at most band interactive; this job asks production"):
        band_allowed("default", "production", RANKS)


def test_a_batch_only_user_must_say_batch_and_is_told_so():
    assert band_allowed("carol", "batch", RANKS) == 0
    with pytest.raises(Forbidden) as refused:
        band_allowed("carol", "interactive", RANKS)
    assert refused.value.message == ("user carol may submit at most band batch; this job asks interactive "
                                     "(the default band when none is given)")


def test_the_client_raises_forbidden_as_its_own_exception():
    error = error_for("forbidden", "user alice may submit at most band interactive; this job asks production")
    assert type(error) is ForbiddenError and error.code == ErrorCode.FORBIDDEN and not error.retryable


# ---------------------------------------------------------------- the wire


def test_a_submit_reply_is_encoded_exactly_as_before():
    reply = SubmitReply("j", "queue", "queued", "", False, "ok", [PeerVerdictMsg("p", "match", "")])
    assert encoder.encode(reply) == (b'{"job_id":"j","disposition":"queue","state":"queued","peer_id":"",'
                                     b'"duplicate":false,"reason":"ok","verdicts":[{"peer_id":"p","code":"match",'
                                     b'"detail":""}]}')
    assert decode_reply(encoder.encode(reply)) == reply


def test_a_dry_run_answer_decodes_as_one_and_says_so():
    answer = DryRunReply("j", "queue", "queued", "", "ok", band="production",
                         placement=DryRunPlacement("gpu-west", "main", ["v1"]))
    data = encoder.encode(answer)
    assert json.loads(data)["dry_run"] is True
    assert decode_reply(data) == answer
    # A plain submit reply is never taken for one.
    assert type(decode_reply(encoder.encode(SubmitReply("j", "queue", "queued", "", False, "ok")))) is SubmitReply


def test_the_schema_exports_the_dry_run_answer():
    assert DryRunReply in WIRE_MESSAGES
    schemas = json_schemas()
    assert set(schemas) == {kind.__name__ for kind in WIRE_MESSAGES}
    answer = schemas["DryRunReply"]["$defs"]["DryRunReply"]
    assert {"placement", "waiting", "waiting_code", "waiting_verdicts", "band", "duplicate", "dry_run"} <= set(
        answer["properties"])
    assert "DryRunPlacement" in schemas["DryRunReply"]["$defs"]
    submit = schemas["SubmitRequest"]["$defs"]["SubmitRequest"]["properties"]
    assert submit["band"]["enum"] == ["batch", "interactive", "production"]
    assert {"max_preemptions", "dry_run"} <= set(submit)
    msgspec.json.encode(schemas)
