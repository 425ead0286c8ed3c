"""What the router's reads show a user (pure: ``services/router/reads.py``): its own
jobs by the ids it sent, and no other user's job named anywhere in what it reads."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec

from irisfed.services.router.reads import as_users, scoped_job_id
from irisfed.shared.lifecycle import JobState
from irisfed.shared.records import ChangelogEntry
from irisfed.shared.seen import OTHERS_JOB, scrub


def test_a_user_names_only_its_own_jobs():
    assert [scoped_job_id("alice", j) for j in ("x", "alice:x", "bob:x", "default:x", "a:b:c", "", "x" * 200,
                                                "../x", 7, None)] == [
        "alice:x", "alice:x", None, None, None, None, None, None, None, None]
    assert [scoped_job_id("default", j) for j in ("x", "default:x", "alice:x")] == ["x", "x", None]


def test_no_other_users_job_is_named_in_texts_a_user_reads():
    assert scrub("placed; preempted alice:x, train-2, bob:y", "alice") == (
        f"placed; preempted x, {OTHERS_JOB}, {OTHERS_JOB}")
    assert scrub("preempted by bob:z; preempted 1 of at most 1 times", "alice") == (
        f"preempted by {OTHERS_JOB}; preempted 1 of at most 1 times")
    assert scrub("preempted by train-9", "default") == "preempted by train-9"  # its own
    explained = {"rule": "backend b held for bob:q, waiting longer", "peers": [{"detail": "held for alice:w"}]}
    assert scrub(explained, "alice") == {"rule": f"backend b held for {OTHERS_JOB}, waiting longer",
                                         "peers": [{"detail": "held for w"}]}
    entry = ChangelogEntry(3, JobState.RUNNING, JobState.QUEUED, "gpu", 2, datetime.now(UTC), "tick",
                           "preempted by bob:urgent")
    [seen] = as_users([entry], "alice")
    assert seen.detail == f"preempted by {OTHERS_JOB}" and msgspec.structs.replace(seen, detail="") == (
        msgspec.structs.replace(entry, detail=""))
