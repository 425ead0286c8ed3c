"""docs/design.md §6 checks shared by every end-to-end test (and the chaos suite)."""

from __future__ import annotations

from collections import defaultdict

from irisfed.services.common.store import Store
from irisfed.shared.lifecycle import JobState, can_transition


async def changelog_violations(store: Store) -> list[str]:
    """Everything wrong between `jobs` and `federation_changelog` (empty: all good).

    - the changelog replays, transition by legal transition, to each job's state;
    - epochs never go backwards and end at the job's epoch;
    - a pinned job never reaches a peer other than its pin;
    - no job succeeds twice.
    """
    problems: list[str] = []
    history = defaultdict(list)
    for row in await store.changelog_list_all():
        history[row.job_id].append(row)
    for job in await store.job_list_states():
        job_id = job.job_id
        rows = history.pop(job_id, [])
        if not rows:
            problems.append(f"{job_id}: no changelog rows")
            continue
        state: JobState | None = None
        epoch = -1
        successes = 0
        for row in rows:
            from_state = JobState(row.from_state) if row.from_state else None
            to_state = JobState(row.to_state)
            if from_state != state:
                problems.append(f"{job_id}: seq {row.seq} starts from {from_state} but the job was {state}")
            if not can_transition(from_state, to_state):
                problems.append(f"{job_id}: seq {row.seq} illegal {from_state} → {to_state}")
            if row.epoch < epoch:
                problems.append(f"{job_id}: epoch went back from {epoch} to {row.epoch}")
            pin = job.pinned_peer_id
            if pin and row.peer_id and row.peer_id != pin:
                problems.append(f"{job_id}: pinned to {pin} but reached {row.peer_id}")
            successes += to_state is JobState.SUCCEEDED
            state, epoch = to_state, row.epoch
        if state is not None and state.value != job.state:
            problems.append(f"{job_id}: changelog replays to {state.value} but jobs says {job.state}")
        if epoch != job.epoch:
            problems.append(f"{job_id}: changelog ends at epoch {epoch} but jobs says {job.epoch}")
        if successes > 1:
            problems.append(f"{job_id}: succeeded {successes} times")
    for job_id in history:
        problems.append(f"{job_id}: changelog rows for a job that does not exist")
    return problems


async def assert_changelog_replays(store: Store) -> None:
    problems = await changelog_violations(store)
    assert not problems, "invariant violations:\n" + "\n".join(problems)
