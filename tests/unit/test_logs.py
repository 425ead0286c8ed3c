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


def _reply(data: bytes, done: bool = False, state: str = "running", epoch: int = 1, seq: int = 0, offset: int = 0,
           exit_code: int | None = None) -> LogsReply:
    return LogsReply("j", epoch, 0, "stdout", data, seq, offset, done, state, exit_code)


async def test_following_asks_again_until_done_and_goes_on_with_a_new_run():
    answers = [_reply(b"a\nb"), _reply(b""), _reply(b"c\n", done=True),  # run 1 ends, the job is retried
               _reply(b"", epoch=1),  # the newest run is still run 1: ask again
               _reply(b"", epoch=2), _reply(b"second\n", epoch=2, done=True, state="succeeded"),
               _reply(b"second\n", epoch=2, done=True, state="succeeded")]  # run 2 is still the newest: the end
    asked: list[LogsRequest] = []

    async def ask(request: LogsRequest) -> LogsReply:
        asked.append(request)
        return answers.pop(0)
    got = [line async for line in lines(read_logs(ask, LogsRequest(job_id="j"), follow=True))]
    assert got == ["a\n", "bc\n", "second\n"] and answers == []
    assert [r.epoch for r in asked] == [None, 1, 1, None, None, 2, None]


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
    output done while the job still runs waits for the job's end, reads nothing again, and
    its last answer is the job's end (what ``submit --wait`` exits with)."""
    def answers():
        return [_reply(b"all\n", done=True), _reply(b"all\n", state="running"),
                _reply(b"all\n", done=True, state="failed")]
    pending = answers()

    async def ask(request: LogsRequest) -> LogsReply:
        return pending.pop(0)
    got = [line async for line in lines(read_logs(ask, LogsRequest(job_id="j"), follow=True))]
    assert got == ["all\n"] and pending == []
    pending = answers()
    replies = [r async for r in read_logs(ask, LogsRequest(job_id="j"), follow=True)]
    assert [(r.state, r.data) for r in replies] == [("running", b"all\n"), ("failed", b"")]


async def test_a_line_without_its_newline_comes_out_in_parts_and_characters_stay_whole():
    from irisfed.logs import LONGEST_LINE

    progress = ("\r" + "█" * 10) * (LONGEST_LINE // 10)  # a progress bar redrawn, never a newline
    data = progress.encode()
    answers = [_reply(data[:7]), _reply(data[7:]), _reply(b"", done=True, state="succeeded"),
               _reply(data[:7], state="succeeded")]  # the newest run is this one

    async def ask(request: LogsRequest) -> LogsReply:
        return answers.pop(0)
    got = [line async for line in lines(read_logs(ask, LogsRequest(job_id="j"), follow=True))]
    assert "".join(got) == progress and "\ufffd" not in "".join(got)  # "█" split between answers
    assert max(len(line) for line in got) <= LONGEST_LINE and len(got) >= 2


async def test_following_from_a_time_keeps_to_it_until_something_is_read():
    answers = [_reply(b"", seq=0), _reply(b"recent\n", seq=9), _reply(b"", done=True, state="succeeded", seq=9),
               _reply(b"old\nrecent\n", seq=9, done=True, state="succeeded")]  # the newest run is this one
    asked: list[LogsRequest] = []

    async def ask(request: LogsRequest) -> LogsReply:
        asked.append(request)
        return answers.pop(0)
    got = [line async for line in lines(read_logs(ask, LogsRequest(job_id="j", since_s=30), follow=True))]
    assert got == ["recent\n"] and [r.since_s for r in asked] == [30, 30, None, None] and asked[2].seq == 9


async def test_the_jobs_end_after_its_output_keeps_where_the_output_ended_and_its_exit_code():
    """The job's end found after the run's output ended is that output's last answer with the
    job's state and exit code: done, where to ask next unchanged (not the head of the run a
    poll read again, which for a long output is not even done)."""
    from irisfed.cli.logs import exit_status

    answers = [_reply(b"x" * 10, seq=3, offset=10, done=True),
               _reply(b"x" * 4, seq=2, offset=4, state="failed", exit_code=3)]  # the run's head again

    async def ask(request: LogsRequest) -> LogsReply:
        return answers.pop(0)
    replies = [r async for r in read_logs(ask, LogsRequest(job_id="j"), follow=True)]
    last = replies[-1]
    assert (last.data, last.done, last.seq, last.offset, last.epoch) == (b"", True, 3, 10, 1) and answers == []
    assert (last.state, last.exit_code, exit_status(last.state, last.exit_code)) == ("failed", 3, 3)


async def test_a_run_read_to_its_end_after_the_job_ran_again_and_ended_is_followed_by_that_run():
    """Run 1 is read by number once started; its last answer gives the job's state now, which
    may be the end of run 2 (retried and ended while run 1 was still being read): a follower
    goes on with run 2's output and ends with run 2's exit code."""
    answers = [_reply(b"one\n"), _reply(b"", done=True, state="failed"),  # run 1 superseded: no exit code
               _reply(b"two\n", epoch=2, done=True, state="failed", exit_code=4),  # the newest run
               _reply(b"two\n", epoch=2, done=True, state="failed", exit_code=4),  # read from its start
               _reply(b"two\n", epoch=2, done=True, state="failed", exit_code=4)]  # and still the newest
    asked: list[LogsRequest] = []

    async def ask(request: LogsRequest) -> LogsReply:
        asked.append(request)
        return answers.pop(0)
    replies = [r async for r in read_logs(ask, LogsRequest(job_id="j"), follow=True)]
    assert b"".join(r.data for r in replies) == b"one\ntwo\n" and answers == []
    assert (replies[-1].epoch, replies[-1].state, replies[-1].exit_code) == (2, "failed", 4)
    assert [r.epoch for r in asked] == [None, 1, None, 2, None]


async def test_following_a_run_by_number_ends_with_the_jobs_end_when_that_run_was_its_last():
    """``irisfed logs --follow --epoch N`` exits with the job's status as without ``--epoch``:
    run N's output done before its end was recorded waits for that end; a job that runs again
    ends the reading with what the run's answer said."""
    answers = [_reply(b"out\n", done=True), _reply(b"out\n"), _reply(b"out\n", done=True, state="succeeded", exit_code=0)]
    asked: list[LogsRequest] = []

    async def ask(request: LogsRequest) -> LogsReply:
        asked.append(request)
        return answers.pop(0)
    replies = [r async for r in read_logs(ask, LogsRequest(job_id="j", epoch=1), follow=True)]
    assert [(r.state, r.data) for r in replies] == [("running", b"out\n"), ("succeeded", b"")] and answers == []
    assert [r.epoch for r in asked] == [1, None, None]
    answers = [_reply(b"out\n", done=True), _reply(b"", epoch=2)]  # the job runs again: run 1 was not its last
    replies = [r async for r in read_logs(ask, LogsRequest(job_id="j", epoch=1), follow=True)]
    assert [(r.state, r.data) for r in replies] == [("running", b"out\n")] and answers == []
