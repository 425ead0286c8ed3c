"""The `irisfed` command line against a running federation, and `irisfed up` from nothing."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import ROOT, interrupt_and_collect

pytestmark = pytest.mark.e2e


async def test_cli_submit_with_constraints_and_read_commands(federation):
    await federation.start_federation("home", "gpu-west")
    submitted = federation.cli("submit", "--id", "cli-1", "--constraint", "device_type=gpu",
                               "--constraint", "device_variant=in:h100,b200", "--priority", "2",
                               "--wait", "--", "sh", "-c", "echo from-cli")
    assert submitted.returncode == 0, submitted.stderr
    assert submitted.stdout.splitlines() == ["cli-1: queue → queued", "from-cli"]  # then the job's own output
    assert "cli-1: succeeded on gpu-west" in submitted.stderr

    jobs = json.loads(federation.cli("jobs", "--output", "json").stdout)
    assert [(j["job_id"], j["state"], j["owner_peer_id"]) for j in jobs] == [("cli-1", "succeeded", "gpu-west")]
    detail = json.loads(federation.cli("job", "cli-1", "--json").stdout)
    assert [c["to_state"] for c in detail["changelog"]] == ["queued", "assigned", "running", "succeeded"]
    peers = json.loads(federation.cli("peers", "--json").stdout)
    assert {p["peer_id"] for p in peers} == {"home", "gpu-west"}
    # Piped (as here): plain aligned columns, no boxes, nothing cut; TSV on request.
    table = federation.cli("jobs")
    lines = table.stdout.splitlines()
    assert table.returncode == 0 and lines[0].split()[:5] == ["JOB", "USER", "STATE", "BAND", "PEER"], table.stdout
    assert lines[1].split()[:5] == ["cli-1", "default", "succeeded", "interactive", "gpu-west"]
    assert [j["job_id"] for j in json.loads(federation.cli("jobs", "--user", "default", "--json").stdout)] == ["cli-1"]
    users = json.loads(federation.cli("users", "--json").stdout)  # the job ended: nothing held
    assert [(u["user_id"], u["usage"], u["queued"], u["running"]) for u in users] == [("default", {}, 0, 0)]
    assert not set(table.stdout) & set("│┃━─…")
    tsv = federation.cli("peers", "--output", "tsv").stdout.splitlines()
    assert tsv[0].split("\t")[0] == "peer" and {"home", "gpu-west"} <= {row.split("\t")[0] for row in tsv[1:]}
    assert {len(row.split("\t")) for row in tsv} == {6}
    explained = federation.cli("explain", "cli-1")
    assert explained.returncode == 0 and "cli-1 is succeeded" in explained.stdout
    generated = federation.cli("submit", "--", "true")  # the router names it: short, typeable
    generated_id = generated.stdout.split(":")[0]
    assert generated.returncode == 0 and len(generated_id) == 17, generated.stdout
    assert federation.cli("logs", "cli-1").stdout == "from-cli\n"

    rejected = federation.cli("submit", "--constraint", "device_type=fpga", "--", "true")
    assert rejected.returncode == 3 and "no peer can host" in rejected.stdout
    bad = federation.cli("submit", "--constraint", "memory>=lots", "--", "true")
    assert bad.returncode == 2 and "needs a number" in bad.stderr
    unknown = federation.cli("submit", "--pin", "mars", "--", "true")
    assert unknown.returncode == 1 and "unknown_peer" in unknown.stderr


async def test_cli_cancel_and_watch(federation):
    await federation.start_federation("home")
    reply = await federation.submit({"command": ["sleep", "300"], "job_id": "long-1"})
    await federation.wait_state("long-1", "running")
    watcher = subprocess.Popen(
        [sys.executable, "-m", "irisfed.cli", "watch", "long-1"], env=federation.env,
        cwd=federation.tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    cancelled = federation.cli("cancel", reply["job_id"])
    assert cancelled.returncode == 0 and "kill_sent" in cancelled.stdout
    out, err = watcher.communicate(timeout=60)
    assert watcher.returncode == 1, err  # watch exits non-zero unless the job succeeded
    assert "long-1: killed" in out


def test_services_refuse_an_unmigrated_database(servers, tmp_path, subject_prefix):
    from tests.e2e.conftest import config_text
    (tmp_path / "f.toml").write_text(config_text(subject_prefix))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "IRISFED_CONFIG": str(tmp_path / "f.toml"),
           "IRISFED_NATS_URL": servers.nats_url, "IRISFED_DATABASE_URL": servers.database_url}
    result = subprocess.run([sys.executable, "-m", "irisfed.services.router"], env=env,
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2
    assert "run `irisfed migrate`" in result.stderr


def test_irisfed_up_from_nothing_runs_the_demo_and_stops_cleanly(tmp_path):
    state = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith("IRISFED_")}
    env["PYTHONPATH"] = str(ROOT)
    up = subprocess.Popen(
        [sys.executable, "-m", "irisfed.cli", "up", "--state-dir", str(state), "--no-live"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        lines = []
        for line in up.stdout:
            lines.append(line)
            if "Ctrl-C stops everything" in line:  # the last line of what `up` prints at start
                break
        assert any("ready" in line for line in lines), "".join(lines)
        connect = json.loads((state / "connect.json").read_text())
        client_env = {**env, "IRISFED_DATABASE_URL": connect["database_url"],
                      "IRISFED_NATS_URL": connect["nats_url"], "IRISFED_CONFIG": connect["config"]}

        def cli(*args):
            return subprocess.run([sys.executable, "-m", "irisfed.cli", *args], env=client_env,
                                  cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)

        for _ in range(100):  # the router needs a moment; each try is a real request
            result = cli("submit", "--wait", "--constraint", "device_type=gpu", "--", "echo", "demo")
            if "no router answered" not in result.stderr and "unreachable" not in result.stdout:
                break
            time.sleep(0.2)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "succeeded on gpu-west" in result.stderr and result.stdout.splitlines()[-1] == "demo"
        # The dashboard: its URL printed, its token private, and it answers.
        url = next(line.split("dashboard: ", 1)[1].split()[0] for line in lines if "dashboard: " in line)
        token_file = state / "web-operator-token"
        assert oct(token_file.stat().st_mode & 0o777) == "0o600"
        assert token_file.read_text().strip() not in "".join(lines)
        health = cli("health", "web", "--url", url)
        for _ in range(100):
            if health.returncode == 0:
                break
            time.sleep(0.2)
            health = cli("health", "web", "--url", url)
        assert health.returncode == 0, health.stdout + health.stderr
        pids = json.loads((state / "pids.json").read_text())
        everything = pids["servers"] + list(pids["children"].values())
        assert len(everything) == 2 + 2 + 3 + 1
    finally:
        rest = interrupt_and_collect(up)
    assert up.returncode == 0, rest
    assert "irisfed up: stopped" in rest
    for pid in everything:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    pg_folder = state / "postgres"
    relocated = pg_folder / "DATA_LOCATION"
    if relocated.exists():  # root with a 0700 temp dir: the cluster lives elsewhere
        pg_folder = Path(relocated.read_text().strip())
    try:
        assert (pg_folder / "pgdata" / "PG_VERSION").exists()  # data kept for next time
    finally:
        if relocated.exists():
            shutil.rmtree(pg_folder, ignore_errors=True)


async def test_health_probes_answer_for_running_services(federation):
    assert federation.cli("health", "router").returncode == 1  # nothing running yet
    await federation.start_federation("home")
    for args in (["router"], ["tick"], ["peer-agent", "--peer-id", "home"]):
        result = federation.cli("health", *args)
        assert result.returncode == 0, result.stdout + result.stderr
    assert federation.cli("health", "peer-agent", "--peer-id", "gpu-west").returncode == 1


async def test_cli_workspace_runs_without_the_producers_folder_and_outputs_come_home(federation):
    """No shared disk: the folder is deleted once submitted, the peer's files before the
    outputs are fetched; every service and the CLI on their own NATS users."""
    await federation.ensure_buckets()  # what `irisfed up` does
    await federation.start_federation("home", "gpu-west")
    folder = federation.tmp / "project"
    (folder / "data").mkdir(parents=True)
    (folder / "train.py").write_text(
        "import os, pathlib\n"
        "text = pathlib.Path('data/input.txt').read_text()\n"
        "pathlib.Path(os.environ['IRISFED_OUTPUT_DIR'], 'model.txt').write_text(text[::-1])\n"
        "print('trained')\n")
    (folder / "data" / "input.txt").write_text("weights")
    (folder / ".git").mkdir()
    (folder / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    stored = federation.cli("submit", "--id", "ws-1", "--workspace", str(folder), "--constraint",
                            "device_type=gpu", "--", sys.executable, "train.py")
    assert stored.returncode == 0, stored.stderr
    assert "stored" in stored.stderr and "ws-1: queue → queued" in stored.stdout
    shutil.rmtree(folder)
    await federation.wait_state("ws-1", "succeeded", "failed")
    job = json.loads(federation.cli("job", "ws-1", "--json").stdout)
    assert job["job"]["state"] == "succeeded", job["job"]["reason"]
    assert [(o["name"], o["stored"]) for o in job["outputs"]] == [("model.txt", True)]
    shutil.rmtree(federation.tmp / "work")  # every peer's run folders and caches
    fetched = federation.cli("outputs", "ws-1", "--to", str(federation.tmp / "results"))
    assert fetched.returncode == 0, fetched.stderr
    assert (federation.tmp / "results" / "model.txt").read_text() == "sthgiew"
    assert "model.txt" in fetched.stdout and "1 file" in fetched.stderr
    missing = federation.cli("submit", "--workspace", str(folder), "--", "true")
    assert missing.returncode == 2 and "is not a directory" in missing.stderr
