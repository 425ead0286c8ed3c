import pytest
from hypothesis import given
from hypothesis import strategies as st

from irisfed.shared.constraints import Constraint, ConstraintError, ConstraintOp, matches_all

GPU = {"device_type": ["gpu"], "device_variant": ["h100", "a100"], "memory_gb": ["80"], "zone": [" US-West-1a "]}

C = Constraint
OP = ConstraintOp


@pytest.mark.parametrize(
    ("constraint", "expected"),
    [
        (C("device_type", OP.EQ, "gpu"), True),
        (C("device_type", OP.EQ, "  GPU "), True),  # trimmed, case-insensitive
        (C("device_type", OP.EQ, "tpu"), False),
        (C("zone", OP.EQ, "us-west-1A"), True),
        (C("memory_gb", OP.EQ, 80), True),  # numeric equality across types
        (C("memory_gb", OP.EQ, "80.0"), True),
        (C("device_type", OP.NE, "tpu"), True),
        (C("device_type", OP.NE, "GPU"), False),
        (C("device_variant", OP.NE, "h100"), True),  # some advertised value (a100) differs
        (C("device_type", OP.EXISTS), True),
        (C("region", OP.EXISTS), False),
        (C("region", OP.NOT_EXISTS), True),
        (C("device_type", OP.NOT_EXISTS), False),
        (C("memory_gb", OP.GT, 40), True),
        (C("memory_gb", OP.GT, 80), False),
        (C("memory_gb", OP.GE, 80), True),
        (C("memory_gb", OP.GE, "81"), False),
        (C("memory_gb", OP.LT, 100), True),
        (C("memory_gb", OP.LT, 80), False),
        (C("memory_gb", OP.LE, 80), True),
        (C("memory_gb", OP.LE, 79.5), False),
        (C("device_variant", OP.IN, ["H100", "b200"]), True),
        (C("device_variant", OP.IN, ["v100"]), False),
        (C("device_type", OP.GT, 1), False),  # non-numeric advertised values never satisfy GT
    ],
)
def test_each_op_positive_and_negative(constraint, expected):
    assert constraint.holds_for(GPU) is expected


@pytest.mark.parametrize("op", [o for o in ConstraintOp if o is not OP.NOT_EXISTS])
def test_missing_key_fails_every_op_but_not_exists(op):
    value = {OP.EXISTS: None, OP.IN: ["x"]}.get(op, 1 if op in (OP.GT, OP.GE, OP.LT, OP.LE) else "x")
    constraint = C("absent", op, value)
    mismatch = constraint.mismatch(GPU)
    assert mismatch is not None and mismatch.code == "missing_attribute"
    assert "absent" in mismatch.detail


def test_key_lookup_is_case_insensitive():
    assert C("Device_Type", OP.EQ, "gpu").holds_for(GPU)


@pytest.mark.parametrize(
    ("key", "op", "value", "message"),
    [
        ("memory_gb", "gt", "lots", "numeric"),
        ("memory_gb", "le", None, "numeric"),
        ("memory_gb", "ge", [1], "numeric"),
        ("memory_gb", "lt", True, "numeric"),
        ("zone", "in", "a,b", "list"),
        ("zone", "in", [], "list"),
        ("zone", "in", [["nested"]], "string or a number"),
        ("zone", "exists", "x", "takes no value"),
        ("zone", "not_exists", 1, "takes no value"),
        ("zone", "eq", None, "string or number"),
        ("zone", "ne", ["a"], "string or number"),
        ("zone", "like", "a", "unknown constraint op"),
        ("", "eq", "a", "non-empty"),
        ("   ", "eq", "a", "non-empty"),
        ("k" * 200, "eq", "a", "longer than"),
    ],
)
def test_bad_constraints_are_errors_not_false(key, op, value, message):
    with pytest.raises(ConstraintError, match=message):
        C(key, op, value)


def test_op_accepts_wire_string():
    assert C("zone", "in", ["a"]).op is OP.IN


def test_matches_all_requires_every_constraint():
    ok = C("device_type", OP.EQ, "gpu")
    bad = C("device_variant", OP.EQ, "v100")
    assert matches_all([ok], GPU)
    assert not matches_all([ok, bad], GPU)
    assert matches_all([], {})


def test_value_mismatch_says_what_was_advertised():
    mismatch = C("device_variant", OP.EQ, "v100").mismatch(GPU)
    assert mismatch.code == "value_mismatch"
    assert "h100" in mismatch.detail and "v100" in mismatch.detail


@given(st.floats(allow_nan=False, allow_infinity=False), st.floats(allow_nan=False, allow_infinity=False))
def test_numeric_ops_agree_with_python(advertised, limit):
    attrs = {"x": [repr(advertised)]}
    assert C("x", OP.GT, limit).holds_for(attrs) is (advertised > limit)
    assert C("x", OP.GE, limit).holds_for(attrs) is (advertised >= limit)
    assert C("x", OP.LT, limit).holds_for(attrs) is (advertised < limit)
    assert C("x", OP.LE, limit).holds_for(attrs) is (advertised <= limit)


def test_to_wire_roundtrip():
    for c in [C("a", OP.IN, ["x", 2]), C("a", OP.EXISTS), C("a", OP.GE, 3)]:
        body = c.to_wire()
        assert C(body["key"], body["op"], body.get("value")) == c
