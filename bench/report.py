"""What a bench run measured: its figures, the table it prints, and the JSON it writes.

A results file (``irisfed bench --out F``; the kept ones are in bench/results/) is
rendered as Markdown by ``irisfed bench --report F``: the headline table
(:func:`headline`, every judged or compared figure), which ``--readme README.md``
writes between README's marker comments (:func:`with_table`), or with ``--all``
every figure with its notes and the targets (:func:`markdown`; also ``python -m
irisfed.bench.report F``). Pure functions of the file's contents: no I/O but the
caller's.
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import sys
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import msgspec


@dataclass
class Figure:
    section: str
    name: str
    value: float
    unit: str
    baseline: str = ""
    ratio: float | None = None
    target: str = ""
    met: bool | None = None
    runs: str = "1 run"
    note: str = ""


def paired_figure(section: str, name: str, ours: list[float], plain: list[float], baseline: str,
                  target: float, target_text: str, as_said: bool, why_not: str, note: str) -> Figure:
    """A row timing ``ours`` against ``plain`` (s each, run in alternating pairs): the
    median of ``ours`` in ms against the median of ``plain`` (``baseline``, its ms added),
    the ratio judged against ``target`` (``target_text``) only when the runs did what the
    figure says (``as_said``; else the note starts ``not judged: <why_not>``). The note
    ends with each pair's ratio."""
    ratio = statistics.median(ours) / statistics.median(plain)
    pairs = " ".join(f"{p / q:.2f}" for p, q in zip(ours, plain, strict=False))
    note = f"{note}; pair ratios {pairs}"
    if not as_said:
        note = f"not judged: {why_not}; " + note
    return Figure(section, name, statistics.median(ours) * 1e3, "ms",
                  f"{baseline} ({statistics.median(plain) * 1e3:,.1f} ms)", ratio, target_text,
                  ratio <= target if as_said else None, f"{len(ours)} pairs, alternating", note)


@dataclass
class Target:
    """One of issue 15's targets, judged from this run's figures; ``met`` is None
    when a figure it needs was not measured in this run."""

    what: str
    measured: str
    met: bool | None


@dataclass
class Profile:
    quick: bool

    def n(self, quick: int, full: int) -> int:
        return quick if self.quick else full

    def s(self, quick: float, full: float) -> float:
        return quick if self.quick else full


@dataclass
class Bench:
    """One run: its sizes (``profile``), scratch folder, figures and same-run baselines."""

    profile: Profile
    folder: Path
    figures: list[Figure] = field(default_factory=list)
    baselines: dict[str, float] = field(default_factory=dict)
    targets: list[Target] = field(default_factory=list)
    load_at_start: tuple[float, ...] = ()  # os.getloadavg() as the run began: was the machine shared?

    def add(self, figure: Figure, after: Figure | None = None) -> Figure:
        """Record ``figure``: last, or right after ``after`` (a comparison beside its row)."""
        if after is None:
            self.figures.append(figure)
        else:
            self.figures.insert(self.figures.index(after) + 1, figure)
        print(f"  {figure.section:<10} {figure.name:<44} {figure.value:>12,.1f} {figure.unit}"
              + (f"  ({figure.ratio:.2f}× {figure.baseline})" if figure.ratio is not None else ""), flush=True)
        return figure


# The irisfed figures pgqueuer and issue 15's targets are judged against: (section, name prefix).
# DISPATCH_*: the QUEUE job's rows (router → tick → agent; named "…, QUEUE job" since
# 2026-12-02, plain before); LOCAL_*: the LOCAL job's (router → the local agent).
DISPATCH_P50 = ("dispatch", "submit → running p50 at")
DISPATCH_P99 = ("dispatch", "submit → running p99 at")
LOCAL_P50 = ("dispatch", "LOCAL job: submit → running p50 at")
LOCAL_P99 = ("dispatch", "LOCAL job: submit → running p99 at")
SUBMITS_100 = ("submit", "durable submits/s, 100 in flight")
SUBMITS_2000 = ("submit", "durable submits/s, 2000 in flight")


def find(figures: list[Figure], key: tuple[str, str]) -> Figure | None:
    section, prefix = key
    return next((f for f in figures if f.section == section and f.name.startswith(prefix)), None)


def note_ms(note: str, label: str) -> float | None:
    """``label``'s value in a note like "p50 1.21 ms, p99 2.10 ms", in ms; None if absent."""
    match = re.search(rf"(?:^|[ ,;(]){re.escape(label)} ([0-9][0-9,]*(?:\.[0-9]+)?) ms", note)
    return float(match.group(1).replace(",", "")) if match else None


# pgqueuer's producer must finish its enqueues at this share of the offered 500/s for its
# enqueue → start to be a latency; below it, enqueues wait for Postgres's commit lock (a
# loaded machine) and the figure is a backlog that no ratio should be judged against.
KEPT_UP = 0.95


def pgqueuer_backlog(baselines: dict[str, float]) -> str:
    """Why pgqueuer's enqueue → start is no latency in this run, or "" when it is (or
    the run predates the check)."""
    kept_up = baselines.get("pgq_start_kept_up")
    if kept_up is None or kept_up >= KEPT_UP:
        return ""
    return (f"not judged: pgqueuer's enqueues finished at {kept_up:.0%} of the offered rate, so its "
            "enqueue → start is a backlog, not a latency")


def pgqueuer_comparisons(figures: list[Figure], baselines: dict[str, float]) -> list[tuple[Figure, Figure]]:
    """(irisfed's row, its comparison with pgqueuer from the same run) for each pair
    this run measured both sides of."""
    pairs = []
    backlog = pgqueuer_backlog(baselines)
    p50, p99 = find(figures, DISPATCH_P50), find(figures, DISPATCH_P99)
    if p50 is not None and "pgq_start_p50" in baselines:
        theirs = baselines["pgq_start_p50"] * 1e3
        ratio = p50.value / theirs
        pairs.append((p50, Figure(
            "dispatch", "submit → running p50 vs pgqueuer enqueue → start p50", p50.value, "ms",
            f"pgqueuer enqueue → start p50 ({theirs:.1f} ms)", ratio, "≤ 2× pgqueuer and ≤ 10 ms",
            None if backlog else ratio <= 2 and p50.value <= 10, p50.runs, backlog)))
    if p99 is not None and "pgq_start_p99" in baselines:
        theirs = baselines["pgq_start_p99"] * 1e3
        pairs.append((p99, Figure(
            "dispatch", "submit → running p99 vs pgqueuer enqueue → start p99", p99.value, "ms",
            f"pgqueuer enqueue → start p99 ({theirs:.1f} ms)", p99.value / theirs, "≤ 50 ms",
            p99.value <= 50, p99.runs, backlog)))
    # LOCAL jobs: the like-for-like comparison. Like pgqueuer's enqueue → start, the
    # producer's side writes the job durably and wakes the process that starts it, which
    # takes it with one statement of its own; no third process in between. No target yet.
    for key, label in ((LOCAL_P50, "p50"), (LOCAL_P99, "p99")):
        local = find(figures, key)
        if local is not None and f"pgq_start_{label}" in baselines:
            theirs = baselines[f"pgq_start_{label}"] * 1e3
            pairs.append((local, Figure(
                "dispatch", f"LOCAL job: submit → running {label} vs pgqueuer enqueue → start {label}", local.value,
                "ms", f"pgqueuer enqueue → start {label} ({theirs:.1f} ms)", local.value / theirs, runs=local.runs,
                note=backlog)))
    ours = find(figures, SUBMITS_100)
    if ours is not None and "pgq_enqueue_100" in baselines:
        theirs = baselines["pgq_enqueue_100"]
        our_p99 = note_ms(ours.note, "p99")
        pairs.append((ours, Figure(
            "submit", "durable submits at 100 in flight vs pgqueuer 100 concurrent enqueues", ours.value, "req/s",
            f"pgqueuer, 100 producers ({theirs:,.0f} jobs/s)", ours.value / theirs, runs=ours.runs,
            note=f"ack p99 {'?' if our_p99 is None else f'{our_p99:.2f}'} ms against pgqueuer's "
                 f"{baselines['pgq_enqueue_100_p99'] * 1e3:.2f} ms")))
    return pairs


def issue_targets(figures: list[Figure], baselines: dict[str, float]) -> list[Target]:
    """Issue 15's targets, each met or not in this run, or not judged (a figure it needs
    was not measured: its section did not run)."""
    def unmeasured(section: str) -> str:
        return f"not measured in this run (irisfed bench --sections {section})"

    targets = []
    p50, p99 = find(figures, DISPATCH_P50), find(figures, DISPATCH_P99)
    theirs = baselines.get("pgq_start_p50")
    targets.append(Target("submit → running p50 at 500/s ≤ 10 ms",
                          f"{p50.value:.1f} ms" if p50 else unmeasured("dispatch"),
                          p50.value <= 10 if p50 else None))
    if p50 is not None and theirs is not None:
        ratio = p50.value / (theirs * 1e3)
        backlog = pgqueuer_backlog(baselines)
        targets.append(Target("submit → running p50 ≤ 2× pgqueuer enqueue → start p50",
                              f"{ratio:.2f}× ({p50.value:.1f} against {theirs * 1e3:.1f} ms)"
                              + (f"; {backlog}" if backlog else ""), None if backlog else ratio <= 2))
    else:
        targets.append(Target("submit → running p50 ≤ 2× pgqueuer enqueue → start p50",
                              unmeasured("dispatch" if p50 is None else "pgqueuer"), None))
    targets.append(Target("submit → running p99 at 500/s ≤ 50 ms",
                          f"{p99.value:.1f} ms" if p99 else unmeasured("dispatch"),
                          p99.value <= 50 if p99 else None))
    for key, what in ((SUBMITS_2000, "durable submits at 2,000 in flight ≥ 0.35× the NATS echo"),
                      (SUBMITS_100, "durable submits at 100 in flight ≥ 0.40× the NATS echo, ack p99 ≤ 10 ms")):
        ours = find(figures, key)
        if ours is None or ours.ratio is None:
            targets.append(Target(what, unmeasured("submit"), None))
            continue
        measured = f"{ours.ratio:.2f}× ({ours.value:,.0f} req/s)"
        p99_ms = note_ms(ours.note, "p99")
        if key == SUBMITS_100 and p99_ms is not None:
            measured += f", ack p99 {p99_ms:.2f} ms"
        targets.append(Target(what, measured, ours.met))
    return targets


def judge(bench: Bench) -> None:
    """Put pgqueuer's comparisons beside irisfed's rows and judge issue 15's targets,
    once every section has run; nothing to judge if neither dispatch, submit nor
    pgqueuer ran."""
    for row, comparison in pgqueuer_comparisons(bench.figures, bench.baselines):
        bench.add(comparison, after=row)
    needs = (DISPATCH_P50, DISPATCH_P99, SUBMITS_100, SUBMITS_2000)
    if any(find(bench.figures, key) for key in needs) or any(k.startswith("pgq_") for k in bench.baselines):
        bench.targets = issue_targets(bench.figures, bench.baselines)


def print_table(bench: Bench) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"irisfed bench ({'quick' if bench.profile.quick else 'full'}), "
                        f"{os.cpu_count()} cores")
    for column in ("section", "figure", "value", "vs baseline", "target", "met", "runs", "notes"):
        table.add_column(column, overflow="fold")
    for f in bench.figures:
        ratio = f"{f.ratio:.2f}× {f.baseline}" if f.ratio is not None else ""
        met = "" if f.met is None else ("[green]yes[/]" if f.met else "[red]no[/]")
        table.add_row(f.section, f.name, f"{f.value:,.2f} {f.unit}", ratio, f.target, met, f.runs, f.note)
    console = Console(width=200)
    console.print(table)
    if bench.targets:
        targets = Table(title="issue 15 targets (this run)")
        for column in ("target", "measured", "met"):
            targets.add_column(column, overflow="fold")
        for t in bench.targets:
            targets.add_row(t.what, t.measured, _met(t.met, "[green]yes[/]", "[red]no[/]", "not judged"))
        console.print(targets)


def _met(met: bool | None, yes: str, no: str, unknown: str = "") -> str:
    return unknown if met is None else (yes if met else no)


def write_json(bench: Bench, out: Path) -> None:
    out.write_text(json.dumps({
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "when": datetime.now(UTC).isoformat(), "quick": bench.profile.quick,
        "load_average": {"start": list(bench.load_at_start), "end": list(os.getloadavg())},
        "figures": [asdict(f) for f in bench.figures], "targets": [asdict(t) for t in bench.targets]},
        indent=2))


def markdown(doc: dict) -> str:
    """Every figure of a results file (as :func:`load_results` returns it), with its
    runs and notes, and the targets; every string from the file escaped (:func:`_cell`)."""
    lines = [f"Machine: {_cell(doc['machine'])}; run {_cell(doc['when'][:16])}Z "
             f"({'quick' if doc['quick'] else 'full'}).", "",
             "| section | figure | value | vs baseline (same run) | target | met | runs | notes |",
             "|---|---|---|---|---|---|---|---|"]
    for f in doc["figures"]:
        ratio = f"{f['ratio']:.2f}× {f['baseline']}" if f["ratio"] is not None else ""
        met = "" if f["met"] is None else ("yes" if f["met"] else "**no**")
        lines.append(f"| {_cell(f['section'])} | {_cell(f['name'])} | {f['value']:,.1f} {_cell(f['unit'])} | "
                     f"{_cell(ratio)} | {_cell(f['target'])} | {met} | {_cell(f['runs'])} | {_cell(f['note'])} |")
    if doc.get("targets"):
        lines += ["", "| issue 15 target | measured | met |", "|---|---|---|"]
        lines += [f"| {_cell(t['what'])} | {_cell(t['measured'])} | {_met(t['met'], 'yes', '**no**', 'not judged')} |"
                  for t in doc["targets"]]
    return "\n".join(lines) + "\n"


# --- the README's table, generated from a results file ---------------------------------

TABLE_START = "<!-- bench-table:start -->"
TABLE_END = "<!-- bench-table:end -->"


class ResultsError(ValueError):
    """A results file, or the README it would go into, that cannot be used; the message says why."""


class _FigureRow(msgspec.Struct):
    """A figure as :func:`write_json` writes it: what :func:`load_results` checks each against."""

    section: str
    name: str
    value: float
    unit: str
    baseline: str
    ratio: float | None
    target: str
    met: bool | None
    note: str
    runs: str = "1 run"  # not in every file: Figure's default


class _TargetRow(msgspec.Struct):
    what: str
    measured: str
    met: bool | None


class _LoadAverage(msgspec.Struct):
    start: list[float] = msgspec.field(default_factory=list)
    end: list[float] = msgspec.field(default_factory=list)


class _Results(msgspec.Struct):
    machine: str
    when: str
    quick: bool
    figures: list[_FigureRow]
    targets: list[_TargetRow] = msgspec.field(default_factory=list)
    load_average: _LoadAverage | None = None


def _where(path: str) -> str:
    """msgspec's ``$.figures[0].value`` as a reader counts: ``figure 1's value``."""
    where = re.sub(r"^\$\.?", "", path)
    where = re.sub(r"^(figure|target)s\[(\d+)\]\.?", lambda m: f"{m[1]} {int(m[2]) + 1}'s ", where)
    return where.strip().removesuffix("'s") or "the file"


def load_results(text: str, source: str) -> dict:
    """A results file's contents (what :func:`write_json` wrote), every field of the
    type the renderers expect (a figure without ``runs`` gets Figure's default), so
    nothing past here can fail on a wrong type; else ResultsError naming the field."""
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ResultsError(f"{source}: not JSON ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("figures"), list) or \
            not all(isinstance(doc.get(k), t) for k, t in (("machine", str), ("when", str), ("quick", bool))):
        raise ResultsError(f"{source}: not a bench results file (irisfed bench --out FILE writes one: "
                           "machine, when, quick, figures)")
    fields = ("section", "name", "value", "unit", "baseline", "ratio", "target", "met", "note")
    for i, f in enumerate(doc["figures"]):
        if not isinstance(f, dict) or any(k not in f for k in fields):
            raise ResultsError(f"{source}: figure {i + 1} lacks one of {', '.join(fields)}")
    try:
        results = msgspec.convert(doc, _Results, strict=True)
    except msgspec.ValidationError as exc:
        match = re.fullmatch(r"(.*?)(?: - at `([^`]*)`)?", str(exc), re.DOTALL)
        why, path = match[1], match[2] or "$"
        why = " ".join(why.replace("`", "").replace("Expected ", "expected ").replace(" | ", " or ").split())
        raise ResultsError(f"{source}: {_where(path)}: {why}") from None
    return msgspec.to_builtins(results)


def _cell(text: str) -> str:
    """Text for a Markdown table cell or line, from anything a results file or the
    command line says: one line (a line break would end the row, or start a heading);
    a pipe escaped (it would end the cell); ``&``, ``<`` and ``>`` as entities, so no
    HTML and no marker comment (:func:`with_table` refuses a second one) gets through."""
    text = " ".join(str(text).split()).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return text.replace("|", "\\|")


def _code(text: str) -> str:
    """``text`` (escaped as :func:`_cell` does) as a Markdown code span: its fence longer
    than any run of backticks in it, so none ends the span early."""
    text = _cell(text)
    fence = "`" * (max((len(run) for run in re.findall("`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _value(value: float, unit: str) -> str:
    """``27,624 req/s``, ``8.2 ms``, ``0.91 calls/interval``: as many digits as a reader needs."""
    digits = 0 if abs(value) >= 100 else 1 if abs(value) >= 1 else 2
    return f"{value:,.{digits}f} {unit}"


# Context rows the headline keeps though nothing judges them: the floor the QUEUE job's
# p50 is a ratio of, and the LOCAL job's p99 beside the QUEUE job's judged one.
HEADLINE_CONTEXT = (("dispatch", "submit → running p50, one job at a time"), LOCAL_P99)


def is_headline(figure: dict) -> bool:
    """A figure the README shows: judged against a target or compared with a same-run
    baseline, or one of HEADLINE_CONTEXT (the raw baselines, counts and the other plain
    rows stay in ``--all``)."""
    return figure["section"] != "baseline" and (
        figure["ratio"] is not None or figure["met"] is not None or figure["target"] != ""
        or any(figure["section"] == section and figure["name"].startswith(name)
               for section, name in HEADLINE_CONTEXT))


def pgqueuer_fell_behind(doc: dict) -> str:
    """A warning when the file's pgqueuer enqueue → start was a backlog (its enqueues
    finished below KEPT_UP of the offered rate, as its note says), else ""."""
    for f in doc["figures"]:
        offered = re.fullmatch(r"pgqueuer enqueue → start p50 at ([0-9]+)/s", f["name"])
        done = re.search(r"enqueues done at ([0-9][0-9,]*)/s", f["note"])
        if f["section"] == "pgqueuer" and offered and done:
            rate, kept = int(offered.group(1)), int(done.group(1).replace(",", ""))
            if kept < KEPT_UP * rate:
                return (f"pgqueuer's enqueues finished at {kept:,}/s of the offered {rate:,}/s, so its enqueue → "
                        "start was a backlog: the ratios against it are not latency comparisons")
    return ""


def headline(doc: dict, source: str, into: str = "README.md") -> str:
    """The README's performance table: every headline figure of one results file
    (``source``), with where it came from and how to regenerate it in ``into``."""
    sizes = "quick" if doc["quick"] else "full"
    sections = list(dict.fromkeys(f["section"] for f in doc["figures"] if f["section"] != "baseline"))
    load = doc.get("load_average") or {}
    busy = (f", load average {load['start'][0]:.1f} at start and {load['end'][0]:.1f} at the end"
            if load.get("start") and load.get("end") else "")
    lines = [f"From {_code(source)}: {_cell(doc['machine'])}, run {_cell(doc['when'][:16])}Z{busy}, {sizes} sizes, "
             f"sections {_cell(', '.join(sections) or 'none')}; every ratio is against a baseline measured in the "
             f"same run. Generated by {_code(f'irisfed bench --report {source} --readme {into}')}: "
             "do not edit by hand.",
             *(["", f"**Read with care:** {warning}."] if (warning := pgqueuer_fell_behind(doc)) else []),
             "", "| section | figure | value | vs same-run baseline | target | met |", "|---|---|---|---|---|---|"]
    for f in doc["figures"]:
        if not is_headline(f):
            continue
        value = _value(f["value"], f["unit"])
        p99 = note_ms(f["note"], "p99") if "p99" in f["target"] else None
        if p99 is not None:
            value += f" (p99 {p99:.2f} ms)"
        ratio = f"{f['ratio']:.2f}× {f['baseline']}" if f["ratio"] is not None else ""
        lines.append(f"| {_cell(f['section'])} | {_cell(f['name'])} | {_cell(value)} | {_cell(ratio)} | "
                     f"{_cell(f['target'])} | {_met(f['met'], 'yes', '**no**', 'not judged' if f['target'] else '')} |")
    return "\n".join(lines) + "\n"


def with_table(readme: str, table: str, source: str = "README.md") -> str:
    """``readme`` with everything between its TABLE_START and TABLE_END lines replaced by
    ``table``; the markers stay, so it can be done again."""
    starts, ends = readme.count(TABLE_START), readme.count(TABLE_END)
    if starts != 1 or ends != 1:
        raise ResultsError(f"{source}: needs exactly one {TABLE_START} line and one {TABLE_END} line "
                           f"(found {starts} and {ends})")
    head, rest = readme.split(TABLE_START, 1)
    if TABLE_END not in rest:
        raise ResultsError(f"{source}: {TABLE_END} comes before {TABLE_START}")
    _, tail = rest.split(TABLE_END, 1)
    return f"{head}{TABLE_START}\n{table.rstrip()}\n{TABLE_END}{tail}"


if __name__ == "__main__":
    try:
        print(markdown(load_results(Path(sys.argv[1]).read_text(encoding="utf-8"), sys.argv[1])), end="")
    except (OSError, UnicodeDecodeError, ResultsError) as exc:
        sys.exit(f"{sys.argv[1]}: {exc}" if not isinstance(exc, ResultsError) else str(exc))
