"""The chaos workload's pipelines (docs/design.md §3.8; invariant 16): chains whose
every job waits for the one before on a valid condition, and jobs made to fail."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from irisfed.shared.dependencies import CONDITIONS
from irisfed.tooling.chaos.result import ChaosSummary, ScheduleResult
from irisfed.tooling.chaos.workload import job_body, pipeline_edges

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("seed", range(20))
def test_every_job_of_a_chain_waits_for_the_one_before_and_only_on_earlier_ones(seed):
    rng = random.Random(seed)
    length = rng.randint(1, 5)
    chain = pipeline_edges(rng, length)
    assert len(chain) == length and chain[0] == []
    for i, needs in enumerate(chain[1:], start=1):
        assert needs[0][0] == i - 1
        assert all(0 <= j < i for j, _ in needs) and len({j for j, _ in needs}) == len(needs)
        assert all(when in CONDITIONS for _, when in needs)


def test_chains_draw_every_condition():
    rng = random.Random(7)
    whens = {when for _ in range(50) for needs in pipeline_edges(rng, 4) for _, when in needs}
    assert whens == set(CONDITIONS)


@pytest.mark.parametrize(("fails", "code"), [(True, "1"), (False, "0")])
def test_a_job_made_to_fail_exits_1_and_one_made_to_succeed_exits_0(fails, code):
    for seed in range(30):
        body = job_body(random.Random(seed), "j", Path("/tmp/runs.log"), kind="local", fails=fails)
        assert body["labels"]["sim.exit_code"] == code and body["command"][5] == code


@pytest.mark.parametrize("seed", range(30))
def test_forcing_the_exit_a_job_would_have_drawn_changes_nothing(seed):
    """``fails`` draws as a job left to chance does: a seed's other draws stay as they were."""
    drawn_rng, forced_rng = random.Random(seed), random.Random(seed)
    drawn = job_body(drawn_rng, "j", Path("/tmp/runs.log"))
    forced = job_body(forced_rng, "j", Path("/tmp/runs.log"), fails=drawn["labels"]["sim.exit_code"] == "1")
    assert forced == drawn and forced_rng.random() == drawn_rng.random()


def test_the_summary_counts_pipelines():
    results = [ScheduleResult(0, pipelines=2, dependency_edges=5, dependents_started=2, dependents_unschedulable=3),
               ScheduleResult(1, pipelines=1, dependency_edges=2, dependents_started=1)]
    summary = ChaosSummary(1, results)
    assert (summary.pipelines, summary.dependency_edges, summary.dependents_started,
            summary.dependents_unschedulable) == (3, 7, 3, 3)
    assert "| pipelines: sent=3 edges=7 started=3 unschedulable=3 " in summary.line()
