"""Bands and preemption in the command line and the client's reads, with no servers:
``irisfed submit --band/--max-preemptions/--dry-run`` (the body sent, the dry run's
answer printed for a placement, a preempting placement, a wait and a reject, and a
router that ignored the dry run), ``irisfed job`` (band, preemptions, who preempted it,
where and when), the BAND column of ``irisfed jobs``, ``explain``'s ``cannot preempt``,
``irisfed.client``'s :class:`Job`, and the dashboard's rows and history. Hostile strings
(rich markup, tabs, newlines, ESC, bidi controls) show literally everywhere."""

from __future__ import annotations

import io
import json
import re
from datetime import UTC, datetime, timedelta

import msgspec
import pytest
from rich.console import Console

from irisfed.cli import client, main, views
from irisfed.cli.parser import build_parser
from irisfed.errors import InvalidRequestError
from irisfed.jobs import build_submit, job_view
from irisfed.services.web import present
from irisfed.shared.explain import explanation
from irisfed.shared.lifecycle import JobState
from irisfed.shared.messages import DryRunPlacement, DryRunReply, PeerVerdictMsg
from irisfed.shared.records import JobListRow
from tests.infra import rows
from tests.infra.cli_runs import bare_environment
from tests.infra.terminal import HOSTILE, assert_safe, capture

MODES = ("table", "plain")  # what `submit` prints in (a terminal, else plain)
T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def preempted_history(by: str = "alice:urgent-1", detail_tail: str = "", to_state=JobState.QUEUED):
    """A batch job placed on gpu-west, started, then preempted by ``by``."""
    return [
        rows.changelog_entry(seq=1, to_state=JobState.QUEUED, at=at(0), detail="queued"),
        rows.changelog_entry(seq=2, from_state=JobState.QUEUED, to_state=JobState.ASSIGNED, peer_id="gpu-west",
                             epoch=1, actor="tick", at=at(1), detail="placed"),
        rows.changelog_entry(seq=3, from_state=JobState.ASSIGNED, to_state=JobState.RUNNING, peer_id="gpu-west",
                             epoch=1, actor="agent", at=at(2), detail="started"),
        rows.changelog_entry(seq=4, from_state=JobState.RUNNING, to_state=to_state, peer_id=None, epoch=2,
                             actor="tick", at=at(3), detail=f"preempted by {by}{detail_tail}"),
    ]


# ---------------------------------------------------------------- irisfed submit: flags and body


@pytest.fixture
def submit(monkeypatch, tmp_path, capsys):
    """``submit(*flags, reply=...)`` → (exit code, stdout, stderr, the body sent) of
    ``irisfed submit *flags -- true`` answered with ``reply`` (a dict, as the router's JSON)."""
    bare_environment(monkeypatch, tmp_path)

    def run(*flags: str, reply: dict | None = None) -> tuple[int, str, str, dict | None]:
        sent: list[dict] = []

        async def answer(args, subject, body):
            sent.append(json.loads(body))
            return reply if reply is not None else {}

        monkeypatch.setattr(client, "_request", answer)
        code = main(["submit", "--prefix", "p", "--nats-url", "nats://127.0.0.1:4222", *flags, "--", "true"])
        captured = capsys.readouterr()
        return code, captured.out, captured.err, sent[0] if sent else None

    return run


def placed(**overrides) -> dict:
    """A dry run's answer as the router's JSON: it would be placed now, preempting two jobs."""
    reply = DryRunReply(
        job_id="urgent-1", disposition="queue", state="queued", peer_id="", reason="queued: gpu-west can take it",
        verdicts=[PeerVerdictMsg("gpu-west", "match", "main"), PeerVerdictMsg("home", "missing_attribute", "gpu")],
        band="production", placement=DryRunPlacement("gpu-west", "main", ["bob:batch-1", "bob:batch-2"]))
    return {**msgspec.to_builtins(reply), **overrides}


def test_band_max_preemptions_and_dry_run_go_on_the_wire_only_when_given(submit):
    ok = {"job_id": "j", "disposition": "queue", "state": "queued", "peer_id": "", "duplicate": False, "reason": ""}
    code, _, err, body = submit(reply=ok)
    assert code == 0, err
    assert body == {"command": ["true"]}  # the contract's defaults: a v1 body, as before
    code, _, err, body = submit("--band", "batch", "--max-preemptions", "3", reply=ok)
    assert code == 0, err
    assert (body["band"], body["max_preemptions"], "dry_run" in body) == ("batch", 3, False)
    code, _, _, body = submit("--band", "production", "--dry-run", reply=placed())
    assert code == 0 and (body["band"], body["dry_run"]) == ("production", True)


@pytest.mark.parametrize("flags", [["--band", "urgent"], ["--band", "PRODUCTION"], ["--max-preemptions", "x"]])
def test_a_bad_band_flag_is_refused_before_sending_anything(flags, capsys):
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["submit", *flags, "--", "true"])
    assert exited.value.code == 2
    assert "--band" in capsys.readouterr().err or "--max-preemptions" in flags


def test_a_dry_run_cannot_wait(submit):
    code, out, err, body = submit("--dry-run", "--wait", reply=placed())
    assert (code, out, body) == (2, "", None)
    assert "--dry-run submits nothing" in err and err.count("\n") == 1


# ---------------------------------------------------------------- irisfed submit --dry-run: the answer


def test_a_dry_run_that_would_preempt_says_where_and_whom(submit):
    code, out, err, _ = submit("--band", "production", "--dry-run", reply=placed())
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "dry run: nothing was submitted"
    assert lines[1] == "urgent-1: queue → queued  (band production)"
    assert "  reason          queued: gpu-west can take it" in lines
    assert "  would run       on gpu-west, backend main" in lines
    assert "  would preempt   bob:batch-1, bob:batch-2" in lines
    assert not any(line.startswith("  would wait") for line in lines)
    verdicts = lines[lines.index("PEER      VERDICT                     DETAIL"):]
    assert verdicts[1].split()[:3] == ["gpu-west", "can", "take"] and verdicts[2].startswith("home ")


def test_a_dry_run_placed_without_preempting_says_nothing_would_be(submit):
    code, out, _, _ = submit("--dry-run", reply=placed(placement={"peer_id": "home", "backend": "cpu",
                                                                  "preempts": []}, band="interactive"))
    assert code == 0
    assert "  would run       on home, backend cpu\n" in out and "  would preempt   nothing\n" in out
    assert "(band interactive)" in out


def test_a_dry_run_that_would_wait_says_why_with_its_cannot_preempt_clause(submit):
    why = "no_free_capacity: gpu-west is full; cannot preempt: only production jobs run there"
    code, out, err, _ = submit("--dry-run", reply=placed(placement=None, waiting=why, band="batch"))
    assert code == 0, err
    assert f"  would wait      {why}\n" in out
    assert "would run" not in out and "would preempt" not in out
    assert out.startswith("dry run: nothing was submitted\n")


def test_a_dry_run_that_would_wait_shows_each_peers_verdict_now(submit):
    now = [{"peer_id": "gpu-west", "code": "no_free_capacity", "detail": "main: 0 of 1 slots free"}]
    reply = placed(placement=None, waiting="matching peers are full", waiting_verdicts=now)
    code, out, _, _ = submit("--dry-run", reply=reply)
    assert code == 0
    lines = out.splitlines()
    table = lines[lines.index("PEER      VERDICT              DETAIL"):]
    assert table[1:] == ["gpu-west  matches but is full  main: 0 of 1 slots free"]  # not the submit's verdicts


def test_a_dry_run_held_back_by_quota_says_so(submit):
    why = "quota: this job's 1 slots would take alice over its quota of 2 slots"
    code, out, _, _ = submit("--dry-run", reply=placed(placement=None, waiting=why, waiting_code="quota"))
    assert code == 0
    assert f"  would wait      {why}  (quota: its user's live jobs hold all its quota allows)\n" in out


def test_a_dry_run_of_an_existing_id_says_it_is_a_duplicate_and_would_place_nothing(submit):
    code, out, _, _ = submit("--dry-run", reply=placed(duplicate=True, placement=None))
    assert code == 0
    assert "(duplicate: that id already names this job; its original answer)" in out.splitlines()[1]
    assert "would run" not in out and "would wait" not in out


def test_a_local_dry_run_names_the_local_cluster(submit):
    reply = placed(disposition="local", state="assigned", peer_id="home", placement=None, verdicts=[])
    code, out, _, _ = submit("--dry-run", reply=reply)
    assert code == 0
    assert "urgent-1: local → assigned" in out and "  would run       on home\n" in out
    assert "PEER" not in out  # no verdicts: no table


def test_a_dry_run_reject_exits_3_as_a_submits_does(submit):
    reply = placed(disposition="reject", state="rejected", placement=None,
                   reason="no peer can take it: home lacks gpu",
                   verdicts=[{"peer_id": "home", "code": "missing_attribute", "detail": "gpu"}])
    code, out, _, _ = submit("--dry-run", reply=reply)
    assert code == 3
    assert "dry run: nothing was submitted" in out and "urgent-1: reject → rejected" in out
    assert "  reason          no peer can take it: home lacks gpu" in out
    assert "would run" not in out and "would wait" not in out


def test_a_dry_run_error_exits_1_with_the_routers_message(submit):
    code, out, err, _ = submit("--band", "production", "--dry-run",
                               reply={"error": {"code": "forbidden", "message": "band production is above bob's "
                                                "max_band interactive"}})
    assert (code, out) == (1, "")
    assert err == "irisfed: forbidden: band production is above bob's max_band interactive\n"


def test_a_dry_run_in_json_is_the_answer_itself(submit):
    code, out, _, _ = submit("--dry-run", "--json", reply=placed())
    assert code == 0
    doc = json.loads(out)
    assert doc["dry_run"] is True and doc["placement"]["preempts"] == ["bob:batch-1", "bob:batch-2"]
    assert "nothing was submitted" not in out  # only the document: tools parse it
    code, out, _, _ = submit("--dry-run", "--json", reply={"error": {"code": "forbidden", "message": "no"}})
    assert code == 1 and json.loads(out)["error"]["code"] == "forbidden"


def test_a_router_that_ignored_the_dry_run_is_said_loudly(submit):
    """A router without dry runs that took the submit as a real one: the user must know."""
    real = {"job_id": "urgent-1", "disposition": "queue", "state": "queued", "peer_id": "", "duplicate": False,
            "reason": ""}
    code, out, err, _ = submit("--dry-run", reply=real)
    assert (code, out) == (1, "")
    assert "does not know dry runs and SUBMITTED the job" in err and "irisfed cancel urgent-1" in err
    assert "nothing was submitted" not in err
    code, out, err, _ = submit("--dry-run", "--json", reply=real)
    assert code == 1 and json.loads(out)["job_id"] == "urgent-1" and "SUBMITTED" in err


@pytest.mark.parametrize("mode", MODES)
def test_hostile_strings_in_a_dry_run_show_literally(mode):
    reply = DryRunReply(job_id=HOSTILE, disposition="queue", state="queued", peer_id="", reason=HOSTILE,
                        verdicts=[PeerVerdictMsg(HOSTILE, "match", HOSTILE)], band=HOSTILE,
                        placement=DryRunPlacement(HOSTILE, HOSTILE, [HOSTILE, "b"]))
    text = capture(mode, lambda out: views.print_dry_run(reply, out))
    assert_safe(text, mode)
    waiting = msgspec.structs.replace(reply, placement=None, waiting=HOSTILE)
    text = capture(mode, lambda out: views.print_dry_run(waiting, out))
    assert_safe(text, mode)
    assert "would wait" in text


def test_a_dry_runs_id_from_a_router_cannot_drive_the_terminal_when_it_was_not_a_dry_run(submit):
    real = {"job_id": "x\x1b[31m\u202e", "disposition": "queue", "state": "queued", "peer_id": "",
            "duplicate": False, "reason": ""}
    code, _, err, _ = submit("--dry-run", reply=real)
    assert code == 1 and "\x1b" not in err and "\u202e" not in err and "\\x1b" in err


# ---------------------------------------------------------------- irisfed jobs


def test_jobs_have_a_band_column_by_name(capsys):
    jobs = [rows.job_summary(job_id="b1", band=0), rows.job_summary(job_id="i1"), rows.job_summary(job_id="p1", band=2),
            rows.job_summary(job_id="n1", band=7)]  # a rank this irisfed does not know: its number
    views.Out("plain").grid(views.jobs_grid(jobs))
    plain = capsys.readouterr().out.splitlines()
    assert plain[0].split()[:4] == ["JOB", "USER", "STATE", "BAND"]
    assert [line.split()[3] for line in plain[1:]] == ["batch", "interactive", "production", "7"]
    views.Out("tsv").grid(views.jobs_grid(jobs))
    tsv = capsys.readouterr().out.splitlines()
    assert tsv[0].split("\t")[:4] == ["job", "user", "state", "band"] and tsv[1].split("\t")[3] == "batch"
    console = Console(file=io.StringIO(), width=200, record=True, force_terminal=True)
    views.Out("table", console_=console).grid(views.jobs_grid(jobs))
    assert "│ production  │" in console.export_text()


def test_job_json_names_the_band():
    assert views.job_json(rows.job_summary(band=0, preemptions=2))["band"] == "batch"
    doc = views.job_json(rows.job_row(band=2, preemptions=3))
    assert (doc["band"], doc["preemptions"]) == ("production", 3)
    assert json.loads(json.dumps(doc, default=str))["band"] == "production"


# ---------------------------------------------------------------- irisfed job


def test_a_job_shows_its_band_and_preemptions(capsys):
    views.print_job(rows.job_row(band=0, preemptions=2, spec={"command": ["true"], "max_preemptions": 5}), [],
                    views.Out("plain"))
    assert "  band        batch   preemptions 2 (at most 5)\n" in capsys.readouterr().out
    views.print_job(rows.job_row(), [], views.Out("plain"))  # defaults: interactive, 100
    out = capsys.readouterr().out
    assert "  band        interactive   preemptions 0 (at most 100)\n" in out
    assert "preempted " not in out and "made room" not in out


def test_a_preempted_job_says_by_whom_when_and_where(capsys):
    history = preempted_history()
    views.print_job(rows.job_row(job_id="bob:batch-1", band=0, preemptions=1, reason="preempted by alice:urgent-1"),
                    history, views.Out("plain"))
    out = capsys.readouterr().out
    clock = at(3).strftime("%H:%M:%S.%f")[:-3]
    assert f"  preempted   {clock} by alice:urgent-1 on gpu-west  (running → queued)\n" in out
    row = [line for line in out.splitlines() if line.startswith("4 ")][0]
    assert row.split()[1:] == [clock, "running", "queued", "-", "2", "tick", "preempted", "by", "alice:urgent-1"]


def test_a_job_preempted_past_its_limit_shows_it_failed(capsys):
    history = preempted_history(detail_tail="; preempted 2 times, more than its max_preemptions 1",
                                to_state=JobState.FAILED)
    views.print_job(rows.job_row(state=JobState.FAILED, band=0, preemptions=2), history, views.Out("plain"))
    out = capsys.readouterr().out
    assert "by alice:urgent-1 on gpu-west  (running → failed)\n" in out  # the id alone, not the tail
    assert "more than its max_preemptions 1" in out  # the history says the rest


def test_preemptions_are_the_ticks_rows_only():
    history = preempted_history()
    # An agent's detail that happens to say the same words is no preemption.
    history.append(rows.changelog_entry(seq=5, from_state=JobState.QUEUED, to_state=JobState.FAILED, actor="agent",
                                        detail="preempted by the OOM killer", at=at(4)))
    stops = views.preemptions(history)
    assert [(s.by, s.peer, s.from_state, s.to_state) for s in stops] == [
        ("alice:urgent-1", "gpu-west", "running", "queued")]
    assert views.preemptions(history[:3]) == []


def test_the_preempting_job_says_whom_it_preempted(capsys):
    placed_row = rows.changelog_entry(seq=2, from_state=JobState.QUEUED, to_state=JobState.ASSIGNED,
                                      peer_id="gpu-west", epoch=1, actor="tick", at=at(1),
                                      detail="placed; preempted bob:batch-1, bob:batch-2")
    views.print_job(rows.job_row(job_id="alice:urgent-1", band=2, state=JobState.ASSIGNED),
                    [rows.changelog_entry(at=at(0)), placed_row], views.Out("plain"))
    out = capsys.readouterr().out
    clock = at(1).strftime("%H:%M:%S.%f")[:-3]
    assert f"  made room   {clock} on gpu-west by preempting bob:batch-1, bob:batch-2\n" in out
    assert "  preempted   " not in out  # it preempted others; nobody preempted it
    views.print_explain(rows.job_row(job_id="alice:urgent-1", state=JobState.ASSIGNED), [placed_row],
                        views.Out("plain"))
    assert ("  placed      on gpu-west at epoch 1 (tick)  preempting bob:batch-1, bob:batch-2\n"
            in capsys.readouterr().out)


@pytest.mark.parametrize("mode", ("table", "plain", "tsv"))
def test_hostile_strings_in_a_preemption_show_literally(mode):
    history = preempted_history(by=HOSTILE)
    history[1] = msgspec.structs.replace(history[1], peer_id=HOSTILE)
    job = rows.job_row(preemptions=1, spec={"command": ["true"], "max_preemptions": HOSTILE})
    text = capture(mode, lambda out: views.print_job(job, history, out))
    assert_safe(text, mode)
    assert "(at most 100)" in text  # a max_preemptions that is not a number is not shown as one
    placed_row = msgspec.structs.replace(history[1], detail=f"placed; preempted {HOSTILE}, b")
    text = capture(mode, lambda out: views.print_job(rows.job_row(), [placed_row], out))
    assert_safe(text, mode)


# ---------------------------------------------------------------- irisfed explain


def test_explain_shows_why_a_waiting_job_cannot_preempt(capsys):
    rule = ("no_free_capacity: every peer that matches is full; cannot preempt: gpu-west runs only "
            "production and interactive jobs")
    job = rows.job_row(job_id="bob:batch-9", band=0, explanation=explanation("tick", rule))
    views.print_explain(job, [], views.Out("plain"))
    out = capsys.readouterr().out
    assert f"  rule        {rule}\n" in out
    views.print_explain(job, preempted_history(), views.Out("plain"))
    out = capsys.readouterr().out
    assert "  preempted   1 time, last by alice:urgent-1 on gpu-west at " in out


# ---------------------------------------------------------------- irisfed.client


def test_the_clients_job_has_its_band_by_name_and_its_preemptions():
    job = job_view(rows.job_row(job_id="alice:train-1", user_id="alice", band=0, preemptions=4))
    assert (job.job_id, job.band, job.preemptions) == ("train-1", "batch", 4)
    job = job_view(rows.job_row())
    assert (job.band, job.preemptions) == ("interactive", 0)
    assert msgspec.json.decode(msgspec.json.encode(job_view(rows.job_row(band=2))))["band"] == "production"


def test_build_submit_takes_band_max_preemptions_and_dry_run():
    request = build_submit(["true"], job_id="j", band="batch", max_preemptions=0, dry_run=True)
    assert (request.band, request.max_preemptions, request.dry_run) == ("batch", 0, True)
    assert build_submit(["true"], job_id="j") == build_submit(["true"], job_id="j", band="interactive",
                                                              max_preemptions=100)
    with pytest.raises(InvalidRequestError, match="band"):
        build_submit(["true"], band="urgent")
    with pytest.raises(InvalidRequestError, match="max_preemptions"):
        build_submit(["true"], max_preemptions=-1)


# ---------------------------------------------------------------- the dashboard's rows and history


def list_row(**changes) -> JobListRow:
    values = dict(job_id="j-1", name="n", state="running", owner_peer_id="gpu", pinned_peer_id=None, epoch=1,
                  attempts=1, priority=0, submitted_at=T0, updated_at=T0, exit_code=None, reason="",
                  command=["true"], labels={})
    values.update(changes)
    return JobListRow(**values)


def test_the_jobs_page_rows_show_the_band_and_preemptions():
    html = present.job_rows_html([list_row(band=0, preemptions=3), list_row(job_id="j-2")], lambda j: "/jobs/" + j)
    first, second = html.split("</tr>")[:2]
    assert '<td data-testid="job-band" data-band="batch">batch <span' in first
    assert "preempted 3×" in first and 'data-testid="job-preemptions"' in first
    assert '<td data-testid="job-band" data-band="interactive">interactive</td>' in second
    assert "preempted" not in second
    # The band cell sits between state and peer, as the header says.
    assert first.index('data-testid="job-state"') < first.index('data-testid="job-band"') < first.index(">gpu<")


def test_the_dashboards_timeline_names_who_preempted_and_whom():
    history = preempted_history(detail_tail="; preempted 2 times, more than its max_preemptions 1",
                                to_state=JobState.FAILED)
    steps = present.timeline(history)
    assert [s.preempted_by for s in steps] == ["", "", "", "alice:urgent-1"]
    assert steps[3].preempted_on == "gpu-west"
    assert steps[3].detail == "preempted 2 times, more than its max_preemptions 1"  # the rest
    assert steps[2].detail == "started" and steps[2].preempted_on == ""
    placing = rows.changelog_entry(seq=2, from_state=JobState.QUEUED, to_state=JobState.ASSIGNED, peer_id="g",
                                   actor="tick", at=at(1), detail="placed; preempted a:1, b:2")
    assert present.timeline([placing])[0].preempting == ("a:1", "b:2")
    assert present.explained({"by": "tick", "rule": "r"}, [placing]).preempting == ("a:1", "b:2")
    agent = rows.changelog_entry(actor="agent", detail="preempted by the OOM killer")
    assert present.timeline([agent])[0].preempted_by == ""
    assert present.spec_view({"command": ["x"], "max_preemptions": 7}).max_preemptions == "7"
    assert present.spec_view({"command": ["x"]}).max_preemptions == "100"


def test_a_hostile_preemptor_in_the_timeline_is_redacted_and_left_to_escaping():
    history = preempted_history(by="<script>alert(1)</script> nats://u:pw@h:4222")
    step = present.timeline(history)[3]
    assert "pw@h" not in step.preempted_by and step.preempted_by.startswith("<script>")  # the template escapes
    assert present.path_part(step.preempted_by).startswith("%3Cscript%3E")


@pytest.mark.parametrize("mode", MODES)
def test_a_preempted_job_waiting_for_its_old_run_to_stop_says_where(mode):
    waiting = rows.job_row(state=JobState.QUEUED, epoch=2, preemptions=1, band=0, stopping_on="gpu-west",
                           reason="preempted by alice:urgent-1")
    for draw in (lambda out: views.print_job(waiting, preempted_history(), out),
                 lambda out: views.print_explain(waiting, preempted_history(), out)):
        shown = capture(mode, draw)
        assert "waiting for gpu-west to stop its preempted run" in shown, shown
    released = msgspec.structs.replace(waiting, stopping_on=None)
    assert "to stop its preempted run" not in capture(mode, lambda out: views.print_job(released, [], out))


@pytest.mark.parametrize("mode", MODES)
def test_a_gangs_tasks_show_in_irisfed_job_with_hostile_node_names_inert(mode):
    from irisfed.jobs import Task

    gang = rows.job_row(state=JobState.RUNNING, epoch=2, replicas=3, owner_peer_id="tpu",
                        spec={"command": ["train"], "replicas": 3, "coschedule": {"group_by": "slice"}})
    tasks = [Task(0, 2, "tpu", "n0", "running", None, "/w/t0"), Task(1, 2, "tpu", HOSTILE, "running", None, None),
             Task(2, 2, "tpu", "n2", "failed", 3, "/w/t2")]
    shown = capture(mode, lambda out: views.print_job(gang, [], out, tasks))
    assert "tasks       3  sharing one slice" in shown
    assert "n2" in shown and "failed" in shown and "/w/t2" in shown
    assert_safe(shown, mode)
    waiting = capture(mode, lambda out: views.print_job(msgspec.structs.replace(gang, state=JobState.QUEUED), [], out))
    assert "(none started yet)" in waiting


@pytest.mark.parametrize("mode", MODES)
def test_a_dry_run_without_an_id_names_the_job_in_words(mode):
    reply = DryRunReply(job_id="", disposition="queue", state="queued", peer_id="", reason="")
    text = re.sub(r"\x1b\[[0-9;]*m", "", capture(mode, lambda out: views.print_dry_run(reply, out)))
    line = next(line for line in text.splitlines() if "queue → queued" in line)
    assert not line.lstrip().startswith(":") and "the job (no --id" in line
