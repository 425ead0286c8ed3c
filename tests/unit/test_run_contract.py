"""What a job's run contract says as people read it (shared/run_contract.py), and the
flags that ask for it (docs/design.md §3.7)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest

from irisfed.shared.errors import ConfigError, InvalidRequest
from irisfed.shared.lifecycle import JobState
from irisfed.shared.messages import SubmitRequest, decode_request
from irisfed.shared.run_contract import contract_text, grace_of, grace_until, runs_text
from irisfed.shared.shorthands import duration_words, parse_duration

AT = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)


def _job(**fields) -> SimpleNamespace:
    base = dict(spec={}, state=JobState.RUNNING, attempts=1, max_retries=2, preemptions=0, failures=0, restarts=0,
                cancel_requested=False, cancel_requested_at=None, stopping_on=None, updated_at=AT)
    return SimpleNamespace(**{**base, **fields})


def test_the_contract_reads_as_its_flags_were_written():
    assert contract_text({}) == "no time limit, grace 30s, failure retries 0"
    assert contract_text({"time_limit_s": 7200, "grace_s": 0, "max_failure_retries": 3}) == (
        "time limit 2h, grace 0s, failure retries 3")
    assert grace_of({"grace_s": True}) == 30.0  # not a number: the default


def test_runs_say_why_each_ran_again_and_what_retries_are_left():
    assert runs_text(_job()) == "1 run; infrastructure retries 0 of 2"
    assert runs_text(_job(attempts=5, preemptions=1, failures=1, restarts=1, spec={"max_failure_retries": 2})) == (
        "5 runs: again after 1 failure (of 2 allowed), 1 preemption, 1 agent restart; infrastructure retries 1 of 2")
    # A preempted job's page: a preemption spends no retry (no "attempts 2 of 3").
    assert runs_text(_job(attempts=2, preemptions=1)) == "2 runs: again after 1 preemption; infrastructure retries 0 of 2"


def test_the_grace_end_of_a_stop_under_way():
    cancelled = _job(cancel_requested=True, cancel_requested_at=AT, spec={"grace_s": 90})
    assert grace_until(cancelled) == AT + timedelta(seconds=90)
    preempted = _job(state=JobState.QUEUED, stopping_on="gpu-west")
    assert grace_until(preempted) == AT + timedelta(seconds=30)
    assert grace_until(_job()) is None and grace_until(_job(state=JobState.KILLED, cancel_requested=True,
                                                            cancel_requested_at=AT)) is None


@pytest.mark.parametrize(("text", "seconds"), [("90", 90), ("30m", 1800), ("2h", 7200), ("1.5s", 1.5), ("1m30s", 90),
                                                  ("1h30m", 5400)])
def test_durations_read_and_write_back(text, seconds):
    assert parse_duration(text, "--time-limit") == seconds
    assert parse_duration(duration_words(seconds), "--time-limit") == seconds


def test_a_grace_may_be_zero_and_a_time_limit_may_not():
    assert parse_duration("0", "--grace", zero=True) == 0
    with pytest.raises(ConfigError, match="--time-limit must be a duration like 90s"):
        parse_duration("0", "--time-limit")
    with pytest.raises(ConfigError, match="--grace must be a duration"):
        parse_duration("-1", "--grace", zero=True)


@pytest.mark.parametrize(("body", "message"), [
    ({"grace_s": 601}, "grace_s must be at most 600"),
    ({"grace_s": -1}, "grace_s must be at least 0"),
    ({"time_limit_s": 0}, "time_limit_s must be more than 0"),
    ({"max_failure_retries": 101}, "max_failure_retries must be at most 100"),
])
def test_bad_contract_fields_are_refused_in_one_plain_sentence(body, message):
    with pytest.raises(InvalidRequest) as refused:
        decode_request(SubmitRequest, json.dumps({"command": ["x"], **body}).encode())
    assert str(refused.value) == message


def test_the_contract_fields_keep_an_old_jobs_hash():
    assert SubmitRequest(["x"]).spec_hash() == SubmitRequest(["x"], grace_s=None, max_failure_retries=0).spec_hash()
    assert SubmitRequest(["x"]).spec_hash() != SubmitRequest(["x"], grace_s=5).spec_hash()
