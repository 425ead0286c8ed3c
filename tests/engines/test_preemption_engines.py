"""Preemption on real engines (docs/design.md §3.3): a ``batch`` job running in Slurm or
Ray is preempted by an ``interactive`` job that needs what it holds.

A federation (router, tick, agents as processes; tests/e2e/conftest.py's ``federation``)
with an engine peer (tests/infra/engine_peers.py: Slurm behind ``gpu-west``, Ray
behind ``tpu-east``). The victim holds every accelerator of the engine; the tick moves
it back to the queue under a new epoch and assigns the new job there; the agent ends
the victim's engine run (Slurm: SIGTERM, the job FAILED by it within its grace, or
CANCELLED by ``scancel`` after it; Ray: ``stop_job``, the job STOPPED), the new job runs in the engine, and the victim runs again there later,
once. The session's engines come from tests/engines/fixtures.py: outside CI a missing
engine skips with its reason, under ``CI=true`` it fails.
"""

from __future__ import annotations

import pytest

from irisfed.shared.lifecycle import TERMINAL_STATES
from tests.e2e.conftest import federation  # noqa: F401 - the federation of service processes
from tests.infra.engine_peers import Engine, engine_for, start_with_engine, unique_job_id, until
from tests.infra.waiting import wait_for

# Its first copy runs until it is stopped; any later copy ends at once.
FIRST_COPY_LINGERS = ["sh", "-c", 'if [ "$IRISFED_EPOCH" = 1 ]; then sleep 300; fi; echo ran']


@pytest.fixture(params=["slurm", "ray"])
def engine(request) -> Engine:
    return engine_for(request)


async def _ended_once(fed, job_id: str):
    done = await fed.wait_state(job_id, *TERMINAL_STATES, timeout=180)
    assert done.state == "succeeded", done
    history = await fed.store.changelog_list_for_job(job_id)
    terminal = [(row.to_state, row.epoch) for row in history if row.to_state in TERMINAL_STATES]
    assert terminal == [("succeeded", done.epoch)], history
    return done


async def test_a_batch_job_in_the_engine_is_preempted_by_an_interactive_job(federation, engine):  # noqa: F811
    await start_with_engine(federation, engine)
    whole = int(engine.totals()[engine.accelerator])
    needs_all = {"cpu": 1, engine.accelerator: whole}
    victim, urgent = unique_job_id("victim"), unique_job_id("urgent")

    await federation.submit({"job_id": victim, "command": FIRST_COPY_LINGERS, "resources": needs_all,
                             "band": "batch", "max_retries": 0})
    running = await federation.wait_state(victim, "running", timeout=120)
    assert (running.owner_peer_id, running.epoch) == (engine.peer_id, 1), running
    await until(lambda: engine.runs_in(victim, "RUNNING"),
                "the victim to run in the engine")

    await federation.submit({"job_id": urgent, "command": ["sh", "-c", "echo urgent"], "resources": needs_all})

    async def preempted():
        rows = await federation.store.changelog_list_for_job(victim)
        return [r for r in rows if r.detail == f"preempted by {urgent}"]
    (moved,) = await wait_for(preempted, f"{urgent} to preempt {victim}", timeout=120)
    assert (moved.from_state, moved.to_state, moved.epoch) == ("running", "queued", 2), moved

    # The engine ends the victim's run: it no longer runs it.
    (engine_id, killed, epoch), = await until(
        lambda: [r for r in engine.runs_of(victim) if r[2] == 1 and r[1] in engine.killed_states] or None,
        f"the engine to show the victim's run {'/'.join(engine.killed_states)}")
    assert epoch == 1

    done = await _ended_once(federation, urgent)
    assert (done.owner_peer_id, done.epoch, done.exit_code) == (engine.peer_id, 1, 0), done
    assert [(r[1], r[2]) for r in engine.runs_of(urgent)] in ([("COMPLETED", 1)], [("SUCCEEDED", 1)])

    # The victim runs again there (the only peer with the accelerator), once, and
    # neither its retries nor its first run's end were counted.
    done = await _ended_once(federation, victim)
    assert (done.owner_peer_id, done.preemptions, done.max_retries, done.attempts) == (
        engine.peer_id, 1, 0, 2), done
    assert done.epoch > 2
    runs = sorted(engine.runs_of(victim), key=lambda r: r[2])
    assert [(state, epoch) for _, state, epoch in runs] == [
        (killed, 1), ("COMPLETED" if engine.kind == "slurm" else "SUCCEEDED", done.epoch)], runs
    assert runs[0][0] == engine_id
