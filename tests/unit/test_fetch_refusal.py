"""Which peer may be sent a job's workspace (pure: ``fetch_refusal`` on a job row):
only the peer the job is assigned to or running on, under that very epoch, and only
for a job that names a workspace."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from irisfed.services.router.workspaces import fetch_inbox, fetch_refusal
from irisfed.shared.lifecycle import JobState
from irisfed.shared.records import JobRow

NOW = datetime(2026, 12, 6, tzinfo=UTC)
WORKSPACE = {"digest": "sha256:" + "a" * 64, "size": 10}


def row(state: JobState = JobState.ASSIGNED, owner: str | None = "gpu", epoch: int = 3,
        workspace: object = WORKSPACE) -> JobRow:
    spec = {"command": ["true"], **({"workspace": workspace} if workspace is not None else {})}
    return JobRow("alice:j", spec, "h", state, "queue", None, owner, "main", epoch, 0, 0, 0, [], NOW, NOW,
                  None, None, None, None, None, None, "", None, False, None, user_id="alice")


@pytest.mark.parametrize("state", [JobState.ASSIGNED, JobState.RUNNING])
def test_the_owner_under_its_epoch_may(state):
    assert fetch_refusal(row(state), "gpu", 3) is None


@pytest.mark.parametrize(("job", "peer", "epoch"), [
    (row(), "cpu", 3),  # another peer
    (row(), "gpu", 2), (row(), "gpu", 4),  # a stale or a future epoch
    (row(JobState.QUEUED, owner=None), "gpu", 3),
    (row(JobState.SUCCEEDED), "gpu", 3), (row(JobState.KILLED), "gpu", 3),  # its run is over
])
def test_anyone_else_may_not(job, peer, epoch):
    assert fetch_refusal(job, peer, epoch) == f"job alice:j is not assigned to {peer} under epoch {epoch}"


@pytest.mark.parametrize("workspace", [None, {"size": 3}, {"digest": 7}, "sha256:x"])
def test_a_job_without_a_workspace_has_nothing_to_stage(workspace):
    assert fetch_refusal(row(workspace=workspace), "gpu", 3) == "job alice:j has no workspace"
    assert fetch_refusal(None, "gpu", 3) == "no such job"


@pytest.mark.parametrize(("reply", "sent"), [
    ("_INBOX_agent-gpu.AbC123", True), ("_INBOX_agent-gpu.a.b", True),  # the asking agent's own
    ("_INBOX.AbC123", True),  # the default prefix: NATS users off (with them, only the admin reads it)
    ("_INBOX_admin.x", True), ("_INBOX_irisfed.x", True),  # an agent run as a NATS user of the operator's choice
    ("_INBOX_agent-gpu-west.x", False), ("_INBOX_agent-cpu.x", False),  # another peer's agent
    ("_INBOX_user-alice.x", False), ("_INBOX_router.x", False), ("_INBOX_web.x", False), ("_INBOX_tick.x", False),
    ("_INBOX_producer.x", False), ("_INBOX_operator.x", False), ("_INBOX_agent-gpu", False),
    ("_INBOX_agent-gpu.>", False), ("_INBOX_agent-gpu.*", False), ("_INBOX_agent-gpu..x", False),
    ("_INBOX_agent-gpu.a b", False), ("$O.acme-workspaces.C.x", False), ("acme.submit.bob", False), ("", False),
])
def test_the_chunks_go_only_to_the_asking_agents_inbox(reply, sent):
    assert fetch_inbox(reply, "gpu") is sent
