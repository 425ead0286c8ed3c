"""What a bench run measured: its figures, the table it prints, and the JSON it writes.

``python -m irisfed.bench.report bench/results/full.json`` renders a JSON file
(``irisfed bench --out F``) as a Markdown table.
"""

from __future__ import annotations

import json
import os
import platform
import re
import sys
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path


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
DISPATCH_P50 = ("dispatch", "submit → running p50 at")
DISPATCH_P99 = ("dispatch", "submit → running p99 at")
SUBMITS_100 = ("submit", "durable submits/s, 100 in flight")
SUBMITS_2000 = ("submit", "durable submits/s, 2000 in flight")


def find(figures: list[Figure], key: tuple[str, str]) -> Figure | None:
    section, prefix = key
    return next((f for f in figures if f.section == section and f.name.startswith(prefix)), None)


def note_ms(note: str, label: str) -> float | None:
    """``label``'s value in a note like "p50 1.21 ms, p99 2.10 ms", in ms; None if absent."""
    match = re.search(rf"(?:^|[ ,;(]){re.escape(label)} ([0-9][0-9,]*(?:\.[0-9]+)?) ms", note)
    return float(match.group(1).replace(",", "")) if match else None


def pgqueuer_comparisons(figures: list[Figure], baselines: dict[str, float]) -> list[tuple[Figure, Figure]]:
    """(irisfed's row, its comparison with pgqueuer from the same run) for each pair
    this run measured both sides of."""
    pairs = []
    p50, p99 = find(figures, DISPATCH_P50), find(figures, DISPATCH_P99)
    if p50 is not None and "pgq_start_p50" in baselines:
        theirs = baselines["pgq_start_p50"] * 1e3
        ratio = p50.value / theirs
        pairs.append((p50, Figure(
            "dispatch", "submit → running p50 vs pgqueuer enqueue → start p50", p50.value, "ms",
            f"pgqueuer enqueue → start p50 ({theirs:.1f} ms)", ratio, "≤ 2× pgqueuer and ≤ 10 ms",
            ratio <= 2 and p50.value <= 10, p50.runs)))
    if p99 is not None and "pgq_start_p99" in baselines:
        theirs = baselines["pgq_start_p99"] * 1e3
        pairs.append((p99, Figure(
            "dispatch", "submit → running p99 vs pgqueuer enqueue → start p99", p99.value, "ms",
            f"pgqueuer enqueue → start p99 ({theirs:.1f} ms)", p99.value / theirs, "≤ 50 ms",
            p99.value <= 50, p99.runs)))
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
        targets.append(Target("submit → running p50 ≤ 2× pgqueuer enqueue → start p50",
                              f"{ratio:.2f}× ({p50.value:.1f} against {theirs * 1e3:.1f} ms)", ratio <= 2))
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
        "figures": [asdict(f) for f in bench.figures], "targets": [asdict(t) for t in bench.targets]},
        indent=2))


def markdown(doc: dict) -> str:
    lines = [f"Machine: {doc['machine']}; run {doc['when'][:16]}Z ({'quick' if doc['quick'] else 'full'}).", "",
             "| section | figure | value | vs baseline (same run) | target | met | runs | notes |",
             "|---|---|---|---|---|---|---|---|"]
    for f in doc["figures"]:
        ratio = f"{f['ratio']:.2f}× {f['baseline']}" if f["ratio"] is not None else ""
        met = "" if f["met"] is None else ("yes" if f["met"] else "**no**")
        lines.append(f"| {f['section']} | {f['name']} | {f['value']:,.1f} {f['unit']} | {ratio} | "
                     f"{f['target']} | {met} | {f['runs']} | {f['note']} |")
    if doc.get("targets"):
        lines += ["", "| issue 15 target | measured | met |", "|---|---|---|"]
        lines += [f"| {t['what']} | {t['measured']} | {_met(t['met'], 'yes', '**no**', 'not judged')} |"
                  for t in doc["targets"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(json.loads(open(sys.argv[1]).read())))
