import json
from datetime import UTC, datetime

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from irisfed.shared.errors import InvalidRequest
from irisfed.shared.messages import (
    MAX_BODY_BYTES,
    WIRE_MESSAGES,
    AssignmentNotice,
    BackendAd,
    CancelRequest,
    Capacity,
    Heartbeat,
    JobEvent,
    SubmitReply,
    SubmitRequest,
    decode_internal,
    decode_reply,
    decode_request,
    encoder,
    error_reply,
    json_schemas,
)


def submit(**fields) -> bytes:
    body = {"command": ["echo", "hi"], **fields}
    return json.dumps(body).encode()


def test_minimal_submit_decodes_with_defaults():
    req = decode_request(SubmitRequest, submit())
    assert req.command == ["echo", "hi"]
    assert (req.job_id, req.cluster_pin, req.priority, req.max_retries) == (None, "", 0, 2)


def test_full_submit_roundtrips():
    body = submit(
        job_id="train-1.v2_x", name="train", env={"A": "1"}, cluster_pin="gpu-west", priority=5,
        max_retries=0, deadline_s=30.5, labels={"team": "ml"},
        constraints=[{"key": "device_type", "op": "eq", "value": "gpu"},
                     {"key": "zone", "op": "in", "value": ["a", "b"]},
                     {"key": "spot", "op": "not_exists"}],
    )
    req = decode_request(SubmitRequest, body)
    again = decode_request(SubmitRequest, encoder.encode(req))
    assert again == req
    assert [c.describe() for c in req.constraint_list()] == ["device_type == gpu", "zone in [a, b]", "not_exists(spot)"]


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"not json", "malformed"),
        (b"", "empty body"),
        (b"[]", "the request must be a JSON object, not a list"),
        (submit(**{"cluster-pin": "x"}), "unknown field 'cluster-pin': this request has no such field"),
        (json.dumps({"name": "x"}).encode(), "command is required"),
        (submit(command=[]), "command must have at least 1 item"),
        (submit(command="echo"), "command must be a list, not text"),
        (submit(command=[""]), "command[0]"),
        (submit(command=[1]), "command[0] must be text, not a whole number"),
        (submit(priority="high"), "priority must be a whole number, not text"),
        (submit(priority=True), "priority must be a whole number, not true or false"),
        (submit(max_retries=-1), "max_retries must be at least 0"),
        (submit(deadline_s=0), "deadline_s must be more than 0"),
        (submit(job_id="bad id"), "job_id must be 1 to 128 letters, digits, '.', '_' or '-', the first a letter or digit"),
        (submit(job_id="-leading"), "job_id"),
        (submit(job_id="x" * 129), "job_id"),
        (submit(job_id="abc\n"), "job_id"),
        (submit(env={"A": 1}), "each entry of env must be text, not a whole number"),
        (submit(constraints=[{"key": "k", "op": "like", "value": "x"}]), "constraints[0].op must be eq, ne, exists, not_exists, gt, ge, lt, le or in, not 'like'"),
        (submit(constraints=[{"key": "k", "op": "gt", "value": "big"}]), "numeric"),
        (submit(constraints=[{"key": "k", "op": "in", "value": "a"}]), "list"),
        (submit(constraints=[{"key": "k", "op": "exists", "value": "a"}]), "takes no value"),
        (submit(constraints=[{"key": "k", "op": "eq", "value": "a", "extra": 1}]), "unknown field 'extra' in constraints[0]"),
        (submit(constraints=[{"op": "eq", "value": "a"}]), "constraints[0].key is required"),
        (submit(constraints=[{"key": "k", "op": "eq", "value": {"a": 1}}]), "constraints[0].value must be a number, text, a list or null, not an object"),
    ],
)
def test_bad_submits_raise_one_clear_error(body, fragment):
    with pytest.raises(InvalidRequest) as info:
        decode_request(SubmitRequest, body)
    assert fragment in info.value.message
    assert info.value.code == "invalid_request"


@pytest.mark.parametrize("job_id", ["abc\n", "abc\n\n", "\nabc"])
def test_a_job_id_with_a_newline_is_no_id_anywhere(job_id):
    import re

    from irisfed.shared.messages import JOB_ID_PATTERN, CancelRequest

    for kind, body in ((SubmitRequest, submit(job_id=job_id)), (CancelRequest, json.dumps({"job_id": job_id}).encode())):
        with pytest.raises(InvalidRequest, match="job_id"):
            decode_request(kind, body)
    assert re.search(JOB_ID_PATTERN, job_id) is None
    assert re.search(JOB_ID_PATTERN, job_id.strip())


def test_oversize_body_rejected_before_parsing():
    body = submit(name="x" * (MAX_BODY_BYTES + 1))
    with pytest.raises(InvalidRequest, match="limit is"):
        decode_request(SubmitRequest, body)


def test_deep_nesting_is_an_error_not_a_crash():
    body = b'{"command": ["x"], "env": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    with pytest.raises(InvalidRequest):
        decode_request(SubmitRequest, body)


@given(st.binary(max_size=2048))
@settings(max_examples=300)
def test_arbitrary_bytes_never_crash_the_decoder(data):
    for kind in (SubmitRequest, CancelRequest):
        try:
            decode_request(kind, data)
        except InvalidRequest:
            pass


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)


@given(st.dictionaries(st.sampled_from(["command", "job_id", "constraints", "env", "priority", "cluster_pin", "x"]), json_values))
@settings(max_examples=300)
def test_arbitrary_json_objects_decode_or_raise_invalid_request(body):
    try:
        req = decode_request(SubmitRequest, json.dumps(body).encode())
    except InvalidRequest:
        return
    assert req.command and req.command[0].strip()


def test_spec_hash_ignores_job_id_only():
    a = decode_request(SubmitRequest, submit(job_id="a", env={"X": "1", "Y": "2"}))
    b = decode_request(SubmitRequest, submit(job_id="b", env={"Y": "2", "X": "1"}))
    c = decode_request(SubmitRequest, submit(job_id="a", env={"X": "1"}))
    assert a.spec_hash() == b.spec_hash() != c.spec_hash()


def test_cancel_request_strict():
    assert decode_request(CancelRequest, b'{"job_id": "j1"}').job_id == "j1"
    with pytest.raises(InvalidRequest, match="unknown field"):
        decode_request(CancelRequest, b'{"job_id": "j1", "force": true}')


def test_internal_messages_tolerate_unknown_fields():
    hb = Heartbeat(peer_id="p", seq=3, sent_at=datetime.now(UTC), ttl_s=6.0, run_id="r",
                   backends=[BackendAd("b", {"device_type": ["gpu"]}, Capacity(8, 2))])
    raw = msgspec.json.decode(encoder.encode(hb))
    raw["added_in_v2"] = {"anything": True}
    assert decode_internal(Heartbeat, msgspec.json.encode(raw)) == hb
    notice = AssignmentNotice("j", "p", 4)
    assert decode_internal(AssignmentNotice, encoder.encode(notice)) == notice
    event = JobEvent("j", "running", "p", 1, datetime.now(UTC))
    assert decode_internal(JobEvent, encoder.encode(event)) == event


def test_reply_decoding_for_clients():
    err = decode_reply(error_reply("conflict", "different spec"))
    assert err.error.code == "conflict"
    ok = decode_reply(encoder.encode(SubmitReply("j", "queue", "queued", "", False, "r")))
    assert ok.disposition == "queue"


def test_json_schemas_cover_every_message():
    schemas = json_schemas()
    assert set(schemas) == {kind.__name__ for kind in WIRE_MESSAGES}
    submit_schema = schemas["SubmitRequest"]
    target = submit_schema["$defs"]["SubmitRequest"]
    assert target["required"] == ["command"]
    assert target["additionalProperties"] is False
    assert set(target["properties"]) >= {"command", "job_id", "constraints", "cluster_pin", "deadline_s"}
    json.dumps(schemas)  # serialisable


@pytest.mark.parametrize("body", [
    {"command": ["echo", "a\u0000b"]},
    {"command": ["true"], "env": {"K": "\u0000"}},
    {"command": ["true"], "env": {"K\u0000": "v"}},
    {"command": ["true"], "labels": {"team": "x\u0000"}},
    {"command": ["true"], "name": "\u0000"},
    {"command": ["true"], "constraints": [{"key": "zone", "op": "eq", "value": "a\u0000"}]},
])
def test_nul_in_any_string_is_refused(body):
    # Postgres text cannot store NUL: refusing it at decode keeps it out of a batch.
    with pytest.raises(InvalidRequest, match="NUL"):
        decode_request(SubmitRequest, json.dumps(body).encode())


def test_escaped_backslash_u0000_is_plain_text():
    body = json.dumps({"command": ["printf", "\\u0000"]}).encode()
    assert b"\\\\u0000" in body
    assert decode_request(SubmitRequest, body).command == ["printf", "\\u0000"]


def test_internal_messages_with_nul_are_refused():
    from irisfed.shared.messages import Heartbeat, decode_internal

    body = json.dumps({"peer_id": "p", "seq": 1, "sent_at": "2026-11-30T00:00:00Z", "ttl_s": 6.0,
                       "backends": [{"name": "main", "attributes": {"zone": ["a\u0000"]},
                                     "capacity": {"total": 1, "free": 1}}]}).encode()
    with pytest.raises(msgspec.ValidationError, match="NUL"):
        decode_internal(Heartbeat, body)
    assert decode_internal(Heartbeat, body.replace(b"\\u0000", b"")).backends[0].attributes == {"zone": ["a"]}


# ---------------------------------------------------------------- additions to v1 (docs/design.md §3.1)


def test_v1_submit_canonical_spec_is_unchanged_by_the_additions():
    # Stored spec hashes of jobs submitted before resources existed must still match.
    req = decode_request(SubmitRequest, submit(priority=3))
    assert req.canonical_spec() == b'{"command":["echo","hi"],"priority":3}'


def test_equivalent_resource_requests_are_the_same_job():
    hashes = {decode_request(SubmitRequest, submit(job_id="a", resources=r)).spec_hash()
              for r in ({}, {"cpu": 1}, {"cpu": 1.0}, {"cpu": 1, "gpu": 0})}
    assert hashes == {decode_request(SubmitRequest, submit(job_id="b")).spec_hash()}
    other = decode_request(SubmitRequest, submit(resources={"cpu": 2})).spec_hash()
    assert other not in hashes
    assert decode_request(SubmitRequest, submit(resources={"gpu": 1, "cpu": 1})).spec_hash() == \
        decode_request(SubmitRequest, submit(resources={"gpu": 1})).spec_hash()


def test_resources_and_preferences_roundtrip():
    body = submit(resources={"cpu": 0.25, "memory_mb": 512, "gpu": 1},
                  preferences=[{"key": "zone", "op": "eq", "value": "a"}, {"key": "spot", "op": "not_exists"}])
    req = decode_request(SubmitRequest, body)
    assert decode_request(SubmitRequest, encoder.encode(req)) == req
    assert req.resource_request().as_dict() == {"cpu": 0.25, "gpu": 1, "memory_mb": 512}
    assert [c.describe() for c in req.preference_list()] == ["zone == a", "not_exists(spot)"]


@pytest.mark.parametrize(
    ("preferences", "fragment"),
    [
        ([{"key": "k", "op": "like", "value": "x"}], "preferences[0].op must be"),
        ([{"key": "k", "op": "gt", "value": "big"}], "numeric"),
        ([{"key": "k", "op": "exists", "value": "a"}], "takes no value"),
        ([{"key": "k", "op": "eq", "value": "a", "extra": 1}], "unknown field 'extra' in preferences[0]"),
        ({"key": "k"}, "preferences must be a list, not an object"),
        ([{"key": "k", "op": "eq", "value": "x"}] * 65, "preferences must have at most 64 items"),
    ],
)
def test_bad_preferences_are_invalid_like_constraints(preferences, fragment):
    with pytest.raises(InvalidRequest) as info:
        decode_request(SubmitRequest, submit(preferences=preferences))
    assert fragment in info.value.message


def test_schema_documents_resources_and_preferences():
    target = json_schemas()["SubmitRequest"]["$defs"]["SubmitRequest"]
    assert {"resources", "preferences"} <= set(target["properties"])
    assert target["required"] == ["command"]
    backend = json_schemas()["Heartbeat"]["$defs"]["BackendAd"]
    assert "resources" in backend["properties"] and "resources" not in backend["required"]


def test_heartbeat_resources_are_optional_both_ways():
    from irisfed.shared.messages import ResourceAmount

    legacy = json.dumps({"peer_id": "p", "seq": 1, "sent_at": "2026-11-30T00:00:00Z", "ttl_s": 6.0,
                         "backends": [{"name": "main", "attributes": {}, "capacity": {"total": 2, "free": 2}}]})
    hb = decode_internal(Heartbeat, legacy.encode())
    assert hb.backends[0].resources == {}
    rich = Heartbeat(peer_id="p", seq=2, sent_at=datetime.now(UTC), ttl_s=6.0, backends=[
        BackendAd("slurm", {"device_type": ["gpu"]}, Capacity(8, 8),
                  {"cpu": ResourceAmount(64, 60.5), "gpu": ResourceAmount(8, 4)})])
    again = decode_internal(Heartbeat, encoder.encode(rich))
    assert again == rich and again.backends[0].resources["gpu"].free == 4
    # An older decoder (a BackendAd without the field) ignores it: internal messages tolerate unknown fields.

    class OldBackendAd(msgspec.Struct, frozen=True):
        name: str
        attributes: dict[str, list[str]]
        capacity: Capacity

    class OldHeartbeat(msgspec.Struct, frozen=True):
        peer_id: str
        seq: int
        sent_at: datetime
        ttl_s: float
        backends: list[OldBackendAd]

    assert msgspec.json.decode(encoder.encode(rich), type=OldHeartbeat).backends[0].capacity.total == 8


@given(st.dictionaries(st.text(max_size=8) | st.sampled_from(["cpu", "gpu", "memory_mb", "tpu", "slots"]),
                       json_values | st.floats() | st.integers(min_value=-(10**20), max_value=10**20),
                       max_size=5))
@settings(max_examples=300)
def test_arbitrary_resources_decode_or_raise_invalid_request(resources):
    try:
        body = json.dumps({"command": ["true"], "resources": resources}).encode()
        req = decode_request(SubmitRequest, body)
    except InvalidRequest:
        return
    request = req.resource_request()
    assert all(units > 0 for _, units in request.units)
    assert decode_request(SubmitRequest, req.canonical_spec()).resource_request() == request
