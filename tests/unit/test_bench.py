"""The benchmark's own arithmetic and command line (its runs are CI's `irisfed bench --quick`)."""

from bench.load import Run, spread
from services.cli import main


def test_percentiles_and_rate():
    run = Run(done=100, seconds=2.0, latencies=[i / 1000 for i in range(100, 0, -1)])
    assert run.rate == 50.0
    assert run.pct(0.5) == 0.051 and run.pct(0.99) == 0.1 and run.pct(0.0) == 0.001


def test_spread_says_how_many_runs():
    assert spread([5.0]) == "1 run"
    assert spread([3.0, 1000.0, 7.0]) == "3 runs, 3–1,000"


def test_unknown_section_is_a_clear_error(capsys):
    assert main(["bench", "--sections", "submit,warp"]) == 2
    assert "unknown bench section(s): warp" in capsys.readouterr().err
