"""The peer agent advertises its resources, free = total less what its runs asked."""

from __future__ import annotations

import argparse

import pytest

from irisfed.services.common.store import Store
from irisfed.services.peer_agent.flags import add_flags, parse_resource_flags, settings
from irisfed.services.peer_agent.service import AgentSettings, BackendSpec, PeerAgent
from irisfed.shared.errors import ConfigError
from tests.infra.factories import assign_jobs, insert_jobs, make_config, make_job
from tests.infra.flaky_nats import FlakyNats


async def test_free_resources_are_the_totals_less_what_runs_asked(pool, tmp_path):
    store = Store(pool)
    jobs = [make_job(resources={"gpu": 2, "cpu": 2}, labels={"sim.duration_s": "30"}), make_job(
        labels={"sim.duration_s": "30"})]
    await insert_jobs(store, jobs)
    assert len(await assign_jobs(store, jobs, "gpu-west")) == 2
    spec = BackendSpec("main", "simulated", {}, 4, {"cpu": 8, "memory_mb": 32768, "gpu": 4})
    agent = PeerAgent(make_config(), pool, FlakyNats(ok=10**6),
                      AgentSettings(peer_id="gpu-west", backends=(spec,), work_root=tmp_path / "work"))
    try:
        (before,) = agent.advertisement()
        assert {k: (v.total, v.free) for k, v in before.resources.items()} == {
            "cpu": (8, 8), "memory_mb": (32768, 32768), "gpu": (4, 4)}
        await agent.reconcile()
        assert set(agent.runs) == {j.job_id for j in jobs}
        (ad,) = agent.advertisement()
        assert {k: (v.total, v.free) for k, v in ad.resources.items()} == {
            "cpu": (8, 5), "memory_mb": (32768, 32768), "gpu": (4, 2)}
        assert (ad.capacity.total, ad.capacity.free) == (4, 2)
        await agent.heartbeat()  # written to Postgres with its resources (a new shape)
        (row,) = [r for r in await store.peer_heartbeat_list() if r.peer_id == "gpu-west"]
        assert row.backends[0]["resources"]["gpu"] == {"total": 4, "free": 2}
    finally:
        await agent.close()


def test_resources_come_from_flags_else_the_configuration():
    config = make_config(peers=[{"id": "home"}, {"id": "gpu-west", "resources": {"cpu": 8, "gpu": 2}}])
    parser = argparse.ArgumentParser()
    add_flags(parser)
    args = parser.parse_args(["--peer-id", "gpu-west"])
    assert settings(args, config).backends[0].resources == {"cpu": 8, "gpu": 2}
    args.resource = ["cpu=0.5", "gpu=1"]
    assert settings(args, config).backends[0].resources == {"cpu": 0.5, "gpu": 1}
    for bad in (["gpu"], ["gpu=x"], ["GPU=1"], ["gpu=-1"], ["slots=2"]):
        with pytest.raises(ConfigError):
            parse_resource_flags(bad)
    with pytest.raises(ConfigError, match="resource gpu"):
        make_config(peers=[{"id": "home", "resources": {"gpu": "two"}}])
