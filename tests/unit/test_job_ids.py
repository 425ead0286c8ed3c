"""Generated job ids: short, valid on the wire, increasing, never repeated by one generator."""

import re

from hypothesis import given
from hypothesis import strategies as st

from shared.ids import ALPHABET, MAX_COUNT, JobIds
from shared.messages import JOB_ID_PATTERN


def test_an_id_is_17_characters_of_lower_case_base32_and_a_valid_job_id():
    made = JobIds()()
    assert len(made) == 17 and set(made) <= set(ALPHABET)
    assert re.fullmatch(JOB_ID_PATTERN, made)


@given(st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=300))
def test_ids_of_one_generator_strictly_increase_even_when_the_clock_stalls_or_goes_back(steps):
    now = [1_764_000_000_000]

    def clock():
        return now[0]

    ids = JobIds(clock, tag=7)
    made = []
    for step in steps:
        now[0] += step - 1  # -1: back, 0: the same millisecond, more: forward
        made.append(ids())
    assert made == sorted(made) and len(set(made)) == len(made)


def test_more_than_a_milliseconds_worth_borrows_the_next_millisecond():
    ids = JobIds(lambda: 1_000, tag=0)
    made = [ids() for _ in range(MAX_COUNT + 2)]
    assert len(set(made)) == len(made) and made == sorted(made)
    assert made[-1][:9] != made[0][:9]  # moved on to the next millisecond


def test_ids_sort_by_time_across_generators():
    early, late = JobIds(lambda: 1_000, tag=31), JobIds(lambda: 1_001, tag=0)
    assert early() < late()
