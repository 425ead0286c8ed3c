"""Users (shared/users.py): configuration, scoped ids, quota and dominant share."""

import re

import pytest

from irisfed.shared.config import parse_config
from irisfed.shared.errors import ConfigError
from irisfed.shared.messages import JOB_ID_PATTERN
from irisfed.shared.resources import Resources
from irisfed.shared.subjects import Subjects
from irisfed.shared.users import (
    DEFAULT_USER,
    STORED_JOB_ID_PATTERN,
    UserConfig,
    UserTable,
    dominant_share,
    over_whole_quota,
    parse_users,
    quota_wait,
    split_job_id,
    stored_job_id,
    user_job_id,
)

PEERS = [{"id": "home"}, {"id": "gpu-west"}]


def config(*users):
    return parse_config({"peers": PEERS, "users": list(users)})


def test_users_parse_with_defaults():
    cfg = config({"id": "alice", "quota": {"gpu": 16, "cpu": 2.5}}, {"id": "bob", "weight": 3, "max_band": "batch"})
    alice, bob = cfg.users
    assert alice == UserConfig("alice", "interactive", 1.0, {"cpu": 2.5, "gpu": 16})
    assert (bob.weight, bob.max_band, bob.quota) == (3.0, "batch", {})
    assert cfg.user_ids == ("alice", "bob")
    assert cfg.user_table.with_quota() == {"alice"}


def test_no_users_is_the_single_team_federation():
    cfg = parse_config({"peers": PEERS})
    assert cfg.users == ()
    table = cfg.user_table
    assert table.knows(DEFAULT_USER) and not table.knows("alice")
    assert table.get(DEFAULT_USER) == UserConfig(DEFAULT_USER)


@pytest.mark.parametrize(("entry", "message"), [
    ({"id": "Alice"}, "invalid"),                      # not a lower-case subject token
    ({"id": "al.ice"}, "invalid"),                     # a dot splits a NATS subject
    ({"id": "al*"}, "invalid"),
    ({"id": ">"}, "invalid"),
    ({"id": "a" * 33}, "invalid"),
    ({"id": "alice\n"}, "invalid"),
    ({"id": ""}, "invalid"),
    ({"id": 7}, "invalid"),
    ({}, "invalid"),
    ({"id": "gpu-west"}, "a peer has the same id"),    # P.cancel.gpu-west is that peer's notices
    ({"id": "alice", "weight": 0}, "weight"),
    ({"id": "alice", "weight": -1}, "weight"),
    ({"id": "alice", "weight": float("inf")}, "weight"),
    ({"id": "alice", "weight": True}, "weight"),
    ({"id": "alice", "max_band": "urgent"}, "max_band"),
    ({"id": "alice", "quota": {"gpu": -1}}, "must not be negative"),
    ({"id": "alice", "quota": {"gpu": 1.5}}, "whole number"),
    ({"id": "alice", "quota": {"GPU": 1}}, "not a valid resource name"),
    ({"id": "alice", "quota": {"slots": 1.5}}, "slots"),
    ({"id": "alice", "quota": 4}, "quota must be a table"),
    ({"id": "alice", "team": "x"}, "unknown keys in [[users]] alice: team"),
])
def test_bad_users_are_refused_naming_the_problem(entry, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        config(entry)


def test_a_user_configured_twice_is_refused():
    with pytest.raises(ConfigError, match="users configured twice: alice"):
        config({"id": "alice"}, {"id": "alice"})


def test_users_must_be_a_list_of_tables():
    with pytest.raises(ConfigError, match="list"):
        parse_users({"id": "alice"})
    with pytest.raises(ConfigError, match="table"):
        parse_users(["alice"])


def test_default_may_be_configured_for_its_weight_and_quota():
    cfg = config({"id": "default", "quota": {"slots": 4}})
    assert cfg.user_table.get(DEFAULT_USER).quota == {"slots": 4}


def test_stored_ids_name_one_user_and_id():
    assert stored_job_id(DEFAULT_USER, "train-1") == "train-1"
    assert stored_job_id("alice", "train-1") == "alice:train-1"
    assert split_job_id("alice:train-1") == ("alice", "train-1")
    assert split_job_id("train-1") == (DEFAULT_USER, "train-1")
    assert user_job_id("bob:x.y_z-1") == "x.y_z-1"
    # Two users' same id never meet, nor does a default id meet a user's.
    assert len({stored_job_id(u, "a") for u in (DEFAULT_USER, "alice", "bob")}) == 3


def test_a_user_sent_id_can_never_look_like_a_stored_one():
    assert not re.match(JOB_ID_PATTERN, "alice:train-1")
    for stored in ("alice:train-1", "train-1", "a-b_c:x"):
        assert re.match(STORED_JOB_ID_PATTERN, stored)
    for bad in ("Alice:x", "alice:", ":x", "alice:x:y", "alice:x\n", "a" * 33 + ":x"):
        assert not re.match(STORED_JOB_ID_PATTERN, bad)


def test_subjects_name_their_user():
    subjects = Subjects("irisfed")
    assert subjects.submit_for(DEFAULT_USER) == "irisfed.submit"
    assert subjects.submit_for("alice") == "irisfed.submit.alice"
    assert subjects.cancel_for("alice") == "irisfed.cancel.alice"
    assert subjects.user_of("irisfed.submit", subjects.submit) == DEFAULT_USER
    assert subjects.user_of("irisfed.submit.alice", subjects.submit) == "alice"
    assert subjects.user_of("irisfed.submitx.alice", subjects.submit) is None
    assert subjects.user_of("irisfed.submit.a.b", subjects.submit) is None
    assert subjects.operator_cancel == "irisfed.operator.cancel"


GPU2 = UserConfig("alice", quota={"gpu": 2, "cpu": 1.5})


def units(**amounts):
    return Resources(amounts).units


def test_quota_waits_name_the_user_the_resource_and_what_it_holds():
    assert quota_wait(GPU2, {}, units(gpu=1, cpu=0.5)) is None
    assert quota_wait(GPU2, {"gpu": 1, "cpu": 500}, units(gpu=1, cpu=0.5)) is None
    why = quota_wait(GPU2, {"gpu": 2, "cpu": 0}, units(gpu=1, cpu=0))
    assert why == "quota: this job's 1 gpu would take alice over its quota of 2 gpu"
    # The words do not change with what the user holds (a stored reason is not rewritten).
    assert quota_wait(GPU2, {"gpu": 1, "cpu": 0}, units(gpu=2, cpu=0)) == (
        "quota: this job's 2 gpu would take alice over its quota of 2 gpu")
    # cpu in millicores inside, in cores in words.
    assert quota_wait(GPU2, {"cpu": 1500}, units(cpu=0.5)) == (
        "quota: this job's 0.5 cpu would take alice over its quota of 1.5 cpu")
    # A resource the quota does not name is not capped.
    assert quota_wait(GPU2, {"tpu": 10**6}, units(tpu=8, cpu=0)) is None
    assert quota_wait(UserConfig("bob"), {"gpu": 10**6}, units(gpu=8)) is None


def test_a_slots_quota_caps_how_many_jobs_are_live():
    user = UserConfig("alice", quota={"slots": 2})
    assert quota_wait(user, {"slots": 1}, units()) is None
    assert quota_wait(user, {"slots": 2}, units()) == "quota: this job's 1 slots would take alice over its quota of 2 slots"


def test_a_job_larger_than_the_whole_quota_is_named():
    assert over_whole_quota(GPU2, units(gpu=2)) is None
    assert over_whole_quota(GPU2, units(gpu=3)) == "quota: the job asks 3 gpu; user alice's quota allows 2 in all"
    assert over_whole_quota(UserConfig("alice", quota={"slots": 0}), units()) is not None
    assert over_whole_quota(UserConfig("bob"), units(gpu=10**6)) is None


def test_dominant_share_is_the_largest_fraction_over_the_weight():
    totals = {"gpu": 8, "cpu": 64_000, "slots": 16}
    assert dominant_share({}, totals, 1.0) == 0.0
    assert dominant_share({"gpu": 2, "cpu": 4000, "slots": 2}, totals, 1.0) == 0.25
    assert dominant_share({"gpu": 2, "cpu": 4000, "slots": 2}, totals, 2.0) == 0.125
    assert dominant_share({"fpga": 3}, totals, 1.0) == 0.0  # nothing advertised: no share of it


def test_user_table_knows_configured_users_and_default():
    table = UserTable.of([UserConfig("alice", quota={"gpu": 1})])
    assert table.knows("alice") and table.knows(DEFAULT_USER) and not table.knows("mallory")
    assert table.get("gone").weight == 1.0 and table.get("gone").quota == {}
