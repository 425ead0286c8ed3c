"""The chaos suite's double-run check, on real processes running the chaos job script."""

import os
import signal
import subprocess
import time

from irisfed.tooling.chaos.watcher import RunWatcher
from irisfed.tooling.chaos.workload import JOB_SCRIPT
from irisfed.tooling.chaos.world import FENCING_WINDOW_S


def test_two_live_epochs_of_a_job_are_violations_unless_the_stale_copy_is_killed_in_time(tmp_path):
    work, log = tmp_path / "work", tmp_path / "runs.log"
    watcher = RunWatcher(log, work)
    watcher.start()
    started: list[subprocess.Popen] = []

    def launch(job: str, epoch: int, peer: str, seconds: float) -> subprocess.Popen:
        run_dir = work / peer / job / f"epoch-{epoch}"
        run_dir.mkdir(parents=True)
        env = {"PATH": os.environ["PATH"], "IRISFED_JOB_ID": job, "IRISFED_EPOCH": str(epoch)}
        started.append(subprocess.Popen(["sh", "-c", JOB_SCRIPT, "chaos-job", str(seconds), "0", str(log)],
                                        cwd=run_dir, env=env, start_new_session=True))
        return started[-1]

    try:
        # a: the stale copy runs to its end while the newer epoch runs: a double run.
        launch("a", 1, "gpu-a", 0.8)
        time.sleep(0.2)
        launch("a", 2, "gpu-b", 0.4)
        # b: the stale copy is killed just after the newer one starts: fenced in time.
        stale_b = launch("b", 1, "gpu-a", 10)
        time.sleep(0.2)
        launch("b", 2, "gpu-a", 0.4)
        time.sleep(0.15)
        os.killpg(stale_b.pid, signal.SIGKILL)
        # c: killed, but only long after the newer epoch started.
        stale_c = launch("c", 1, "gpu-b", 10)
        time.sleep(0.2)
        launch("c", 2, "gpu-b", 10)
        time.sleep(FENCING_WINDOW_S + 0.6)
        os.killpg(stale_c.pid, signal.SIGKILL)
        # d: one epoch after the other: fine.
        launch("d", 1, "gpu-a", 0.1).wait()
        time.sleep(0.2)
        launch("d", 2, "gpu-b", 0.1).wait()
        time.sleep(0.2)
        assert watcher.live_on("gpu-b") and not watcher.live_on("home")
    finally:
        for process in started:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        watcher.stop()

    problems, fenced = watcher.violations()
    assert sorted(p.split(":")[0] for p in problems) == ["a", "c"], problems
    assert "ran to its end on gpu-a while epoch 2 was running on gpu-b" in problems[0]
    assert "stayed alive" in problems[1]
    assert fenced == 1
    assert len(watcher.runs) == 8 and not watcher.live_pids()
