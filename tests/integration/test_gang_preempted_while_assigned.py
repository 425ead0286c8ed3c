"""A gang preempted while still ``assigned`` (real Postgres, the tick in process).

A gang's agent launches its tasks while the job is still ``assigned`` and accepts it
(assigned → running) only once every task runs (docs/scheduling.md, "Gangs"). So an
assigned gang, unlike an assigned single-task job, may have live tasks on its peer.
The stopping rule (docs/decisions.md, "A preempted victim waits for its old run to
stop") frees an *assigned* victim at once on the ground that it "never started a run"
— which is not true of a gang. Pinned here: a gang preempted from ``assigned`` waits
(``stopping_on`` = its old peer) like a running victim, and is not placed anywhere
else while that peer has not said its tasks are gone.
"""

from __future__ import annotations

from datetime import UTC, datetime

from irisfed.services.common.store import Store
from irisfed.shared.lifecycle import JobState
from tests.infra.factories import assign_jobs, banded_job, insert_jobs, tick_for


async def advertise_nodes(store: Store, peer_id: str, nodes: int, seq: int = 1) -> None:
    """``peer_id``: one backend of ``nodes`` one-cpu nodes, a slot each, all free."""
    backends = [{"name": "main", "attributes": {}, "capacity": {"total": nodes, "free": nodes},
                 "resources": {"cpu": {"total": nodes, "free": nodes}},
                 "nodes": [{"count": nodes, "attributes": {}, "resources": {"cpu": {"total": 1, "free": 1}}}]}]
    await store.peer_heartbeat_upsert(peer_id, "run-1", seq, backends, 120.0, datetime.now(UTC))


async def test_a_gang_preempted_while_assigned_waits_for_its_launched_tasks_to_stop(pool):
    store = Store(pool)
    await advertise_nodes(store, "gpu-west", 2)
    await advertise_nodes(store, "tpu-east", 2)
    # The batch gang is assigned to gpu-west: its agent has launched its two tasks and
    # waits to accept it (or died meanwhile, its heartbeat not yet expired).
    gang = banded_job("batch", replicas=2)
    await insert_jobs(store, [gang])
    await assign_jobs(store, [gang], "gpu-west")
    urgent = banded_job("interactive", pin="gpu-west")
    await insert_jobs(store, [urgent])
    tick = await tick_for(pool)

    result = await tick.run_once(full=False)
    assert [v.job_id for v in result.preempted] == [gang.job_id], result
    row = await store.job_get(gang.job_id)
    assert (row.state, row.epoch, row.owner_peer_id) == (JobState.QUEUED, 2, None), row
    # Its tasks may be running on gpu-west: it must wait for gpu-west to say they are gone.
    assert row.stopping_on == "gpu-west", (
        f"an assigned gang preempted was freed at once (stopping_on={row.stopping_on!r}) "
        "although its agent launches its tasks before accepting it")

    # tpu-east has room for it: it must still not be placed there meanwhile.
    placed = [(j, p) for j, p, _ in (await tick.run_once(full=False)).assigned]
    assert (gang.job_id, "tpu-east") not in placed, (
        f"the preempted gang was placed on tpu-east while its epoch-1 tasks may still run on gpu-west: {placed}")


async def test_an_assigned_single_task_victim_is_free_at_once(pool):
    """The contrast (documented): an assigned single-task job never started a run."""
    store = Store(pool)
    await advertise_nodes(store, "gpu-west", 1)
    victim = banded_job("batch")
    await insert_jobs(store, [victim])
    await assign_jobs(store, [victim], "gpu-west")
    await insert_jobs(store, [banded_job("interactive", pin="gpu-west")])
    tick = await tick_for(pool)
    assert [v.job_id for v in (await tick.run_once(full=False)).preempted] == [victim.job_id]
    row = await store.job_get(victim.job_id)
    assert (row.state, row.stopping_on) == (JobState.QUEUED, None), row
