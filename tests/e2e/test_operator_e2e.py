"""The operator's view: explain, metrics, logs and `irisfed top` on a running federation."""

import json
import urllib.error
import urllib.request

import pytest

from irisfed.tooling.servers import free_port
from tests.infra.waiting import wait_for

pytestmark = pytest.mark.e2e


def explain(federation, job_id):
    result = federation.cli("explain", job_id, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


async def test_explain_covers_reject_wait_and_placement(federation):
    await federation.start_federation("home", "gpu-west")
    rejected = await federation.submit({"command": ["true"], "constraints": [
        {"key": "device_type", "op": "eq", "value": "tpu"},
        {"key": "device_variant", "op": "exists"}]})
    why = explain(federation, rejected["job_id"])["explanation"]
    assert why["by"] == "router" and why["rule"].startswith("rule 4")
    assert {p["peer_id"]: p["code"] for p in why["peers"]} == {
        "home": "value_mismatch", "gpu-west": "value_mismatch", "tpu-east": "unreachable",
        "gpu-east": "unreachable"}

    # A pinned job whose peer is away: the tick explains the wait.
    pinned = await federation.submit({"command": ["true"], "cluster_pin": "tpu-east"})

    async def tick_explained():
        doc = explain(federation, pinned["job_id"])["explanation"]
        return doc if doc and doc["by"] == "tick" else None

    why = await wait_for(tick_explained, "the tick to explain the pinned job")
    assert why["rule"].startswith("pinned to tpu-east")
    assert {p["peer_id"]: p["code"] for p in why["peers"]} == {
        "home": "not_pinned_peer", "gpu-west": "not_pinned_peer", "tpu-east": "unreachable",
        "gpu-east": "not_pinned_peer"}

    # GPU jobs beyond gpu-west's two slots wait with "no free capacity".
    long = [await federation.submit({"command": ["sleep", "300"], "constraints": [
        {"key": "device_type", "op": "eq", "value": "gpu"}]}) for _ in range(3)]

    async def one_full():
        for reply in long:
            doc = explain(federation, reply["job_id"])
            if doc["state"] == "queued" and doc["explanation"]["by"] == "tick":
                return doc
        return None

    why = (await wait_for(one_full, "a GPU job to wait for capacity"))["explanation"]
    assert {p["peer_id"]: p["code"] for p in why["peers"]}["gpu-west"] == "no_free_capacity"
    assert why["rule"].startswith("matching peers are full")

    human = federation.cli("explain", long[0]["job_id"])
    assert human.returncode == 0 and "placed" in human.stdout and "gpu-west" in human.stdout
    for reply in long:
        await federation.cancel(reply["job_id"])
    for reply in long:
        await federation.wait_state(reply["job_id"], "killed")


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def value(text: str, name: str, labels: str = "") -> float | None:
    wanted = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(wanted + " "):
            return float(line.split()[-1])
    return None


async def test_metrics_are_scraped_from_running_services(federation):
    ports = {name: free_port() for name in ("router", "tick", "home")}
    federation.start("router", "--metrics-port", str(ports["router"]))
    federation.start("tick", "--metrics-port", str(ports["tick"]))
    federation.start("home", "--metrics-port", str(ports["home"]))
    await federation.wait_router()
    await federation.wait_agent("home")
    local = await federation.submit({"command": ["true"]})
    await federation.submit({"command": ["true"], "cluster_pin": "gpu-west"})
    await federation.submit({"command": ["true"], "constraints": [{"key": "zone", "op": "gt", "value": "x"}]})
    await federation.wait_state(local["job_id"], "succeeded")

    router = scrape(ports["router"])
    assert value(router, "irisfed_submits_total", 'disposition="local"') == 1.0
    assert value(router, "irisfed_submits_total", 'disposition="queue"') == 1.0
    assert value(router, "irisfed_submit_errors_total", 'code="invalid_request"') == 1.0
    assert value(router, "irisfed_submit_ack_seconds_count") == 2.0
    assert value(router, "irisfed_peer_reachable", 'peer_id="home"') == 1.0
    assert value(router, "irisfed_peer_heartbeat_age_seconds", 'peer_id="home"') is not None

    async def tick_exported():
        # The tick may start after the submits (a cold interpreter in a fresh venv is
        # slow): its port may not answer yet, and its gauge can show the queued job
        # before its first run has ended. Wait for all of it.
        try:
            text = scrape(ports["tick"])
        except urllib.error.URLError:
            return None
        depth = value(text, "irisfed_queue_depth", 'constraints="[]",pinned_peer="gpu-west"')
        runs = value(text, "irisfed_tick_duration_seconds_count") or 0
        return text if depth == 1.0 and runs >= 1 else None

    await wait_for(tick_exported, "the tick's queue depth gauge and a finished tick run")
    agent = scrape(ports["home"])
    assert value(agent, "irisfed_jobs_finished_total", 'state="succeeded"') == 1.0
    assert "# TYPE irisfed_fenced_writes_total counter" in agent


async def test_service_logs_are_json_lines_without_secrets(federation):
    # The database URL carries a password (ignored by the trust-auth test server): it
    # must never reach a log line.
    secret = "s3cret-pw-do-not-log"
    federation.database_url = federation.database_url.replace("postgres@", f"postgres:{secret}@")
    await federation.start_federation("home")
    reply = await federation.submit({"command": ["true"]})
    await federation.wait_state(reply["job_id"], "succeeded")
    federation.close()
    for name in ("router", "home"):
        text = federation.log(name)
        assert secret not in text
        events = [json.loads(line) for line in text.splitlines() if line.strip()]
        assert events and all({"ts", "level", "service", "event"} <= set(e) for e in events)
    agent_events = [json.loads(line) for line in federation.log("home").splitlines()]
    finished = [e for e in agent_events if e["event"] == "job_finished"]
    assert finished[0]["job_id"] == reply["job_id"] and finished[0]["peer_id"] == "home"
    assert finished[0]["epoch"] == 1


async def test_top_renders_peers_and_job_counts(federation):
    await federation.start_federation("home", "gpu-west")
    reply = await federation.submit({"command": ["true"]})
    await federation.wait_state(reply["job_id"], "succeeded")
    result = federation.cli("top", "--once")
    assert result.returncode == 0, result.stderr
    for text in ("irisfed top", "home", "gpu-west", "tpu-east", "succeeded=1", "queued=0"):
        assert text in result.stdout
