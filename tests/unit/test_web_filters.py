"""The job list's filters and cursor: every value from a URL is checked, and a bad one
is a FilterError with a message for people, never anything else."""

from __future__ import annotations

import base64
from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from irisfed.services.web.filters import (
    MAX_TEXT,
    FilterError,
    JobFilter,
    decode_cursor,
    encode_cursor,
    like_escape,
    parse_filters,
)

HOSTILE = ["<script>alert(1)</script>", '"><img src=x onerror=alert(1)>', "\x00", "a\x00b", "x" * 100_000,
           "%", "_", "\\", "' OR 1=1 --", "\u202e", "\ud7ff", "=", "==", "k=v=w"]
NAMES = ["state", "peer", "label", "text", "after"]


def test_good_filters_become_a_page_query():
    chosen = parse_filters([("state", "queued"), ("peer", "gpu-west"), ("label", "team=ml"),
                            ("label", "tier = gold"), ("text", " 50%_off "), ("ignored", "x")])
    assert chosen == JobFilter(state="queued", peer="gpu-west", labels=(("team", "ml"), ("tier", " gold")),
                               text="50%_off")
    query = chosen.query(51)
    assert query.state == "queued" and query.owner_peer_id == "gpu-west" and query.limit == 51
    assert query.labels == {"team": "ml", "tier": " gold"}
    assert query.text == "50\\%\\_off"
    assert parse_filters([]).query(50).labels is None and not parse_filters([]).active


def test_links_keep_the_filters_and_parse_back_the_same():
    after = (datetime(2026, 11, 30, 12, 0, 0, 123456, tzinfo=UTC), "job-7")
    chosen = JobFilter(state="running", peer="home", labels=(("a", "b&c=d"),), text="x y")
    from urllib.parse import parse_qsl

    again = parse_filters(parse_qsl(chosen.query_string(after)[1:]))
    assert again == JobFilter(state="running", peer="home", labels=(("a", "b&c=d"),), text="x y", after=after)
    assert JobFilter().query_string() == ""


def test_like_metacharacters_are_taken_literally():
    assert like_escape("100%_done\\") == "100\\%\\_done\\\\"


@pytest.mark.parametrize("items, says", [
    ([("state", "<script>")], "unknown state"),
    ([("state", "queued"), ("state", "running")], "at most once"),
    ([("peer", '"><img src=x>')], "peer id"),
    ([("peer", "a" * 65)], "peer id"),
    ([("peer", "ho\nme")], "peer id"),
    ([("label", "no-equals")], "key=value"),
    ([("label", "=v")], "key=value"),
    ([("label", "k=" + "v" * 257)], "at most"),
    ([("label", "k\x00=v")], "NUL"),
    ([("text", "a\x00")], "NUL"),
    ([("text", "x" * (MAX_TEXT + 1))], "at most"),
    ([("label", f"k{i}=v") for i in range(9)], "at most 8"),
    ([("after", "!!")], "not valid"),
    ([("after", "A" * 401)], "not valid"),
])
def test_bad_filters_say_what_is_wrong(items, says):
    with pytest.raises(FilterError, match=says):
        parse_filters(items)


@given(st.lists(st.tuples(st.sampled_from(NAMES), st.one_of(st.text(max_size=300), st.sampled_from(HOSTILE))),
                max_size=12))
def test_any_query_string_is_a_filter_or_a_filter_error(items):
    try:
        chosen = parse_filters(items)
    except FilterError as exc:
        assert str(exc) and len(str(exc)) < 300
        return
    query = chosen.query(50)
    for value in (query.state, query.owner_peer_id, query.text, *(query.labels or {}).keys(),
                  *(query.labels or {}).values()):
        assert value is None or "\x00" not in value


@given(st.datetimes(min_value=datetime(1970, 1, 2), max_value=datetime(9999, 1, 1),
                    timezones=st.sampled_from([UTC, timezone(timedelta(hours=5, minutes=45))])),
       st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", fullmatch=True))
def test_a_cursor_round_trips(when, job_id):
    assert decode_cursor(encode_cursor(when, job_id)) == (when, job_id)


@pytest.mark.parametrize("raw", [
    b"2026-01-01T00:00:00|job",  # no time zone
    b"2026-01-01T00:00:00+00:00|<script>",  # not a job id
    b"2026-01-01T00:00:00+00:00|job\n",
    b"2026-01-01T00:00:00+00:00",  # no job
    b"not a time|job",
    b"\xff\xfe|job",  # not UTF-8
])
def test_a_forged_cursor_is_refused(raw):
    cursor = base64.urlsafe_b64encode(raw).decode().rstrip("=")
    with pytest.raises(FilterError, match="not valid"):
        decode_cursor(cursor)


@pytest.mark.parametrize("raw", [b"9999-12-31T23:59:59-14:00|job", b"0001-01-01T00:00:00+14:00|job"])
def test_a_cursor_whose_time_has_no_utc_datetime_is_refused(raw):
    # Such a cursor must not reach the query: there it fails the whole page (HTTP 500).
    cursor = base64.urlsafe_b64encode(raw).decode().rstrip("=")
    with pytest.raises(FilterError, match="not valid"):
        decode_cursor(cursor)


@given(st.text(max_size=600))
def test_any_text_as_a_cursor_is_a_cursor_or_a_filter_error(text):
    try:
        when, job_id = decode_cursor(text)
    except FilterError:
        return
    assert when.tzinfo is not None and job_id
