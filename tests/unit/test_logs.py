"""Logs' pure parts (docs/design.md §3.6): subjects, splitting, the cap's arithmetic,
how a reader puts pieces back together, and the client's read loop over a fake router."""

from __future__ import annotations

import pytest

from irisfed.logs import lines, read_logs
from irisfed.shared.errors import ConfigError
from irisfed.shared.logs import (
    Piece,
    assemble,
    dropped_text,
    log_subject,
    purge_below,
    skip_to,
    split,
    subject_token,
)
from irisfed.shared.messages import LogsReply, LogsRequest
from irisfed.shared.shorthands import parse_duration


def test_job_ids_become_one_subject_token_each_and_never_meet():
    ids = ["a.b", "a_2Eb", "alice:a", "alice_3Aa", "a_b", "a-b"]
    tokens = [subject_token(i) for i in ids]
    assert len(set(tokens)) == len(ids) and all("." not in t and ":" not in t for t in tokens)
    assert log_subject("p.x", "gpu-west", "alice:train.1", 2, 3, "stderr") == "p.x.logs.gpu-west.alice_3Atrain_2E1.2.3.err"


def test_split_skip_and_purge_keep_the_newest_within_the_cap():
    assert split(b"abcdefg", 10, limit=3) == [(10, b"abc"), (13, b"def"), (16, b"g")]
    assert skip_to(offset=5, size=100, cap=50) == 50 and skip_to(offset=80, size=100, cap=50) == 80
    held = [(1, 40), (2, 40), (3, 40), (4, 10)]
    assert purge_below(held, 100) == 2  # 40 + 40 + 10 fit: seq 1 goes
    assert purge_below(held, 200) is None
    assert purge_below([(7, 500)], 100) == 7  # the newest stays whatever its size


def test_a_reader_sees_gaps_as_a_line_saying_how_much_was_dropped():
    pieces = [Piece(1, 100, b"abc"), Piece(2, 103, b"def"), Piece(3, 2_000_000, b"x"), Piece(4, 2_000_001, b"", end=2_000_001)]
    data, offset, ended = assemble(pieces, 0)
    assert data == dropped_text(100) + b"abcdef" + dropped_text(2_000_000 - 106) + b"x"
    assert (offset, ended) == (2_000_001, True)
    assert b"1.9 MiB" in dropped_text(2_000_000 - 106)
    again, offset, _ = assemble([Piece(2, 103, b"def")], 104)  # read twice: only what is new
    assert (again, offset) == (b"ef", 106)


def _reply(data: bytes, done: bool = False, state: str = "running", epoch: int = 1, seq: int = 0) -> LogsReply:
    return LogsReply("j", epoch, 0, "stdout", data, seq, 0, done, state)


async def test_following_asks_again_until_done_and_goes_on_with_a_new_run():
    answers = [_reply(b"a\nb"), _reply(b""), _reply(b"c\n", done=True),  # run 1 ends, the job is retried
               _reply(b"", epoch=1),  # the newest run is still run 1: ask again
               _reply(b"", epoch=2), _reply(b"second\n", epoch=2, done=True, state="succeeded")]
    asked: list[LogsRequest] = []

    async def ask(request: LogsRequest) -> LogsReply:
        asked.append(request)
        return answers.pop(0)
    got = [line async for line in lines(read_logs(ask, LogsRequest(job_id="j"), follow=True))]
    assert got == ["a\n", "bc\n", "second\n"] and answers == []
    assert [r.epoch for r in asked] == [None, 1, 1, None, None, 2]


async def test_without_follow_reading_stops_at_the_first_answer_with_nothing_new():
    answers = [_reply(b"x"), _reply(b"y"), _reply(b""), _reply(b"never")]

    async def ask(request: LogsRequest) -> LogsReply:
        return answers.pop(0)
    assert [r.data async for r in read_logs(ask, LogsRequest(job_id="j"))] == [b"x", b"y", b""]


def test_durations():
    assert [parse_duration(t, "--since") for t in ("90", "90s", "30m", "2h", "1d", "1.5h")] == [
        90, 90, 1800, 7200, 86400, 5400]
    for bad in ("", "0", "-3m", "10w", "m"):
        with pytest.raises(ConfigError, match="--since must be a duration like 90s, 30m, 2h or 1d"):
            parse_duration(bad, "--since")


async def test_output_ended_before_the_jobs_end_was_recorded_is_not_read_twice():
    """The agent ships a run's end before it reports the job's: a follower that sees the
    output done while the job still runs waits for the job's end, and reads nothing again."""
    answers = [_reply(b"all\n", done=True), _reply(b"all\n", state="running"),
               _reply(b"all\n", done=True, state="succeeded")]
    asked: list[LogsRequest] = []

    async def ask(request: LogsRequest) -> LogsReply:
        asked.append(request)
        return answers.pop(0)
    got = [line async for line in lines(read_logs(ask, LogsRequest(job_id="j"), follow=True))]
    assert got == ["all\n"] and answers == []


async def test_a_line_without_its_newline_comes_out_in_parts_and_characters_stay_whole():
    from irisfed.logs import LONGEST_LINE

    progress = ("\r" + "█" * 10) * (LONGEST_LINE // 10)  # a progress bar redrawn, never a newline
    data = progress.encode()
    answers = [_reply(data[:7]), _reply(data[7:]), _reply(b"", done=True, state="succeeded")]

    async def ask(request: LogsRequest) -> LogsReply:
        return answers.pop(0)
    got = [line async for line in lines(read_logs(ask, LogsRequest(job_id="j"), follow=True))]
    assert "".join(got) == progress and "\ufffd" not in "".join(got)  # "█" split between answers
    assert max(len(line) for line in got) <= LONGEST_LINE and len(got) >= 2


async def test_following_from_a_time_keeps_to_it_until_something_is_read():
    answers = [_reply(b"", seq=0), _reply(b"recent\n", seq=9), _reply(b"", done=True, state="succeeded", seq=9)]
    asked: list[LogsRequest] = []

    async def ask(request: LogsRequest) -> LogsReply:
        asked.append(request)
        return answers.pop(0)
    got = [line async for line in lines(read_logs(ask, LogsRequest(job_id="j", since_s=30), follow=True))]
    assert got == ["recent\n"] and [r.since_s for r in asked] == [30, 30, None] and asked[2].seq == 9
