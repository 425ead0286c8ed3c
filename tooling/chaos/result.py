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
    shared_ids: int = 0  # job ids sent by two or more users (two jobs each)
    foreign_cancels: int = 0  # cancels sent by a user whose job it was not
    quotas_reached: list[str] = field(default_factory=list)  # user:resource quotas live jobs filled
    # Preemptions the changelog records, by how each victim ended them (queued, failed, killed).
    preempted: Counter = field(default_factory=Counter)
    forbidden_bands: int = 0  # submits of a band above the user's max_band (answered forbidden)
    gang_runs: int = 0  # gang runs (job, epoch) whose tasks were recorded
    gangs_requeued: int = 0  # gangs that ran under more than one epoch (requeued whole)
    workspace_runs: int = 0  # real runs that started in their job's workspace (invariant 14)
    logs_read: int = 0  # succeeded runs' output read back whole through the router (invariant 15)
    pipelines: int = 0  # chains of jobs waiting for each other sent (invariant 16)
    # Their edges (job_dependencies rows), dependents that started (each dependency met
    # first) and dependents ended unschedulable for a dependency that could not be met.
    dependency_edges: int = 0
    dependents_started: int = 0
    dependents_unschedulable: int = 0
    # Arrays (§3.8): those acknowledged, jobs sent after an array's base id, base-id
    # cancels sent; the elements Postgres holds, and each array's peak as (most live at
    # once, its limit), from the changelog.
    arrays: int = 0
    array_dependents: int = 0
    array_cancels: int = 0
    array_elements: int = 0
    array_peaks: list[tuple[int, int]] = field(default_factory=list)

    @property
    def preemptions(self) -> int:
        return sum(self.preempted.values())

    def fault(self, kind: str) -> None:
        self.faults += 1
        self.kinds[kind] += 1


@dataclass
class ChaosSummary:
    seed: int
    results: list[ScheduleResult]
    restricted_roles: bool = False
    ha: bool = False  # on Patroni and a NATS cluster (irisfed chaos --ha)

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
    def shared_ids(self) -> int:
        return sum(r.shared_ids for r in self.results)

    @property
    def foreign_cancels(self) -> int:
        return sum(r.foreign_cancels for r in self.results)

    @property
    def quotas_reached(self) -> Counter:
        """user:resource → in how many schedules live jobs filled that quota."""
        return Counter(q for r in self.results for q in r.quotas_reached)

    @property
    def preemptions(self) -> int:
        return sum(r.preemptions for r in self.results)

    @property
    def preempted(self) -> Counter:
        """How the preemptions of every schedule ended their victims (queued, failed, killed)."""
        return sum((r.preempted for r in self.results), Counter())

    @property
    def preempting_schedules(self) -> int:
        return sum(1 for r in self.results if r.preemptions)

    @property
    def forbidden_bands(self) -> int:
        return sum(r.forbidden_bands for r in self.results)

    @property
    def gang_runs(self) -> int:
        return sum(r.gang_runs for r in self.results)

    @property
    def gangs_requeued(self) -> int:
        return sum(r.gangs_requeued for r in self.results)

    @property
    def workspace_runs(self) -> int:
        return sum(r.workspace_runs for r in self.results)

    @property
    def logs_read(self) -> int:
        return sum(r.logs_read for r in self.results)

    @property
    def pipelines(self) -> int:
        return sum(r.pipelines for r in self.results)

    @property
    def dependency_edges(self) -> int:
        return sum(r.dependency_edges for r in self.results)

    @property
    def dependents_started(self) -> int:
        return sum(r.dependents_started for r in self.results)

    @property
    def dependents_unschedulable(self) -> int:
        return sum(r.dependents_unschedulable for r in self.results)

    @property
    def arrays(self) -> int:
        return sum(r.arrays for r in self.results)

    @property
    def array_elements(self) -> int:
        return sum(r.array_elements for r in self.results)

    @property
    def array_dependents(self) -> int:
        return sum(r.array_dependents for r in self.results)

    @property
    def array_cancels(self) -> int:
        return sum(r.array_cancels for r in self.results)

    @property
    def most_live(self) -> tuple[int, int]:
        """(most live at once, limit) of the array that came nearest its limit (over it:
        a violation); (0, 0) without arrays."""
        return most_live([peak for r in self.results for peak in r.array_peaks])

    @property
    def arrays_full(self) -> int:
        """Arrays that had as many elements live at once as their limit allows."""
        return sum(1 for r in self.results for most, limit in r.array_peaks if most >= limit)

    @property
    def violations(self) -> list[str]:
        return [f"schedule {r.index}: {v}" for r in self.results for v in r.violations]

    def line(self) -> str:
        kinds = " ".join(f"{kind}={n}" for kind, n in sorted(self.kinds.items()))
        runs = sum(r.runs for r in self.results)
        full = ",".join(f"{quota}:{n}" for quota, n in sorted(self.quotas_reached.items()))
        ends = ",".join(f"{state}:{n}" for state, n in sorted(self.preempted.items()))
        return (f"chaos: schedules={len(self.results)} faults={self.faults} jobs={self.jobs} "
                f"violations={len(self.violations)} seed={self.seed} "
                f"roles={'restricted' if self.restricted_roles else 'owner'} "
                f"servers={'ha' if self.ha else 'single'} runs={runs} "
                f"| users: shared_ids={self.shared_ids} foreign_cancels={self.foreign_cancels} "
                f"quotas_full={full or 'none'} "
                f"| bands: preemptions={self.preemptions} ({ends or 'none'}) in "
                f"{self.preempting_schedules}/{len(self.results)} schedules forbidden={self.forbidden_bands} "
                f"| gangs: runs={self.gang_runs} requeued={self.gangs_requeued} "
                f"| workspaces: runs={self.workspace_runs} | logs: read={self.logs_read} "
                f"| pipelines: sent={self.pipelines} edges={self.dependency_edges} "
                f"started={self.dependents_started} unschedulable={self.dependents_unschedulable} "
                f"| arrays: sent={self.arrays} elements={self.array_elements} most_live={'/'.join(map(str, self.most_live))} "
                f"full={self.arrays_full} after={self.array_dependents} cancelled={self.array_cancels} "
                f"| faults by kind: {kinds or 'none'}")


def most_live(peaks: list[tuple[int, int]]) -> tuple[int, int]:
    """Of arrays' (most live at once, limit), the one with the highest share of its limit
    (then the most live); (0, 0) for none."""
    return max(peaks, key=lambda peak: (peak[0] / peak[1] if peak[1] else 0, peak[0]), default=(0, 0))
