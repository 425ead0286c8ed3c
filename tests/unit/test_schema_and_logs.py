import io
import json
import logging
from pathlib import Path

from irisfed.cli import main
from irisfed.services.common.log import EventLogger, setup_logging
from irisfed.shared.messages import json_schemas

ROOT = Path(__file__).resolve().parents[2]


def test_committed_schemas_match_the_structs():
    committed = {p.stem: json.loads(p.read_text()) for p in (ROOT / "docs" / "schema").glob("*.json")}
    assert committed == json_schemas(), "docs/schema drifted: run `irisfed schema` and commit"


def test_schema_command_writes_every_message(tmp_path):
    assert main(["schema", "--out", str(tmp_path)]) == 0
    written = {p.stem for p in tmp_path.glob("*.json")}
    assert written == set(json_schemas())
    submit = json.loads((tmp_path / "SubmitRequest.json").read_text())
    assert submit["$defs"]["SubmitRequest"]["required"] == ["command"]


def _capture(as_json: bool) -> tuple[io.StringIO, logging.Handler]:
    setup_logging("debug", as_json=as_json)
    handler = logging.getLogger().handlers[0]
    stream = io.StringIO()
    handler.setStream(stream)
    return stream, handler


def test_json_logs_are_one_object_per_event_with_ids():
    stream, _ = _capture(as_json=True)
    log = EventLogger("router")
    log.info("job_assigned", job_id="j1", peer_id="gpu-west", epoch=3)
    log.debug("noise", job_id="j2")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    event = json.loads(lines[0])
    assert {k: event[k] for k in ("level", "service", "event", "job_id", "peer_id", "epoch")} == {
        "level": "info", "service": "router", "event": "job_assigned", "job_id": "j1",
        "peer_id": "gpu-west", "epoch": 3,
    }
    assert isinstance(event["ts"], float)


def test_terminal_logs_are_key_value_lines():
    stream, _ = _capture(as_json=False)
    EventLogger("tick").warning("job_recovered", job_id="j1", peer_id="p")
    line = stream.getvalue().strip()
    assert "WARNING" in line and "tick: job_recovered job_id=j1 peer_id=p" in line
