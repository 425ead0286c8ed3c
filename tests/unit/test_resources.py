import json
import math

import pytest

from irisfed.shared.errors import InvalidRequest
from irisfed.shared.messages import SubmitRequest, decode_request
from irisfed.shared.resources import (
    DEFAULT_RESOURCES,
    MAX_AMOUNT,
    MAX_RESOURCES,
    Amount,
    ResourceError,
    Resources,
    as_resources,
    describe_shortfalls,
    fmt_amount,
    normalize_request,
    offer_units,
    parse_offer,
    resources_from_json,
    shortfalls,
)


def submit(**fields) -> bytes:
    return json.dumps({"command": ["true"], **fields}).encode()


def test_absent_empty_and_explicit_default_are_one_cpu():
    for body in (submit(), submit(resources={}), submit(resources={"cpu": 1}), submit(resources={"cpu": 1.0})):
        req = decode_request(SubmitRequest, body)
        assert req.resource_request() == DEFAULT_RESOURCES
        assert req.resource_request().as_dict() == {"cpu": 1}


def test_well_known_and_extended_resources_decode():
    req = decode_request(SubmitRequest, submit(resources={"cpu": 0.5, "memory_mb": 2048, "gpu": 2, "tpu": 4,
                                                          "fpga.xilinx-u250": 1, "licence_matlab": 0}))
    res = req.resource_request()
    assert res.as_dict() == {"cpu": 0.5, "fpga.xilinx-u250": 1, "gpu": 2, "memory_mb": 2048, "tpu": 4}
    # Integer units inside: cpu in millicores; zero amounts left out.
    assert res.units == (("cpu", 500), ("fpga.xilinx-u250", 1), ("gpu", 2), ("memory_mb", 2048), ("tpu", 4))
    assert res.describe() == "cpu=0.5, fpga.xilinx-u250=1, gpu=2, memory_mb=2048, tpu=4"


def test_other_resources_keep_the_default_cpu_unless_it_is_zeroed():
    assert Resources({"gpu": 1}).as_dict() == {"cpu": 1, "gpu": 1}
    assert Resources({"cpu": 0, "gpu": 1}).units == (("gpu", 1),)
    assert Resources({"cpu": 0}).units == ()


@pytest.mark.parametrize(
    ("resources", "fragment"),
    [
        ({"GPU": 1}, "'GPU' is not a valid resource name"),
        ({"1gpu": 1}, "'1gpu' is not a valid resource name"),
        ({"": 1}, "'' is not a valid resource name"),
        ({"gp u": 1}, "not a valid resource name"),
        ({"a" * 64: 1}, "not a valid resource name"),
        ({"a" * 65: 1}, "each key of resources must have at most 64 characters"),
        ({"slots": 1}, "'slots' is reserved"),
        ({"cpu": -1}, "resources.cpu must not be negative"),
        ({"gpu": -0.5}, "resources.gpu must not be negative"),
        ({"cpu": MAX_AMOUNT + 1}, "the most a job may ask is 1000000000"),
        ({"memory_mb": 10**30}, "the most a job may ask"),
        ({"cpu": "1"}, "each entry of resources must be a number, not text"),
        ({"cpu": True}, "each entry of resources must be a number, not true or false"),
        ({"cpu": None}, "each entry of resources must be a number, not null"),
        ({"cpu": [1]}, "each entry of resources must be a number, not a list"),
        ({"gpu": 1.5}, "resources.gpu must be a whole number"),
        ({"tpu": 0.5}, "resources.tpu must be a whole number"),
        ({"memory_mb": 1024.5}, "resources.memory_mb must be a whole number"),
        ({"cpu": 0.0001}, "counted to 0.001 of a core"),
        ({f"r{i}": 1 for i in range(MAX_RESOURCES + 1)}, f"resources must have at most {MAX_RESOURCES} entries"),
    ],
)
def test_bad_resources_are_invalid_requests_naming_the_problem(resources, fragment):
    with pytest.raises(InvalidRequest) as info:
        decode_request(SubmitRequest, submit(resources=resources))
    assert info.value.code == "invalid_request"
    assert fragment in info.value.message


@pytest.mark.parametrize("raw", ['"cpu"', "[1]", "1", "null"])
def test_resources_must_be_an_object(raw):
    body = b'{"command": ["true"], "resources": ' + raw.encode() + b"}"
    with pytest.raises(InvalidRequest, match=r"resources must be an object \(\{\.\.\.\}\), not "):
        decode_request(SubmitRequest, body)


@pytest.mark.parametrize(("raw", "fragment"), [("NaN", "malformed"), ("Infinity", "malformed"),
                                               ("1e400", "a number out of range")])
def test_nan_and_infinity_never_decode(raw, fragment):
    body = b'{"command": ["true"], "resources": {"cpu": ' + raw.encode() + b"}}"
    with pytest.raises(InvalidRequest, match=fragment):
        decode_request(SubmitRequest, body)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_amounts_are_refused_in_python_too(value):
    with pytest.raises(ResourceError, match="finite"):
        Resources({"cpu": value})


def test_python_api_validates_like_the_wire():
    with pytest.raises(ResourceError, match="reserved"):
        as_resources({"slots": 2})
    with pytest.raises(ResourceError, match="must be a number"):
        as_resources({"cpu": "2"})
    with pytest.raises(ResourceError, match="must be a number"):
        as_resources({"cpu": [2]})  # unhashable: validated uncached, same message
    with pytest.raises(ResourceError, match="object"):
        as_resources([("cpu", 1)])


def test_cpu_fractions_are_exact_millicores():
    assert Resources({"cpu": 0.1}).units == (("cpu", 100),)
    assert Resources({"cpu": 2.5}).as_dict() == {"cpu": 2.5}
    assert Resources({"cpu": 2.0}).as_dict() == {"cpu": 2}
    assert normalize_request({"cpu": 0.001}) == {"cpu": 0.001}


def test_resources_are_values():
    a, b = Resources({"gpu": 1, "cpu": 2}), Resources({"cpu": 2.0, "gpu": 1})
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != Resources({"cpu": 2})
    assert resources_from_json('{"gpu": 1, "cpu": 2}') == a
    assert resources_from_json(None) is DEFAULT_RESOURCES
    import pickle

    assert pickle.loads(pickle.dumps(a)) == a


def test_advertised_resources_are_sanitised():
    offered = offer_units({
        "cpu": Amount(8, 2.5), "memory_mb": (4096, 9999), "gpu": Amount(-1, -1), "tpu": (math.nan, 1),
        "BAD": (1, 1), "slots": (5, 5), "fpga": (math.inf, math.inf),
    })
    assert offered["cpu"] == (8000, 2500)
    assert offered["memory_mb"] == (4096, 4096)  # free never above total
    assert offered["gpu"] == (0, 0) and offered["tpu"] == (0, 0)
    assert "BAD" not in offered and "slots" not in offered
    assert offered["fpga"][0] == offered["fpga"][1] > 0  # capped, not infinite


def test_configured_resources_accept_a_total_or_total_and_free():
    assert parse_offer({"cpu": 8, "gpu": {"total": 4, "free": 1}}, "peer a") == {
        "cpu": Amount(8.0, 8.0), "gpu": Amount(4.0, 1.0)}
    for bad, fragment in [({"GPU": 1}, "not a valid resource name"), ({"gpu": -1}, "non-negative"),
                          ({"gpu": {"total": "x"}}, "non-negative"), ({"gpu": True}, "non-negative"), ([], "map")]:
        with pytest.raises(ResourceError, match=fragment):
            parse_offer(bad, "peer a")


def test_shortfalls_name_resource_asked_and_available():
    short = shortfalls(Resources({"cpu": 2, "gpu": 8}).units, {"cpu": 4000, "gpu": 4}, "slurm")
    assert [tuple(s) for s in short] == [("gpu", 8, 4, "slurm")]
    assert describe_shortfalls(short, "at most") == "gpu: asked 8, at most 4"
    assert describe_shortfalls(shortfalls((("cpu", 1500),), {"cpu": 500}), "free") == "cpu: asked 1.5, 0.5 free"
    assert fmt_amount(1_000_000_000) == "1000000000" and fmt_amount(0.25) == "0.25"


def test_memory_reads_in_mib_and_gib_where_people_read_it():
    from irisfed.shared.resources import Shortfall, amount_text, describe_shortfalls, resource_label

    assert [amount_text("memory_mb", m) for m in (0, 512, 65536, 2097152, 1536.5)] == [
        "0", "512.0 MiB", "64.0 GiB", "2,048.0 GiB", "1.5 GiB"]
    assert amount_text("cpu", 0.5) == "0.5" and amount_text("gpu", 8) == "8"
    assert resource_label("memory_mb") == "memory" and resource_label("gpu") == "gpu"
    assert describe_shortfalls([Shortfall("memory_mb", 8192, 4096)], "at most") == "memory: asked 8.0 GiB, at most 4.0 GiB"
