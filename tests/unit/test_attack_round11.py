"""Attack pass, round 11: pure pieces (the Ray entrypoint's env, agent flags).

The Ray entrypoint is run here as Ray runs it: ``/bin/sh -c`` through a real exec,
so the kernel's own limits on one argument or environment string apply."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from irisfed.services.peer_agent.backends import ray_text as text

# What one submit may carry (shared/messages.py): values of up to 4096 characters, a
# 64 KB body. Twelve values of 4096 quotes is ~49 KB.
QUOTES = {f"Q{i}": "'" * 4096 for i in range(12)}


def _run(line: str, job_env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["/bin/sh", "-c", line], env={"PATH": "/usr/bin:/bin", **job_env},
                          capture_output=True, cwd=cwd)


def test_a_quote_heavy_env_a_submit_may_carry_is_refused_before_submit() -> None:
    # Encoded, it was ~330 KB: Ray hands the runtime env to its job supervisor's worker
    # as one argument, the exec failed (E2BIG) and Ray retried it for minutes, then
    # failed the job as its own machinery's fault (a lost run, retried elsewhere).
    with pytest.raises(ValueError, match="environment is .* at most"):
        text.job_env(QUOTES, "j", 1)


def test_the_largest_env_that_fits_reaches_the_command_verbatim(tmp_path: Path) -> None:
    env = {f"V{i}": "a" * 4096 for i in range(17)} | {"my.var": "'\"$x`\n"}
    job_env = text.job_env(env, "j", 2)
    assert len(job_env[text.ENV_VARIABLE]) > text.ENV_MAX_CHARS - 8 * 1024  # near the limit
    line = text.entrypoint(["/usr/bin/env", "-0"], env)
    out = _run(line, job_env, tmp_path)
    assert out.returncode == 0, out.stderr[:300]
    seen = dict(entry.split("=", 1) for entry in out.stdout.decode().split("\0")[:-1])
    seen.pop("PWD", None)
    assert seen == {**env, "PATH": "/usr/bin:/bin", "IRISFED_JOB_ID": "j", "IRISFED_EPOCH": "2"}


def test_a_command_too_long_for_one_exec_argument_is_refused_before_submit() -> None:
    # 30 arguments of 4096 quotes fit a submit; quoted they are ~600 KB of `sh -c` line.
    with pytest.raises(ValueError, match="entrypoint may hold at most"):
        text.entrypoint(["printf", "%s", *["'" * 4096] * 30])


# ---------------------------------------------------------------- dashboard live streams


def test_one_ipv6_client_cannot_take_every_live_slot_by_changing_its_address() -> None:
    from irisfed.services.web.live import Broker, Refused

    broker = Broker(max_viewers=20, viewers_per_client=2)
    # A host picks any address of its /64 (privacy addresses, or simply at will).
    taken = [broker.join(f"2001:db8:1:2::{i:x}") for i in range(10)]
    assert sum(viewer is not None for viewer in taken) == 2
    assert broker.refusal("2001:db8:1:2:ffff::1") is Refused.CLIENT_FULL
    assert broker.join("2001:db8:1:3::1") is not None  # another network is another client
    # The same IPv4 client written as an IPv4-mapped IPv6 address is the same client.
    assert broker.join("192.0.2.7") is not None and broker.join("::ffff:192.0.2.7") is not None
    assert broker.join("::ffff:c000:207") is None
    # A refused client gets its share back as its streams end.
    for viewer in taken:
        if viewer is not None:
            broker.leave(viewer)
    assert broker.join("2001:db8:1:2::99") is not None


# ---------------------------------------------------------------- agent flags


@pytest.mark.parametrize("flag", ["--poll-interval", "--engine-timeout"])
@pytest.mark.parametrize("bad", ["inf", "-inf", "nan", "0", "-1"])
def test_engine_intervals_must_be_positive_and_finite(flag: str, bad: str) -> None:
    # --poll-interval inf was taken: the poller then sleeps forever and no run ever ends.
    import argparse

    from irisfed.services.peer_agent.flags import add_flags, settings
    from irisfed.shared.config import parse_config
    from irisfed.shared.errors import ConfigError

    parser = argparse.ArgumentParser()
    add_flags(parser)
    config = parse_config({"local_cluster": "hpc", "peers": [{"id": "hpc"}]})
    with pytest.raises(ConfigError, match=flag):
        settings(parser.parse_args(["--peer-id", "hpc", "--backend", "slurm", f"{flag}={bad}"]), config)
