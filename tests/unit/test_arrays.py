"""Arrays as pure rules (docs/design.md §3.8): the request's checks, the flag, each
element's request and the one line an array shows."""

from __future__ import annotations

import msgspec
import pytest

from irisfed.services.router.arrays import array_words, element_id, element_request, held_words
from irisfed.shared.arrays import array_state, counts_words, fold_arrays
from irisfed.shared.errors import ConfigError
from irisfed.shared.lifecycle import JobState
from irisfed.shared.messages import SubmitRequest, decode_request
from irisfed.shared.shorthands import parse_array

pytestmark = pytest.mark.unit


def _request(**fields) -> SubmitRequest:
    return msgspec.convert({"command": ["true"], **fields}, SubmitRequest)


@pytest.mark.parametrize(("body", "words"), [
    ({"array": 0}, "array"),
    ({"array": 10_001}, "array"),
    ({"array": 3, "array_parallel": 0}, "array_parallel"),
    ({"array_parallel": 2}, "array_parallel limits an array: give array too"),
    ({"array": 3, "env": {"IRISFED_ARRAY_INDEX": "1"}}, "env: IRISFED_ARRAY_INDEX is set for each job"),
    ({"array": 10_000, "job_id": "x" * 124}, "job_id: an array's jobs are <job_id>_<i>, so with array 10000 "
                                             "it may have at most 123 characters"),
])
def test_a_bad_array_is_refused_naming_the_field(body, words):
    from irisfed.shared.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match=words.replace("(", r"\(").replace(")", r"\)")):
        decode_request(SubmitRequest, msgspec.json.encode({"command": ["true"], **body}))


def test_an_array_keeps_the_hash_of_a_plain_job_when_absent():
    assert _request().spec_hash() == _request(array=None).spec_hash()
    assert _request(array=2).spec_hash() != _request(array=3).spec_hash()


def test_each_element_runs_the_same_job_told_its_index():
    request = _request(job_id="sweep", array=6, array_parallel=2, env={"LR": "0.1"})
    element = element_request(request, 4)
    assert element.env == {"LR": "0.1", "IRISFED_ARRAY_INDEX": "4", "IRISFED_ARRAY_SIZE": "6"}
    assert (element.array, element.array_parallel, element.command) == (None, None, ["true"])
    assert element_id("sweep", 4) == "sweep_4"


def test_what_an_array_says():
    assert array_words("sweep", 6, 2) == "array of 6 jobs sweep_0 … sweep_5, at most 2 live at once"
    assert array_words("one", 1, None) == "array of 1 job one_0"
    assert array_words("wide", 3, 5) == "array of 3 jobs wide_0 … wide_2"  # a limit above the size limits nothing
    assert held_words("sweep", 2) == "waiting for a slot of array sweep (2 live at once)"


@pytest.mark.parametrize(("text", "parsed"), [("6", (6, None)), ("6%2", (6, 2)), (" 10000 % 1 ", (10_000, 1))])
def test_the_array_flag(text, parsed):
    assert parse_array(text) == parsed


@pytest.mark.parametrize("text", ["", "0", "6%", "6%0", "10001", "-1", "a%b", "6%2%1"])
def test_a_bad_array_flag_is_refused_naming_it(text):
    with pytest.raises(ConfigError, match="--array must be N or N%K"):
        parse_array(text)


def test_an_array_shows_its_most_telling_state_and_its_counts():
    assert array_state({"succeeded": 3, "running": 1}) == "running"
    assert array_state({"succeeded": 3, "failed": 1}) == "failed"
    assert array_state({"succeeded": 3}) == "succeeded"
    assert counts_words({"queued": 1, "succeeded": 3, "running": 2}) == "6 jobs: 2 running, 1 queued, 3 succeeded"


class _Row(msgspec.Struct, frozen=True):
    job_id: str
    state: JobState
    reason: str = ""
    array_id: str | None = None


def test_fold_puts_one_line_per_array_where_its_newest_job_stood():
    rows = [_Row("a_2", JobState.QUEUED, array_id="a"), _Row("plain", JobState.RUNNING),
            _Row("a_1", JobState.RUNNING, array_id="a"), _Row("a_0", JobState.SUCCEEDED, array_id="a")]
    folded = fold_arrays(rows, {"a": {"queued": 5, "running": 1, "succeeded": 1}})
    assert [(r.job_id, r.state, r.reason) for r in folded] == [
        ("a", "running", "7 jobs: 1 running, 5 queued, 1 succeeded"), ("plain", "running", "")]
    counted = fold_arrays(rows, {})  # counts not read: counted from the rows
    assert counted[0].reason == "3 jobs: 1 running, 1 queued, 1 succeeded"
