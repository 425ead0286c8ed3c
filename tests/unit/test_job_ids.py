"""Generated job ids: short, valid on the wire, increasing, never repeated by one
generator, and not guessable from the ids a producer sees."""

import re

from hypothesis import given
from hypothesis import strategies as st

from irisfed.shared.ids import ALPHABET, FIRST_SPAN, MAX_STEP, SPAN, TIME_CHARS, JobIds
from irisfed.shared.messages import JOB_ID_PATTERN


def test_an_id_is_17_characters_of_lower_case_base32_and_a_valid_job_id():
    made = JobIds()()
    assert len(made) == 17 and set(made) <= set(ALPHABET)
    assert re.fullmatch(JOB_ID_PATTERN, made)


@given(st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=300))
def test_ids_of_one_generator_strictly_increase_even_when_the_clock_stalls_or_goes_back(steps):
    now = [1_764_000_000_000]

    def clock():
        return now[0]

    ids = JobIds(clock)
    made = []
    for step in steps:
        now[0] += step - 1  # -1: back, 0: the same millisecond, more: forward
        made.append(ids())
    assert made == sorted(made) and len(set(made)) == len(made)


def test_more_than_a_milliseconds_worth_borrows_the_next_millisecond():
    ids = JobIds(lambda: 1_000, randbelow=lambda n: n - 1)  # the largest start and steps: the fewest ids
    made = [ids() for _ in range((SPAN - FIRST_SPAN) // MAX_STEP + 2)]
    assert len(set(made)) == len(made) and made == sorted(made)
    assert made[-1][:TIME_CHARS] != made[0][:TIME_CHARS]  # moved on to the next millisecond


def test_ids_sort_by_time_across_generators():
    early, late = JobIds(lambda: 1_000, randbelow=lambda n: n - 1), JobIds(lambda: 1_001, randbelow=lambda n: 0)
    assert early() < late()


def test_what_follows_an_id_is_not_in_the_id():
    # Were the part after the time the same for every id of one router, a producer
    # could name the next ones (tests/integration/test_hostile_input.py tries).
    now = [5_000]
    ids = JobIds(lambda: now[0])
    first = ids()
    same_ms = {ids()[TIME_CHARS:] for _ in range(50)}
    now[0] += 1
    next_ms = {ids()[TIME_CHARS:] for _ in range(1)}
    assert len(same_ms) == 50 and first[TIME_CHARS:] not in same_ms | next_ms
    later = set()
    for _ in range(200):  # each millisecond starts afresh
        now[0] += 1
        later.add(ids()[TIME_CHARS:])
    assert len(later) == 200
