"""Arrays (docs/design.md §3.8) through real router, tick and agent processes: at most K
live at once, each element told its index, the base id naming them all for `after`,
`cancel` and `irisfed jobs`, an array of gangs, and one duplicate check for the whole."""

from __future__ import annotations

import pytest

from tests.infra.configs import make_peer

pytestmark = pytest.mark.e2e

ENDED = ("succeeded", "failed", "killed", "rejected", "unschedulable")


def most_live_at_once(histories: dict[str, list]) -> int:
    """The most elements assigned or running at one time, from their changelogs (an end at
    the same instant as a start counts first: the start was released by it)."""
    events = []
    for rows in histories.values():
        started = next((row.at for row in rows if row.to_state in ("assigned", "running")), None)
        ended = next((row.at for row in rows if row.to_state in ENDED), None)
        if started is not None:
            events += [(started, 1), (ended, -1)]
    live = most = 0
    for _, change in sorted(events, key=lambda e: (e[0], e[1])):
        live += change
        most = max(most, live)
    return most


def test_most_live_at_once_counts_overlaps():
    from types import SimpleNamespace as Row
    two = {"a": [Row(to_state="running", at=1), Row(to_state="succeeded", at=3)],
           "b": [Row(to_state="assigned", at=2), Row(to_state="succeeded", at=4)],
           "c": [Row(to_state="running", at=3), Row(to_state="succeeded", at=5)]}
    assert most_live_at_once(two) == 2
    two["d"] = [Row(to_state="running", at=2.5), Row(to_state="succeeded", at=2.6)]
    assert most_live_at_once(two) == 3


async def test_six_jobs_two_at_a_time_each_told_its_index_then_one_after_them_all(federation):
    federation.configure([make_peer("home", "cpu", 4)])
    await federation.start_federation("home")
    reply = await federation.submit({"job_id": "sweep", "array": 6, "array_parallel": 2, "command": [
        "sh", "-c", 'echo "index $IRISFED_ARRAY_INDEX of $IRISFED_ARRAY_SIZE"; sleep 0.3']})
    assert (reply["job_id"], reply["state"]) == ("sweep", "queued"), reply
    assert reply["reason"] == "array of 6 jobs sweep_0 … sweep_5, at most 2 live at once"
    report = await federation.submit({"job_id": "report", "command": ["true"], "after": [{"job_id": "sweep"}]})
    assert report["reason"].startswith("waiting for its dependencies: sweep_0 ("), report
    again = await federation.submit({"job_id": "sweep", "array": 6, "array_parallel": 2, "command": [
        "sh", "-c", 'echo "index $IRISFED_ARRAY_INDEX of $IRISFED_ARRAY_SIZE"; sleep 0.3']})
    assert again["duplicate"] is True and again["reason"] == reply["reason"]
    other = await federation.submit({"job_id": "sweep", "array": 3, "command": ["true"]})
    assert other["error"]["code"] == "conflict", other
    elements = [f"sweep_{i}" for i in range(6)]
    rows = {j: await federation.wait_state(j, *ENDED, timeout=120) for j in elements}
    assert {row.state for row in rows.values()} == {"succeeded"}
    histories = {j: await federation.store.changelog_list_for_job(j) for j in elements}
    assert most_live_at_once(histories) <= 2
    for index, job in enumerate(elements):
        shown = federation.cli("logs", job)
        assert f"index {index} of 6" in shown.stdout, (job, shown.stdout, shown.stderr)
    last_end = max(next(r.at for r in h if r.to_state == "succeeded") for h in histories.values())
    done = await federation.wait_state("report", *ENDED, timeout=60)
    started = next(r.at for r in await federation.store.changelog_list_for_job("report") if r.to_state == "running")
    assert done.state == "succeeded" and started >= last_end
    listed = federation.cli("jobs", "--wide")
    assert "6 jobs: 6 succeeded" in listed.stdout and "sweep_3" not in listed.stdout, listed.stdout
    assert "sweep_3" in federation.cli("jobs", "--expand", "--wide").stdout
    assert "is an array of 6 jobs: 6 succeeded" in federation.cli("job", "sweep").stderr


async def test_cancelling_the_base_ends_every_job_and_what_waits_on_it(federation):
    federation.configure([make_peer("home", "cpu", 4)])
    await federation.start_federation("home")
    await federation.submit({"job_id": "long", "array": 4, "array_parallel": 2, "command": ["sleep", "60"]})
    await federation.submit({"job_id": "then", "command": ["true"], "after": [{"job_id": "long"}]})
    await federation.wait_state("long_0", "running")
    await federation.wait_state("long_1", "running")
    held = await federation.job("long_3")
    assert (held.state, held.reason) == ("queued", "waiting for a slot of array long (2 live at once)")
    cancelled = await federation.cancel("long")
    assert cancelled["job_id"] == "long" and cancelled["outcome"] == "kill_sent", cancelled
    states = {j: (await federation.wait_state(j, *ENDED, timeout=60)).state for j in
              ("long_0", "long_1", "long_2", "long_3", "then")}
    assert states == {"long_0": "killed", "long_1": "killed", "long_2": "killed", "long_3": "killed",
                      "then": "unschedulable"}
    for job in ("long_2", "long_3"):  # held ones never ran
        assert "running" not in [r.to_state for r in await federation.store.changelog_list_for_job(job)]
    missing = await federation.cancel("nothing-here")
    assert missing["error"]["code"] == "not_found"


async def test_an_array_of_gangs_and_an_id_that_would_collide(federation):
    federation.configure([make_peer("home", "cpu", 3)])
    await federation.start_federation()
    federation.start("home", "--node", "2:cpu=1", "--resource", "cpu=2")  # a gang's tasks need two nodes
    await federation.wait_agent("home")
    reply = await federation.submit({"job_id": "pairs", "array": 2, "replicas": 2, "command": [
        "sh", "-c", "echo $IRISFED_ARRAY_INDEX"]})
    assert reply["state"] == "queued", reply
    rows = [await federation.wait_state(f"pairs_{i}", *ENDED, timeout=120) for i in range(2)]
    assert [(row.state, row.replicas) for row in rows] == [("succeeded", 2), ("succeeded", 2)]
    await federation.submit({"job_id": "taken_1", "command": ["true"]})
    clash = await federation.submit({"job_id": "taken", "array": 3, "command": ["true"]})
    assert clash["error"]["code"] == "conflict" and "taken_1" in clash["error"]["message"], clash
    assert await federation.job("taken_0") is None  # the whole submit wrote nothing
    plain = await federation.submit({"job_id": "pairs", "array": 2, "replicas": 2, "command": ["true"]})
    assert plain["error"]["code"] == "conflict", plain
    bad = await federation.submit({"job_id": "x", "command": ["true"], "array_parallel": 2})
    assert bad["error"]["code"] == "invalid_request" and "array_parallel" in bad["error"]["message"], bad
