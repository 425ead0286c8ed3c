"""How ``irisfed peer-agent`` flags and ``[[peers]]`` entries choose and configure an engine backend."""

from __future__ import annotations

import argparse

import pytest

from services.peer_agent.flags import add_flags, settings
from shared.config import parse_config
from shared.errors import ConfigError


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


@pytest.mark.parametrize("bad", [0, -1, float("nan")])
def test_a_poll_interval_must_be_positive(bad):
    with pytest.raises(ConfigError, match="--poll-interval"):
        _settings(["--peer-id", "hpc", "--backend", "slurm", "--poll-interval", str(bad)], [{"id": "hpc"}])


@pytest.mark.parametrize("entry", [{"slurm_partition": 3}, {"ray_address": ["x"]}, {"slurm_partition": "a\x00b"}])
def test_engine_settings_in_the_file_must_be_strings(entry):
    with pytest.raises(ConfigError, match="must be a string"):
        parse_config({"local_cluster": "p", "peers": [{"id": "p", **entry}]})
