"""Untrusted strings (peer attributes, job names, labels, reasons, commands, ids)
are shown literally by every CLI view: never read as rich markup or emoji codes,
and never passed through as terminal control sequences."""

from __future__ import annotations

import asyncio
import io

import pytest
from rich.console import Console

from irisfed.cli import views
from irisfed.shared.lifecycle import JobState
from tests.infra import rows

HOSTILE = ["[cpu]", "[bold]x[/]", "[link=http://x]y[/link]", "oops [/] done", ":smile:"]
ESC = "\x1b[31mred"  # a terminal escape hidden in a string


@pytest.fixture(autouse=True)
def wide(monkeypatch):
    # Wide enough that no table folds a cell; the views' own consoles read COLUMNS.
    monkeypatch.setenv("COLUMNS", "500")


def render(renderable) -> str:
    out = Console(file=io.StringIO(), width=500, force_terminal=True, color_system="truecolor")
    out.print(renderable)
    return out.file.getvalue()


def assert_literal(text: str) -> None:
    for hostile in HOSTILE:
        assert hostile in text, f"{hostile!r} not shown literally in:\n{text}"
    assert "\x1b[31mred" not in text and "\\x1b[31mred" in text
    assert "😄" not in text


HOSTILE_JOB = {"job_id": "j-[cpu]", "pinned_peer_id": "[bold]x[/]", "epoch": 1, "reason": f"oops [/] done {ESC}"}


def job_row(command=("echo", "[link=http://x]y[/link]", ":smile:"), **overrides):
    spec = {"command": list(command), "name": "[bold]x[/]", "labels": {"team": "[cpu]"}}
    return rows.job_row(spec=spec, **{**HOSTILE_JOB, **overrides})


def job_summary(command=("echo", "[link=http://x]y[/link]", ":smile:"), **overrides):
    return rows.job_summary(list(command), **{**HOSTILE_JOB, **overrides})


def peer_row():
    return rows.peer_heartbeat_row(
        peer_id="p-[cpu]",
        backends=[{"name": "main", "capacity": {"total": 2, "free": 1},
                   "attributes": {"device_type": ["[cpu]", "[bold]x[/]"],
                                  "zone": ["[link=http://x]y[/link]", "oops [/] done", ":smile:", ESC]}}])


def test_jobs_table_shows_strings_literally():
    text = render(views.jobs_table([job_summary(job_id="[cpu]", owner_peer_id="[bold]x[/]",
                                                command=["[link=http://x]y[/link]", ":smile:"])]))
    assert_literal(text)


def test_peers_table_shows_attributes_literally():
    assert_literal(render(views.peers_table([peer_row()])))


def test_job_view_shows_strings_literally(capsys):
    history = [rows.changelog_entry(peer_id="[cpu]", detail="[bold]x[/] :smile:")]
    views.print_job(job_row(command=["[link=http://x]y[/link]", "oops [/] done"]), history)
    out = capsys.readouterr().out
    assert_literal(out)
    assert "[bold]x[/]" in out and "team=[cpu]" in out  # name and labels


def test_explain_shows_peer_attributes_literally(capsys):
    from irisfed.shared.explain import explanation
    from irisfed.shared.federation.router import PeerVerdict

    verdicts = [PeerVerdict("[cpu]", "value_mismatch", "device_type=[cpu] does not satisfy device_type eq gpu"),
                PeerVerdict("gpu-west", "missing_attribute", "[bold]x[/] [link=http://x]y[/link] :smile:")]
    job = job_row(state=JobState.REJECTED, disposition="reject",
                  explanation=explanation("router", "rule 4: oops [/] done", verdicts))
    history = [rows.changelog_entry(to_state=JobState.ASSIGNED, peer_id="[bold]x[/]", epoch=1, actor=ESC)]
    views.print_explain(job, history)
    out = capsys.readouterr().out
    assert "device_type=[cpu] does not satisfy" in out
    assert_literal(out)


def test_explain_with_only_a_reason(capsys):
    views.print_explain(job_row(state=JobState.FAILED, reason="[bold]x[/] [link=http://x]y[/link] oops [/] done"), [])
    out = capsys.readouterr().out
    assert "[bold]x[/] [link=http://x]y[/link] oops [/] done" in out


class _Store:
    """The three reads the dashboard makes (no I/O in unit tests)."""

    async def peer_heartbeat_list(self):
        return [peer_row()]

    async def job_count_by_state(self):
        return {"queued": 1}

    async def job_list(self, state, limit):
        return [job_summary(job_id="[cpu]", owner_peer_id="[bold]x[/]", command=["[link=http://x]y[/link]", ":smile:"])]


def test_top_dashboard_shows_strings_literally():
    frame = asyncio.run(views.dashboard(_Store(), None, "irisfed top"))
    text = render(frame)
    assert_literal(text)
    assert "queued=1" in text


def test_job_output_on_a_terminal_shows_control_characters_escaped(capsys):
    # A job's output is the job's text: on a terminal `irisfed logs` must not let it drive the terminal.
    from irisfed.cli.logs import exit_status, write_output

    write_output(f"ok {ESC} \u202e done\n".encode() + b"\xff\n", tty=True)
    out = capsys.readouterr().out
    assert out.startswith("ok ") and "\x1b" not in out and "\u202e" not in out and "\\x1b[31mred" in out
    assert out.endswith("\ufffd\n")  # invalid UTF-8 shown as such, not raw
    assert [exit_status(*case) for case in (("succeeded", 0), ("failed", 7), ("failed", None), ("killed", None),
                                            ("failed", 300))] == [0, 7, 1, 1, 1]
