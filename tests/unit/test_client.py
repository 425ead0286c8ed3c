"""The Python client's pure parts: job ids, backoff, error mapping, request building,
where the servers come from. (Against real servers: tests/e2e/test_client_e2e.py.)"""

from __future__ import annotations

import json
import re

import msgspec
import pytest

from irisfed.client import (
    Client,
    ConfigurationError,
    ConflictError,
    InternalError,
    InvalidRequestError,
    IrisfedClientError,
    NotFoundError,
    Retry,
    Servers,
    UnavailableError,
    UnknownPeerError,
    error_for,
    new_job_id,
    resolve_servers,
)
from irisfed.connection import answer_or_error as _answer_or_error
from irisfed.jobs import build_submit, checked_submit, constraint_wire
from irisfed.shared.constraints import Constraint, ConstraintOp
from irisfed.shared.errors import ErrorCode, InvalidRequest, Unavailable
from irisfed.shared.messages import (
    JOB_ID_PATTERN,
    CancelReply,
    ConstraintSpec,
    SubmitReply,
    SubmitRequest,
    error_reply,
)

# ---------------------------------------------------------------- job ids


def test_generated_job_ids_are_short_valid_and_sortable_by_time():
    job_id = new_job_id()
    assert len(job_id) == 20 and re.fullmatch(JOB_ID_PATTERN, job_id)
    earlier = [new_job_id(now_ms=ms, random_bits=bits) for ms, bits in ((1_000, 2**55 - 1), (1_001, 0))]
    assert earlier == sorted(earlier)  # a later millisecond sorts later, whatever the random part
    assert new_job_id(now_ms=0, random_bits=0) == "0" * 20


def test_generated_job_ids_do_not_repeat_within_a_millisecond():
    ids = {new_job_id(now_ms=1_700_000_000_000) for _ in range(10_000)}
    assert len(ids) == 10_000


def test_build_submit_makes_one_job_id_and_keeps_a_given_one():
    made = build_submit(["true"])
    assert made.job_id and re.fullmatch(JOB_ID_PATTERN, made.job_id)
    assert build_submit(["true"], job_id="mine-1").job_id == "mine-1"


# ---------------------------------------------------------------- backoff


def test_backoff_doubles_to_its_cap_with_jitter_between_half_and_full():
    retry = Retry(attempts=10, base_s=0.25, cap_s=2.0)
    assert [retry.delay(n, rand=lambda: 1.0) for n in range(1, 6)] == [0.25, 0.5, 1.0, 2.0, 2.0]
    assert [retry.delay(n, rand=lambda: 0.0) for n in range(1, 4)] == [0.125, 0.25, 0.5]
    assert all(0.125 <= retry.delay(1) <= 0.25 for _ in range(200))


def test_retry_needs_at_least_one_attempt():
    with pytest.raises(ValueError):
        Retry(attempts=0)
    with pytest.raises(ValueError):
        Retry(base_s=-1)


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("code, kind", [
    ("invalid_request", InvalidRequestError), ("conflict", ConflictError), ("unknown_peer", UnknownPeerError),
    ("not_found", NotFoundError), ("unavailable", UnavailableError), ("internal", InternalError),
    ("config_error", ConfigurationError),
])
def test_each_documented_code_has_its_exception(code, kind):
    error = error_for(code, "what happened")
    assert type(error) is kind and isinstance(error, IrisfedClientError)
    assert error.code == code and error.code == ErrorCode(code) and error.message == "what happened"
    assert str(error) == f"{code}: what happened"
    assert error.retryable is (code == "unavailable")


def test_a_code_this_client_does_not_know_stays_a_string():
    error = error_for("too_many_cats", "meow")
    assert type(error) is IrisfedClientError and error.code == "too_many_cats" and not error.retryable


def test_router_replies_become_answers_or_exceptions():
    assert isinstance(_answer_or_error(error_reply("conflict", "taken")), ConflictError)
    unavailable = _answer_or_error(error_reply("unavailable", "database down"))
    assert isinstance(unavailable, UnavailableError) and unavailable.retryable
    reply = SubmitReply("j1", "local", "assigned", "home", False, "rule 2")
    assert _answer_or_error(msgspec.json.encode(reply)) == reply
    cancel = CancelReply("j1", "killed", "never_started")
    assert _answer_or_error(msgspec.json.encode(cancel)) == cancel
    assert isinstance(_answer_or_error(b"not json"), InternalError)
    assert isinstance(_answer_or_error(b'{"job_id": 3}'), InternalError)


# ---------------------------------------------------------------- requests


def test_constraints_in_every_accepted_form_become_wire_dicts():
    wire = {"key": "device_type", "op": "eq", "value": "gpu"}
    assert constraint_wire("device_type=gpu") == wire
    assert constraint_wire(Constraint("device_type", ConstraintOp.EQ, "gpu")) == wire
    assert constraint_wire(ConstraintSpec("device_type", ConstraintOp.EQ, "gpu")) == wire
    assert constraint_wire(wire) == wire
    assert constraint_wire("exists:spot") == {"key": "spot", "op": "exists"}
    assert constraint_wire("zone=in:a,b") == {"key": "zone", "op": "in", "value": ["a", "b"]}
    with pytest.raises(InvalidRequestError):
        constraint_wire("memory_gb>lots")
    with pytest.raises(InvalidRequestError):
        constraint_wire(42)


def test_only_what_differs_from_the_defaults_goes_on_the_wire():
    request = build_submit(["python3", "train.py"], job_id="j1", constraints=["device_type=gpu"],
                           resources={"gpu": 2}, max_retries=0, priority=0, labels={"team": "vision"})
    assert json.loads(msgspec.json.encode(request)) == {
        "command": ["python3", "train.py"], "job_id": "j1",
        "constraints": [{"key": "device_type", "op": "eq", "value": "gpu"}],
        "max_retries": 0, "labels": {"team": "vision"}, "resources": {"gpu": 2},
    }


@pytest.mark.parametrize("fields", [
    {"priority": 10**9}, {"resources": {"gpu": 1.5}}, {"resources": {"gpu": -1}}, {"deadline_s": 0},
    {"job_id": "-starts-with-a-dash"}, {"env": {"A": "nul\x00"}}, {"max_retries": -1},
    {"constraints": [{"key": "x", "op": "gt", "value": "abc"}]}, {"constraints": [{"key": "x", "op": "near"}]},
])
def test_invalid_requests_are_refused_before_they_are_sent(fields):
    with pytest.raises(InvalidRequestError):
        build_submit(["true"], **fields)


def test_a_command_given_as_one_string_is_refused_with_the_list_it_meant():
    with pytest.raises(InvalidRequestError, match=r"\['echo', 'hi'\]"):
        build_submit("echo hi")


def test_checked_submit_decodes_a_ready_request_like_the_router():
    request = SubmitRequest(command=["true"], job_id="j2", resources={"cpu": 2})
    assert checked_submit(request) == request
    with pytest.raises(InvalidRequestError):
        checked_submit({"command": ["true"], "cluster-pin": "gpu-west"})  # unknown field


# ---------------------------------------------------------------- where the servers are


def _state(tmp_path, **connect):
    state = tmp_path / ".irisfed"
    state.mkdir()
    (state / "connect.json").write_text(json.dumps(connect))
    return state


def test_arguments_win_then_the_environment_then_connect_json(tmp_path):
    config = tmp_path / "federation.toml"
    config.write_text('subject_prefix = "from-file"\n[[peers]]\nid = "home"\n')
    state = _state(tmp_path, nats_url="nats://file:4222", database_url="postgresql://file/db", config=str(config))

    from_file = resolve_servers(state_dir=state, environ={})
    assert from_file == Servers("nats://file:4222", "postgresql://file/db", "from-file")

    env = {"IRISFED_NATS_URL": "nats://env:4222", "IRISFED_DATABASE_URL": "postgresql://env/db"}
    assert resolve_servers(state_dir=state, environ=env) == Servers("nats://env:4222", "postgresql://env/db",
                                                                     "from-file")
    given = resolve_servers("nats://arg:4222", "postgresql://arg/db", prefix="mine", state_dir=state, environ=env)
    assert given == Servers("nats://arg:4222", "postgresql://arg/db", "mine")


def test_without_any_config_the_prefix_is_irisfed_and_the_database_optional(tmp_path):
    servers = resolve_servers("nats://h:4222", state_dir=tmp_path / "none", environ={})
    assert servers == Servers("nats://h:4222", None, "irisfed")


def test_no_nats_url_anywhere_says_how_to_give_one(tmp_path):
    with pytest.raises(ConfigurationError, match="irisfed env"):
        resolve_servers(state_dir=tmp_path / "none", environ={})


@pytest.mark.parametrize("environ, prefix", [({"IRISFED_CONFIG": "/does/not/exist.toml"}, None), ({}, "a b")])
def test_a_bad_config_or_prefix_is_a_configuration_error(tmp_path, environ, prefix):
    with pytest.raises(ConfigurationError):
        resolve_servers("nats://h:4222", prefix=prefix, state_dir=tmp_path / "none", environ=environ)


def test_servers_never_show_a_password():
    shown = repr(Servers("nats://producer:s3cret@h:4222", "postgresql://u:pw@h/db", "irisfed"))
    assert "s3cret" not in shown and "pw@" not in shown and "producer" in shown


async def test_reads_without_a_database_url_go_through_the_router():
    from irisfed.remote_reads import RemoteReads

    client = Client(None, Servers("nats://user-alice:pw@h:4222", None, "acme", user="alice"))
    reads = await client._get_store()
    assert isinstance(reads, RemoteReads) and reads._subject == "acme.read.store.alice"


def test_errors_raised_inside_irisfed_keep_their_code():
    from irisfed.errors import translated

    assert isinstance(translated(Unavailable("postgres at postgresql://u:pw@h/db is away")), UnavailableError)
    assert "pw" not in translated(Unavailable("postgresql://u:pw@h/db")).message
    assert translated(InvalidRequest("bad")).code == ErrorCode.INVALID_REQUEST


# ---------------------------------------------------------------- ids and database settings, before any I/O

HOSTILE_IDS = ["a\x00b", "x" * 5000, "", "-leading-dash", "has space", "../../etc", "ünïcødé"]


@pytest.mark.parametrize("job_id", HOSTILE_IDS)
async def test_an_id_no_job_can_have_is_refused_before_any_io(job_id):
    """As the router refuses it for a cancel, and without a connection: the client has a
    database URL, so any read that got through would open a socket (the unit guard)."""
    client = Client(None, Servers("nats://h:4222", "postgresql://u:pw@h/db", "irisfed"))
    reads = {"get": client.get(job_id), "wait": client.wait(job_id), "cancel": client.cancel(job_id),
             "watch": anext(client.watch(job_id))}
    for name, read in reads.items():
        with pytest.raises(InvalidRequestError) as refused:
            await read
        message = refused.value.message
        assert message.startswith("not a job id: ") and len(message) < 200, (name, message)
        assert "\x00" not in message and not refused.value.retryable


def test_a_long_id_is_quoted_by_its_first_characters_only():
    from irisfed.reads import checked_job_id
    from irisfed.shared.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match=r"^not a job id: 'x{40}'\.\.\. \(5000 characters\)"):
        checked_job_id("x" * 5000)
    assert checked_job_id("nightly-2024.05_01") == "nightly-2024.05_01"
    assert checked_job_id("y" * 128) == "y" * 128


def test_database_settings_no_retry_can_fix_are_configuration_errors():
    from irisfed.errors import SchemaMismatchError, translated
    from irisfed.shared.errors import DatabaseConfigError, DatabaseSchemaMismatch

    refused = translated(DatabaseConfigError(
        "Postgres at postgresql://web:***@db:5432/irisfed refused the connection: password authentication "
        "failed for user \"web\"", "InvalidPasswordError", "28P01"))
    assert type(refused) is ConfigurationError and not refused.retryable and refused.code == "config_error"
    mismatch = translated(DatabaseSchemaMismatch("the database is not at the schema this irisfed needs "
                                                 "(relation \"jobs\" does not exist); run `irisfed migrate`"))
    assert type(mismatch) is SchemaMismatchError and isinstance(mismatch, ConfigurationError)
    assert mismatch.code == "schema_mismatch" and not mismatch.retryable and "irisfed migrate" in mismatch.message
    assert type(error_for("schema_mismatch", "not migrated")) is SchemaMismatchError


async def test_a_database_url_that_cannot_be_parsed_is_a_configuration_error_without_its_password():
    client = Client(None, Servers("nats://h:4222", "postgresql://u:s3cret@[::1", "irisfed"))
    with pytest.raises(ConfigurationError) as refused:
        await client.get("j1")
    assert "u:***@[::1" in refused.value.message and "s3cret" not in str(refused.value)
    assert not refused.value.retryable
