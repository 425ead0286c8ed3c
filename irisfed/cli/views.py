"""Renderings of the unified view: jobs, one job, peers, users.

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import msgspec
from rich.console import Console
from rich.table import Table
from rich.text import Text

from irisfed.shared.bands import DEFAULT_MAX_PREEMPTIONS, band_name
from irisfed.shared.config import FederationConfig
from irisfed.shared.dependencies import CONDITION_WORDS, DEPENDENCY
from irisfed.shared.federation.peer import FederationPeer
from irisfed.shared.lifecycle import TERMINAL_STATES, JobState
from irisfed.shared.messages import DryRunReply
from irisfed.shared.records import ChangelogEntry, JobRow, JobSummary, PeerHeartbeatRow
from irisfed.shared.resources import (
    SLOTS,
    amount_text,
    fmt_amount,
    from_units,
    offer_units,
    resource_label,
    size_text,
)
from irisfed.shared.run_contract import contract_text, grace_until, runs_text
from irisfed.shared.users import (
    DEFAULT_USER,
    QUOTA,
    UserTable,
    describe_usage,
    dominant_share,
    share_text,
)

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

    title: str | Text  # a str is read as markup: ours only
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

    def _rich(self, grid: Grid, fit: bool = True) -> Table:
        """``grid`` as a rich table; ``fit``: cut to this console's width (short cells and
        ids whole), else only ids kept whole (a table printed elsewhere: ``top``)."""
        table = Table(title=grid.title)
        if self.wide:
            for column in grid.columns:
                table.add_column(column, overflow="fold")
        elif fit:  # one line a row: a long cell is cut with …
            for column, (least, most) in zip(grid.columns, fitted_widths(grid, self.console.width), strict=True):
                table.add_column(column, overflow="ellipsis", no_wrap=True, min_width=least, max_width=most)
        else:
            for column in grid.columns:
                table.add_column(column, overflow="ellipsis", no_wrap=True,
                                 min_width=ID_WIDTH if column in ("job", "peer") else None)
        for row in grid.rows:
            table.add_row(*row)
        return table


SHORT_CELL = 12  # a column whose cells are all this short (numbers, states, user ids) is never cut
ID_WIDTH = 17  # job and peer ids keep at least this much
LEAST_WIDTH = 5  # what any other long column keeps


def fitted_widths(grid: Grid, width: int) -> list[tuple[int | None, int | None]]:
    """(min, max) width of each column so that the table fits ``width`` cells: short
    columns whole; the rest share what is left, the narrowest first (none cut below
    its least); nothing limited when the whole table fits."""
    natural = [max([len(column), *(row[i].cell_len for row in grid.rows)]) for i, column in enumerate(grid.columns)]
    short = [n <= max(SHORT_CELL, len(column)) for n, column in zip(natural, grid.columns, strict=True)]
    least = [n if is_short else ID_WIDTH if column in ("job", "peer") else LEAST_WIDTH
             for n, is_short, column in zip(natural, short, grid.columns, strict=True)]
    room = width - 3 * len(natural) - 1  # a border and two spaces of padding a column, one border more
    left = room - sum(n for n, is_short in zip(natural, short, strict=True) if is_short)
    cut = sorted((i for i, is_short in enumerate(short) if not is_short), key=natural.__getitem__)
    limits: dict[int, int] = {}
    for k, i in enumerate(cut):  # max-min fair: the narrowest keep all they need, the rest share
        fair = left // (len(cut) - k) if left > 0 else 0
        limits[i] = max(least[i], min(natural[i], fair))
        left -= limits[i]
    return [(least[i], None) if short[i] or limits[i] >= natural[i] else (least[i], limits[i])
            for i in range(len(natural))]


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


def resources_text(resources: Mapping[str, Any] | None, replicas: int = 1) -> str:
    """``cpu 4, gpu 2, memory 64.0 GiB`` (a gang's: ``4 × …``, each task's)."""
    if not isinstance(resources, Mapping) or not resources:
        return "-"
    each = ", ".join(f"{resource_label(name)} {amount_text(name, amount)}" for name, amount in sorted(resources.items())
                     if isinstance(amount, (int, float)) and not isinstance(amount, bool))
    return f"{replicas} × {each}" if replicas > 1 else each or "-"


def duration_text(seconds: float) -> str:
    """``45s``, ``3m04s``, ``2h01m``, ``3d04h``."""
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


def ran_text(started: datetime | None, finished: datetime | None, now: datetime | None = None) -> str:
    """How long its newest run ran (so far, while it runs); ``-`` when it did not run."""
    if started is None:
        return "-"
    return duration_text(((finished or now or datetime.now(UTC)) - started).total_seconds())


def jobs_grid(rows: Sequence[JobSummary], title: str = "jobs") -> Grid:
    grid = Grid(title, ("job", "user", "state", "band", "peer", "epoch", "exit", "resources", "ran", "submitted",
                        "command", "reason"))
    for row in rows:
        ended = row.finished_at if row.state in TERMINAL_STATES else None
        grid.add(lit(row.job_id), lit(row.user_id), _state(row.state), lit(band_name(row.band)),
                 lit(row.owner_peer_id or row.pinned_peer_id or "-"),
                 str(row.epoch), "-" if row.exit_code is None else str(row.exit_code),
                 lit(resources_text(row.resources, row.replicas)),
                 ran_text(row.started_at, ended) if row.started_at and (ended or row.state == JobState.RUNNING)
                 else "-", _ago(row.submitted_at), lit(" ".join(row.command or [])), lit(row.reason or "-"))
    return grid


def job_json(row: JobRow | JobSummary) -> dict[str, Any]:
    """A job row for ``--json``: its fields, the band by name (``batch``) as the wire says it."""
    doc = msgspec.structs.asdict(row)
    doc["band"] = band_name(row.band)
    return doc


def jobs_table(rows: Sequence[JobSummary], title: str = "jobs", width: int | None = None) -> Table:
    """``rows`` fitted to ``width`` columns (the terminal's): short columns and ids whole,
    long text (command, reason) cut with … (``top``)."""
    return Out(console_=Console(width=width) if width else None)._rich(jobs_grid(rows, title), fit=True)


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
        amounts = ", ".join(f"{resource_label(name)} {amount_text(name, from_units(name, free))}/"
                            f"{amount_text(name, from_units(name, total))}"
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


def peers_table(rows: Sequence[PeerHeartbeatRow], config: FederationConfig | None = None,
                width: int | None = None) -> Table:
    return Out(console_=Console(width=width) if width else None)._rich(peers_grid(rows, config), fit=True)


def outputs_grid(outputs: Sequence[Any], title: str = "outputs") -> Grid:
    """A run's output files: task, name, size, and stored or why left out."""
    grid = Grid(title, ("task", "name", "size", "stored"))
    for o in outputs:
        grid.add(str(o.task), lit(o.name), size_text(o.size), "yes" if o.stored else lit(f"no: {o.note}"))
    return grid


def print_job(job: JobRow, history: Sequence[ChangelogEntry], out: Out | None = None,
              tasks: Sequence[Any] = (), outputs: Sequence[Any] = ()) -> None:
    out = out or Out()
    spec = job.spec
    out.line(lit(job.job_id, "bold"), "  ", lit(job.state), "  (", lit(job.disposition), ")")
    out.line("  user        ", lit(job.user_id))
    out.line("  command     ", lit(" ".join(spec["command"])))
    workspace = spec.get("workspace")
    if isinstance(workspace, dict):
        out.line("  workspace   ", lit(str(workspace.get("digest"))), "  ",
                 size_text(int(workspace.get("size") or 0)))
    if spec.get("name"):
        out.line("  name        ", lit(spec["name"]))
    if spec.get("labels"):
        out.line("  labels      ", lit(", ".join(f"{k}={v}" for k, v in spec["labels"].items())))
    out.line("  owner       ", lit(job.owner_peer_id or "-"), "   pinned ", lit(job.pinned_peer_id or "-"),
             f"   epoch {job.epoch}")
    out.line("  runs        ", lit(runs_text(job)))
    out.line("  contract    ", lit(contract_text(spec)))
    out.line("  band        ", lit(band_name(job.band)),
             f"   preemptions {job.preemptions} (at most ", lit(max_preemptions(spec)), ")")
    asked = spec.get("resources") or {"cpu": 1}
    ended = job.state in TERMINAL_STATES
    ran = (ran_text(job.started_at, job.finished_at if ended else None)
           if job.started_at and (ended or job.state == JobState.RUNNING) else "-")
    out.line("  resources   ", lit(resources_text(asked if isinstance(asked, dict) else None, job.replicas)),
             "   ran ", ran)
    out.line("  exit code   ", "-" if job.exit_code is None else str(job.exit_code))
    out.line("  reason      ", lit(job.reason or "-"))
    stopping_line(job, out)
    if job.cancel_requested:
        # Who asked: `user alice`, `operator (cli)`; none recorded before users existed.
        out.line("  cancel      requested by ", lit(job.cancel_requested_by or "(not recorded)"),
                 f"  {_ago(job.cancel_requested_at)}" if job.cancel_requested_at else "")
    for stop in preemptions(history):
        out.line("  preempted   ", _clock(stop.at), " by ", lit(stop.by, "bold"), " on ", lit(stop.peer or "-"),
                 "  (", lit(stop.from_state), " → ", _state(stop.to_state), ")")
    for placed in history:
        victims = preempted_for(placed)
        if victims:
            out.line("  made room   ", _clock(placed.at), " on ", lit(placed.peer_id or "-"), " by preempting ",
                     lit(", ".join(victims)))
    if job.replicas > 1:
        coschedule = spec.get("coschedule")
        group_by = coschedule.get("group_by") if isinstance(coschedule, dict) else None
        out.line(f"  tasks       {job.replicas}", *(("  sharing one ", lit(group_by)) if group_by else ()),
                 "" if tasks else "  (none started yet)")
        if tasks:
            task_grid = Grid(f"tasks (epoch {tasks[0].epoch})", ("task", "node", "state", "exit", "log"))
            for task in tasks:
                task_grid.add(str(task.index), lit(task.node or "-"), lit(task.state),
                              "-" if task.exit_code is None else str(task.exit_code), lit(task.log_path or "-"))
            out.grid(task_grid)
    if outputs:
        out.grid(outputs_grid(outputs, f"outputs (epoch {outputs[0].epoch})"))
    grid = Grid("history", ("seq", "at", "from", "to", "peer", "epoch", "by", "detail"))
    for row in history:
        grid.add(str(row.seq), _clock(row.at), lit(row.from_state or "(new)"),
                 lit(row.to_state), lit(row.peer_id or "-"), str(row.epoch), lit(row.actor), lit(row.detail))
    out.grid(grid)


def stopping_line(job: JobRow, out: Out) -> None:
    """A stop under way (docs/design.md §3.7): a preempted job waiting for its old run to
    stop (where, and what then), or a cancelled running job; each until when its grace lasts."""
    until = grace_until(job)
    grace = f"grace until {until.astimezone().strftime('%H:%M:%S')}" if until is not None else ""
    if job.stopping_on and job.state == JobState.QUEUED:
        out.line("  waiting for ", lit(job.stopping_on), f" to stop its preempted run ({grace}; placed again once "
                 "it is gone)")
    elif until is not None:
        out.line("  stopping    ", f"SIGTERM sent or on its way ({grace}, then SIGKILL)")


def _clock(at: datetime) -> str:
    return at.strftime("%H:%M:%S.%f")[:-3]


def max_preemptions(spec: Mapping[str, Any]) -> str:
    """How many preemptions a job takes before the next one fails it (its spec's, else the default)."""
    value = spec.get("max_preemptions", DEFAULT_MAX_PREEMPTIONS) if isinstance(spec, Mapping) else None
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else str(DEFAULT_MAX_PREEMPTIONS)


# The tick's history details for a preemption (services/tick, ``job_preempt_batch`` and
# ``job_assign_batch``): the victim's row, then the preempting job's placement.
PREEMPTED_BY = "preempted by "
PLACED_PREEMPTING = "placed; preempted "


@dataclass(frozen=True, slots=True)
class Preemption:
    """One time a job was preempted: when, for which job, on which peer, and where it went."""

    at: datetime
    by: str  # the stored id of the job it made room for
    peer: str  # where its run was stopped ("" when the history does not say)
    from_state: str
    to_state: str  # queued; failed after max_preemptions; killed when a cancel was stored


def preemptions(history: Sequence[ChangelogEntry]) -> list[Preemption]:
    """The job's preemptions, oldest first, read from its history (the tick's rows saying
    ``preempted by <job>``); the peer is the last one its history names before each."""
    found, peer = [], ""
    for row in history:
        detail = row.detail or ""
        if row.actor == "tick" and detail.startswith(PREEMPTED_BY):
            by = detail[len(PREEMPTED_BY):].split(";", 1)[0].strip()
            found.append(Preemption(row.at, by, peer, str(row.from_state or ""), str(row.to_state)))
        if row.peer_id:
            peer = row.peer_id
    return found


def preempted_for(row: ChangelogEntry) -> list[str]:
    """The jobs the tick preempted to place this job, from its ``assigned`` row (none: [])."""
    detail = row.detail or ""
    if row.actor != "tick" or row.to_state != JobState.ASSIGNED or not detail.startswith(PLACED_PREEMPTING):
        return []
    return [victim.strip() for victim in detail[len(PLACED_PREEMPTING):].split(",") if victim.strip()]


async def dashboard(store, config: FederationConfig | None, header: str | Text, width: int | None = None):
    """One frame of the live view: peers, jobs by state, recent jobs, fitted to ``width``
    (default: the terminal's).

    ``header`` is ours (a str is read as markup); everything else is shown literally.
    """
    from rich.console import Group

    peers = await store.peer_heartbeat_list()
    counts = await store.job_count_by_state()
    recent = await store.job_list(None, 10)
    return Group(header, peers_table(peers, config, width), lit(counts_line(counts)),
                 jobs_table(recent, title="recent jobs", width=width))


def counts_line(counts: dict[str, int]) -> str:
    return "  ".join(f"{state}={counts.get(state, 0)}" for state in JobState)


def now_stamp() -> str:
    return time.strftime("%H:%M:%S")


# Why a queued job waits when that is not a peer's doing (the explanation's "wait").
WAIT_CODES = {QUOTA: "its user's live jobs hold all its quota allows",
              DEPENDENCY: "jobs it waits for have not all ended"}


def print_links(needs: Sequence[Any], needed_by: Sequence[Any], out: Out) -> None:
    """A job's dependencies and its dependents, each with its state now and its condition."""
    for label, rows in (("after       ", needs), ("dependents  ", needed_by)):
        if rows:
            out.line(label, lit(", ".join(f"{row.job_id} ({row.state}: {CONDITION_WORDS.get(row.condition, row.condition)})"
                                          for row in rows)))


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
        wait = explained.get("wait")
        if wait and state == JobState.QUEUED:  # a placed job's last word may still be its wait
            meaning = f"  ({WAIT_CODES[wait]})" if isinstance(wait, str) and wait in WAIT_CODES else ""
            out.line("  waiting     ", lit(wait, "yellow"), meaning)
    elif job.reason:
        out.line("  reason      ", lit(job.reason))
    placed = [row for row in history if row.to_state == JobState.ASSIGNED]
    if placed:
        last = placed[-1]
        victims = preempted_for(last)
        out.line("  placed      on ", lit(last.peer_id), f" at epoch {last.epoch} (", lit(last.actor), ")",
                 *(("  preempting ", lit(", ".join(victims))) if victims else ()))
    stops = preemptions(history)
    if stops:
        last_stop = stops[-1]
        out.line(f"  preempted   {len(stops)} time{'s' if len(stops) != 1 else ''}, last by ", lit(last_stop.by),
                 " on ", lit(last_stop.peer or "-"), " at ", _clock(last_stop.at))
    stopping_line(job, out)
    if state not in (JobState.QUEUED, JobState.REJECTED):
        out.line("  now         ", lit(job.reason or state))
    if job.attempts:
        out.line("  runs        ", lit(runs_text(job)))
    out.line("  contract    ", lit(contract_text(job.spec)))
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


# ---------------------------------------------------------------- dry run

DRY_RUN_NOTICE = "dry run: nothing was submitted"


def print_dry_run(reply: DryRunReply, out: Out | None = None) -> None:
    """``irisfed submit --dry-run``: what the submit would do now, and that nothing was written."""
    from irisfed.shared.explain import PEER_CODES

    out = out or Out()
    out.line(Text(DRY_RUN_NOTICE, "bold"))
    named = lit(reply.job_id, "bold") if reply.job_id else Text("the job (no --id: submitted, it gets one)", "bold")
    out.line(named, ": ", lit(reply.disposition), " → ", _state(reply.state),
             "  (band ", lit(reply.band), ")",
             "  (duplicate: that id already names this job; its original answer)" if reply.duplicate else "")
    out.line("  reason          ", lit(reply.reason or "-"))
    placement = reply.placement
    if reply.disposition == "reject" or reply.duplicate:
        pass  # nothing would be placed
    elif placement is not None:
        out.line("  would run       on ", lit(placement.peer_id), ", backend ", lit(placement.backend))
        out.line("  would preempt   ", lit(", ".join(placement.preempts)) if placement.preempts else "nothing")
    elif reply.waiting:
        code = reply.waiting_code
        meaning = f"  ({code}: {WAIT_CODES[code]})" if code in WAIT_CODES else ""
        out.line("  would wait      ", lit(reply.waiting, "yellow"), meaning)
    elif reply.peer_id:
        out.line("  would run       on ", lit(reply.peer_id))
    # A job that would wait: why each peer cannot take it now; else how the submit judged them.
    verdicts = reply.waiting_verdicts if placement is None and reply.waiting_verdicts else reply.verdicts
    if verdicts:
        grid = Grid("peers", ("peer", "verdict", "detail"))
        for verdict in verdicts:
            style = "green" if verdict.code == "match" else "red"
            grid.add(lit(verdict.peer_id), lit(PEER_CODES.get(verdict.code, verdict.code), style),
                     lit(verdict.detail or "-"))
        out.grid(grid)


# ---------------------------------------------------------------- users


def federation_totals(rows: Sequence[PeerHeartbeatRow], config: FederationConfig | None = None) -> dict[str, int]:
    """What the reachable peers advertise in all, in units, ``slots`` included: the
    totals fair share divides by (``irisfed.shared.fair_share.federation_totals``), from
    the heartbeat rows; with a config, only its peers count, as in the tick's view. A
    row that is not a valid advertisement counts as nothing, as the services skip it."""
    from irisfed.services.common.peer_view import backends_from_wire
    from irisfed.shared.fair_share import federation_totals as totals_of
    from irisfed.shared.messages import BackendAd

    wanted = set(config.peer_ids) if config else None
    peers = []
    for row in rows:
        if not row.reachable or (wanted is not None and row.peer_id not in wanted):
            continue
        try:
            msgspec.convert(row.backends, list[BackendAd])
            peers.append(FederationPeer(row.peer_id, backends_from_wire(row.backends)))
        except (msgspec.ValidationError, KeyError, TypeError, ValueError, AttributeError):
            continue
    return totals_of(peers)


@dataclass(frozen=True, slots=True)
class UserLine:
    """One user's row of ``irisfed users``. Amounts in units (cpu: millicores; ``slots``:
    live jobs). ``quota``, ``weight`` and ``max_band`` are None when no configuration was read."""

    user_id: str
    configured: bool
    held: Mapping[str, int]
    quota: Mapping[str, int] | None
    weight: float | None
    max_band: str | None
    share: float  # weighted dominant share of the federation totals (weight 1 when unknown)
    queued: int
    running: int  # assigned + running


def user_lines(config: FederationConfig | None, held: Mapping[str, Mapping[str, int]],
               counts: Mapping[str, Mapping[str, int]], totals: Mapping[str, int]) -> list[UserLine]:
    """Every configured user and every user with queued or live jobs, by id; with a
    configuration also ``default``, which is always a user (v1's producers act as it)."""
    table = config.user_table if config else UserTable()
    ids = set(table.users) | set(held) | set(counts) | ({DEFAULT_USER} if config else set())
    lines = []
    for user_id in sorted(ids):
        user = table.get(user_id)
        usage = dict(held.get(user_id, {}))
        states = counts.get(user_id, {})
        weight = user.weight if config else None
        lines.append(UserLine(
            user_id=user_id, configured=user_id in table.users, held=usage,
            quota=user.quota_units() if config else None, weight=weight,
            max_band=user.max_band if config else None,
            share=dominant_share(usage, totals, weight or 1.0),
            queued=int(states.get("queued", 0)),
            running=int(states.get("assigned", 0)) + int(states.get("running", 0))))
    return lines


def _units(name: str, units: int) -> str:
    return fmt_amount(units) if name == SLOTS else amount_text(name, from_units(name, units))


def usage_cell(line: UserLine) -> str:
    """``gpu 2/2, cpu 3/-``: what the user's live jobs hold against its quota (``-``: no
    cap), the resources with a quota first; without a configuration, just what they hold."""
    quota = line.quota or {}
    held = {name: units for name, units in line.held.items() if units and (name != SLOTS or name in quota)}
    names = sorted(quota) + sorted(set(held) - set(quota))
    if line.quota is None:
        return ", ".join(f"{resource_label(name)} {_units(name, held[name])}" for name in names) or "-"
    parts = [f"{resource_label(name)} {_units(name, held.get(name, 0))}/"
             f"{_units(name, quota[name]) if name in quota else '-'}" for name in names]
    return ", ".join(parts) or "-"


def totals_text(totals: Mapping[str, int]) -> str:
    """``slots 16, cpu 64, gpu 8``: what shares are shares of."""
    names = ([SLOTS] if SLOTS in totals else []) + sorted(set(totals) - {SLOTS})
    return ", ".join(f"{resource_label(name)} {_units(name, totals[name])}" for name in names) or "nothing advertised"


def users_grid(lines: Sequence[UserLine], totals: Mapping[str, int] | None = None) -> Grid:
    title = Text("users") if totals is None else Text.assemble("users (shares of ", lit(totals_text(totals)), ")")
    grid = Grid(title, ("user", "usage/quota", "weight", "share", "queued", "running", "max_band"))
    for line in lines:
        grid.add(lit(line.user_id, "" if line.configured else "dim"), lit(usage_cell(line)),
                 "-" if line.weight is None else f"{line.weight:g}", share_text(line.share),
                 str(line.queued), str(line.running), lit(line.max_band or "-"))
    return grid


def users_json(lines: Sequence[UserLine]) -> list[dict[str, Any]]:
    """``irisfed users --json``: amounts in each resource's own unit (``slots``: live jobs)."""
    return [{"user_id": line.user_id, "configured": line.configured,
             "usage": describe_usage(line.held),
             "quota": None if line.quota is None else describe_usage(line.quota),
             "weight": line.weight, "share": line.share, "queued": line.queued, "running": line.running,
             "max_band": line.max_band} for line in lines]
