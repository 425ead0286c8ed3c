"""Job rows as the services hand them to the store: plain frozen values."""

from __future__ import annotations

from dataclasses import dataclass

from shared.lifecycle import JobState


@dataclass(frozen=True, slots=True)
class NewJob:
    """One row for ``job_insert_batch``, built by the router."""

    job_id: str
    spec_json: str  # the canonical JSON of the request without job_id
    spec_hash: str
    state: str
    disposition: str
    pinned_peer_id: str | None
    owner_peer_id: str | None
    backend: str | None
    epoch: int
    max_retries: int
    priority: int
    deadline_s: float | None
    reason: str
    explanation_json: str | None  # shared.explain's stored form, as JSON text
    submit_reply_json: str  # the first reply, returned again to duplicates


@dataclass(frozen=True, slots=True)
class Move:
    """A compare-and-set state change of one job (see ``job_move``)."""

    job_id: str
    from_state: JobState
    to_state: JobState
    epoch: int
    actor: str
    owner_peer_id: str | None
    new_epoch: int | None = None  # default: unchanged
    reason: str = ""
    exit_code: int | None = None
    log_dir: str | None = None
    avoid_peer: str | None = None
