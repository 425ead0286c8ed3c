"""Renderings of the unified view: jobs, one job, peers.

Everything a job, a producer or a peer chose (ids, names, labels, commands,
reasons, advertised attributes) reaches the screen through :func:`lit`: a rich
``Text`` (never parsed as markup or emoji) with control characters escaped, so
``[cpu]`` shows as ``[cpu]`` and nothing can restyle or drive the terminal.

Tables are built once (``Grid``) and printed by an ``Out`` in one of four modes
(:func:`output_mode`): ``table`` (rich boxes, for a terminal: long cells cut with
``…`` unless ``--wide``), ``plain`` (aligned columns, no colour, nothing cut or
wrapped: the default when stdout is not a terminal), ``tsv`` (one row a line,
tab-separated, tabs and newlines in cells escaped; key/value lines as ``# `` comments)
and ``json`` (the commands print their rows as JSON themselves).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from rich.console import Console
from rich.table import Table
from rich.text import Text

from irisfed.shared.config import FederationConfig
from irisfed.shared.lifecycle import JobState
from irisfed.shared.records import ChangelogEntry, JobRow, JobSummary, PeerHeartbeatRow
from irisfed.shared.resources import fmt_amount, from_units, offer_units

STATE_STYLE = {
    JobState.QUEUED: "yellow", JobState.ASSIGNED: "cyan", JobState.RUNNING: "blue", JobState.SUCCEEDED: "green",
    JobState.FAILED: "red", JobState.KILLED: "magenta", JobState.REJECTED: "red", JobState.UNSCHEDULABLE: "red",
}


def console() -> Console:
    return Console()


def output_mode(args) -> str:
    """``--output``, else ``json`` for ``--json``, else ``table`` on a terminal and ``plain`` in a pipe."""
    chosen = getattr(args, "output", None)
    if chosen:
        return chosen
    if getattr(args, "json", False):
        return "json"
    return "table" if sys.stdout.isatty() else "plain"


@dataclass
class Grid:
    """A table to print: its title, column names and rows of literal cells."""

    title: str
    columns: Sequence[str]
    rows: list[list[Text]] = field(default_factory=list)

    def add(self, *cells: Text | str) -> None:
        self.rows.append([cell if isinstance(cell, Text) else Text(cell) for cell in cells])


class Out:
    """Prints lines and grids in one output mode (see the module docstring)."""

    def __init__(self, mode: str = "table", wide: bool = False, console_: Console | None = None) -> None:
        self.mode, self.wide = mode, wide
        self.console = console_ or Console()

    def line(self, *parts: Text | str) -> None:
        if self.mode == "table":
            self.console.print(Text.assemble(*parts))
            return
        # One line whatever a producer put in a name or reason (``lit`` keeps tabs and
        # newlines): a line break here would start a line a tool reads as a row.
        text = _one_line("".join(part.plain if isinstance(part, Text) else part for part in parts))
        print(f"# {text.strip()}" if self.mode == "tsv" else text)

    def grid(self, grid: Grid) -> None:
        if self.mode == "table":
            self.console.print(self._rich(grid))
        elif self.mode == "tsv":
            print("\t".join(grid.columns))
            for row in grid.rows:
                print("\t".join(_tsv_cell(cell.plain) for cell in row))
        else:
            for line in aligned(grid.columns, [[_one_line(cell.plain) for cell in row] for row in grid.rows]):
                print(line)

    def _rich(self, grid: Grid) -> Table:
        table = Table(title=grid.title)
        for column in grid.columns:
            if self.wide:
                table.add_column(column, overflow="fold")
            else:  # one line a row: a long cell is cut with … (ids keep their full width)
                table.add_column(column, overflow="ellipsis", no_wrap=True,
                                 min_width=17 if column in ("job", "peer") else None)
        for row in grid.rows:
            table.add_row(*row)
        return table


def aligned(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Plain columns padded to their widest cell, two spaces apart; nothing cut or wrapped."""
    widths = [max([len(column), *(len(row[i]) for row in rows)]) for i, column in enumerate(columns)]
    lines = [[column.upper() for column in columns], *rows]
    return ["  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
            for line in lines]


def _one_line(text: str) -> str:
    """A cell on one line: tabs and line breaks (which ``lit`` keeps) shown as ``\\t``, ``\\n``."""
    return text.replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")


def _tsv_cell(text: str) -> str:
    return _one_line(text.replace("\\", "\\\\"))  # backslashes first: the escapes stay readable


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


def jobs_grid(rows: Sequence[JobSummary], title: str = "jobs") -> Grid:
    grid = Grid(title, ("job", "state", "peer", "epoch", "exit", "submitted", "command", "reason"))
    for row in rows:
        grid.add(lit(row.job_id), _state(row.state), lit(row.owner_peer_id or row.pinned_peer_id or "-"),
                 str(row.epoch), "-" if row.exit_code is None else str(row.exit_code),
                 _ago(row.submitted_at), lit(" ".join(row.command or [])), lit(row.reason or "-"))
    return grid


def jobs_table(rows: Sequence[JobSummary], title: str = "jobs") -> Table:
    return Out()._rich(jobs_grid(rows, title))


def backend_resources(backends: Sequence[dict]) -> str:
    """``main: cpu 5/8, gpu 2/4; other: -`` (``-``: a backend placed by slots only;
    ``discovering``: its engine has not said what it has yet)."""
    parts = []
    for b in backends:
        if b.get("discovering") is True:
            parts.append(f"{b['name']}: discovering" if len(backends) > 1 else "discovering")
            continue
        raw = b.get("resources") or {}
        offered = offer_units({name: (v.get("total"), v.get("free")) for name, v in raw.items() if isinstance(v, dict)}
                              if isinstance(raw, dict) else {})
        amounts = ", ".join(f"{name} {fmt_amount(from_units(name, free))}/{fmt_amount(from_units(name, total))}"
                            for name, (total, free) in sorted(offered.items()))
        parts.append(f"{b['name']}: {amounts or '-'}" if len(backends) > 1 else amounts or "-")
    return "; ".join(parts) or "-"


def peers_grid(rows: Sequence[PeerHeartbeatRow], config: FederationConfig | None = None) -> Grid:
    grid = Grid("peers", ("peer", "reachable", "heartbeat", "free/total", "resources free/total", "attributes"))
    seen = set()
    for row in rows:
        seen.add(row.peer_id)
        free = sum(b["capacity"]["free"] for b in row.backends)
        total = sum(b["capacity"]["total"] for b in row.backends)
        attrs = "; ".join(
            ", ".join(f"{k}={'|'.join(v)}" for k, v in b["attributes"].items()) for b in row.backends
        )
        reachable = Text("yes", "green") if row.reachable else Text("no", "red")
        grid.add(lit(row.peer_id), reachable, _ago(row.received_at), f"{free}/{total}",
                 lit(backend_resources(row.backends)), lit(attrs or "-"))
    for peer_id in (config.peer_ids if config else ()):
        if peer_id not in seen:
            grid.add(lit(peer_id), Text("no", "red"), "never", "-", "-", "-")
    return grid


def peers_table(rows: Sequence[PeerHeartbeatRow], config: FederationConfig | None = None) -> Table:
    return Out()._rich(peers_grid(rows, config))


def print_job(job: JobRow, history: Sequence[ChangelogEntry], out: Out | None = None) -> None:
    out = out or Out()
    spec = job.spec
    out.line(lit(job.job_id, "bold"), "  ", lit(job.state), "  (", lit(job.disposition), ")")
    out.line("  command     ", lit(" ".join(spec["command"])))
    if spec.get("name"):
        out.line("  name        ", lit(spec["name"]))
    if spec.get("labels"):
        out.line("  labels      ", lit(", ".join(f"{k}={v}" for k, v in spec["labels"].items())))
    out.line("  owner       ", lit(job.owner_peer_id or "-"), "   pinned ", lit(job.pinned_peer_id or "-"),
             f"   epoch {job.epoch}   attempts {job.attempts}/{job.max_retries + 1}")
    out.line("  exit code   ", "-" if job.exit_code is None else str(job.exit_code))
    out.line("  reason      ", lit(job.reason or "-"))
    if job.cancel_requested:
        out.line("  cancel      requested")
    grid = Grid("history", ("seq", "at", "from", "to", "peer", "epoch", "by", "detail"))
    for row in history:
        grid.add(str(row.seq), row.at.strftime("%H:%M:%S.%f")[:-3], lit(row.from_state or "(new)"),
                 lit(row.to_state), lit(row.peer_id or "-"), str(row.epoch), lit(row.actor), lit(row.detail))
    out.grid(grid)


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


def print_explain(job: JobRow, history: Sequence[ChangelogEntry], out: Out | None = None) -> None:
    """A person's answer to "why is this job where it is?"."""
    from irisfed.shared.explain import PEER_CODES

    out = out or Out()
    state = job.state
    out.line(lit(job.job_id, "bold"), " is ", _state(state), " (", lit(job.disposition), " at submit)")
    explained = job.explanation or {}
    if explained:
        out.line("  decided by  ", lit(explained["by"]))
        out.line("  rule        ", lit(explained["rule"]))
    elif job.reason:
        out.line("  reason      ", lit(job.reason))
    placed = [row for row in history if row.to_state == JobState.ASSIGNED]
    if placed:
        last = placed[-1]
        out.line("  placed      on ", lit(last.peer_id), f" at epoch {last.epoch} (", lit(last.actor), ")")
    if state not in (JobState.QUEUED, JobState.REJECTED):
        out.line("  now         ", lit(job.reason or state))
    peers = explained.get("peers") or []
    if peers:
        grid = Grid("peers", ("peer", "verdict", "detail"))
        for peer in peers:
            style = "green" if peer["code"] == "match" else "red"
            grid.add(lit(peer["peer_id"]), lit(PEER_CODES.get(peer["code"], peer["code"]), style), lit(peer["detail"]))
        out.grid(grid)
    more = explained.get("more") or {}
    if more:
        counts = ", ".join(f"{count} {PEER_CODES.get(code, code)}" for code, count in more.items())
        out.line(lit(f"  and {sum(more.values())} more peers: {counts}"))
