"""The chaos suite in CI: ≥ 20 seeded schedules, zero violations, summary in the output.

12 schedules run the services on the database owner and 8 on their own restricted
login roles (`irisfed db-roles`: row-level security), all on durable Postgres with
crash restarts, stalls, SIGKILLed agents whose real runs live on, and a rogue agent
user forging heartbeats (tooling/chaos/ says what each checks). Three users submit and
cancel, each with its own NATS credentials: two with quotas their bursts fill, job ids
shared between users, cancels of other users' jobs; the identity (§6.9) and quota
(§6.10, a replay of the changelog) checks run after every schedule. Jobs come in
bands (§3.3: mostly batch, some interactive, a few production from alice, the one
user allowed it) and every schedule squeezes a kind of work full of batch jobs before
sending it work of a higher band, so preemptions happen; the preemption checks
(§6.11, a replay of the changelog) run after every schedule too, and the NATS server's
log is read for any publish or subscribe it refused a service. Some jobs are gangs of
2-3 tasks on the peers with nodes (real processes on gpu-b, simulated on tpu), some
sharing a slice; the gang checks (§6.12: all tasks recorded or none, one peer, a node
each, one fate; from the changelog and the tasks' rows, and every task's process on
one peer) run after every schedule. Every schedule sends pipelines (chains of jobs
``after`` each other on ``ok``/``any``/``failed``, the first failing half the time);
the dependency checks (§6.16, a replay of the changelog: no dependent starts before its
dependencies ended as it asks, a broken one ends it ``unschedulable``, nothing waits
queued once they all ended) run after every schedule.

Run hundreds yourself: ``irisfed chaos --schedules 300 --steps 14 --seed $RANDOM``
(add ``--restricted-roles`` for the second mode). A failing schedule replays with
``--seed S --first I --schedules 1``. With ``IRISFED_CHAOS_TIMING=1`` each schedule's
line is followed by its wall time by phase (set-up, each step, the gaps, convergence,
stopping the services).
"""

import os

import pytest

from irisfed.tooling.chaos import ChaosSettings, run_chaos
from irisfed.tooling.ha import ha_available
from tests.engines.fixtures import _unavailable

pytestmark = pytest.mark.e2e

SEED = int(os.environ.get("IRISFED_CHAOS_SEED", "20261130"))
OWNER_SCHEDULES = int(os.environ.get("IRISFED_CHAOS_SCHEDULES", "12"))
RESTRICTED_SCHEDULES = int(os.environ.get("IRISFED_CHAOS_RESTRICTED_SCHEDULES", "8"))
HA_SCHEDULES = int(os.environ.get("IRISFED_CHAOS_HA_SCHEDULES", "2"))


def _run_and_show(settings: ChaosSettings, capsys):
    """Run the schedules; print each one's line and the summary past pytest's capture."""
    lines: list[str] = []
    summary = run_chaos(settings, say=lines.append)
    with capsys.disabled():
        print()
        for line in lines:
            print(line)
        print(summary.line())
    return summary


def test_chaos_schedules_on_an_ha_world_keep_every_invariant(capsys):
    """Past one machine: the same workload and checks on Patroni (a primary and a
    synchronous standby) and a NATS cluster of three, each schedule failing the primary
    over or killing NATS nodes (every acknowledged job must be found and end)."""
    why = ha_available()
    if why:
        _unavailable(why)
    settings = ChaosSettings(schedules=HA_SCHEDULES, seed=SEED, steps=8, first=OWNER_SCHEDULES + RESTRICTED_SCHEDULES,
                             ha=True)
    summary = _run_and_show(settings, capsys)
    assert len(summary.results) == settings.schedules
    assert summary.kinds["failover_postgres"] >= 1 and summary.kinds["kill_nats_node"] >= 1, summary.kinds
    assert summary.jobs > 0 and sum(r.runs for r in summary.results) > 0
    assert summary.violations == []


@pytest.mark.parametrize("restricted", [False, True], ids=["owner-role", "restricted-roles"])
def test_chaos_schedules_keep_every_invariant(capsys, restricted):
    settings = ChaosSettings(
        schedules=RESTRICTED_SCHEDULES if restricted else OWNER_SCHEDULES,
        seed=SEED,
        steps=8,
        # Different schedules in each mode: the restricted ones follow the owner ones.
        first=OWNER_SCHEDULES if restricted else 0,
        restricted_roles=restricted,
    )
    summary = _run_and_show(settings, capsys)
    assert len(summary.results) == settings.schedules
    assert summary.faults > settings.schedules  # faults were really injected
    assert len(summary.kinds) >= 5, summary.kinds  # of many kinds
    assert summary.jobs > 0
    assert sum(r.runs for r in summary.results) > 0  # real processes ran (and were watched)
    assert summary.shared_ids > 0  # one job_id sent by two users (two jobs)
    assert summary.foreign_cancels > 0  # users cancelled jobs that were not theirs
    assert summary.quotas_reached, "no quota was ever filled: the workload did not test them"
    assert summary.preemptions > 0, "nothing was preempted: the workload did not test bands"
    assert summary.gang_runs > 0, "no gang ran: the workload did not test gangs"
    assert summary.dependency_edges > 0 and summary.dependents_started > 0, \
        "no dependent ran: the workload did not test pipelines"
    assert summary.dependents_unschedulable > 0, "no dependency was broken: the workload did not test pipelines"
    assert summary.violations == []
