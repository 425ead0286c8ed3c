"""Past one machine (docs/design.md §7; invariant 13): the services on a Patroni cluster
(a primary and a synchronous standby, etcd) and a NATS cluster of three, all real, all
on loopback; faults injected while producers submit.

- The primary SIGKILLed (its Patroni and its postmaster: the machine died) in the middle
  of a burst of submits with 200 in flight while jobs are assigned and running: the
  standby is promoted; every acknowledged submit is on the new primary; every job ends;
  the changelog replays; the old primary rejoins as a standby, and nothing it had that
  the new primary lacks was ever acknowledged (read from a copy of its data taken when
  it died).
- A planned switchover (``patronictl switchover``) under load: no error but
  ``unavailable`` retries, nothing lost.
- NATS nodes killed one, then a second, under load: work goes on on what is left.
- The primary and a NATS node killed within a second of each other.

The Patroni cluster (tests/e2e/conftest.py's ``patroni``) is started once for this module
(~12 s) and repaired between tests (a dead node restarted, a synchronous standby waited
for: tests/infra/ha.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from irisfed.shared.lifecycle import TERMINAL_STATES
from irisfed.tooling.ha import ha_available, start_nats_cluster
from irisfed.tooling.invariants import assert_changelog_replays
from irisfed.tooling.servers import _postgres_user, find_postgres_bin, free_port
from tests.e2e.conftest import Federation
from tests.engines.fixtures import _unavailable
from tests.infra.ha import fresh_federation, start_simulated
from tests.infra.waiting import wait_for

pytestmark = pytest.mark.e2e

BURST = 3000
IN_FLIGHT = 200
KILL_AFTER = 800  # acknowledgements before the primary dies
RETRY_S = 0.2
REQUEST_TIMEOUT_S = 5.0  # above the router's ~4 s answer bound
# A producer gives up on one submit after this long: far beyond a failover (~TTL).
GIVE_UP_S = 120.0


@pytest.fixture
async def ha(patroni, tmp_path, servers, subject_prefix, nats_client):
    """A federation (router, tick, two simulated agents) on a fresh database of the
    Patroni cluster, every service given the multi-host URL."""
    async with fresh_federation(patroni, tmp_path, servers, subject_prefix, nats_client, "ha") as fed:
        yield fed, patroni


class Burst:
    """``count`` submits, ``in_flight`` at once, each retried with its job_id until
    acknowledged: ``acked`` (job_id → when), and every error code seen."""

    def __init__(self, fed: Federation, prefix: str, count: int, in_flight: int) -> None:
        self.fed = fed
        self.ids = [f"{prefix}-{i}" for i in range(count)]
        self.in_flight = in_flight
        self.acked: dict[str, float] = {}
        self.errors: dict[str, int] = {}
        self.gave_up: list[str] = []

    def body(self, job_id: str) -> dict:
        n = int(job_id.rsplit("-", 1)[1])
        body = {"job_id": job_id, "command": ["true"], "labels": {"sim.duration_s": "0.05"}}
        if n % 2:
            body["constraints"] = [{"key": "device_type", "op": "eq", "value": "gpu"}]
        return body

    async def _one(self, job_id: str) -> None:
        deadline = time.monotonic() + GIVE_UP_S
        while time.monotonic() < deadline:
            reply = await self.fed.request("submit", self.body(job_id), timeout=REQUEST_TIMEOUT_S)
            if reply is None:
                self.errors["timeout"] = self.errors.get("timeout", 0) + 1
            elif "error" in reply:
                code = reply["error"]["code"]
                self.errors[code] = self.errors.get(code, 0) + 1
                if code != "unavailable":
                    return
            else:
                self.acked.setdefault(job_id, time.monotonic())
                return
            await asyncio.sleep(RETRY_S)
        self.gave_up.append(job_id)

    async def run(self) -> None:
        queue: asyncio.Queue[str] = asyncio.Queue()
        for job_id in self.ids:
            queue.put_nowait(job_id)

        async def worker() -> None:
            while not queue.empty():
                await self._one(queue.get_nowait())

        await asyncio.gather(*(worker() for _ in range(self.in_flight)))


async def all_terminal(fed: Federation, job_ids, timeout: float = 240.0) -> None:
    async def done():
        rows = {r.job_id: r.state for r in await fed.store.job_list_states()}
        left = [j for j in job_ids if rows.get(j) not in TERMINAL_STATES]
        return not left or None
    await wait_for(done, f"{len(job_ids)} acknowledged jobs to end", timeout=timeout)


def _copy_data(node, into: Path) -> Path:
    """A copy of a dead node's data folder, to read what it had committed (beside the
    cluster's own folders: the postgres user reaches those)."""
    source = Path(node.process.extra["data"])
    target = into / f"{node.name}-copy-{uuid.uuid4().hex[:8]}"
    shutil.copytree(source, target, symlinks=True)
    shutil.chown(target, user="postgres")
    for path in target.rglob("*"):
        shutil.chown(path, user="postgres")
    os.chmod(target, 0o700)
    for name in ("standby.signal", "recovery.signal", "postmaster.pid"):
        (target / name).unlink(missing_ok=True)
    return target


def _job_ids_in(data: Path, database: str) -> set[str]:
    """The job ids a (copied) data folder holds, by starting a throwaway Postgres on it."""
    bin_dir = find_postgres_bin()
    port = free_port()
    log = data.parent / f"{data.name}.log"
    process = subprocess.Popen(
        [str(bin_dir / "postgres"), "-D", str(data), "-p", str(port), "-c", "listen_addresses=127.0.0.1",
         "-c", f"unix_socket_directories={data}", "-c", "hot_standby=on", "-c", "synchronous_standby_names=",
         "-c", "archive_mode=off"],
        user=_postgres_user(), stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)  # noqa: SIM115
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ready = subprocess.run([str(bin_dir / "pg_isready"), "-h", "127.0.0.1", "-p", str(port), "-q"],
                                   check=False)
            if ready.returncode == 0:
                break
            time.sleep(0.2)
        out = subprocess.run(
            [str(bin_dir / "psql"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "-d", database,
             "-At", "-c", "SELECT job_id FROM jobs"], capture_output=True, text=True, check=True,
            env={k: v for k, v in os.environ.items() if not k.startswith("PG")})
        return set(out.stdout.split())
    finally:
        process.terminate()
        process.wait(timeout=30)
        shutil.rmtree(data, ignore_errors=True)


async def test_the_primary_dies_mid_burst_and_nothing_acknowledged_is_lost(ha, tmp_path):
    fed, cluster = ha
    await start_simulated(fed)
    burst = Burst(fed, "b", BURST, IN_FLIGHT)
    running = asyncio.ensure_future(burst.run())
    await wait_for(lambda: _at_least(burst, KILL_AFTER), f"{KILL_AFTER} acknowledgements", timeout=120)
    killed_at = time.monotonic()
    old = await asyncio.to_thread(cluster.kill_leader)
    copy = await asyncio.to_thread(_copy_data, old, cluster.folder)
    new = await asyncio.to_thread(cluster.wait_leader, 120.0, old)
    await running
    assert burst.gave_up == [] and len(burst.acked) == BURST, (len(burst.acked), burst.errors)
    assert set(burst.errors) <= {"unavailable", "timeout"}, burst.errors
    after = [t for t in burst.acked.values() if t > killed_at]
    assert after, "no submit was acknowledged after the failover"
    # Every acknowledged submit is on the new primary, and every one ends.
    stored = {r.job_id for r in await fed.store.job_list_states()}
    assert set(burst.acked) <= stored
    await all_terminal(fed, list(burst.acked))
    await assert_changelog_replays(fed.store)
    # What the old primary had committed that the new one lacks was never acknowledged.
    database = fed.database_url.rsplit("/", 1)[1].split("?")[0]
    had = await asyncio.to_thread(_job_ids_in, copy, database)
    assert not ((had - stored) & set(burst.acked)), sorted((had - stored) & set(burst.acked))[:10]
    # The old primary rejoins as a standby by itself once its Patroni is back.
    await asyncio.to_thread(cluster.restart, old)
    await wait_for(lambda: _role(old, "replica"), f"{old.name} to rejoin as a standby", timeout=120)
    assert new.role() in ("primary", "master")  # Patroni 3.0 says master


async def test_a_planned_switchover_under_load_costs_retries_only(ha):
    fed, cluster = ha
    await start_simulated(fed)
    burst = Burst(fed, "s", 1000, 100)
    running = asyncio.ensure_future(burst.run())
    await wait_for(lambda: _at_least(burst, 200), "200 acknowledgements", timeout=120)
    before = await asyncio.to_thread(cluster.leader)
    after = await asyncio.to_thread(cluster.switchover)
    assert after is not before
    await running
    assert burst.gave_up == [] and len(burst.acked) == 1000
    assert set(burst.errors) <= {"unavailable", "timeout"}, burst.errors
    await all_terminal(fed, list(burst.acked))
    await assert_changelog_replays(fed.store)


async def test_nats_nodes_die_one_then_another_and_work_goes_on(ha, tmp_path, servers):
    """Three nats-servers in one cluster: the services and the producer are given all
    three. Killing one, then a second, moves every client to what is left (core NATS has
    no quorum to lose: one server carries everything); the killed ones come back."""
    fed, _ = ha
    async with _on_a_nats_cluster(fed, tmp_path, servers) as nats:
        done = []
        for victim in (0, 1):
            nats.servers[victim].kill()
            burst = Burst(fed, f"n{victim}", 100, 20)
            await burst.run()
            assert len(burst.acked) == 100 and burst.gave_up == [], burst.errors
            done += list(burst.acked)
        await all_terminal(fed, done)
        await asyncio.to_thread(nats.restart, 0)
        await asyncio.to_thread(nats.restart, 1)
        nats.servers[2].kill()  # the last of the first three: clients move to the restarted ones
        burst = Burst(fed, "back", 100, 20)
        await burst.run()
        assert len(burst.acked) == 100, burst.errors
        await all_terminal(fed, list(burst.acked))
        await assert_changelog_replays(fed.store)


async def test_the_primary_and_a_nats_node_die_within_a_second(ha, tmp_path, servers):
    fed, cluster = ha
    async with _on_a_nats_cluster(fed, tmp_path, servers) as nats:
        burst = Burst(fed, "both", 1000, 100)
        running = asyncio.ensure_future(burst.run())
        await wait_for(lambda: _at_least(burst, 200), "200 acknowledgements", timeout=120)
        old = await asyncio.to_thread(cluster.kill_leader)
        nats.servers[0].kill()
        await asyncio.to_thread(cluster.wait_leader, 120.0, old)
        await running
        assert burst.gave_up == [] and len(burst.acked) == 1000, burst.errors
        assert set(burst.errors) <= {"unavailable", "timeout"}, burst.errors
        assert set(burst.acked) <= {r.job_id for r in await fed.store.job_list_states()}
        await all_terminal(fed, list(burst.acked))
        await assert_changelog_replays(fed.store)


@contextlib.asynccontextmanager
async def _on_a_nats_cluster(fed: Federation, tmp_path: Path, servers):
    """A NATS cluster of three (its ``servers``), the services and the test's producer on
    all three URLs, the simulated services started; all stopped at the end."""
    from irisfed.services.common.bus import connect_client

    conf, _ = servers.nats_auth.write(tmp_path / "nats-auth")
    nats = await asyncio.to_thread(start_nats_cluster, tmp_path / "nats", 3, conf)
    producer = None
    try:
        fed.nats_url = nats.url  # every service (and the CLI) on the cluster's three URLs
        producer = await connect_client(servers.nats_auth.url(nats.url, "admin"), max_reconnect_attempts=-1,
                                        reconnect_time_wait=0.2)
        fed.nats = producer
        await start_simulated(fed)
        yield nats
    finally:
        fed.close()
        if producer is not None:
            await producer.close()
        nats.stop()


def _role(node, role: str):
    async def probe():
        return await asyncio.to_thread(node.role) == role
    return probe()


async def _at_least(burst: Burst, n: int) -> bool:
    return len(burst.acked) >= n


def test_irisfed_up_ha_runs_on_patroni_and_a_nats_cluster_and_stops_everything(tmp_path):
    """``irisfed up --ha``: the demo federation on a primary and a synchronous standby
    and three nats-servers; the CLI's URLs name every member; a job runs; SIGINT stops
    every process it started (Patroni's Postgres and etcd included)."""
    import signal as signals
    import sys

    why = ha_available()
    if why:
        _unavailable(why)
    state = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith("IRISFED_")}
    up = subprocess.Popen([sys.executable, "-m", "irisfed.cli", "up", "--ha", "--state-dir", str(state), "--no-live"],
                          cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    started: list[int] = []
    try:
        lines = []
        for line in up.stdout:
            lines.append(line)
            if "Ctrl-C stops everything" in line:
                break
        assert any("ready" in line for line in lines), "".join(lines)
        connect = _read_json(state / "connect.json")
        assert connect["database_url"].count(",") == 1 and "target_session_attrs=read-write" in connect["database_url"]
        assert connect["nats_url"].count(",") == 2
        client_env = {**env, "IRISFED_DATABASE_URL": connect["database_url"], "IRISFED_NATS_URL": connect["nats_url"],
                      "IRISFED_CONFIG": connect["config"]}
        code = tmp_path / "code"  # the job's code reaches it through the replicated object store
        code.mkdir()
        (code / "train.py").write_text("print('ha')\n")
        for _ in range(100):
            result = subprocess.run([sys.executable, "-m", "irisfed.cli", "submit", "--wait", "--workspace", str(code),
                                     "--", "python3", "train.py"],
                                    env=client_env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                                    check=False)
            if "no router answered" not in result.stderr:
                break
            time.sleep(0.2)
        assert result.returncode == 0 and "succeeded" in result.stderr, result.stdout + result.stderr
        assert result.stdout.splitlines()[-1] == "ha"  # its output, streamed through the log stream
        assert _bucket_replicas(connect["nats_url"], "irisfed-workspaces") == 3  # one per NATS node
        _a_nats_node_dies_while_a_job_prints(client_env, tmp_path, _read_json(state / "pids.json")["servers"][0])
        pids = _read_json(state / "pids.json")
        started = pids["servers"] + list(pids["children"].values())
        assert len(pids["servers"]) == 3  # the NATS cluster (Patroni is stopped after them)
        patroni = _postgres_pids(state)
        assert len(patroni) >= 2
        started += patroni
    finally:
        up.send_signal(signals.SIGINT)
        rest, _ = up.communicate(timeout=180)
    assert up.returncode == 0, rest
    for pid in started:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    relocated = state / "patroni" / "DATA_LOCATION"
    if relocated.exists():  # root with a 0700 temp dir: the cluster lived elsewhere
        shutil.rmtree(relocated.read_text().strip(), ignore_errors=True)


def _a_nats_node_dies_while_a_job_prints(client_env: dict, cwd: Path, nats_pid: int) -> None:
    """A job prints a line every 0.2 s; once its first line came home, a NATS node is
    SIGKILLed. Its log, read after it ended, holds every line once, in order (the log
    stream has a replica on each node: what was acknowledged survives the node)."""
    import sys

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "irisfed.cli", *args], env=client_env, cwd=cwd,
                              capture_output=True, text=True, timeout=120, check=False)
    printed = [f"tick {i}" for i in range(20)]
    submitted = cli("submit", "--id", "printer", "--", "sh", "-c", "for i in $(seq 0 19); do echo tick $i; sleep 0.2; done")
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    for _ in range(300):
        if cli("logs", "printer").stdout.startswith("tick 0"):
            break
        time.sleep(0.1)
    os.kill(nats_pid, 9)
    followed = cli("logs", "printer", "--follow")
    assert followed.returncode == 0 and followed.stdout.splitlines() == printed, followed.stdout + followed.stderr
    assert cli("logs", "printer").stdout.splitlines() == printed


def _bucket_replicas(nats_url: str, name: str) -> int:
    from irisfed.services.common.bus import connect_client

    async def replicas() -> int:
        nc = await connect_client(nats_url)
        try:
            return (await nc.jetstream().stream_info(f"OBJ_{name}")).config.num_replicas
        finally:
            await nc.close()
    return asyncio.run(replicas())


def _read_json(path: Path) -> dict:
    import json

    return json.loads(path.read_text())


def _postgres_pids(state: Path) -> list[int]:
    """The postmasters and Patroni processes whose command line names this state folder."""
    found = []
    folder = state / "patroni"
    relocated = folder / "DATA_LOCATION"
    if relocated.exists():
        folder = Path(relocated.read_text().strip())
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(folder) in cmdline and ("patroni" in cmdline or "postgres" in cmdline or "etcd" in cmdline):
            found.append(int(entry.name))
    return found
