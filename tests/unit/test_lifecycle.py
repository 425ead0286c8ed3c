import itertools

import pytest

from irisfed.shared.lifecycle import (
    INITIAL_STATES,
    TERMINAL_STATES,
    TRANSITIONS,
    IllegalTransition,
    JobState,
    can_transition,
    check_transition,
    sources_of,
)

S = JobState
ALLOWED = {
    (S.QUEUED, S.ASSIGNED), (S.QUEUED, S.KILLED), (S.QUEUED, S.UNSCHEDULABLE),
    (S.ASSIGNED, S.RUNNING), (S.ASSIGNED, S.QUEUED), (S.ASSIGNED, S.KILLED), (S.ASSIGNED, S.FAILED),
    (S.RUNNING, S.SUCCEEDED), (S.RUNNING, S.FAILED), (S.RUNNING, S.KILLED), (S.RUNNING, S.QUEUED),
}


@pytest.mark.parametrize(("old", "new"), list(itertools.product(JobState, JobState)))
def test_every_pair_is_allowed_exactly_when_listed(old, new):
    assert can_transition(old, new) is ((old, new) in ALLOWED)
    if (old, new) in ALLOWED:
        check_transition(old, new)
    else:
        with pytest.raises(IllegalTransition, match=f"from {old.value} to {new.value}"):
            check_transition(old, new)


@pytest.mark.parametrize("new", list(JobState))
def test_creation_states(new):
    assert can_transition(None, new) is (new in {S.QUEUED, S.ASSIGNED, S.REJECTED})


def test_terminal_states_are_final_and_exactly_five():
    assert {s.value for s in TERMINAL_STATES} == {"succeeded", "failed", "killed", "rejected", "unschedulable"}
    for state in TERMINAL_STATES:
        assert TRANSITIONS[state] == frozenset() and state.is_terminal
    assert not S.QUEUED.is_terminal


def test_every_state_is_reachable_from_creation():
    reached = set(INITIAL_STATES)
    frontier = list(reached)
    while frontier:
        for nxt in TRANSITIONS[frontier.pop()]:
            if nxt not in reached:
                reached.add(nxt)
                frontier.append(nxt)
    assert reached == set(JobState)


def test_sources_of():
    assert sources_of(S.RUNNING) == {S.ASSIGNED}
    assert sources_of(S.QUEUED) == {S.ASSIGNED, S.RUNNING}
