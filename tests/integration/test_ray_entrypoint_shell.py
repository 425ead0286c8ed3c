"""The Ray entrypoint and job env run as Ray runs them: ``/bin/sh -c`` through a real
exec, so the shell's quoting and the kernel's limits on one argument or environment
string apply. Hostile arguments and values reach the command literally, and a job env
that cannot be decoded never runs the command."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

from irisfed.services.peer_agent.backends import ray_text as text

HOSTILE = ["$(touch {pwned})", "`touch {pwned}`", "a b", "'quoted'", '"dq"', "semi;colon", "back\\slash",
           "new\nline", "*", "~", "$HOME", ""]


def _run(line: str, job_env: dict[str, str], cwd: Path, path: str = "/usr/bin:/bin") -> subprocess.CompletedProcess:
    """``line`` as Ray runs an entrypoint: ``/bin/sh -c``, with the node's variables
    (here only PATH and one the job does not name) plus the job's ``env_vars``."""
    env = {"PATH": path, "NODE_ONLY": "kept", **job_env}
    return subprocess.run(["/bin/sh", "-c", line], env=env, capture_output=True, cwd=cwd)


def test_the_entrypoint_quotes_every_argument(tmp_path: Path) -> None:
    pwned = tmp_path / "pwned"
    args = [arg.format(pwned=pwned) for arg in HOSTILE]
    line = text.entrypoint(["printf", "%s\\0", *args])
    assert line.endswith(" " + shlex.join(["printf", "%s\\0", *args]))  # readable in Ray's job list
    # Ray runs the entrypoint through a shell: the arguments reach the program literally.
    out = _run(line, text.job_env({}, "j", 1), tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.decode().split("\0")[:-1] == args
    assert not pwned.exists()


def _environ(out: subprocess.CompletedProcess) -> dict[str, str]:
    assert out.returncode == 0, out.stderr
    seen = dict(entry.split("=", 1) for entry in out.stdout.decode().split("\0")[:-1])
    seen.pop("PWD", None)  # the shell's own (dash exports it)
    return seen


def test_the_entrypoint_sets_the_env_verbatim_and_execs_the_command(tmp_path: Path) -> None:
    pwned = tmp_path / "pwned"
    values = [value.format(pwned=pwned) for value in HOSTILE]
    env = {f"V{i}": value for i, value in enumerate(values)}
    env |= {"IRISFED_EPOCH": "forged", "PS4": f"$(touch {pwned})", "IFS": "x"}
    line = text.entrypoint(["/usr/bin/env", "-0"], env)
    seen = _environ(_run(line, text.job_env(env, "j", 4), tmp_path))
    assert seen == {**env, "PATH": "/usr/bin:/bin", "NODE_ONLY": "kept", "IRISFED_JOB_ID": "j", "IRISFED_EPOCH": "4"}
    assert not pwned.exists()

    args = ["$(touch pwned)", "it's", "${HOME}"]
    line = text.entrypoint(["sh", "-c", 'printf "%s|" "$A" "$@"', "sh", *args], {"A": "${HOME} $(x)"})
    out = _run(line, text.job_env({"A": "${HOME} $(x)"}, "j", 1), tmp_path)
    assert out.stdout.decode() == "${HOME} $(x)|$(touch pwned)|it's|${HOME}|"
    assert not (tmp_path / "pwned").exists()


def test_names_export_cannot_take_reach_the_command_through_env(tmp_path: Path) -> None:
    env = {"my.var": "$HOME 'q'", "1st": "${NOT_SET}", "with space": "a b", "A": "plain"}
    line = text.entrypoint(["/usr/bin/env", "-0"], env)
    seen = _environ(_run(line, text.job_env(env, "j", 1), tmp_path))
    assert seen == {**env, "PATH": "/usr/bin:/bin", "NODE_ONLY": "kept", "IRISFED_JOB_ID": "j", "IRISFED_EPOCH": "1"}
    # A program named with a leading '-' is a program, not an option of exec.
    (tmp_path / "-prog").write_text("#!/bin/sh\necho ran \"$1\"\n")
    (tmp_path / "-prog").chmod(0o755)
    out = _run(text.entrypoint(["-prog", "$x"]), text.job_env({}, "j", 1), tmp_path, path=f"{tmp_path}:/usr/bin:/bin")
    assert (out.returncode, out.stdout) == (0, b"ran $x\n"), out.stderr


def test_a_failed_decode_never_runs_the_command(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    line = text.entrypoint(["/usr/bin/touch", str(marker)], {"A": "1"})
    out = _run(line, text.job_env({"A": "1"}, "j", 1), tmp_path, path=str(tmp_path))  # no base64 on PATH
    assert out.returncode != 0 and b"base64" in out.stderr
    out = _run(line, {text.ENV_VARIABLE: "not base64!"}, tmp_path)
    assert out.returncode != 0
    assert not marker.exists()
    assert _run(line, text.job_env({"A": "1"}, "j", 1), tmp_path).returncode == 0 and marker.exists()


def test_the_largest_env_that_fits_reaches_the_command_verbatim(tmp_path: Path) -> None:
    # The encoded env is one argument of an exec: near its limit it must still arrive whole.
    env = {f"V{i}": "a" * 4096 for i in range(17)} | {"my.var": "'\"$x`\n"}
    job_env = text.job_env(env, "j", 2)
    assert len(job_env[text.ENV_VARIABLE]) > text.ENV_MAX_CHARS - 8 * 1024  # near the limit
    line = text.entrypoint(["/usr/bin/env", "-0"], env)
    seen = _environ(_run(line, job_env, tmp_path))
    assert seen == {**env, "PATH": "/usr/bin:/bin", "NODE_ONLY": "kept", "IRISFED_JOB_ID": "j", "IRISFED_EPOCH": "2"}
