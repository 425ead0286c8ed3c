"""How ``irisfed peer-agent`` flags and ``[[peers]]`` entries choose and configure an engine backend."""

from __future__ import annotations

import argparse

import pytest

from irisfed.services.peer_agent.flags import add_flags, settings
from irisfed.shared.config import parse_config
from irisfed.shared.errors import ConfigError


def _settings(argv: list[str], peers: list[dict]):
    parser = argparse.ArgumentParser()
    add_flags(parser)
    config = parse_config({"local_cluster": peers[0]["id"], "peers": peers})
    return settings(parser.parse_args(argv), config)


def test_a_slurm_peer_takes_its_partition_from_the_flag_else_the_configuration():
    peers = [{"id": "hpc", "backend": "slurm", "slurm_partition": "gpu"}]
    assert _settings(["--peer-id", "hpc"], peers).backends[0].options == {"partition": "gpu"}
    flagged = _settings(["--peer-id", "hpc", "--slurm-partition", "debug", "--poll-interval", "0.5"], peers)
    assert (flagged.backends[0].kind, flagged.backends[0].options) == (
        "slurm", {"partition": "debug", "poll_interval_s": "0.5"})


def test_a_ray_peer_needs_a_dashboard_address():
    peers = [{"id": "ml"}]
    with pytest.raises(ConfigError, match="--ray-address"):
        _settings(["--peer-id", "ml", "--backend", "ray"], peers)
    with pytest.raises(ConfigError, match="--ray-address"):
        _settings(["--peer-id", "ml", "--backend", "ray", "--ray-address", "127.0.0.1:8265"], peers)
    ok = _settings(["--peer-id", "ml"], [{"id": "ml", "backend": "ray", "ray_address": "http://h:8265"}])
    assert ok.backends[0].options == {"address": "http://h:8265"}


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), float("-inf")])
def test_a_poll_interval_must_be_positive_and_finite(bad):
    # An infinite poll interval would let the poller sleep for ever: no run would ever end.
    # (`--flag=value`: argparse would read a separate "-inf" as an option.)
    with pytest.raises(ConfigError, match="--poll-interval"):
        _settings(["--peer-id", "hpc", "--backend", "slurm", f"--poll-interval={bad}"], [{"id": "hpc"}])


@pytest.mark.parametrize("entry", [{"slurm_partition": 3}, {"ray_address": ["x"]}, {"slurm_partition": "a\x00b"}])
def test_engine_settings_in_the_file_must_be_strings(entry):
    with pytest.raises(ConfigError, match="must be a string"):
        parse_config({"local_cluster": "p", "peers": [{"id": "p", **entry}]})


def test_the_harness_writes_resources_and_engine_settings_the_services_read_back():
    from irisfed.tooling.federation import Peer, render_config

    text = render_config([Peer("home", resources={"cpu": 4, "memory_mb": 8192}),
                          Peer("hpc", backend="slurm", slurm_partition="gpu"),
                          Peer("ml", backend="ray", ray_address="http://127.0.0.1:8265")], local_cluster="home")
    import tomllib

    config = parse_config(tomllib.loads(text))
    assert config.peer("home").resources == {"cpu": 4, "memory_mb": 8192}
    assert (config.peer("hpc").backend, config.peer("hpc").slurm_partition) == ("slurm", "gpu")
    assert config.peer("ml").ray_address == "http://127.0.0.1:8265"


def test_the_demo_federation_has_realistic_shapes():
    from irisfed.cli.up import DEMO_PEERS

    shapes = {peer.id: dict(peer.resources) for peer in DEMO_PEERS}
    assert shapes["gpu-west"]["gpu"] == 8 and shapes["tpu-east"]["tpu"] == 8
    assert all("cpu" in shape and "memory_mb" in shape for shape in shapes.values())


@pytest.mark.parametrize("flag", [["gpu"], ["gpu=x"], ["GPU=1"], ["gpu=-1"], ["gpu=0.5"], ["cpu=nan"]])
def test_submit_refuses_a_bad_resource_flag_before_sending_anything(flag, monkeypatch):
    from irisfed.cli import client
    from irisfed.cli.parser import build_parser

    sent = []
    monkeypatch.setattr(client, "_request", lambda *a, **k: sent.append(a))
    args = build_parser().parse_args(["submit", *(x for f in flag for x in ("--resource", f)), "--", "true"])
    with pytest.raises(ConfigError, match="--resource"):
        client.cmd_submit(args)
    assert sent == []


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), float("-inf")])
def test_an_engine_timeout_must_be_a_positive_finite_number(bad):
    with pytest.raises(ConfigError, match="--engine-timeout"):
        _settings(["--peer-id", "hpc", "--backend", "slurm", f"--engine-timeout={bad}"], [{"id": "hpc"}])


def test_the_engine_timeout_reaches_the_slurm_and_ray_backends(tmp_path):
    from irisfed.services.peer_agent.backends import make_backend

    flagged = _settings(["--peer-id", "hpc", "--backend", "slurm", "--engine-timeout", "4.5"], [{"id": "hpc"}])
    options = flagged.backends[0].options
    assert options["call_timeout_s"] == "4.5"
    assert make_backend("slurm", tmp_path, options=options, peer_id="hpc").command_timeout_s == 4.5
    assert make_backend("slurm", tmp_path, peer_id="hpc").command_timeout_s == 30.0
    ray = make_backend("ray", tmp_path, options={"address": "http://127.0.0.1:1", "call_timeout_s": "2"},
                       peer_id="ml")
    assert ray.call_timeout_s == 2.0
