"""``irisfed chaos``, ``bench`` and ``up`` stop on SIGTERM and SIGINT even when started
with SIGINT ignored (a shell's ``cmd &`` without job control hands it so, and Python
keeps an inherited ignore): their cleanup runs from KeyboardInterrupt."""

import signal
import subprocess
import sys

import pytest

PROGRAM = """
import os, signal, sys, time
from irisfed.cli.admin import interrupted_by_signals
try:
    with interrupted_by_signals():
        os.kill(os.getpid(), getattr(signal, sys.argv[1]))
        time.sleep(30)
except KeyboardInterrupt:
    sys.exit(0)
sys.exit(3)
"""


def _sigint_ignored() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])
def test_a_signal_interrupts_even_with_sigint_ignored_on_start(name):
    done = subprocess.run([sys.executable, "-c", PROGRAM, name], preexec_fn=_sigint_ignored,
                          capture_output=True, text=True, timeout=20, check=False)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
