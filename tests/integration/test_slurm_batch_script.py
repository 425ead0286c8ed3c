"""The Slurm batch script (``slurm_script.batch_script``) run by a real shell, as Slurm
runs it: hostile values and arguments reach the command literally, the script records
the start and the exit status before it ends with that status, a SIGTERM from Slurm is
recorded as -15, and nothing runs when the start cannot be recorded."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from irisfed.services.peer_agent.backends.slurm_script import batch_script
from irisfed.services.peer_agent.backends.slurm_text import EXIT_STATUS_FILE, STARTED_MARKER

HOSTILE = {
    "SUBST": "$(touch {pwned})",
    "BACKTICK": "`touch {pwned}`",
    "QUOTES": "it's \"quoted\" \\ $HOME",
    "NEWLINE": "line1\nline2\n#SBATCH --gres=gpu:4\n",
    "CRLF": "a\r\nb\r",
    "EMPTY": "",
    "GLOB": "*",
    "with-dash": "dashed $(touch {pwned})",
    "1digit": "one",
    "sp ace": "space'd",
}


def _run_script(tmp_path: Path, command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    script = tmp_path / "job.sh"
    script.write_text(batch_script(command, env, str(tmp_path)))
    script.chmod(0o700)
    return subprocess.run([str(script)], capture_output=True, cwd=tmp_path, env={"PATH": os.environ["PATH"]},
                          timeout=30, check=False)


def test_script_passes_hostile_values_literally(tmp_path: Path) -> None:
    pwned = tmp_path / "pwned"
    env = {name: value.format(pwned=pwned) for name, value in HOSTILE.items()}
    printer = ["python3", "-c", "import os, json, sys; print(json.dumps({k: os.environ.get(k) for k in sys.argv[1:]}))"]
    done = _run_script(tmp_path, [*printer, *env], env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == env
    assert not pwned.exists()


def test_script_arguments_are_literal(tmp_path: Path) -> None:
    pwned = tmp_path / "pwned"
    args = [f"$(touch {pwned})", "a b", "'", "\n", "\r\n", "*", ";", "--"]
    done = _run_script(tmp_path, ["python3", "-c", "import sys; print(repr(sys.argv[1:]))", *args], {})
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode().strip() == repr(args)
    assert not pwned.exists()


@pytest.mark.parametrize("command, code", [
    (["sh", "-c", "echo ran > ran; exit 0"], 0),
    (["sh", "-c", "echo ran > ran; exit 3"], 3),
    (["sh", "-c", "echo ran > ran; kill -9 $$"], 137),  # as sh reports a signal: 128 + N
])
def test_script_records_start_and_exit_status_and_exits_with_it(tmp_path: Path, command: list[str],
                                                                code: int) -> None:
    done = subprocess.run([str(_write(tmp_path, command, {}))], capture_output=True, cwd=tmp_path,
                          env={"PATH": os.environ["PATH"], "SLURM_JOB_ID": "42"}, timeout=30, check=False)
    assert done.returncode == code, done.stderr
    assert (tmp_path / "ran").exists()
    assert (tmp_path / STARTED_MARKER).read_text() == "42\n"
    assert (tmp_path / EXIT_STATUS_FILE).read_text() == f"{code}\n"
    assert not (tmp_path / f"{EXIT_STATUS_FILE}.tmp").exists()


def _write(tmp_path: Path, command: list[str], env: dict[str, str], run_dir: Path | None = None) -> Path:
    script = tmp_path / "job.sh"
    script.write_text(batch_script(command, env, str(run_dir or tmp_path)))
    script.chmod(0o700)
    return script


def test_a_command_ended_by_sigterm_is_recorded_as_minus_15_and_the_shell_ends_by_it(tmp_path: Path) -> None:
    """Slurm's SIGTERM may reach the command before the shell: killed by it (143 to sh)
    is recorded as -15, and the shell ends by SIGTERM, as the command did."""
    script = _write(tmp_path, ["sh", "-c", "echo ran > ran; kill -TERM $$"], {})
    done = subprocess.run([str(script)], capture_output=True, cwd=tmp_path, env={"PATH": os.environ["PATH"]},
                          timeout=30, check=False)
    assert done.returncode == -15, done.stderr
    assert (tmp_path / "ran").exists()
    assert (tmp_path / EXIT_STATUS_FILE).read_text() == "-15\n"


def test_script_runs_a_program_never_a_shell_builtin_and_the_job_env_cannot_break_its_records(
    tmp_path: Path,
) -> None:
    """``echo`` is a program here (sh's builtin would turn ``\\n`` into a newline); a job
    ``PATH`` with no ``mv``, an ``IFS`` and variables named like the script's own change
    nothing in what it records."""
    env = {"PATH": "/nowhere", "IFS": "0123456789-", "irisfed_signal": "9", "irisfed_status": "x",
           "irisfed_code": "y"}
    script = _write(tmp_path, ["/bin/echo", "a\\nb"], env)
    done = subprocess.run([str(script)], capture_output=True, cwd=tmp_path, env={"PATH": os.environ["PATH"]},
                          timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout == b"a\\nb\n"
    assert (tmp_path / EXIT_STATUS_FILE).read_text() == "0\n"
    plain = _write(tmp_path, ["echo", "a\\nb"], {})
    assert subprocess.run([str(plain)], capture_output=True, cwd=tmp_path, env={"PATH": os.environ["PATH"]},
                          timeout=30, check=False).stdout == b"a\\nb\n"


def test_script_runs_nothing_when_it_cannot_record_the_start(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-folder"
    script = _write(tmp_path, ["sh", "-c", f"touch {tmp_path}/ran"], {}, run_dir=missing)
    done = subprocess.run([str(script)], capture_output=True, cwd=tmp_path, env={"PATH": os.environ["PATH"]},
                          timeout=30, check=False)
    assert done.returncode == 1
    assert b"the command was not run" in done.stderr
    assert not (tmp_path / "ran").exists()


def test_script_killed_by_sigterm_records_minus_15_and_dies_by_it_after_its_command(tmp_path: Path) -> None:
    """As Slurm cancels or times out a job: SIGTERM to every process of it (here its
    process group). The command gets it and ends; the shell records -15 and ends by
    SIGTERM itself, so Slurm sees the wait status it always did."""
    import signal
    import time

    command = ["sh", "-c", "trap 'echo got-term > term; exit 0' TERM; touch ready; while :; do sleep 0.1; done"]
    process = subprocess.Popen([str(_write(tmp_path, command, {}))], cwd=tmp_path, start_new_session=True,
                               env={"PATH": os.environ["PATH"]})
    try:
        for _ in range(300):  # a bound on a slow machine, not an expectation
            if (tmp_path / "ready").exists():
                break
            time.sleep(0.1)
        os.killpg(process.pid, signal.SIGTERM)
        assert process.wait(timeout=30) == -signal.SIGTERM
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert (tmp_path / "term").read_text() == "got-term\n"
    assert (tmp_path / EXIT_STATUS_FILE).read_text() == "-15\n"
