import pytest

from irisfed.shared.config import load_config, parse_config
from irisfed.shared.errors import ConfigError
from irisfed.shared.subjects import Subjects


def test_defaults_apply_and_peers_parse():
    config = parse_config({"peers": [{"id": "home"}, {"id": "gpu", "attributes": {"device_type": "gpu", "zone": ["a", "b"]}, "slots": 8}]})
    assert config.local_cluster == "home" and config.subject_prefix == "irisfed"
    assert (config.heartbeat_interval_s, config.heartbeat_ttl_s) == (2.0, 6.0)
    assert config.peer("gpu").attributes == {"device_type": ("gpu",), "zone": ("a", "b")}
    assert config.peer("gpu").slots == 8


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({}, "at least one"),
        ({"peers": []}, "at least one"),
        ({"peers": [{"id": "a"}], "local_cluster": "b"}, "local_cluster"),
        ({"peers": [{"id": "a"}], "local_cluster": "a", "heartbeat_ttl_s": 1}, "larger than"),
        ({"peers": [{"id": "a"}], "local_cluster": "a", "heartbeat_interval_s": -1}, "positive"),
        ({"peers": [{"id": "a"}], "typo_key": 1}, "unknown configuration keys: typo_key"),
        ({"peers": [{"id": "a", "slot": 1}]}, "unknown keys in"),
        ({"peers": [{"id": "a"}, {"id": "a"}], "local_cluster": "a"}, "twice"),
        ({"peers": [{"id": "a", "backend": "k8s"}], "local_cluster": "a"}, "backend"),
        ({"peers": [{"id": "a.b"}]}, "invalid peer id"),
        ({"peers": [{"id": "a"}], "local_cluster": "a", "subject_prefix": "bad prefix"}, "subject prefix"),
    ],
)
def test_bad_config_is_a_clear_error(raw, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(raw)


def test_load_config_file(tmp_path):
    path = tmp_path / "f.toml"
    path.write_text('local_cluster = "a"\n[[peers]]\nid = "a"\n')
    assert load_config(path).peer_ids == ("a",)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    path.write_text("not = = toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(path)


def test_subjects():
    s = Subjects("acme.irisfed")
    assert s.submit == "acme.irisfed.submit"
    assert s.assign("gpu") == "acme.irisfed.assign.gpu"
    assert s.cancel_notice("gpu") == "acme.irisfed.cancel.gpu"
    assert s.heartbeat() == "acme.irisfed.heartbeat.*"
    assert s.events("j1") == "acme.irisfed.events.j1"


def test_attributes_with_nul_are_a_config_error():
    with pytest.raises(ConfigError, match="NUL"):
        parse_config({"peers": [{"id": "home", "attributes": {"zone": "a\x00b"}}]})
