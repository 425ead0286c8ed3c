"""SIGUSR2 dumps every asyncio task of a service process running on uvloop, and
SIGTERM still stops it cleanly afterwards: the one way to see where a stuck service
waits, on the event loop services run on by default (docs/decisions.md)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DUMPER = textwrap.dedent("""
    import asyncio, os, signal, sys
    import uvloop
    from irisfed.services.common.runtime import run_service

    async def main(stop):
        async def parked():
            await asyncio.Event().wait()
        task = asyncio.get_running_loop().create_task(parked(), name="parked-task")
        print(type(asyncio.get_running_loop()).__module__, flush=True)
        await stop.wait()
        task.cancel()

    sys.exit(run_service(main, uvloop.new_event_loop))
""")


def test_sigusr2_on_uvloop_dumps_every_task_and_sigterm_still_stops_it():
    proc = subprocess.Popen([sys.executable, "-c", DUMPER], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "uvloop"  # main is running on uvloop
        proc.send_signal(signal.SIGUSR2)
        seen = []
        for line in proc.stderr:  # the dump ends with the parked task's stack
            seen.append(line)
            if "in parked" in line:
                break
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "".join(seen)
    assert "asyncio tasks (SIGUSR2)" in text
    assert "parked-task" in text
    assert "in parked" in text  # where the task waits (a -c script has no source lines to show)
