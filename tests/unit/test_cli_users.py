"""Users in the command line, rendered with no database: ``irisfed users`` (usage against
quota, weight, fair share, queued and running jobs), the USER column of ``irisfed jobs``,
a job's user and who asked to cancel it, and the waiting code ``quota`` in ``explain``.
Hostile user ids, resource names and cancel requesters show literally in every mode."""

from __future__ import annotations

import argparse
import io
import json

import pytest
from rich.console import Console

from irisfed.cli import main, reads, views
from irisfed.cli.parser import build_parser
from irisfed.shared.errors import ConfigError, InvalidRequest
from irisfed.shared.explain import explanation
from irisfed.shared.lifecycle import JobState
from tests.infra import rows
from tests.infra.factories import make_config
from tests.infra.terminal import HOSTILE, assert_safe, capture

MODES = ("table", "plain", "tsv")


def config(**users_extra):
    return make_config(users=[{"id": "alice", "weight": 2, "quota": {"gpu": 2, "slots": 4}},
                              {"id": "bob", "max_band": "batch", "quota": {"cpu": 8}}], **users_extra)


def gpu_west(**overrides):
    backends = [{"name": "main", "attributes": {}, "capacity": {"total": 8, "free": 2},
                 "resources": {"gpu": {"total": 4, "free": 2}, "cpu": {"total": 16, "free": 4}}}]
    return rows.peer_heartbeat_row(**{"peer_id": "gpu-west", "backends": backends, **overrides})


HELD = {"alice": {"slots": 2, "gpu": 2, "cpu": 3000}, "carol": {"slots": 1, "cpu": 500}}
COUNTS = {"alice": {"queued": 3, "assigned": 1, "running": 1}, "carol": {"running": 1}, "dave": {"queued": 1}}
TOTALS = {"slots": 10, "gpu": 4, "cpu": 16000}


# ---------------------------------------------------------------- federation totals


def test_totals_count_reachable_configured_peers_in_units():
    home = rows.peer_heartbeat_row(peer_id="home", backends=[{"name": "main", "attributes": {},
                                                              "capacity": {"total": 2, "free": 2}}])
    gone = gpu_west(peer_id="tpu-east", reachable=False)
    stranger = gpu_west(peer_id="mars")  # not in the configuration: the tick ignores it too
    assert views.federation_totals([gpu_west(), home, gone, stranger], config()) == TOTALS
    assert views.federation_totals([gpu_west(), stranger]) == {"slots": 16, "gpu": 8, "cpu": 32000}  # no config
    assert views.federation_totals([]) == {}


def test_totals_ignore_nonsense_in_advertisements():
    # A row that is no valid advertisement counts as nothing, as the services skip it.
    odd = rows.peer_heartbeat_row(peer_id="home", backends=[
        {"name": "a", "attributes": {}, "capacity": {"total": -3, "free": 0},
         "resources": {"gpu": {"total": "lots", "free": 0}}},
        {"name": "b", "capacity": "full", "resources": ["gpu"]}, "not a backend"])
    assert views.federation_totals([odd]) == {}
    # Amounts a valid advertisement cannot mean (negative, huge) offer nothing or are capped.
    shaky = rows.peer_heartbeat_row(peer_id="home", backends=[
        {"name": "a", "attributes": {}, "capacity": {"total": -3, "free": 0},
         "resources": {"gpu": {"total": -2, "free": 0}, "cpu": {"total": 0.5, "free": 0}}}])
    assert views.federation_totals([shaky]) == {"slots": 0, "gpu": 0, "cpu": 500}


# ---------------------------------------------------------------- users: rows


def test_every_configured_user_and_every_user_with_jobs_by_id():
    lines = views.user_lines(config(), HELD, COUNTS, TOTALS)
    assert [(u.user_id, u.configured) for u in lines] == [
        ("alice", True), ("bob", True), ("carol", False), ("dave", False), ("default", False)]
    alice, bob, carol, dave, default = lines
    assert (alice.queued, alice.running, alice.weight, alice.max_band) == (3, 2, 2.0, "interactive")
    assert alice.share == pytest.approx(0.25)  # gpu 2 of 4 is its dominant share, over weight 2
    assert (bob.queued, bob.running, bob.share, bob.max_band) == (0, 0, 0.0, "batch")
    assert carol.share == pytest.approx(0.1) and carol.weight == 1.0 and carol.quota == {}  # slots 1 of 10
    assert (dave.queued, dave.running) == (1, 0)
    # `default` is always a user (v1's producers): listed with a configuration, jobs or not.
    assert (default.queued, default.running, default.weight, default.quota) == (0, 0, 1.0, {})


def test_usage_against_quota_names_quota_resources_first():
    alice, bob, carol, dave, _ = views.user_lines(config(), HELD, COUNTS, TOTALS)
    assert views.usage_cell(alice) == "gpu 2/2, slots 2/4, cpu 3/-"  # slots only when capped
    assert views.usage_cell(bob) == "cpu 0/8"
    assert views.usage_cell(carol) == "cpu 0.5/-"
    assert views.usage_cell(dave) == "-"


def test_without_a_configuration_only_users_with_jobs_and_no_quotas():
    lines = views.user_lines(None, HELD, COUNTS, TOTALS)
    assert [u.user_id for u in lines] == ["alice", "carol", "dave"]
    alice = lines[0]
    assert (alice.quota, alice.weight, alice.max_band) == (None, None, None)
    assert alice.share == pytest.approx(0.5)  # weight unknown: unweighted
    assert views.usage_cell(alice) == "cpu 3, gpu 2"
    assert views.users_json(lines)[0] == {
        "user_id": "alice", "configured": False, "usage": {"cpu": 3, "gpu": 2, "slots": 2}, "quota": None,
        "weight": None, "share": 0.5, "queued": 3, "running": 2, "max_band": None}


def test_users_json_has_numbers_in_each_resources_own_unit():
    doc = json.loads(json.dumps(views.users_json(views.user_lines(config(), HELD, COUNTS, TOTALS))))
    assert doc[0] == {"user_id": "alice", "configured": True, "usage": {"cpu": 3, "gpu": 2, "slots": 2},
                      "quota": {"gpu": 2, "slots": 4}, "weight": 2.0, "share": 0.25, "queued": 3, "running": 2,
                      "max_band": "interactive"}
    assert doc[1]["quota"] == {"cpu": 8} and doc[1]["usage"] == {}
    assert doc[2]["usage"] == {"cpu": 0.5, "slots": 1}  # millicores back to cores


def test_users_in_plain_and_tsv(capsys):
    lines = views.user_lines(config(), HELD, COUNTS, TOTALS)
    views.Out("plain").grid(views.users_grid(lines, TOTALS))
    plain = capsys.readouterr().out.splitlines()
    assert plain[0].split() == ["USER", "USAGE/QUOTA", "WEIGHT", "SHARE", "QUEUED", "RUNNING", "MAX_BAND"]
    assert plain[1].split("  ")[0] == "alice" and "gpu 2/2, slots 2/4, cpu 3/-" in plain[1]
    assert plain[1].split()[-5:] == ["2", "25.0%", "3", "2", "interactive"]
    views.Out("tsv").grid(views.users_grid(lines, TOTALS))
    tsv = capsys.readouterr().out.splitlines()
    assert tsv[0] == "user\tusage/quota\tweight\tshare\tqueued\trunning\tmax_band"
    assert tsv[2] == "bob\tcpu 0/8\t1\t0.0%\t0\t0\tbatch"


def test_a_terminal_table_says_what_shares_are_of_and_keeps_numbers_whole():
    lines = views.user_lines(config(), HELD, COUNTS, TOTALS)
    console = Console(file=io.StringIO(), width=80, record=True, force_terminal=True)
    views.Out("table", console_=console).grid(views.users_grid(lines, TOTALS))
    text = console.export_text()
    assert "users (shares of slots 10, cpu 16, gpu 4)" in text
    assert "25.0%" in text and "interactive" in text and "running" in text
    assert max(len(line) for line in text.splitlines()) <= 80


@pytest.mark.parametrize("mode", MODES)
def test_hostile_user_ids_and_resource_names_show_literally(mode):
    held = {HOSTILE: {"slots": 1, HOSTILE: 3}}
    lines = views.user_lines(None, held, {HOSTILE: {"running": 1}}, {})
    text = capture(mode, lambda out: out.grid(views.users_grid(lines, {HOSTILE: 1})))
    assert_safe(text, mode)
    if mode == "tsv":
        assert [len(line.split("\t")) for line in text.splitlines()] == [7, 7]


def test_hostile_user_ids_in_json_are_only_data():
    lines = views.user_lines(None, {HOSTILE: {"slots": 1}}, {}, {})
    text = json.dumps(views.users_json(lines))
    assert "\x1b" not in text and "\n" not in text and json.loads(text)[0]["user_id"] == HOSTILE


# ---------------------------------------------------------------- jobs, job, explain


def test_jobs_have_a_user_column_in_every_mode(capsys):
    jobs = [rows.job_summary(job_id="alice:train-1", user_id="alice"), rows.job_summary(job_id="j2")]
    views.Out("plain").grid(views.jobs_grid(jobs))
    plain = capsys.readouterr().out.splitlines()
    assert plain[0].split()[:3] == ["JOB", "USER", "STATE"]
    assert plain[1].split()[:3] == ["alice:train-1", "alice", "queued"]
    assert plain[2].split()[:2] == ["j2", "default"]
    views.Out("tsv").grid(views.jobs_grid(jobs))
    assert capsys.readouterr().out.splitlines()[1].split("\t")[:2] == ["alice:train-1", "alice"]
    console = Console(file=io.StringIO(), width=200, record=True, force_terminal=True)
    views.Out("table", console_=console).grid(views.jobs_grid(jobs))
    assert "│ alice:train-1     │ alice   │" in console.export_text()


@pytest.mark.parametrize("mode", MODES)
def test_hostile_user_and_job_ids_in_jobs_show_literally(mode):
    jobs = [rows.job_summary(job_id=HOSTILE, user_id=HOSTILE)]
    text = capture(mode, lambda out: out.grid(views.jobs_grid(jobs)))
    assert_safe(text, mode)


def test_a_job_shows_its_user_and_who_asked_to_cancel(capsys):
    from datetime import UTC, datetime

    job = rows.job_row(job_id="alice:train-1", user_id="alice", state=JobState.RUNNING, cancel_requested=True,
                       cancel_requested_at=datetime.now(UTC), cancel_requested_by="user alice")
    views.print_job(job, [], views.Out("plain"))
    out = capsys.readouterr().out
    assert "  user        alice\n" in out
    assert "  cancel      requested by user alice  0s ago\n" in out
    views.print_job(rows.job_row(), [], views.Out("plain"))
    out = capsys.readouterr().out
    assert "  user        default\n" in out and "cancel" not in out
    views.print_job(rows.job_row(cancel_requested=True), [], views.Out("plain"))  # before users: nobody recorded
    assert "  cancel      requested by (not recorded)\n" in capsys.readouterr().out


@pytest.mark.parametrize("mode", MODES)
def test_hostile_user_and_cancel_requester_in_a_job_show_literally(mode):
    job = rows.job_row(job_id=HOSTILE, user_id=HOSTILE, cancel_requested=True, cancel_requested_by=HOSTILE)
    text = capture(mode, lambda out: views.print_job(job, [], out))
    assert_safe(text, mode)
    assert sum("FAKE" in line for line in text.splitlines()) >= 3  # job, user and cancel lines


def _quota_wait(state=JobState.QUEUED):
    doc = explanation("tick", "quota: alice holds 2 of 2 gpu; this job asks 1 more", code="quota")
    return rows.job_row(job_id="alice:train-2", user_id="alice", state=state, explanation=doc)


def test_explain_shows_the_waiting_code_quota(capsys):
    views.print_explain(_quota_wait(), [], views.Out("plain"))
    out = capsys.readouterr().out
    assert "  rule        quota: alice holds 2 of 2 gpu; this job asks 1 more\n" in out
    assert "  waiting     quota  (its user's live jobs hold all its quota allows)\n" in out
    views.print_explain(_quota_wait(JobState.RUNNING), [], views.Out("plain"))  # placed since
    assert "waiting" not in capsys.readouterr().out


@pytest.mark.parametrize("mode", MODES)
def test_a_hostile_waiting_code_shows_literally(mode):
    job = rows.job_row(explanation={"by": "tick", "rule": "r", "peers": [], "wait": HOSTILE})
    assert_safe(capture(mode, lambda out: views.print_explain(job, [], out)), mode)


# ---------------------------------------------------------------- commands and flags


def test_the_users_command_and_the_jobs_user_filter_parse():
    args = build_parser().parse_args(["users", "--json", "--config", "f.toml", "--database-url", "postgresql://x"])
    assert (args.command, views.output_mode(args), args.config) == ("users", "json", "f.toml")
    assert views.output_mode(build_parser().parse_args(["users"])) == "plain"  # pytest's stdout: a pipe
    assert build_parser().parse_args(["jobs", "--user", "alice"]).user == "alice"
    assert build_parser().parse_args(["jobs"]).user is None


@pytest.mark.parametrize("bad", ["Alice", "a:b", "-x", "", "a" * 33, "x\n", "a\x1b[31m", "x" * 5000])
def test_a_user_id_nobody_can_have_is_refused(bad):
    with pytest.raises(ConfigError) as caught:
        reads.checked_user_id(bad)
    message = str(caught.value)
    assert message.startswith("--user ") and "\n" not in message and "\x1b" not in message and len(message) < 200


def test_jobs_for_an_invalid_user_is_one_line_and_exit_2(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # no .irisfed/connect.json; nothing is connected to before the check
    assert main(["jobs", "--user", "Not A User", "--database-url", "postgresql://x@127.0.0.1:1/db"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("irisfed: --user 'Not A User' is not a user id")


def test_job_reads_take_stored_ids_and_refuse_others(monkeypatch, capsys):
    asked = []

    async def fake_with_store(args, read):
        class Store:
            async def job_get(self, job_id):
                asked.append(job_id)
                return rows.job_row(job_id=job_id, user_id="alice")

            async def changelog_list_for_job(self, job_id):
                return []

            async def job_tasks_list(self, job_id):
                return []

            async def job_outputs_list(self, job_id):
                return []

            async def job_dependencies_of(self, job_id):
                return []

            async def job_dependents_of(self, job_id):
                return []

        return await read(Store())

    monkeypatch.setattr(reads, "with_store", fake_with_store)
    args = argparse.Namespace(job_id="alice:train-1", output="json", json=False, wide=False)
    assert reads.cmd_job(args) == 0
    assert json.loads(capsys.readouterr().out)["job"]["user_id"] == "alice"
    assert reads.cmd_explain(args) == 0
    explained = json.loads(capsys.readouterr().out)
    assert (explained["user_id"], explained["wait"]) == ("alice", None)
    assert asked == ["alice:train-1", "alice:train-1"]
    for bad in ("Alice:train-1", "a:b:c", "alice:"):
        with pytest.raises(InvalidRequest):
            reads.cmd_job(argparse.Namespace(job_id=bad, output="json", json=False, wide=False))
    assert len(asked) == 2


def test_the_users_command_reads_usage_counts_and_heartbeats(monkeypatch, capsys):
    class Store:
        async def job_live_usage_by_user(self):
            return HELD

        async def job_count_by_user(self):
            return COUNTS

        async def peer_heartbeat_list(self):
            return [gpu_west(), rows.peer_heartbeat_row(
                peer_id="home", backends=[{"name": "main", "attributes": {}, "capacity": {"total": 2, "free": 2}}])]

    async def fake_with_store(args, read):
        return await read(Store())

    monkeypatch.setattr(reads, "with_store", fake_with_store)
    monkeypatch.setattr(reads, "federation_config", lambda args, required=True: config())
    assert reads.cmd_users(argparse.Namespace(output="json", json=False, wide=False)) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(u["user_id"], u["share"]) for u in doc] == [("alice", 0.25), ("bob", 0.0), ("carol", 0.1),
                                                         ("dave", 0.0), ("default", 0.0)]
    assert reads.cmd_users(argparse.Namespace(output="tsv", json=False, wide=False)) == 0
    assert capsys.readouterr().out.splitlines()[1] == "alice\tgpu 2/2, slots 2/4, cpu 3/-\t2\t25.0%\t3\t2\tinteractive"
