"""Typed rows as the store returns them (``irisfed.shared.records``), for tests of what reads
them (CLI views) with no database: every field defaulted, any overridden."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from irisfed.shared.lifecycle import JobState
from irisfed.shared.records import (
    ChangelogEntry,
    ClaimedJob,
    JobRow,
    JobSummary,
    LostPeerJob,
    OwnedJob,
    PeerHeartbeatRow,
)


def job_row(command: list[str] | None = None, **overrides: Any) -> JobRow:
    """A ``job_get`` row; ``command`` (and the name and labels) live in its spec."""
    now = datetime.now(UTC)
    fields: dict[str, Any] = dict(
        job_id="j1", spec={"command": command or ["true"]}, spec_hash="h", state=JobState.QUEUED,
        disposition="queue", pinned_peer_id=None, owner_peer_id=None, backend=None, epoch=0, attempts=0,
        max_retries=2, priority=0, avoid_peers=[], submitted_at=now, updated_at=now, assigned_at=None,
        started_at=None, finished_at=None, deadline_at=None, exit_code=None, log_dir=None, reason="",
        explanation=None, cancel_requested=False, cancel_requested_at=None)
    fields.update(overrides)
    return JobRow(**fields)


def job_summary(command: list[str] | None = None, **overrides: Any) -> JobSummary:
    """A ``job_list`` row: the same job as :func:`job_row` with the same overrides."""
    job = job_row(command, **{k: v for k, v in overrides.items() if k in JobRow.__struct_fields__})
    fields = {name: job.spec["command"] if name == "command" else getattr(job, name)
              for name in JobSummary.__struct_fields__ if name == "command" or name in JobRow.__struct_fields__}
    fields.update({k: v for k, v in overrides.items() if k in JobSummary.__struct_fields__})
    return JobSummary(**fields)


def changelog_entry(**overrides: Any) -> ChangelogEntry:
    fields: dict[str, Any] = dict(seq=1, from_state=None, to_state=JobState.QUEUED, peer_id=None, epoch=0,
                                  at=datetime.now(UTC), actor="router", detail="")
    fields.update(overrides)
    return ChangelogEntry(**fields)


def peer_heartbeat_row(**overrides: Any) -> PeerHeartbeatRow:
    now = datetime.now(UTC)
    fields: dict[str, Any] = dict(peer_id="home", run_id="r1", seq=1, backends=[], ttl_s=6.0, sent_at=now,
                                  received_at=now, expires_at=now, received_epoch=now.timestamp(), age_s=0.0,
                                  reachable=True)
    fields.update(overrides)
    return PeerHeartbeatRow(**fields)


def claimed_job(**overrides: Any) -> ClaimedJob:
    """A ``job_claim_queued`` row: an unpinned queued job the tick has locked."""
    fields: dict[str, Any] = dict(job_id="j1", epoch=0, pinned_peer_id=None, avoid_peers=None, priority=0,
                                  submitted_at=datetime.now(UTC), constraints_json=None)
    fields.update(overrides)
    return ClaimedJob(**fields)


def owned_job(**overrides: Any) -> OwnedJob:
    """A ``job_list_live_for_owner`` row: a job this agent's peer runs."""
    fields: dict[str, Any] = dict(job_id="j1", state=JobState.RUNNING, epoch=1, backend="main",
                                  cancel_requested=False, priority=0)
    fields.update(overrides)
    return OwnedJob(**fields)


def lost_peer_job(**overrides: Any) -> LostPeerJob:
    """A live job whose owner the tick found lost."""
    fields: dict[str, Any] = dict(job_id="j1", state=JobState.RUNNING, epoch=1, owner_peer_id="gpu-west",
                                  attempts=1, max_retries=2, pinned_peer_id=None)
    fields.update(overrides)
    return LostPeerJob(**fields)
