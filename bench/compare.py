"""``irisfed bench --compare REV``: the working tree against another commit, A/B.

One run on this kind of machine varies by ±40%, so a regression is found by
alternating: REV's bench, then the working tree's, round after round, and comparing
medians. REV is built once into a temporary virtualenv (``git archive`` of REV,
installed editable without dependencies; the packages come from this interpreter's
site-packages through a ``.pth`` line), so any commit with an ``irisfed bench
--sections ... --out FILE`` compares, whatever its package layout. Figures present in
both runs are printed as REV's median, the working tree's median, their ratio and
every round's values; ``--out`` keeps the whole comparison as JSON.

``summarise`` and ``render`` are pure (tests/unit/test_bench_compare.py).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

# Figures compared: those whose value is a time or a rate; ratios to the same run's
# baselines are left out (they are quotients of two compared figures).
Key = tuple[str, str]
# Figures renamed since: the older name's suffix dropped, so both sides meet (the QUEUE
# job's dispatch figures were named without it before LOCAL jobs were measured beside them).
RENAMED_SUFFIXES = (", QUEUE job",)


def figure_key(section: str, name: str) -> Key:
    for suffix in RENAMED_SUFFIXES:
        if name.endswith(suffix):
            return section, name[: -len(suffix)]
    return section, name


@dataclass(frozen=True)
class Compared:
    """One figure over the rounds: REV's and the working tree's values, each round's."""
    section: str
    name: str
    unit: str
    rev: list[float]
    work: list[float]

    @property
    def rev_median(self) -> float:
        return statistics.median(self.rev)

    @property
    def work_median(self) -> float:
        return statistics.median(self.work)

    @property
    def ratio(self) -> float | None:
        """Working tree's median over REV's (> 1: the working tree is slower for a time,
        faster for a rate); None when REV's is zero."""
        return self.work_median / self.rev_median if self.rev_median else None


def summarise(rev_runs: list[dict], work_runs: list[dict]) -> list[Compared]:
    """The figures found in every run of both sides (by section and name, in the
    working tree's order), each with its values per round. A figure without a unit
    or with a same-run ratio's name (``... vs ...``) is left out."""
    def values(runs: list[dict]) -> dict[Key, list[float]]:
        found: dict[Key, list[float]] = {}
        for run in runs:
            for f in run["figures"]:
                found.setdefault(figure_key(f["section"], f["name"]), []).append(float(f["value"]))
        return {k: v for k, v in found.items() if len(v) == len(runs)}

    rev, work = values(rev_runs), values(work_runs)
    units = {figure_key(f["section"], f["name"]): f["unit"] for f in work_runs[0]["figures"]} if work_runs else {}
    out = []
    for key in work:
        if key in rev and units.get(key) and " vs " not in key[1]:
            out.append(Compared(key[0], key[1], units[key], rev[key], work[key]))
    return out


def render(rows: list[Compared], rev: str, other: str = "working") -> str:
    """The comparison as a plain table: medians, the ratio, and every round."""
    lines = [f"{'section':<10} {'figure':<52} {rev[:12]:>12} {other[:12]:>12} {'ratio':>7}  "
             f"rounds (rev | {other[:12]})"]
    for r in rows:
        ratio = f"{r.ratio:.2f}×" if r.ratio is not None else "—"
        rounds = " ".join(f"{v:,.1f}" for v in r.rev) + " | " + " ".join(f"{v:,.1f}" for v in r.work)
        lines.append(f"{r.section:<10} {r.name[:52]:<52} {r.rev_median:>12,.2f} {r.work_median:>12,.2f} "
                     f"{ratio:>7}  {rounds} {r.unit}")
    return "\n".join(lines)


def repository() -> Path:
    """The git checkout this irisfed runs from."""
    here = Path(__file__).resolve().parent
    top = subprocess.run(["git", "-C", str(here), "rev-parse", "--show-toplevel"],
                         capture_output=True, text=True)
    if top.returncode != 0:
        raise SystemExit("irisfed bench --compare: this irisfed does not run from a git checkout "
                         "(install it with pip install -e from one)")
    return Path(top.stdout.strip())


def build(repo: Path, rev: str, folder: Path) -> Path:
    """REV installed into a virtualenv under ``folder``; its ``irisfed`` executable."""
    sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", f"{rev}^{{commit}}"],
                         capture_output=True, text=True)
    if sha.returncode != 0:
        raise SystemExit(f"irisfed bench --compare: no commit {rev!r} in {repo}")
    src = folder / "src"
    src.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(repo), "archive", sha.stdout.strip()], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    venv = folder / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    purelib = Path(sysconfig.get_paths(vars={"base": str(venv), "platbase": str(venv)})["purelib"])
    # This interpreter's packages, as a plain path: its own .pth files (this tree's
    # editable install among them) are not processed from there.
    (purelib / "irisfed-compare-base.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    print(f"building {rev} ({sha.stdout.strip()[:10]}) in {venv}", flush=True)
    # Editable: the services run from REV's own folders, data files (migrations) included
    # whatever REV's packaging listed.
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "-e", str(src)],
                   check=True)
    return venv / "bin" / "irisfed"


def run_once(cmd: list[str], sections: str, quick: bool, out: Path) -> dict:
    args = [*cmd, "bench", "--sections", sections, "--out", str(out)] + (["--quick"] if quick else [])
    # This interpreter's bin folder first: the servers its packages bring (nats-server).
    env = os.environ | {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    # Run from the run's own folder: `python -m services.router` from inside a checkout
    # would import that checkout's folders, not REV's.
    done = subprocess.run(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                          cwd=out.parent)
    if done.returncode != 0 or not out.exists():
        raise SystemExit(f"irisfed bench --compare: {' '.join(args)} failed ({done.returncode}):\n"
                         f"{done.stderr[-2000:]}")
    return json.loads(out.read_text())


def render_series(rev: str, sides: dict[str, list[Compared]]) -> str:
    """Several commits against REV (a bisect's whole series): each figure's median for
    REV, then each side's median and its ratio to REV's, in the order given."""
    first = next(iter(sides.values()), [])
    lines = [f"{'section':<10} {'figure':<44} {rev[:10]:>10} " + " ".join(f"{s[:10]:>17}" for s in sides)]
    for row in first:
        cells = []
        for rows in sides.values():
            match = next((r for r in rows if (r.section, r.name) == (row.section, row.name)), None)
            ratio = f"{match.ratio:.2f}×" if match is not None and match.ratio is not None else "—"
            cells.append(f"{match.work_median:>9,.2f} {ratio:>7}" if match is not None else f"{'—':>17}")
        lines.append(f"{row.section:<10} {row.name[:44]:<44} {row.rev_median:>10,.2f} " + " ".join(cells)
                     + f"  {row.unit}")
    return "\n".join(lines)


def compare(rev: str, sections: str, rounds: int, quick: bool, out: Path | None,
            against: list[str] | None = None) -> dict[str, list[Compared]]:
    """REV and the working tree (or the commits ``against``, each built like REV: a
    bisect's steps then do not depend on what the working tree holds meanwhile, and
    several of them run as one series), every side once a round, the order rotating
    from round to round (with two sides: REV first in odd rounds, the other first in
    even ones), so a drift of the machine's speed favours none; prints the table and
    returns each side's rows against REV."""
    repo = repository()
    folder = Path(tempfile.mkdtemp(prefix="irisfed-compare-"))
    try:
        commands = {"rev": [str(build(repo, rev, folder / "rev"))]}
        for i, other in enumerate(against or []):
            commands[other] = [str(build(repo, other, folder / f"against-{i}"))]
        if not against:
            commands["working"] = [sys.executable, "-m", "irisfed.cli"]
        runs: dict[str, list[dict]] = {side: [] for side in commands}
        sides = list(commands)
        for i in range(rounds):
            for side in sides[i % len(sides):] + sides[:i % len(sides)]:
                print(f"round {i + 1}/{rounds}: {side}", flush=True)
                runs[side].append(run_once(commands[side], sections, quick, folder / f"side{sides.index(side)}-{i}.json"))
        compared = {side: summarise(runs["rev"], runs[side]) for side in sides[1:]}
        if len(compared) == 1:
            (other, rows), = compared.items()
            print(render(rows, rev, other), flush=True)
        else:
            print(render_series(rev, compared), flush=True)
        if out is not None:
            single = len(compared) == 1
            out.write_text(json.dumps({
                "rev": rev, "against": (against[0] if against else "working tree") if single else against,
                "sections": sections, "rounds": rounds, "quick": quick,
                "when": datetime.now(UTC).isoformat(), "machine": f"{os.cpu_count()} cores",
                "figures": _figures(next(iter(compared.values()))) if single
                else {side: _figures(rows) for side, rows in compared.items()},
                "runs": {"rev": runs["rev"], "working": runs[sides[1]]} if single else runs}, indent=2))
        return compared
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _figures(rows: list[Compared]) -> list[dict]:
    return [asdict(r) | {"rev_median": r.rev_median, "work_median": r.work_median, "ratio": r.ratio} for r in rows]
