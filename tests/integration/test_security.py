"""Least privilege on NATS: each role may touch only its own subjects."""

import json

import nats
import pytest

from irisfed.cli import main
from irisfed.services.common.nats_auth import object_store_rights, role_permissions
from tests.infra.secured_nats import connected, until


async def test_a_peer_cannot_pose_as_another_or_read_its_assignments(secured_nats):
    heard, stolen, delivered, killed = [], [], [], []

    async def on_heartbeat(msg):
        heard.append(msg.subject)

    async def on_stolen(msg):
        stolen.append(msg.data)

    async def on_delivered(msg):
        delivered.append(msg.data)

    async def on_kill(msg):
        killed.append(msg.data)

    async with connected(secured_nats, "router", "tick", "agent-gpu-west", "agent-tpu-east") as (
            errors, router, tick, spy, victim):
        await router.subscribe("irisfed.heartbeat.*", cb=on_heartbeat)
        await victim.subscribe("irisfed.assign.tpu-east", cb=on_delivered)
        await victim.subscribe("irisfed.cancel.tpu-east", cb=on_kill)
        await spy.subscribe("irisfed.assign.tpu-east", cb=on_stolen)
        await router.flush()
        await victim.flush()
        await spy.publish("irisfed.heartbeat.tpu-east", b"spoofed")
        await spy.publish("irisfed.heartbeat.gpu-west", b"genuine")
        await spy.flush()
        await tick.publish("irisfed.assign.tpu-east", b"job-1")
        await tick.publish("irisfed.cancel.tpu-east", b"preempted-1")  # the tick's preemption kill
        await tick.flush()
        await until(lambda: delivered and killed and heard and len(errors) >= 2,
                    what=lambda: {"delivered": delivered, "killed": killed, "heard": heard, "errors": errors})
        assert heard == ["irisfed.heartbeat.gpu-west"]  # the spoofed heartbeat never arrived
        assert delivered == [b"job-1"] and stolen == []
        assert killed == [b"preempted-1"]
        assert any('publish to "irisfed.heartbeat.tpu-east"' in e for e in errors)
        assert any('subscription to "irisfed.assign.tpu-east"' in e for e in errors)


async def test_producers_can_only_ask(secured_nats):
    async with connected(secured_nats, "producer") as (errors, producer):
        await producer.publish("irisfed.assign.gpu-west", b"forged")
        await producer.subscribe("irisfed.events.*")
        await producer.flush()
        await until(lambda: len(errors) >= 2, what=lambda: errors)
        assert any("publish" in e for e in errors) and any("subscription" in e for e in errors)


async def test_the_web_user_reads_events_and_may_only_ask_for_a_cancel(secured_nats):
    async with connected(secured_nats, "web") as (errors, web):
        await web.subscribe("irisfed.events.*")
        await web.subscribe("irisfed.heartbeat.*")
        await web.publish("irisfed.operator.cancel", b"{}")  # allowed: what an operator's cancel sends
        await web.flush()
        for forged in ("irisfed.submit", "irisfed.assign.gpu-west", "irisfed.events.job-1",
                       "irisfed.heartbeat.gpu-west", "irisfed.cancel.gpu-west", "irisfed.cancel"):
            await web.publish(forged, b"forged")
        await web.subscribe("irisfed.assign.*")
        await web.flush()
        await until(lambda: len(errors) >= 7, what=lambda: errors)
        assert not any('"irisfed.operator.cancel"' in e or "events.*" in e or "heartbeat.*" in e for e in errors), errors
        assert any('publish to "irisfed.cancel"' in e for e in errors)
        assert any('subscription to "irisfed.assign.*"' in e for e in errors)


async def test_wrong_password_is_refused(secured_nats):
    auth, server = secured_nats
    with pytest.raises(Exception, match="Authorization"):
        await nats.connect(server.url.replace("nats://", "nats://router:wrong@"),
                           allow_reconnect=False, connect_timeout=3)


def test_permissions_table_per_role():
    roles = role_permissions("acme", ["gpu", "cpu"], ["alice"])
    agent_objects = object_store_rights("acme", ("default", "alice"), write=("outputs",), peers=("gpu",))
    agent_logs = ("$JS.API.DIRECT.GET.acme-logs__gpu", "$JS.API.DIRECT.GET.acme-logs__gpu.>",
                  "$JS.API.STREAM.PURGE.acme-logs__gpu", "acme.logs.gpu.>")  # its own peer's log stream only
    assert roles["agent-gpu"].publish == ("acme.heartbeat.gpu", "acme.events.*", "acme.uevents.>", "acme.fetch.gpu",
                                          *agent_objects, *agent_logs)
    assert roles["agent-gpu"].subscribe == ("acme.assign.gpu", "acme.cancel.gpu", "_INBOX_agent-gpu.>")
    # An agent's buckets are its own peer's outputs: no workspace, no other peer's.
    assert all("-outputs" in r and r.endswith(("__gpu", "__gpu.>")) for r in agent_objects if "acme-" in r)
    producer_objects = (*object_store_rights("acme", ("default",), read=("workspaces",), write=("workspaces",)),
                        *object_store_rights("acme", ("default",), read=("outputs",), peers=("gpu", "cpu")))
    assert roles["producer"].publish == ("acme.submit", "acme.cancel", "acme.read.*",
                                         *tuple(dict.fromkeys(producer_objects)))
    assert roles["router"].allow_responses and not roles["producer"].allow_responses
    # Object store rights name buckets' streams and nothing else of JetStream; a user's
    # are its own buckets', and it never writes outputs.
    assert not any(r.startswith(("$JS.API.STREAM.CREATE", "$JS.API.STREAM.DELETE", "$JS.API.STREAM.UPDATE"))
                   for role in roles.values() for r in role.publish)
    assert not any(r.startswith(("$JS", "$O")) for r in roles["tick"].publish)
    # The dashboard reads outputs (an operator's download) and nothing else of the store;
    # no role makes a consumer (one delivers to any subject its creator names).
    web_objects = object_store_rights("acme", ("default", "alice"), read=("outputs",), peers=("gpu", "cpu"))
    web_logs = ("$JS.API.DIRECT.GET.acme-logs__gpu", "$JS.API.DIRECT.GET.acme-logs__gpu.>",
                "$JS.API.DIRECT.GET.acme-logs__cpu", "$JS.API.DIRECT.GET.acme-logs__cpu.>")
    assert roles["web"].publish == ("acme.operator.cancel", "acme.operator.read.*", *web_objects, *web_logs)
    assert not any(r.startswith("$O.") or "workspaces" in r for r in web_objects)
    assert not any("CONSUMER" in r or r.startswith("$JS.FC") for role in roles.values() if role is not roles["admin"]
                   for r in role.publish)
    alice_objects = [r for r in roles["user-alice"].publish if r.startswith(("$JS.API.STREAM.INFO", "$O."))]
    assert alice_objects == ["$JS.API.STREAM.INFO.OBJ_acme-workspaces-alice", "$O.acme-workspaces-alice.>",
                             "$JS.API.STREAM.INFO.OBJ_acme-outputs-alice__gpu",
                             "$JS.API.STREAM.INFO.OBJ_acme-outputs-alice__cpu"]
    # The router writes no object at all; it sends workspaces on only to agents' inboxes.
    assert not any(r.startswith(("$O.", "$JS.API.STREAM.PURGE")) for r in roles["router"].publish)
    assert {"_INBOX_agent-gpu.>", "_INBOX_agent-cpu.>"} <= set(roles["router"].publish)
    assert "acme.fetch.*" in roles["router"].subscribe
    # A user may ask only for itself, and read only its own replies and its own jobs'
    # events: no log stream, its jobs only through the router's reads.
    assert roles["user-alice"].publish[:3] == ("acme.submit.alice", "acme.cancel.alice", "acme.read.*.alice")
    assert not any("logs" in r or "events" in r for r in roles["user-alice"].publish)
    assert {"acme.read.>", "acme.operator.read.*"} <= set(roles["router"].subscribe)
    assert roles["user-alice"].subscribe == ("acme.uevents.alice.>", "_INBOX_user-alice.>")
    assert roles["producer"].subscribe == ("acme.uevents.default.>", "_INBOX_producer.>")
    assert not roles["user-alice"].allow_responses
    assert {"acme.submit.*", "acme.cancel.*", "acme.operator.cancel"} <= set(roles["router"].subscribe)
    assert "acme.operator.cancel" in roles["operator"].publish
    assert not any("operator" in p for role in ("producer", "user-alice") for p in roles[role].publish)


def test_nats_auth_keeps_existing_passwords_and_adds_users(tmp_path):
    config = tmp_path / "f.toml"
    config.write_text('local_cluster = "a"\n[[peers]]\nid = "a"\n')
    out = tmp_path / "out"
    assert main(["nats-auth", "--config", str(config), "--out", str(out)]) == 0
    before = json.loads((out / "nats-credentials.json").read_text())
    config.write_text(config.read_text() + '[[users]]\nid = "alice"\nquota = { gpu = 2 }\n')
    assert main(["nats-auth", "--config", str(config), "--out", str(out)]) == 0
    after = json.loads((out / "nats-credentials.json").read_text())
    assert {k: after[k] for k in before} == before  # nobody else's credentials changed
    assert set(after) - set(before) == {"user-alice"} and after["user-alice"]
    assert '"acme' not in (out / "nats-auth.conf").read_text()
    assert '"irisfed.submit.alice"' in (out / "nats-auth.conf").read_text()


def test_nats_auth_command_writes_private_files(tmp_path):
    config = tmp_path / "f.toml"
    config.write_text('local_cluster = "a"\n[[peers]]\nid = "a"\n')
    assert main(["nats-auth", "--config", str(config), "--out", str(tmp_path / "out")]) == 0
    creds = tmp_path / "out" / "nats-credentials.json"
    assert oct(creds.stat().st_mode & 0o777) == "0o600"
    assert "agent-a" in creds.read_text()
    assert "authorization" in (tmp_path / "out" / "nats-auth.conf").read_text()
