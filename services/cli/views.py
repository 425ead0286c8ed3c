"""Rich renderings of the unified view: jobs, one job, peers."""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import UTC, datetime

from rich.console import Console
from rich.table import Table

from shared.config import FederationConfig

STATE_STYLE = {
    "queued": "yellow", "assigned": "cyan", "running": "blue", "succeeded": "green",
    "failed": "red", "killed": "magenta", "rejected": "red", "unschedulable": "red",
}


def console() -> Console:
    return Console()


def _ago(when: datetime | None) -> str:
    if when is None:
        return "-"
    seconds = (datetime.now(UTC) - when).total_seconds()
    return f"{seconds:.0f}s ago" if seconds < 120 else f"{seconds / 60:.0f}m ago"


def jobs_table(rows: Sequence, title: str = "jobs") -> Table:
    table = Table(title=title)
    for column in ("job", "state", "peer", "epoch", "exit", "submitted", "command", "reason"):
        table.add_column(column, overflow="fold")
    for row in rows:
        style = STATE_STYLE.get(row["state"], "")
        command = " ".join(row["command"] or [])
        table.add_row(
            row["job_id"], f"[{style}]{row['state']}[/]", row["owner_peer_id"] or row["pinned_peer_id"] or "-",
            str(row["epoch"]), "-" if row["exit_code"] is None else str(row["exit_code"]),
            _ago(row["submitted_at"]), command[:40], (row["reason"] or "")[:60],
        )
    return table


def peers_table(rows: Sequence, config: FederationConfig | None = None) -> Table:
    table = Table(title="peers")
    for column in ("peer", "reachable", "heartbeat", "free/total", "attributes"):
        table.add_column(column, overflow="fold")
    seen = set()
    for row in rows:
        seen.add(row["peer_id"])
        free = sum(b["capacity"]["free"] for b in row["backends"])
        total = sum(b["capacity"]["total"] for b in row["backends"])
        attrs = "; ".join(
            ", ".join(f"{k}={'|'.join(v)}" for k, v in b["attributes"].items()) for b in row["backends"]
        )
        reachable = "[green]yes[/]" if row["reachable"] else "[red]no[/]"
        table.add_row(row["peer_id"], reachable, _ago(row["received_at"]), f"{free}/{total}", attrs or "-")
    for peer_id in (config.peer_ids if config else ()):
        if peer_id not in seen:
            table.add_row(peer_id, "[red]no[/]", "never", "-", "-")
    return table


def print_job(job, history) -> None:
    out = console()
    spec = job["spec"]
    out.print(f"[bold]{job['job_id']}[/]  {job['state']}  ({job['disposition']})")
    out.print(f"  command     {' '.join(spec['command'])}")
    out.print(f"  owner       {job['owner_peer_id'] or '-'}   pinned {job['pinned_peer_id'] or '-'}   "
              f"epoch {job['epoch']}   attempts {job['attempts']}/{job['max_retries'] + 1}")
    out.print(f"  exit code   {'-' if job['exit_code'] is None else job['exit_code']}")
    out.print(f"  reason      {job['reason'] or '-'}")
    if job["cancel_requested"]:
        out.print("  cancel      requested")
    table = Table(title="history")
    for column in ("seq", "at", "from", "to", "peer", "epoch", "by", "detail"):
        table.add_column(column, overflow="fold")
    for row in history:
        table.add_row(str(row["seq"]), row["at"].strftime("%H:%M:%S.%f")[:-3], row["from_state"] or "(new)",
                      row["to_state"], row["peer_id"] or "-", str(row["epoch"]), row["actor"], row["detail"])
    out.print(table)


def counts_line(counts: dict[str, int]) -> str:
    order = ["queued", "assigned", "running", "succeeded", "failed", "killed", "rejected", "unschedulable"]
    return "  ".join(f"{state}={counts.get(state, 0)}" for state in order)


def now_stamp() -> str:
    return time.strftime("%H:%M:%S")
