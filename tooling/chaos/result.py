"""What chaos found: per schedule, and summed over a run."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class ScheduleResult:
    index: int
    faults: int = 0
    jobs: int = 0
    violations: list[str] = field(default_factory=list)
    log_dir: str = ""
    kinds: Counter = field(default_factory=Counter)  # faults by kind
    runs: int = 0  # real job processes seen
    fenced_overlaps: int = 0  # stale copies seen alive with a newer epoch, killed in the window
    converge_s: float = 0.0  # from "everything restored" to every acknowledged job ended
    # Wall time by phase (set-up, each step, converge, teardown): where a schedule's time goes.
    phases: list[tuple[str, float]] = field(default_factory=list)

    def fault(self, kind: str) -> None:
        self.faults += 1
        self.kinds[kind] += 1


@dataclass
class ChaosSummary:
    seed: int
    results: list[ScheduleResult]
    restricted_roles: bool = False

    @property
    def faults(self) -> int:
        return sum(r.faults for r in self.results)

    @property
    def kinds(self) -> Counter:
        return sum((r.kinds for r in self.results), Counter())

    @property
    def jobs(self) -> int:
        return sum(r.jobs for r in self.results)

    @property
    def violations(self) -> list[str]:
        return [f"schedule {r.index}: {v}" for r in self.results for v in r.violations]

    def line(self) -> str:
        kinds = " ".join(f"{kind}={n}" for kind, n in sorted(self.kinds.items()))
        runs = sum(r.runs for r in self.results)
        return (f"chaos: schedules={len(self.results)} faults={self.faults} jobs={self.jobs} "
                f"violations={len(self.violations)} seed={self.seed} "
                f"roles={'restricted' if self.restricted_roles else 'owner'} runs={runs} "
                f"| faults by kind: {kinds or 'none'}")
