"""Validation errors as a person reads them: one plain sentence naming the field and
what is allowed, instead of a decoder's internals (types, regular expressions,
``$.path``s). Pure: ``plain(message)`` rewrites what msgspec says about a request
(``shared.messages.decode_request`` applies it to every request a user can send);
a message it does not know is kept, cleaned of the ``- at `$...``` suffix only.
"""

from __future__ import annotations

import re

from irisfed.shared.bands import BANDS
from irisfed.shared.constraints import ConstraintOp

# A string field's pattern → what it allows, in words.
_PATTERN_RULES = {
    "^[A-Za-z0-9][A-Za-z0-9._-]{0,127}": "1 to 128 letters, digits, '.', '_' or '-', the first a letter or digit",
    "^(?:[a-z][a-z0-9_-]{0,31}:)?[A-Za-z0-9][A-Za-z0-9._-]{0,127}":
        "a job id ([USER:]ID: ID 1 to 128 letters, digits, '.', '_' or '-', the first a letter or digit)",
    "^[a-z][a-z0-9_-]{0,31}": "a lower-case letter, then up to 31 lower-case letters, digits, '_' or '-'",
    "^sha256:[0-9a-f]{64}": "'sha256:' and 64 lower-case hex digits",
}


def _one_of(values) -> str:
    values = [str(v) for v in values]
    return ", ".join(values[:-1]) + f" or {values[-1]}" if len(values) > 1 else values[0]


# A field with a fixed set of values → the values.
_CHOICES = {
    "band": _one_of(BANDS),
    "op": _one_of(op.value for op in ConstraintOp),
    "stream": "stdout or stderr",
    "when": "ok, any or failed",
    "method": "a read the router answers (job_get, job_list, ...)",
}
_TYPES = {"int": "a whole number", "float": "a number", "str": "text",
          "bool": "true or false", "array": "a list", "object": "an object ({...})", "null": "null"}
_AT = re.compile(r"\s*- at (?P<key>`key` in )?`\$(?P<path>[^`]*)`$")
_INDEX = re.compile(r"\[(?:\d+|\.\.\.)\]")


def _field(path: str) -> str:
    """``.constraints[0].op`` → ``constraints[0].op``; ``.env[...]`` → ``each entry of env``."""
    path = path.lstrip(".")
    if path.endswith("[...]"):
        return f"each entry of {path[:-5] or 'the request'}"
    return path or "the request"


def _number(text: str) -> str:
    value = float(text)
    return f"{int(value):,}" if value.is_integer() else f"{value:g}"


def plain(message: str) -> str:
    """One plain sentence for a decoder's ``message`` (see the module docstring)."""
    at = _AT.search(message)
    path = at.group("path") if at else ""
    body = message[:at.start()] if at else message
    name = f"each key of {_field(path)}" if at and at.group("key") else _field(path)
    last = _INDEX.sub("", path.rsplit(".", 1)[-1])
    if m := re.fullmatch(r"Expected `str` matching regex '(.*)'", body):
        rule = next((words for start, words in _PATTERN_RULES.items() if m.group(1).startswith(start)), None)
        return f"{name} must be {rule}" if rule else f"{name} has characters that are not allowed"
    if m := re.fullmatch(r"Expected `(int|float)` (<=|>=|<|>) (\S+)", body):
        words = {"<=": "at most", ">=": "at least", "<": "less than", ">": "more than"}[m.group(2)]
        return f"{name} must be {words} {_number(m.group(3))}"
    if m := re.fullmatch(r"Expected `(str|array|object)` of length (<=|>=) (\d+)", body):
        count = int(m.group(3))
        kind = {"str": "character", "array": "item", "object": "entr"}[m.group(1)]
        kind += ("y" if count == 1 else "ies") if kind == "entr" else ("" if count == 1 else "s")
        words = "at most" if m.group(2) == "<=" else "at least"
        return f"{name} must have {words} {count:,} {kind}"
    if m := re.fullmatch(r"Expected `([^`]+)`, got `([^`]+)`", body):
        kinds = [_TYPES.get(kind.strip(), kind.strip()) for kind in m.group(1).split("|")]
        if "a number" in kinds:  # int | float: any number
            kinds = [kind for kind in kinds if kind != "a whole number"]
        want, got = (kinds[0] if len(kinds) == 1 else _one_of(dict.fromkeys(kinds))), _TYPES.get(m.group(2), m.group(2))
        if not path and m.group(1) == "object":
            return f"the request must be a JSON object, not {got}"
        return f"{name} must be {want}, not {got}"
    if m := re.fullmatch(r"Invalid enum value '(.*)'", body):
        allowed = _CHOICES.get(last)
        return f"{name} must be {allowed}, not {m.group(1)!r}" if allowed else f"{name}: {m.group(1)!r} is not allowed"
    if m := re.fullmatch(r"Object contains unknown field `([^`]+)`", body):
        where = f" in {name}" if path else ""
        return f"unknown field {m.group(1)!r}{where}: this request has no such field"
    if m := re.fullmatch(r"Object missing required field `([^`]+)`", body):
        return f"{(name + '.') if path else ''}{m.group(1)} is required"
    if body == "Number out of range":
        return f"{name} is a number out of range"
    if body in ("Input data was truncated",) or body.startswith("JSON is malformed"):
        return f"the body is not valid JSON: {body.replace('JSON is malformed: ', 'malformed, ')[:200]}"
    return body if not path else f"{name}: {body}"
