"""The suite's own process: what the engines and services it starts inherit."""

import signal


def test_the_suite_runs_with_sigint_and_sigquit_not_ignored():
    """tests/conftest.py's pytest_configure: an ignored SIGINT would reach Ray's workers,
    whose polite cancel is a SIGINT (docs/engines.md, gangs on Ray)."""
    assert signal.getsignal(signal.SIGINT) != signal.SIG_IGN
    assert signal.getsignal(signal.SIGQUIT) != signal.SIG_IGN
