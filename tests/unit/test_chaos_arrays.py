"""The chaos workload's arrays (docs/design.md §3.8): an array body whose elements each
exit as drawn (by their index, where they really run), seeded draws, and the summary."""

from __future__ import annotations

import random
from pathlib import Path

import msgspec
import pytest

from irisfed.shared.messages import SubmitRequest
from irisfed.shared.users import stored_job_id
from irisfed.tooling.chaos.result import ChaosSummary, ScheduleResult, most_live
from irisfed.tooling.chaos.schedule import Schedule
from irisfed.tooling.chaos.workload import (
    ARRAY_PARALLEL,
    ARRAY_SIZES,
    JOB_SCRIPT,
    array_body,
    array_exit_codes,
    job_body,
)

pytestmark = pytest.mark.unit


def test_each_element_runs_the_job_script_told_its_own_exit_code():
    """The array's command is the job script (so the run watcher and the log check read its
    lines as any job's) after a line that keeps, of the codes in $2, the element's own:
    field IRISFED_ARRAY_INDEX + 1. (It runs for real in the chaos suite.)"""
    body = array_body(job_body(random.Random(1), "sweep", Path("/tmp/runs.log"), kind="gpu", fails=True),
                      ["0", "1", "0"], 2)
    shell, flag, script, name, duration, codes, log = body["command"]
    assert (shell, flag, name, log) == ("sh", "-c", "chaos-job", "/tmp/runs.log") and float(duration) >= 0
    assert script.endswith(JOB_SCRIPT) and codes == "0,1,0"
    assert 'cut -d, -f"$((IRISFED_ARRAY_INDEX + 1))"' in script.removesuffix(JOB_SCRIPT)


@pytest.mark.parametrize(("codes", "label"), [(["0", "0", "0"], "0"), (["0", "1", "0", "0"], "1")])
def test_an_array_body_is_a_valid_submit(codes, label):
    body = array_body(job_body(random.Random(3), "sweep", Path("/tmp/runs.log"), kind="local"), codes, 2)
    request = msgspec.convert(body, SubmitRequest)
    assert (request.array, request.array_parallel) == (len(codes), 2)
    assert body["labels"]["sim.exit_code"] == label and body["command"][5] == ",".join(codes)
    unlimited = array_body(job_body(random.Random(3), "sweep", Path("/tmp/runs.log"), kind="local"), codes, None)
    assert "array_parallel" not in unlimited and unlimited["array"] == len(codes)


def test_exit_codes_fail_now_and_then():
    rng = random.Random(5)
    codes = [code for _ in range(200) for code in array_exit_codes(rng, 4)]
    assert set(codes) == {"0", "1"} and 0.1 < codes.count("1") / len(codes) < 0.4


def _schedule(tmp_path: Path, seed: int) -> Schedule:
    return Schedule(None, tmp_path, 0, seed, 8, "template", print)  # only its draws are used


@pytest.mark.parametrize("seed", range(12))
def test_a_drawn_array_reproduces_and_its_elements_are_recorded_as_sent(tmp_path, seed):
    first, again = _schedule(tmp_path, seed), _schedule(tmp_path, seed)
    drawn, redrawn = first._draw_array(), again._draw_array()
    assert drawn == redrawn and first.rng.random() == again.rng.random()
    body = drawn.body
    assert body["array"] in ARRAY_SIZES and body["array_parallel"] in ARRAY_PARALLEL
    assert drawn.element_ids() == [f"{body['job_id']}_{i}" for i in range(body["array"])]
    assert {(drawn.user, element) for element in drawn.element_ids()} <= first.ledger.sent
    for job, _ in filter(None, (drawn.head, drawn.dependent)):
        assert job["labels"]["chaos.user"] == drawn.user and "array" not in job


def test_draws_cover_heads_dependents_cancels_and_kinds(tmp_path):
    schedule = _schedule(tmp_path, 11)
    draws = [schedule._draw_array() for _ in range(60)]
    assert any(d.head for d in draws) and any(d.dependent for d in draws)
    assert any(d.cancel_after_s for d in draws) and any(d.cancel_after_s is None for d in draws)
    assert any("1" in d.body["command"][5] for d in draws) and any("1" not in d.body["command"][5] for d in draws)
    assert all(d.body.get("constraints", [{}])[0].get("value") != "fpga" for d in draws)


def test_a_shared_id_is_never_an_array_element_id(tmp_path):
    """A user's plain job never takes another's element id ``<base>_<i>``: its own array
    named ``<base>`` later would find that id taken (and the whole submit refused)."""
    schedule = _schedule(tmp_path, 2)
    schedule.ledger.sent |= {("alice", "sweep_0"), ("alice", "sweep_1")}
    ids = {schedule._new_job(user="bob")[1]["job_id"] for _ in range(200)}
    assert not {i for i in ids if "_" in i}


async def test_an_acknowledged_array_acknowledges_each_element(tmp_path):
    schedule = _schedule(tmp_path, 4)
    body = array_body(job_body(random.Random(1), "sweep", tmp_path / "runs.log", user="alice"), ["0"] * 3, 1)
    reply = {"job_id": "sweep", "disposition": "queue", "state": "queued", "reason": ""}

    async def request(verb, sent, user):
        return reply

    schedule._request = request
    assert await schedule._send("alice", body)
    stored = [stored_job_id("alice", f"sweep_{i}") for i in range(3)]
    assert sorted(schedule.acked) == stored and all(schedule.tokens[s] == "-" for s in stored)
    assert [schedule.ledger.owner_of[s] for s in stored] == [("alice", f"sweep_{i}") for i in range(3)]
    assert schedule.result.violations == []


def test_the_summary_counts_arrays_and_the_one_nearest_its_limit():
    results = [ScheduleResult(0, arrays=2, array_elements=9, array_peaks=[(1, 2), (3, 3)], array_cancels=1),
               ScheduleResult(1, arrays=1, array_elements=4, array_peaks=[(2, 4)], array_dependents=1)]
    summary = ChaosSummary(1, results)
    assert (summary.arrays, summary.array_elements, summary.most_live, summary.arrays_full) == (3, 13, (3, 3), 1)
    assert "| arrays: sent=3 elements=13 most_live=3/3 full=1 after=1 cancelled=1 " in summary.line()
    assert ChaosSummary(1, [ScheduleResult(0)]).most_live == (0, 0)
    assert most_live([(2, 2), (3, 2), (4, 6)]) == (3, 2)  # over its limit comes first
