"""Rich renderings of the unified view: jobs, one job, peers.

Everything a job, a producer or a peer chose (ids, names, labels, commands,
reasons, advertised attributes) reaches the screen through :func:`lit`: a rich
``Text`` (never parsed as markup or emoji) with control characters escaped, so
``[cpu]`` shows as ``[cpu]`` and nothing can restyle or drive the terminal.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import UTC, datetime

from rich.console import Console
from rich.table import Table
from rich.text import Text

from shared.config import FederationConfig
from shared.lifecycle import JobState
from shared.records import ChangelogEntry, JobRow, JobSummary, PeerHeartbeatRow
from shared.resources import fmt_amount, from_units, offer_units

STATE_STYLE = {
    JobState.QUEUED: "yellow", JobState.ASSIGNED: "cyan", JobState.RUNNING: "blue", JobState.SUCCEEDED: "green",
    JobState.FAILED: "red", JobState.KILLED: "magenta", JobState.REJECTED: "red", JobState.UNSCHEDULABLE: "red",
}


def console() -> Console:
    return Console()


def printable(value: object) -> str:
    """``value`` as a string whose control characters (ESC, CR, bidi overrides ...) are escaped."""
    text = "" if value is None else str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in "\n\t" else c.encode("unicode_escape").decode("ascii")
                   for c in text)


def lit(value: object, style: str = "") -> Text:
    """Untrusted text shown literally: no markup, no emoji codes, no control sequences."""
    return Text(printable(value), style=style)


def _state(state: str) -> Text:
    return lit(state, STATE_STYLE.get(state, ""))


def _ago(when: datetime | None) -> str:
    if when is None:
        return "-"
    seconds = (datetime.now(UTC) - when).total_seconds()
    return f"{seconds:.0f}s ago" if seconds < 120 else f"{seconds / 60:.0f}m ago"


def jobs_table(rows: Sequence[JobSummary], title: str = "jobs") -> Table:
    table = Table(title=title)
    for column in ("job", "state", "peer", "epoch", "exit", "submitted", "command", "reason"):
        table.add_column(column, overflow="fold")
    for row in rows:
        command = " ".join(row.command or [])
        table.add_row(
            lit(row.job_id), _state(row.state), lit(row.owner_peer_id or row.pinned_peer_id or "-"),
            str(row.epoch), "-" if row.exit_code is None else str(row.exit_code),
            _ago(row.submitted_at), lit(command[:40]), lit((row.reason or "")[:60]),
        )
    return table


def backend_resources(backends: Sequence[dict]) -> str:
    """``main: cpu 5/8, gpu 2/4; other: -`` (``-``: a backend placed by slots only)."""
    parts = []
    for b in backends:
        raw = b.get("resources") or {}
        offered = offer_units({name: (v.get("total"), v.get("free")) for name, v in raw.items() if isinstance(v, dict)}
                              if isinstance(raw, dict) else {})
        amounts = ", ".join(f"{name} {fmt_amount(from_units(name, free))}/{fmt_amount(from_units(name, total))}"
                            for name, (total, free) in sorted(offered.items()))
        parts.append(f"{b['name']}: {amounts or '-'}" if len(backends) > 1 else amounts or "-")
    return "; ".join(parts) or "-"


def peers_table(rows: Sequence[PeerHeartbeatRow], config: FederationConfig | None = None) -> Table:
    table = Table(title="peers")
    for column in ("peer", "reachable", "heartbeat", "free/total", "resources free/total", "attributes"):
        table.add_column(column, overflow="fold")
    seen = set()
    for row in rows:
        seen.add(row.peer_id)
        free = sum(b["capacity"]["free"] for b in row.backends)
        total = sum(b["capacity"]["total"] for b in row.backends)
        attrs = "; ".join(
            ", ".join(f"{k}={'|'.join(v)}" for k, v in b["attributes"].items()) for b in row.backends
        )
        reachable = "[green]yes[/]" if row.reachable else "[red]no[/]"
        table.add_row(lit(row.peer_id), reachable, _ago(row.received_at), f"{free}/{total}",
                      lit(backend_resources(row.backends)), lit(attrs or "-"))
    for peer_id in (config.peer_ids if config else ()):
        if peer_id not in seen:
            table.add_row(lit(peer_id), "[red]no[/]", "never", "-", "-", "-")
    return table


def print_job(job: JobRow, history: Sequence[ChangelogEntry]) -> None:
    out = console()
    spec = job.spec
    out.print(Text.assemble(lit(job.job_id, "bold"), "  ", lit(job.state), "  (",
                            lit(job.disposition), ")"))
    out.print(Text.assemble("  command     ", lit(" ".join(spec["command"]))))
    if spec.get("name"):
        out.print(Text.assemble("  name        ", lit(spec["name"])))
    if spec.get("labels"):
        out.print(Text.assemble("  labels      ", lit(", ".join(f"{k}={v}" for k, v in spec["labels"].items()))))
    out.print(Text.assemble("  owner       ", lit(job.owner_peer_id or "-"), "   pinned ",
                            lit(job.pinned_peer_id or "-"),
                            f"   epoch {job.epoch}   attempts {job.attempts}/{job.max_retries + 1}"))
    out.print(Text.assemble("  exit code   ", "-" if job.exit_code is None else str(job.exit_code)))
    out.print(Text.assemble("  reason      ", lit(job.reason or "-")))
    if job.cancel_requested:
        out.print("  cancel      requested", markup=False)
    table = Table(title="history")
    for column in ("seq", "at", "from", "to", "peer", "epoch", "by", "detail"):
        table.add_column(column, overflow="fold")
    for row in history:
        table.add_row(str(row.seq), row.at.strftime("%H:%M:%S.%f")[:-3], lit(row.from_state or "(new)"),
                      lit(row.to_state), lit(row.peer_id or "-"), str(row.epoch), lit(row.actor),
                      lit(row.detail))
    out.print(table)


async def dashboard(store, config: FederationConfig | None, header: str | Text):
    """One frame of the live view: peers, jobs by state, recent jobs.

    ``header`` is ours (a str is read as markup); everything else is shown literally.
    """
    from rich.console import Group

    peers = await store.peer_heartbeat_list()
    counts = await store.job_count_by_state()
    recent = await store.job_list(None, 10)
    return Group(header, peers_table(peers, config), lit(counts_line(counts)), jobs_table(recent, title="recent jobs"))


def counts_line(counts: dict[str, int]) -> str:
    return "  ".join(f"{state}={counts.get(state, 0)}" for state in JobState)


def now_stamp() -> str:
    return time.strftime("%H:%M:%S")


def print_explain(job: JobRow, history: Sequence[ChangelogEntry]) -> None:
    """A person's answer to "why is this job where it is?"."""
    from shared.explain import PEER_CODES

    out = console()
    state = job.state
    out.print(Text.assemble(lit(job.job_id, "bold"), " is ", _state(state), " (", lit(job.disposition),
                            " at submit)"))
    explained = job.explanation or {}
    if explained:
        out.print(Text.assemble("  decided by  ", lit(explained["by"])))
        out.print(Text.assemble("  rule        ", lit(explained["rule"])))
    elif job.reason:
        out.print(Text.assemble("  reason      ", lit(job.reason)))
    placed = [row for row in history if row.to_state == JobState.ASSIGNED]
    if placed:
        last = placed[-1]
        out.print(Text.assemble("  placed      on ", lit(last.peer_id), f" at epoch {last.epoch} (",
                                lit(last.actor), ")"))
    if state not in (JobState.QUEUED, JobState.REJECTED):
        out.print(Text.assemble("  now         ", lit(job.reason or state)))
    peers = explained.get("peers") or []
    if peers:
        table = Table(title="peers")
        for column in ("peer", "verdict", "detail"):
            table.add_column(column, overflow="fold")
        for peer in peers:
            style = "green" if peer["code"] == "match" else "red"
            table.add_row(lit(peer["peer_id"]), lit(PEER_CODES.get(peer["code"], peer["code"]), style),
                          lit(peer["detail"]))
        out.print(table)
    more = explained.get("more") or {}
    if more:
        counts = ", ".join(f"{count} {PEER_CODES.get(code, code)}" for code, count in more.items())
        out.print(lit(f"  and {sum(more.values())} more peers: {counts}"))
