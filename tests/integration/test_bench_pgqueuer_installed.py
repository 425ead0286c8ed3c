"""The pgqueuer the bench measures irisfed against is installed, in its 1.x line. Importing
pgqueuer runs a process (croniter asks ``file`` what the interpreter is), so this is
no unit test."""

from irisfed.bench.pgqueuer import missing


def test_the_installed_pgqueuer_is_the_measured_line():
    # dev brings the bench extra: the quick run in CI has its pgqueuer rows.
    assert missing() is None
