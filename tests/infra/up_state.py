"""What ``irisfed up`` leaves in its state folder for ``irisfed env`` to read."""

from __future__ import annotations

import json


def up_state(tmp_path, producer_url="nats://producer:pw1@127.0.0.1:4222"):
    """A ``.irisfed`` folder in ``tmp_path`` with its producer and operator connections."""
    state = tmp_path / ".irisfed"
    state.mkdir()
    (state / "producer.json").write_text(json.dumps({"nats_url": producer_url, "config": "/x/federation.toml"}))
    (state / "connect.json").write_text(json.dumps({
        "nats_url": "nats://operator:pw2@127.0.0.1:4222", "database_url": "postgresql://postgres@127.0.0.1:5/irisfed",
        "config": "/x/federation.toml"}))
    return state
