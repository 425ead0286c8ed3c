"""Hostile review of the run contract's wire fields (docs/design.md §3.7): forged and
out-of-range ``grace_s``, ``time_limit_s`` and ``max_failure_retries`` are refused in one
plain sentence naming the field, whoever builds the body (a raw producer or
``irisfed.client``); and the retry accounting stays consistent whatever mix of
failures, preemptions and agent restarts a job went through. Pure: no process, no socket.
"""

from __future__ import annotations

import json
import math

import pytest

from irisfed.client import InvalidRequestError
from irisfed.jobs import build_submit
from irisfed.shared.errors import InvalidRequest
from irisfed.shared.messages import SubmitRequest, decode_request
from irisfed.shared.retry import after_infra_failure, may_retry_infra_failure, retries_used
from irisfed.shared.run_contract import contract_text

pytestmark = pytest.mark.unit


def _body(field: str, raw: str) -> bytes:
    return f'{{"command": ["x"], "{field}": {raw}}}'.encode()


# ---------------------------------------------------------------- a raw producer's body


@pytest.mark.parametrize(("field", "raw", "read"), [
    ("grace_s", "0", 0.0),
    ("grace_s", "600", 600.0),
    ("grace_s", "0.5", 0.5),
    ("grace_s", "null", None),
    ("time_limit_s", "1", 1.0),
    ("time_limit_s", "31536000", 31536000.0),
    ("time_limit_s", "null", None),
    ("max_failure_retries", "0", 0),
    ("max_failure_retries", "100", 100),
])
def test_the_bounds_themselves_are_accepted(field, raw, read):
    assert getattr(decode_request(SubmitRequest, _body(field, raw)), field) == read


@pytest.mark.parametrize(("field", "raw"), [
    # out of bounds
    ("grace_s", "600.0000001"), ("grace_s", "601"), ("grace_s", "-1"), ("grace_s", "-1e-9"),
    ("time_limit_s", "0"), ("time_limit_s", "-5"), ("time_limit_s", "31536001"),
    ("max_failure_retries", "101"), ("max_failure_retries", "-1"),
    # huge numbers (a float overflowing to inf, an integer past 64 bits)
    ("grace_s", "1e400"), ("time_limit_s", "1e400"), ("time_limit_s", "-1e400"),
    ("max_failure_retries", "99999999999999999999999999"), ("max_failure_retries", "-99999999999999999999999999"),
    # wrong types: strings, booleans, fractions, containers
    ("grace_s", '"30"'), ("grace_s", '"30s"'), ("grace_s", "true"), ("grace_s", "false"), ("grace_s", "[]"),
    ("grace_s", "{}"),
    ("time_limit_s", '"1h"'), ("time_limit_s", "true"), ("time_limit_s", "[1]"),
    ("max_failure_retries", '"2"'), ("max_failure_retries", "true"), ("max_failure_retries", "false"),
    ("max_failure_retries", "1.5"), ("max_failure_retries", "1.0"), ("max_failure_retries", "null"),
])
def test_each_bad_value_is_refused_in_one_sentence_naming_its_field(field, raw):
    with pytest.raises(InvalidRequest) as refused:
        decode_request(SubmitRequest, _body(field, raw))
    message = str(refused.value)
    assert field in message, message
    assert "\n" not in message and "Traceback" not in message and "msgspec" not in message, message


@pytest.mark.parametrize("raw", ["NaN", "Infinity", "-Infinity", "nan", "inf"])
@pytest.mark.parametrize("field", ["grace_s", "time_limit_s", "max_failure_retries"])
def test_nan_and_infinity_tokens_are_refused_as_not_json(field, raw):
    """What Python's ``json.dumps`` writes for float('nan') and float('inf') is not JSON:
    refused (the sentence says the body is not valid JSON and where, not the field: it
    cannot be parsed far enough to know one)."""
    with pytest.raises(InvalidRequest) as refused:
        decode_request(SubmitRequest, _body(field, raw))
    assert "not valid JSON" in str(refused.value) and "\n" not in str(refused.value)


def test_python_json_dumps_of_a_nan_grace_is_refused_too():
    body = json.dumps({"command": ["x"], "grace_s": math.nan}).encode()  # allow_nan: writes NaN
    with pytest.raises(InvalidRequest):
        decode_request(SubmitRequest, body)


# ---------------------------------------------------------------- irisfed.client's own builder


@pytest.mark.parametrize(("field", "value"), [
    ("grace_s", math.nan), ("grace_s", math.inf), ("grace_s", -math.inf),
    ("time_limit_s", math.nan), ("time_limit_s", math.inf), ("time_limit_s", -math.inf),
])
def test_the_client_refuses_a_non_finite_contract_value_naming_the_field(field, value):
    with pytest.raises(InvalidRequestError, match=field):
        build_submit(["x"], **{field: value})


@pytest.mark.parametrize(("field", "value"), [
    ("grace_s", True), ("grace_s", "30"), ("grace_s", 601), ("grace_s", -1),
    ("time_limit_s", 0), ("time_limit_s", False), ("time_limit_s", "1h"),
    ("max_failure_retries", True), ("max_failure_retries", 1.5), ("max_failure_retries", 101),
    ("max_failure_retries", -1), ("max_failure_retries", "2"),
])
def test_the_client_refuses_what_the_router_refuses(field, value):
    with pytest.raises(InvalidRequestError, match=field):
        build_submit(["x"], **{field: value})


def test_a_negative_zero_grace_reads_as_zero():
    request = decode_request(SubmitRequest, _body("grace_s", "-0.0"))
    assert "-0" not in contract_text({"grace_s": request.grace_s})


def test_the_contract_defaults_leave_the_spec_hash_alone():
    """Omitted at their defaults: a v1 body and one spelling the defaults out are the same job
    (so a resubmit is a duplicate, not a conflict)."""
    plain = decode_request(SubmitRequest, b'{"command": ["x"], "job_id": "a"}')
    spelled = decode_request(SubmitRequest, b'{"command": ["x"], "job_id": "a", "grace_s": null, '
                                            b'"time_limit_s": null, "max_failure_retries": 0}')
    assert plain == spelled


# ---------------------------------------------------------------- retry accounting


@pytest.mark.parametrize(("attempts", "preemptions", "failures", "restarts", "used"), [
    (1, 0, 0, 0, 0),
    (3, 0, 2, 0, 0),   # two failure retries: no infrastructure retry spent
    (4, 1, 1, 1, 0),   # one of each reason to run again
    (5, 1, 1, 1, 1),   # ... and one infrastructure retry on top
    (2, 1, 1, 0, 0),   # preempted before it started (counted in its favour): never below 0
])
def test_retries_used_counts_only_infrastructure_retries(attempts, preemptions, failures, restarts, used):
    spared = failures + restarts
    assert retries_used(attempts, preemptions, spared) == used
    assert may_retry_infra_failure(attempts, 0, preemptions, spared) is False  # max_retries 0: never
    assert may_retry_infra_failure(attempts, used + 1, preemptions, spared) is True
    assert after_infra_failure(attempts, used, preemptions, spared).to_state.value == "failed"


# ---------------------------------------------------------------- per-user event subjects


@pytest.mark.parametrize(("stored", "subject", "seen_id"), [
    ("alice:x.y", "irisfed.uevents.alice.x~y", "x.y"),  # one token: shared.subjects.job_token
    ("alice:x..y", "irisfed.uevents.alice.x~~y", "x..y"),
    ("x.y", "irisfed.uevents.default.x~y", "x.y"),
    ("bob:alice", "irisfed.uevents.bob.alice", "alice"),
])
def test_a_users_event_goes_under_its_own_user_whatever_the_id(stored, subject, seen_id):
    """Dots in an id add tokens after the user's, never before: a job's event can only land
    under ``P.uevents.<its user>.``, which only that user's credentials may subscribe to."""
    from datetime import UTC, datetime

    from irisfed.services.common.bus import user_event
    from irisfed.shared.messages import JobEvent
    from irisfed.shared.subjects import Subjects

    where, copy = user_event(Subjects("irisfed"), JobEvent(stored, "running", "home", 1, datetime.now(UTC)))
    assert (where, copy.job_id) == (subject, seen_id)
    assert where.startswith(f"irisfed.uevents.{stored.partition(':')[0] if ':' in stored else 'default'}.")


@pytest.mark.parametrize("job_id", ["a:b", "alice:x", "x>", "x*", "x y", ".x", "-x", "x" * 129, "x\x00"])
def test_an_id_that_could_change_a_subjects_shape_is_refused(job_id):
    with pytest.raises(InvalidRequest, match="job_id"):
        decode_request(SubmitRequest, json.dumps({"command": ["x"], "job_id": job_id}).encode())


@pytest.mark.parametrize("job_id", ["x.", "x..y", "a-._b."])
def test_an_accepted_job_id_makes_a_valid_event_subject(job_id):
    from datetime import UTC, datetime

    from irisfed.services.common.bus import user_event
    from irisfed.shared.messages import JobEvent
    from irisfed.shared.subjects import Subjects

    try:
        decode_request(SubmitRequest, json.dumps({"command": ["x"], "job_id": job_id}).encode())
    except InvalidRequest:
        return  # refused at submit: no subject is ever made of it
    subjects = Subjects("irisfed")
    where, _ = user_event(subjects, JobEvent(f"alice:{job_id}", "running", "home", 1, datetime.now(UTC)))
    assert "" not in where.split("."), where
    assert "" not in subjects.events(f"alice:{job_id}").split(".")
