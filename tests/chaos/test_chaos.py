"""The chaos suite in CI: ≥ 20 seeded schedules, zero violations, summary in the output.

Run hundreds yourself: ``irisfed chaos --schedules 300 --steps 14 --seed $RANDOM``.
A failing schedule replays with ``--seed S --first I --schedules 1``.
"""

import os

import pytest

from services.chaos.runner import ChaosSettings, run_chaos

pytestmark = pytest.mark.e2e


def test_chaos_schedules_keep_every_invariant(capsys):
    settings = ChaosSettings(
        schedules=int(os.environ.get("IRISFED_CHAOS_SCHEDULES", "20")),
        seed=int(os.environ.get("IRISFED_CHAOS_SEED", "20261130")),
        steps=8,
    )
    lines: list[str] = []
    summary = run_chaos(settings, say=lines.append)
    with capsys.disabled():
        print()
        for line in lines:
            print(line)
        print(summary.line())
    assert len(summary.results) == settings.schedules
    assert summary.faults > settings.schedules  # faults were really injected
    assert summary.jobs > 0
    assert summary.violations == []
