"""Failure scenarios: peer loss, fencing, partitions, durable cancel, control-plane loss.

Real servers, real service subprocesses; partitions through TCP proxies; crashes
by SIGKILL or by a crash point between a commit and its publish. Heartbeat TTL is
1.5 s and the recovery grace 1 s (see conftest), so each scenario takes seconds.
"""

import json
import shutil

import pytest

from irisfed.tooling.servers import start_nats
from tests.infra.probes import alive, returns
from tests.infra.waiting import wait_for

pytestmark = pytest.mark.e2e

GPU = [{"key": "device_type", "op": "eq", "value": "gpu"}]
# The first copy (epoch 1) would run a minute; any later copy finishes at once.
EPOCH_AWARE = ["sh", "-c", 'if [ "$IRISFED_EPOCH" = 1 ]; then sleep 60; else echo ran; fi']



def log_events(text: str) -> list[dict]:
    """The structured events of a service's log (lines that are not JSON left out)."""
    events = []
    for line in text.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events


async def wait_unreachable(federation, peer_id):
    async def gone():
        rows = await federation.store.peer_heartbeat_list()
        return any(r["peer_id"] == peer_id and not r["reachable"] for r in rows)
    await wait_for(gone, f"{peer_id} to look unreachable")


async def test_peer_loss_requeues_elsewhere_and_the_stale_copy_is_fenced(federation):
    await federation.start_federation("gpu-west")
    nats_proxy, db_proxy = federation.start_behind_proxies("gpu-east")
    await federation.wait_agent("gpu-east")
    # Only gpu-east advertises an a100, so after losing it the job can only wait.
    reply = await federation.submit({"command": EPOCH_AWARE, "constraints": GPU + [
        {"key": "device_variant", "op": "eq", "value": "a100"}], "max_retries": 1})
    assert reply["disposition"] == "queue"
    job = await federation.wait_state(reply["job_id"], "running")
    assert job["owner_peer_id"] == "gpu-east"
    first_pid = await federation.run_pid(job["job_id"])

    nats_proxy.cut()
    db_proxy.cut()
    # gpu-east goes silent; after TTL + grace the tick requeues the job under a new
    # epoch. No other a100 peer exists, so it waits queued (avoiding gpu-east).
    requeued = await federation.wait_state(reply["job_id"], "queued")
    assert requeued["epoch"] == 2 and requeued["avoid_peers"] == ["gpu-east"]
    last = await federation.store.changelog_get_last_for_job(reply["job_id"])
    history = await federation.store.changelog_list_for_job(reply["job_id"])
    assert last["to_state"] == "queued" and "peer lost" in history[-1]["detail"]
    assert alive(first_pid)  # the partitioned peer keeps running what it has

    nats_proxy.restore()
    db_proxy.restore()

    # What gpu-east logs when it has written its note: the note itself may be gone by the
    # time it is read, since the job's next start there (below) begins a new sync.
    async def fenced():
        return [event for event in log_events(federation.log("gpu-east"))
                if (event.get("event"), event.get("job_id"), event.get("epoch")) == (
                    "stale_copy_killed", reply["job_id"], 1)]

    await wait_for(fenced, "gpu-east to kill and record its stale copy")
    assert not alive(first_pid)
    # gpu-east is the only a100 peer, so once it is back the tick may place the job
    # there again (a peer is avoided only while another matches), under a new epoch.
    # Either way the stale epoch-1 copy never reported anything.
    history = await federation.store.changelog_list_for_job(reply["job_id"])
    assert [r["to_state"] for r in history][:4] == ["queued", "assigned", "running", "queued"]
    assert all(r["epoch"] >= 3 for r in history[4:])  # nothing written under a stale epoch


async def test_lost_peer_work_moves_to_another_peer_and_succeeds_once(federation):
    await federation.start_federation()
    nats_proxy, db_proxy = federation.start_behind_proxies("gpu-west")
    await federation.wait_agent("gpu-west")
    reply = await federation.submit({"command": EPOCH_AWARE, "constraints": GPU, "max_retries": 2})
    job = await federation.wait_state(reply["job_id"], "running")
    assert job["owner_peer_id"] == "gpu-west"
    federation.start("gpu-east")  # a second GPU peer appears
    nats_proxy.cut()
    db_proxy.cut()
    job = await federation.wait_state(reply["job_id"], "succeeded", "failed")
    assert (job["state"], job["owner_peer_id"], job["epoch"], job["attempts"]) == ("succeeded", "gpu-east", 3, 2)
    nats_proxy.restore()
    db_proxy.restore()
    successes = await federation.store.db.fetchval(
        "SELECT count(*) FROM federation_changelog WHERE job_id = $1 AND to_state = 'succeeded'", reply["job_id"])
    assert successes == 1


async def test_nats_partition_agent_keeps_working_from_postgres(federation):
    await federation.start_federation()
    nats_proxy, _ = federation.start_behind_proxies("home")
    await federation.wait_agent("home")
    nats_proxy.cut()
    # The assign notice is lost with the partition; the agent's periodic reconcile
    # with Postgres finds the job anyway.
    reply = await federation.submit({"command": ["sh", "-c", "echo via postgres"]})
    assert reply["disposition"] == "local"
    job = await federation.wait_state(reply["job_id"], "succeeded", "failed")
    assert job["state"] == "succeeded"
    rows = await federation.store.peer_heartbeat_list()
    assert [r["reachable"] for r in rows if r["peer_id"] == "home"] == [True]  # heartbeats via Postgres


async def test_full_partition_keeps_running_and_syncs_on_return(federation):
    await federation.start_federation()
    nats_proxy, db_proxy = federation.start_behind_proxies("gpu-west")
    await federation.wait_agent("gpu-west")
    short = await federation.submit({"command": ["sh", "-c", "sleep 2; echo done"], "cluster_pin": "gpu-west"})
    long = await federation.submit({"command": ["sleep", "120"], "cluster_pin": "gpu-west"})
    await federation.wait_state(short["job_id"], "running")
    long_job = await federation.wait_state(long["job_id"], "running")
    long_pid = await federation.run_pid(long_job["job_id"])
    nats_proxy.cut()
    db_proxy.cut()
    await wait_unreachable(federation, "gpu-west")
    # The parent keeps serving the last known state while the peer is away.
    shown = federation.cli("job", short["job_id"], "--json")
    assert '"state": "running"' in shown.stdout
    # Durable cancel: the owner is offline, so the cancel is stored for its return.
    cancel = await federation.cancel(long["job_id"])
    assert cancel["outcome"] == "pending_owner_offline"
    assert alive(long_pid)
    nats_proxy.restore()
    db_proxy.restore()
    done = await federation.wait_state(short["job_id"], "succeeded", "failed")
    assert (done["state"], done["exit_code"], done["epoch"]) == ("succeeded", 0, 1)  # finished while cut off
    killed = await federation.wait_state(long["job_id"], "killed")
    assert killed["cancel_requested"]
    await wait_for(lambda: returns(not alive(long_pid)), "the cancelled process to die")
    last_seq = (await federation.store.changelog_get_last_for_job(short["job_id"]))["seq"]
    sync = await federation.store.sync_state_get(short["job_id"])
    assert [(r["peer_id"], r["changelog_seq"]) for r in sync] == [("gpu-west", last_seq)]


@pytest.mark.parametrize("crash_at", ["router_after_commit", "tick_after_commit"])
async def test_control_plane_crash_between_commit_and_publish_loses_nothing(federation, crash_at):
    service = crash_at.split("_")[0]
    federation.start(service, env={"IRISFED_CRASH_AT": crash_at})
    federation.start("tick" if service == "router" else "router")
    federation.start("gpu-west")
    await federation.wait_agent("gpu-west")
    await federation.wait_router()
    body = {"job_id": f"crash-{service}", "command": ["true"], "constraints": GPU}
    reply = await federation.request("submit", body, timeout=5.0)
    if service == "router":
        assert reply is None  # died after the commit, before replying
    await wait_for(lambda: returns(federation.processes[service].poll() is not None), f"{service} to crash")
    federation.processes.pop(service)
    job = await federation.job(body["job_id"])
    assert job is not None  # committed before the crash
    federation.start(service)  # restarted without the crash point
    await federation.wait_router()
    again = await federation.submit(body)
    assert again["job_id"] == body["job_id"] and (service != "router" or again["duplicate"] is True)
    job = await federation.wait_state(body["job_id"], "succeeded", "failed")
    assert job["state"] == "succeeded"


async def test_agent_crash_after_accept_is_retried(federation):
    await federation.start_federation()
    federation.start("home", env={"IRISFED_CRASH_AT": "agent_after_accept"})
    await federation.wait_agent("home")
    reply = await federation.submit({"command": ["true"], "max_retries": 1})
    await wait_for(lambda: returns(federation.processes["home"].poll() is not None), "the agent to crash")
    federation.processes.pop("home")
    assert (await federation.job(reply["job_id"]))["state"] == "running"
    federation.start("home")
    job = await federation.wait_state(reply["job_id"], "succeeded", "failed")
    # epoch 1: LOCAL assignment; 2: requeued after the crash; 3: placed again by the tick
    assert (job["state"], job["attempts"], job["epoch"]) == ("succeeded", 2, 3)


async def test_a_missing_program_and_a_non_zero_exit_are_the_jobs_own_failures(federation):
    await federation.start_federation("home")
    missing = await federation.submit({"command": ["/no/such/program"], "max_retries": 1})
    job = await federation.wait_state(missing["job_id"], "failed")
    assert job["attempts"] == 1 and job["reason"] == "cannot start '/no/such/program': No such file or directory"
    exits = await federation.submit({"command": ["sh", "-c", "exit 3"], "max_retries": 5})
    job = await federation.wait_state(exits["job_id"], "failed")
    assert (job["attempts"], job["exit_code"]) == (1, 3)


async def test_postgres_outage_answers_unavailable_and_recovers(federation):
    from irisfed.tooling.proxy import proxy_for

    db_proxy = proxy_for(federation.database_url)
    federation.proxies.append(db_proxy)
    federation.start("router", env={"IRISFED_DATABASE_URL": db_proxy.url_for(federation.database_url)})
    federation.start("tick")
    federation.start("home")
    await federation.wait_router()
    await federation.wait_agent("home")
    db_proxy.cut()  # to the router, Postgres just restarted and is not back yet
    reply = await federation.submit({"job_id": "during-outage", "command": ["true"]})
    assert reply["error"]["code"] == "unavailable"
    assert await federation.job("during-outage") is None  # never a false ack
    db_proxy.restore()

    async def accepted():
        answer = await federation.submit({"job_id": "during-outage", "command": ["true"]})
        return answer if "error" not in answer else None

    answer = await wait_for(accepted, "the router to reconnect")
    assert answer["duplicate"] is False
    job = await federation.wait_state("during-outage", "succeeded", "failed")
    assert job["state"] == "succeeded"


async def test_nats_restart_and_cluster_node_loss_converge(federation, tmp_path):
    # This test owns its NATS servers: a 3-node cluster on fixed ports.
    from irisfed.tooling.servers import free_port

    client_ports = [free_port() for _ in range(3)]
    route_ports = [free_port() for _ in range(3)]
    routes = ",".join(f"nats://127.0.0.1:{p}" for p in route_ports)
    nodes = []

    def start_node(i):
        return start_nats(tmp_path / f"n{i}", port=client_ports[i], jetstream=False, extra_args=(
            "--cluster_name", "irisfed", "--cluster", f"nats://127.0.0.1:{route_ports[i]}",
            "--routes", routes, "--server_name", f"n{i}"))

    try:
        for i in range(3):  # one at a time, so a node that fails to start leaves none behind
            nodes.append(start_node(i))
        cluster_url = ",".join(n.url for n in nodes)
        federation.nats_url = cluster_url
        federation.auth = None  # these nodes run without auth
        await federation.nats.close()
        import nats

        federation.nats = await nats.connect([n.url for n in nodes], max_reconnect_attempts=-1,
                                             reconnect_time_wait=0.2)
        await federation.start_federation("home")
        first = await federation.submit({"command": ["true"]})
        assert (await federation.wait_state(first["job_id"], "succeeded"))["state"] == "succeeded"

        nodes[0].kill()  # lose one node: everyone on it reconnects to the others
        second = await federation.submit({"command": ["true"]})
        assert (await federation.wait_state(second["job_id"], "succeeded"))["state"] == "succeeded"

        for i in (1, 2):  # restart the remaining nodes one at a time
            nodes[i].stop()
            nodes[i] = start_node(i)
        nodes[0] = start_node(0)
        third = await federation.submit({"command": ["true"]})
        assert (await federation.wait_state(third["job_id"], "succeeded"))["state"] == "succeeded"
    finally:
        federation.close()
        await federation.nats.close()
        for node in nodes:
            node.stop()
        shutil.rmtree(tmp_path, ignore_errors=True)


async def test_whole_federation_runs_on_least_privilege_database_roles(federation):
    from tests.infra.db_roles import as_role

    created = federation.cli("db-roles", "--out", str(federation.tmp / "db-credentials.json"))
    assert created.returncode == 0, created.stderr
    assert oct((federation.tmp / "db-credentials.json").stat().st_mode & 0o777) == "0o600"
    role_url = {
        "router": as_role(federation.database_url, "irisfed_svc_router"),
        "tick": as_role(federation.database_url, "irisfed_svc_tick"),
        "home": as_role(federation.database_url, "irisfed_peer_home"),
        "gpu-west": as_role(federation.database_url, "irisfed_peer_gpu-west"),
    }
    for name, url in role_url.items():
        federation.start(name, env={"IRISFED_DATABASE_URL": url})
    await federation.wait_router()
    await federation.wait_agent("home")
    await federation.wait_agent("gpu-west")
    local = await federation.submit({"command": ["true"]})
    gpu = await federation.submit({"command": ["sh", "-c", "exit 4"], "constraints": GPU})
    long = await federation.submit({"command": ["sleep", "60"], "constraints": GPU})
    assert (await federation.wait_state(local["job_id"], "succeeded"))["owner_peer_id"] == "home"
    assert (await federation.wait_state(gpu["job_id"], "failed"))["exit_code"] == 4
    await federation.wait_state(long["job_id"], "running")
    assert (await federation.cancel(long["job_id"]))["outcome"] == "kill_sent"
    await federation.wait_state(long["job_id"], "killed")
    for name in role_url:
        assert "InsufficientPrivilege" not in federation.log(name)
        assert "permission denied" not in federation.log(name)
