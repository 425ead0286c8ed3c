"""Errors a user can cause read as one plain sentence naming the field or flag and what
is allowed: no regular expressions, no ``$.path``, no usage dump (docs/design.md §3.7,
"the first hour")."""

from __future__ import annotations

import json

import pytest

from irisfed.cli.parser import build_parser
from irisfed.shared.errors import InvalidRequest
from irisfed.shared.messages import SubmitRequest, decode_request
from irisfed.shared.plain import plain


@pytest.mark.parametrize(("fields", "sentence"), [
    ({"job_id": "my job"}, "job_id must be 1 to 128 letters, digits, '.', '_' or '-', the first a letter or digit"),
    ({"priority": 99999999999999999999}, "priority must be at most 1,000,000"),
    ({"band": "urgent"}, "band must be batch, interactive or production, not 'urgent'"),
    ({"workspace": {"digest": "md5:x", "size": 1}}, "workspace.digest must be 'sha256:' and 64 lower-case hex digits"),
    ({"cluster_pin": "x" * 65}, "cluster_pin must have at most 64 characters"),
    ({"replicas": 0}, "replicas must be at least 1"),
    ({"user_id": "bob"}, "unknown field 'user_id': this request has no such field"),
])
def test_a_bad_submit_is_one_plain_sentence(fields, sentence):
    with pytest.raises(InvalidRequest) as refused:
        decode_request(SubmitRequest, json.dumps({"command": ["true"], **fields}).encode())
    assert refused.value.message == sentence
    assert "$." not in sentence and "Expected" not in sentence and "regex" not in sentence


def test_messages_it_does_not_know_lose_only_their_path():
    assert plain("something new - at `$.x.y`") == "x.y: something new"
    assert plain("command[0] (the program) must not be empty") == "command[0] (the program) must not be empty"


@pytest.mark.parametrize("argv", [["submit", "--band", "urgent", "--", "true"], ["submit", "--priority", "x"],
                                  ["logs"], ["jobs", "--limit", "many"]])
def test_a_flag_given_wrongly_is_one_line_not_the_usage(argv, capsys):
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1 and "usage:" not in err
    assert err.startswith(f"irisfed {argv[0]}: ") and "--help" in err
