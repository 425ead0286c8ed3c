"""What a bench run measured: its figures, the table it prints, and the JSON it writes.

``python -m bench.report bench/results/full.json`` renders a JSON file
(``irisfed bench --out F``) as a Markdown table.
"""

from __future__ import annotations

import json
import os
import platform
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

    def add(self, figure: Figure) -> Figure:
        self.figures.append(figure)
        print(f"  {figure.section:<10} {figure.name:<44} {figure.value:>12,.1f} {figure.unit}"
              + (f"  ({figure.ratio:.2f}× {figure.baseline})" if figure.ratio is not None else ""), flush=True)
        return figure


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
    Console(width=200).print(table)


def write_json(bench: Bench, out: Path) -> None:
    out.write_text(json.dumps({
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "when": datetime.now(UTC).isoformat(), "quick": bench.profile.quick,
        "figures": [asdict(f) for f in bench.figures]}, indent=2))


def markdown(doc: dict) -> str:
    lines = [f"Machine: {doc['machine']}; run {doc['when'][:16]}Z ({'quick' if doc['quick'] else 'full'}).", "",
             "| section | figure | value | vs baseline (same run) | target | met | runs | notes |",
             "|---|---|---|---|---|---|---|---|"]
    for f in doc["figures"]:
        ratio = f"{f['ratio']:.2f}× {f['baseline']}" if f["ratio"] is not None else ""
        met = "" if f["met"] is None else ("yes" if f["met"] else "**no**")
        lines.append(f"| {f['section']} | {f['name']} | {f['value']:,.1f} {f['unit']} | {ratio} | "
                     f"{f['target']} | {met} | {f['runs']} | {f['note']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(json.loads(open(sys.argv[1]).read())))
