"""The dispatch bench's two paths against real services: gpu jobs go QUEUE (router →
tick → agent), cpu jobs LOCAL (the router creates them assigned to the local cluster
and its agent starts them), and the probe times each from submit to running."""

import uuid

from irisfed.bench.report import Bench, Profile
from irisfed.bench.sections import DISPATCH_PEERS, DispatchProbe, dispatch_deployment
from irisfed.services.common.bus import connect_client


async def test_local_and_queue_jobs_reach_running_by_their_own_paths(servers, tmp_path):
    bench = Bench(Profile(True), tmp_path)
    dep = await dispatch_deployment(bench, servers.database_url, servers.nats_url, f"paths{uuid.uuid4().hex[:8]}")
    nc = await connect_client(servers.nats_url)
    try:
        probe = DispatchProbe(dep, nc, rate=100)
        await probe.open(len(DISPATCH_PEERS))
        local = await probe.measure(0.5, "l", device_type="cpu")
        queued = await probe.measure(0.5, "q")
        rows = await dep.pool.fetch("SELECT job_id, disposition, owner_peer_id FROM jobs "
                                    "WHERE job_id LIKE 'l-%' OR job_id LIKE 'q-%'")
    finally:
        await nc.close()
        await dep.close()

    for result in (local, queued):
        assert result.sent == 50 and result.errors == 0
        assert result.run.done == result.sent, result.note()
        assert 0 < result.run.pct(0.5) <= result.run.pct(0.99) < 10
    local_rows = {(r["disposition"], r["owner_peer_id"]) for r in rows if r["job_id"].startswith("l-")}
    assert local_rows == {("local", "home")}  # the local cluster, DISPATCH_PEERS' first
    queue_rows = [r for r in rows if r["job_id"].startswith("q-")]
    assert len(queue_rows) == 50
    assert all(r["disposition"] == "queue" and r["owner_peer_id"].startswith("gpu") for r in queue_rows)
    # A LOCAL job is never queued: its hops are the router's (→assigned) and the agent's.
    assert [h.split()[0] for h in local.hops] == ["→assigned", "→running"]
    assert [h.split()[0] for h in queued.hops] == ["→queued", "→assigned", "→running"]
