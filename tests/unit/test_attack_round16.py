"""Attack round 16: services on uvloop (f1aab21).

Hostile ``--event-loop`` values through the real commands (``irisfed router``,
``python -m irisfed.services.tick``): exit 2, one line naming the flag, nothing connected (the
URLs point at local listeners that count connections); and SIGUSR2's task dump on a
service running on uvloop.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IRISFED = os.path.join(os.path.dirname(sys.executable), "irisfed")


HOSTILE = ["", "UVLOOP", " asyncio", "uv\x1b[31mloop", "asyncio;id", "-x", "é" * 40, "a" * 2000,
           "asyncio\nuvloop"]


@pytest.mark.parametrize("command", [[IRISFED, "router"], [sys.executable, "-m", "irisfed.services.tick"]],
                         ids=["irisfed-router", "python-m-services.tick"])
@pytest.mark.parametrize("value", HOSTILE, ids=range(len(HOSTILE)))
def test_a_hostile_event_loop_value_stops_the_service_before_it_connects(listeners, command, value):
    db, nats = listeners
    done = subprocess.run(
        [*command, f"--event-loop={value}", "--database-url", f"postgresql://u@127.0.0.1:{db.port}/x",
         "--nats-url", f"nats://127.0.0.1:{nats.port}"],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
        env={k: v for k, v in os.environ.items() if not k.startswith("IRISFED_")})
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("irisfed: event loop (--event-loop) must be one of auto, uvloop, asyncio, got ")
    assert "\x1b" not in done.stderr and "Traceback" not in done.stderr
    assert done.stdout == ""
    assert (db.accepted, nats.accepted) == (0, 0)


DUMPER = textwrap.dedent("""
    import asyncio, os, signal, sys
    import uvloop
    from irisfed.services.common.runtime import run_service

    async def main(stop):
        async def parked():
            await asyncio.Event().wait()
        task = asyncio.get_running_loop().create_task(parked(), name="round16-parked-task")
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
    assert "round16-parked-task" in text
    assert "in parked" in text  # where the task waits (a -c script has no source lines to show)
