"""What the ray backend says to and reads from the Ray Jobs API (``ray_text``,
``ray_capacity``, ``ray_gang_text``): names, quoting, resources, outcomes, the cluster's
capacity and nodes, and a gang's driver (``ray_gang``: what it prints, read back). Pure
(the entrypoint run through a real shell is tests/integration/test_ray_entrypoint_shell.py;
gangs on a real cluster are tests/engines/test_ray_gangs.py); the cluster status samples
were captured from a real head (ray 2.60, 2 CPUs, ``{"TPU": 4}``), idle and while a job
held 1 CPU, 1 TPU and 512 MiB, and the node samples from a head with three worker
raylets, one of them dead."""

from __future__ import annotations

import base64
from types import SimpleNamespace

import pytest

from irisfed.services.peer_agent import backends
from irisfed.services.peer_agent.backends import KILLED_EXIT_CODE, Discovered, RunLost
from irisfed.services.peer_agent.backends import ray_capacity as capacity
from irisfed.services.peer_agent.backends import ray_gang as driver
from irisfed.services.peer_agent.backends import ray_gang_text as gang_text
from irisfed.services.peer_agent.backends import ray_text as text

MIB = 1024 * 1024
NODE = "b612f84876d11d51cf29d2fdaf789db8ea7ced22fcd6b87b46e874a0"


def status_payload(usage: dict, by_node: dict | None = None) -> dict:
    """A ``GET /api/cluster_status`` answer (what the parser reads of it)."""
    report = {"usage": usage, "resourceDemand": [], "pgDemand": [], "headIp": None}
    if by_node is not None:
        report["usageByNode"] = by_node
    return {"result": True, "msg": "Got cluster status.",
            "data": {"autoscalingError": None, "clusterStatus": {"loadMetricsReport": report}}}


IDLE_USAGE = {"objectStoreMemory": [0.0, 209715200.0], "TPU": [0.0, 4.0], "memory": [0.0, 24429871104.0],
              "node:InternalHead": [0.0, 1.0], "CPU": [0.0, 2.0], "node:192.0.2.2": [0.0, 1.0]}
BUSY_USAGE = {"node:192.0.2.2": [0.0, 1.0], "memory": [536870912.0, 24429871104.0], "TPU": [1.0, 4.0],
              "node:InternalHead": [0.0, 1.0], "CPU": [1.0, 2.0], "objectStoreMemory": [0.0, 209715200.0]}
IDLE = status_payload(IDLE_USAGE, {NODE: IDLE_USAGE})
BUSY = status_payload(BUSY_USAGE, {NODE: BUSY_USAGE})

# A bigger cluster: two GPU nodes (A100), one CPU node with an FPGA, placement group
# bookkeeping and names that are not valid irisfed resource names.
GPU_NODE = {"CPU": [2.0, 8.0], "GPU": [1.0, 4.0], "memory": [0.0, 64.0 * 1024 * MIB],
            "accelerator_type:A100": [0.0, 1.0], "node:10.0.0.1": [0.0, 1.0],
            "GPU_group_0_4b6a0e3f9e0d1c2b3a4f5e6d7c8b9a01": [0.0, 1.0]}
FPGA_NODE = {"CPU": [0.0, 16.0], "memory": [0.0, 32.0 * 1024 * MIB], "FPGA.Xilinx": [0.0, 2.0],
             "Bad Name": [0.0, 1.0], "node:10.0.0.2": [0.0, 1.0]}
BIG = status_payload(
    {"CPU": [4.0, 32.0], "GPU": [2.0, 8.0], "memory": [1.5 * MIB, 160.0 * 1024 * MIB],
     "accelerator_type:A100": [0.0, 2.0], "FPGA.Xilinx": [0.0, 2.0], "Bad Name": [0.0, 1.0],
     "objectStoreMemory": [0.0, 1e9], "node:10.0.0.1": [0.0, 1.0], "node:10.0.0.2": [0.0, 1.0],
     "node:10.0.0.3": [0.0, 1.0], "GPU_group_0_4b6a0e3f9e0d1c2b3a4f5e6d7c8b9a01": [0.0, 1.0],
     "bundle_group_4b6a0e3f9e0d1c2b3a4f5e6d7c8b9a01": [0.0, 1000.0]},
    {"n1": GPU_NODE, "n2": dict(GPU_NODE), "n3": FPGA_NODE},
)


# ------------------------------------------------------------------ names


@pytest.mark.parametrize("job_id, epoch", [("job-1", 0), ("a-e5", 3), ("A.b_c", 12), ("x" * 128, 999)])
def test_submission_id_round_trips(job_id: str, epoch: int) -> None:
    submission_id = text.submission_id(job_id, epoch)
    assert submission_id == f"irisfed-{job_id}-e{epoch}"
    assert text.parse_submission_id(submission_id) == (job_id, epoch)


@pytest.mark.parametrize("other", ["raysubmit_4LamXRuQpYdSMg7J", "irisfed-job", "irisfed-job-ex", None, ""])
def test_other_submission_ids_are_not_ours(other: str | None) -> None:
    assert text.parse_submission_id(other) is None


def test_a_run_is_ours_only_when_its_metadata_names_our_peer_and_agrees_with_its_id() -> None:
    meta = text.metadata("peer-a", "job-1", 2)
    assert meta == {"irisfed_peer": "peer-a", "irisfed_job": "job-1", "irisfed_epoch": "2"}
    assert text.owned_run("irisfed-job-1-e2", meta, "peer-a") == ("job-1", 2)
    assert text.owned_run("irisfed-job-1-e2", meta, "peer-b") is None
    assert text.owned_run("irisfed-job-1-e3", meta, "peer-a") is None  # id and metadata disagree
    assert text.owned_run("irisfed-job-1-e2", None, "peer-a") is None
    assert text.owned_run("irisfed-job-1-e2", {}, "") is None  # no peer named: never ours
    assert text.owned_run("irisfed-job-1-e2", {**meta, "irisfed_epoch": "two"}, "peer-a") is None


# ------------------------------------------------------------------ submission


def test_a_run_is_our_submission_only_when_it_carries_the_nonce_its_run_folder_recorded() -> None:
    ours = text.metadata("peer-a", "job-1", 2, nonce="n0nce")
    forged = text.metadata("peer-a", "job-1", 2)  # the name and metadata are no secret; the nonce is
    assert text.owned_run("irisfed-job-1-e2", ours, "peer-a") == text.owned_run("irisfed-job-1-e2", forged, "peer-a")
    assert text.submitted_by_us(ours, "n0nce")
    assert not text.submitted_by_us(forged, "n0nce")
    assert not text.submitted_by_us({**ours, text.META_NONCE: "guess"}, "n0nce")
    assert not text.submitted_by_us(ours, None) and not text.submitted_by_us(forged, None)  # never submitted
    assert text.submitted_by_us(forged, "") and not text.submitted_by_us(ours, "")  # a folder from before nonces


def test_an_empty_command_is_refused() -> None:
    with pytest.raises(ValueError, match="no command"):
        text.entrypoint([])


def test_what_no_process_can_be_given_is_refused() -> None:
    for env in ({"": "x"}, {"A=B": "x"}):
        with pytest.raises(ValueError, match="empty or holds '='"):
            text.entrypoint(["true"], env)
        with pytest.raises(ValueError, match="empty or holds '='"):
            text.job_env(env, "j", 1)
    with pytest.raises(ValueError, match="NUL"):
        text.job_env({"A": "a\0b"}, "j", 1)
    with pytest.raises(ValueError, match="NUL"):
        text.entrypoint(["echo", "a\0b"])
    # A name export cannot take sends the command through env, which would read X=1 as a variable.
    with pytest.raises(ValueError, match="holds '='"):
        text.entrypoint(["X=1"], {"my.var": "v"})
    assert text.entrypoint(["X=1"], {"A": "v"}).endswith(" X=1")  # exec'd directly: no env in the way


def test_the_job_env_is_the_jobs_own_plus_its_identity_encoded_beyond_rays_expansion() -> None:
    env = text.job_env({"A": "$(x) $HOME ${B}", "IRISFED_EPOCH": "forged"}, "job-1", 4)
    assert set(env) == {text.ENV_VARIABLE, "IRISFED_JOB_ID", "IRISFED_EPOCH"}
    assert "$" not in "".join(env.values())  # nothing Ray could expand
    assert (env["IRISFED_JOB_ID"], env["IRISFED_EPOCH"]) == ("job-1", "4")
    assert "$(x) $HOME ${B}" in base64.b64decode(env[text.ENV_VARIABLE]).decode()


# What one submit may carry (shared/messages.py): values of up to 4096 characters, a
# 64 KB body. Twelve values of 4096 quotes is ~49 KB.
QUOTES = {f"Q{i}": "'" * 4096 for i in range(12)}


def test_a_quote_heavy_env_a_submit_may_carry_is_refused_before_submit() -> None:
    # Encoded, it would be ~330 KB: Ray hands the runtime env to its job supervisor's
    # worker as one argument, the exec fails (E2BIG) and Ray retries it for minutes,
    # then fails the job as its own machinery's fault (a lost run, retried elsewhere).
    with pytest.raises(ValueError, match="environment is .* at most"):
        text.job_env(QUOTES, "j", 1)


def test_a_command_too_long_for_one_exec_argument_is_refused_before_submit() -> None:
    # 30 arguments of 4096 quotes fit a submit; quoted they are ~600 KB of `sh -c` line.
    with pytest.raises(ValueError, match="entrypoint may hold at most"):
        text.entrypoint(["printf", "%s", *["'" * 4096] * 30])


def test_resources_become_entrypoint_resources() -> None:
    kwargs = text.submit_resources({"cpu": 1.0, "gpu": 2, "tpu": 1, "memory_mb": 512, "fpga.xilinx": 1})
    assert kwargs == {"entrypoint_num_cpus": 1.0, "entrypoint_num_gpus": 2, "entrypoint_memory": 512 * MIB,
                      "entrypoint_resources": {"TPU": 1, "fpga.xilinx": 1}}


def test_cpu_is_always_given_because_ray_counts_an_unnamed_one_as_none() -> None:
    assert text.submit_resources({}) == {"entrypoint_num_cpus": 1}
    assert text.submit_resources({"cpu": 0.25}) == {"entrypoint_num_cpus": 0.25}
    assert text.submit_resources({"cpu": 0, "gpu": 0}) == {"entrypoint_num_cpus": 0}


def test_extended_resources_take_the_name_discovery_saw() -> None:
    report = capacity.cluster_report(BIG)
    assert report.ray_names == {"fpga.xilinx": "FPGA.Xilinx"}
    kwargs = text.submit_resources({"cpu": 1, "fpga.xilinx": 2}, report.ray_names)
    assert kwargs["entrypoint_resources"] == {"FPGA.Xilinx": 2}


@pytest.mark.parametrize("request_, named", [
    ({"cpu": 1, "tpu": 8}, "tpu=8 but the largest Ray node has tpu=4 (4 in the whole cluster)"),
    ({"cpu": 3}, "cpu=3 but the largest Ray node has cpu=2"),
    ({"gpu": 1}, "gpu=1 but the largest Ray node has gpu=0"),
    ({"memory_mb": 23299}, "memory_mb=23299 but the largest Ray node has memory_mb=23298"),
    ({"fpga": 1}, "fpga=1 but the largest Ray node has fpga=0"),
    ({}, None), ({"cpu": 2, "tpu": 4, "memory_mb": 23298}, None), ({"cpu": 0, "tpu": 1}, None),
])
def test_a_request_no_node_could_hold_is_named(request_: dict, named: str | None) -> None:
    problem = text.too_big(request_, capacity.cluster_report(BUSY))  # totals count, not what is free now
    if named is None:
        assert problem is None
    else:
        assert problem is not None and named in problem


def test_a_request_must_fit_one_node_not_the_sum_of_them() -> None:
    report = capacity.cluster_report(BIG)
    assert text.too_big({"cpu": 8, "gpu": 4}, report) is None
    assert "largest Ray node has gpu=4 (8 in the whole cluster)" in text.too_big({"gpu": 5}, report)
    assert "no single Ray node has all of cpu=1, fpga.xilinx=1, gpu=1" in text.too_big(
        {"cpu": 1, "gpu": 1, "fpga.xilinx": 1}, report)
    # Without per-node totals the cluster's are all there is.
    flat = capacity.cluster_report(status_payload(BIG["data"]["clusterStatus"]["loadMetricsReport"]["usage"]))
    assert flat.nodes == []
    assert text.too_big({"cpu": 1, "gpu": 5}, flat) is None


def test_already_exists_is_read_from_rays_error() -> None:
    error = RuntimeError("Request failed with status code 500: Traceback (most recent call last): ...\n"
                         "ValueError: Job with submission_id irisfed-j-e1 already exists. "
                         "Please use a different submission_id.")
    assert text.already_exists(error)
    assert not text.already_exists(RuntimeError("Request failed with status code 500: boom"))


# ------------------------------------------------------------------ outcomes


def details(status: object, code: int | None = None, error_type: object = None,
            message: str = "") -> SimpleNamespace:
    """A stand-in for Ray's ``JobDetails`` (the fields the mapping reads)."""
    return SimpleNamespace(status=status, driver_exit_code=code, error_type=error_type, message=message,
                           submission_id="irisfed-j-e1", metadata={})


@pytest.mark.parametrize("job, kill_requested, code", [
    (details("SUCCEEDED", 0), False, 0),
    (details("STOPPED", None, message="Job was intentionally stopped."), True, KILLED_EXIT_CODE),
    (details("STOPPED"), False, KILLED_EXIT_CODE),  # someone else stopped it: still a kill
    (details("FAILED", 7, "JOB_ENTRYPOINT_COMMAND_ERROR"), False, 7),
    (details("FAILED", 7, "JOB_ENTRYPOINT_COMMAND_ERROR"), True, 7),  # ended on its own first
    (details("FAILED", -9, "JOB_ENTRYPOINT_COMMAND_ERROR"), False, -9),
    # Ray 2.60: a pending job asked to stop whose command then ended on its own first.
    (details("FAILED", None, "JOB_ENTRYPOINT_COMMAND_START_ERROR", "psutil.NoSuchProcess"), True,
     KILLED_EXIT_CODE),
])
def test_terminal_jobs_map_to_exit_codes(job: SimpleNamespace, kill_requested: bool, code: int) -> None:
    assert text.exit_code(text.job_state(job), kill_requested) == code


def test_a_job_ray_failed_before_its_command_ended_is_lost() -> None:
    state = text.job_state(details("FAILED", None, "JOB_SUPERVISOR_ACTOR_START_TIMEOUT",
                                   "Job supervisor actor failed to start within 900.0 seconds." + "x" * 1000))
    with pytest.raises(RunLost, match=r"JOB_SUPERVISOR_ACTOR_START_TIMEOUT\): Job supervisor actor") as lost:
        text.exit_code(state)
    assert len(str(lost.value)) < 700  # Ray's message may carry 20,000 characters of logs


def test_every_ray_error_type_without_an_exit_code_is_lost() -> None:
    common = pytest.importorskip("ray.dashboard.modules.job.common")
    for error_type in common.JobErrorType:
        state = text.job_state(details(common.JobStatus.FAILED, None, error_type, "why"))
        assert state.status == "FAILED" and state.error_type == error_type.value
        with pytest.raises(RunLost, match=error_type.value):
            text.exit_code(state)


def test_ray_status_enums_are_read_by_value() -> None:
    common = pytest.importorskip("ray.dashboard.modules.job.common")
    assert text.job_state(details(common.JobStatus.SUCCEEDED, 0)).status == "SUCCEEDED"
    assert {text.status_name(s) for s in common.JobStatus if s.is_terminal()} == text.TERMINAL


def test_a_job_that_has_not_ended_has_no_exit_code() -> None:
    for status in ("PENDING", "RUNNING"):
        state = text.job_state(details(status))
        assert not state.terminal
        with pytest.raises(ValueError, match="not ended"):
            text.exit_code(state)


# ------------------------------------------------------------------ capacity


def test_an_idle_head_reports_its_totals_free() -> None:
    report = capacity.cluster_report(IDLE)
    assert report.discovered == Discovered(
        attributes={"device_type": ["tpu"]},
        resources={"cpu": (2.0, 2.0), "tpu": (4.0, 4.0), "memory_mb": (23298.0, 23298.0)},
        nodes=[{"count": 1, "attributes": {}, "resources": {
            "cpu": {"total": 2, "free": 2}, "memory_mb": {"total": 23298, "free": 23298},
            "tpu": {"total": 4, "free": 4}}}])
    assert [node.totals() for node in report.nodes] == [{"cpu": 2.0, "tpu": 4.0, "memory_mb": 23298.0}]
    assert report.ray_names == {"tpu": "TPU"}


def test_what_a_running_job_holds_is_not_free() -> None:
    resources = capacity.cluster_report(BUSY).discovered.resources
    assert resources == {"cpu": (2.0, 1.0), "tpu": (4.0, 3.0), "memory_mb": (23298.0, 22786.0)}


def test_gpus_accelerator_types_and_custom_resources_are_discovered() -> None:
    report = capacity.cluster_report(BIG)
    assert report.discovered.attributes == {"device_type": ["gpu"], "device_variant": ["a100"]}
    # Never advertised: node:*, accelerator_type:*, the object store, placement group
    # bookkeeping, names that are not irisfed resource names.
    assert report.discovered.resources == {
        "cpu": (32.0, 28.0), "gpu": (8.0, 6.0), "memory_mb": (163840.0, 163838.0), "fpga.xilinx": (2.0, 2.0)}
    assert sorted(sorted(node.totals()) for node in report.nodes) == [
        ["cpu", "fpga.xilinx", "memory_mb"], ["cpu", "gpu", "memory_mb"], ["cpu", "gpu", "memory_mb"]]


def test_gpu_and_tpu_together_and_neither() -> None:
    both = capacity.cluster_report(status_payload({"CPU": [0, 4], "GPU": [0, 1], "TPU": [0, 8]}))
    assert both.discovered.attributes == {"device_type": ["gpu", "tpu"]}
    neither = capacity.cluster_report(status_payload({"CPU": [0, 4], "GPU": [0, 0]}))
    assert neither.discovered.attributes == {"device_type": ["cpu"]}
    assert neither.discovered.resources["gpu"] == (0.0, 0.0)


def test_a_resource_used_beyond_its_total_has_none_free() -> None:
    report = capacity.cluster_report(status_payload({"CPU": [3.0, 2.0]}))
    assert report.discovered.resources == {"cpu": (2.0, 0.0)}


def test_names_that_collide_once_lower_cased_keep_the_first() -> None:
    report = capacity.cluster_report(status_payload({"CPU": [0, 1], "TPU": [0, 4], "tpu": [0, 9], "cpu": [0, 7]}))
    assert report.discovered.resources == {"cpu": (1.0, 1.0), "tpu": (4.0, 4.0)}
    assert report.ray_names == {"tpu": "TPU"}


@pytest.mark.parametrize("payload", [
    {}, {"data": {}}, {"data": {"clusterStatus": None}}, status_payload({}),
    status_payload({"TPU": [0, 4]}), status_payload({"CPU": "lots"}),
])
def test_an_answer_without_a_resource_report_is_an_error(payload: dict) -> None:
    with pytest.raises(ValueError, match="resource report"):
        capacity.cluster_report(payload)


# ------------------------------------------------------------------ nodes

HEAD_ID, WORKER_A, WORKER_B, DEAD, NEW = "4be45e0b" * 7, "082937a3" * 7, "b9fe765b" * 7, "99d8cae3" * 7, "c0ffee00" * 7
WORKER_USAGE = {"CPU": [0.0, 1.0], "memory": [0.0, 1024.0 * MIB], "objectStoreMemory": [0.0, 83886080.0],
                "node:192.0.2.2": [0.0, 1.0]}


def node_entry(node_id: str, state: str = "ALIVE", labels: dict | None = None, totals: dict | None = None,
               head: bool = False) -> dict:
    """One node of a ``GET /api/v0/nodes`` answer (as ray 2.60 lists it)."""
    return {"node_id": node_id, "node_ip": "192.0.2.2", "is_head_node": head, "state": state, "state_message": None,
            "node_name": "192.0.2.2", "labels": {"ray.io/node-id": node_id, **(labels or {})},
            "resources_total": totals or {"CPU": 1.0, "memory": 1024.0 * MIB, "object_store_memory": 83886080.0,
                                          "node:192.0.2.2": 1.0}}


def nodes_payload(*entries: dict) -> dict:
    return {"result": True, "msg": "", "data": {"result": {
        "total": len(entries), "num_after_truncation": len(entries), "num_filtered": len(entries),
        "result": list(entries), "partial_failure_warning": "", "warnings": None}}}


def cluster(busy_b: bool = False) -> capacity.ClusterReport:
    """A head (TPU, no labels), two alike workers of rack r1 (B running a 1-CPU task when
    ``busy_b``), a dead worker of rack r2 and one just joined that the resource report
    has not seen yet."""
    b_usage = {**WORKER_USAGE, "CPU": [1.0, 1.0]} if busy_b else WORKER_USAGE
    by_node = {HEAD_ID: IDLE_USAGE, WORKER_A: WORKER_USAGE, WORKER_B: b_usage, DEAD: WORKER_USAGE}
    # The summed report still counts the dead worker (it does for a while), not the new one.
    usage = {"CPU": [1.0 if busy_b else 0.0, 5.0], "TPU": [0.0, 4.0], "memory": [0.0, 3072.0 * MIB]}
    return capacity.cluster_report(status_payload(usage, by_node), nodes_payload(
        node_entry(WORKER_A, labels={"rack": "r1"}), node_entry(HEAD_ID, head=True, totals={"CPU": 2.0}),
        node_entry(DEAD, "DEAD", {"rack": "r2"}), node_entry(WORKER_B, labels={"rack": "r1"}),
        node_entry(NEW, labels={"rack": "r3", "ray.io/tpu-worker-id": "0"})))


def test_alive_nodes_are_grouped_with_their_labels_as_attributes_and_their_own_free() -> None:
    report = cluster()
    assert sorted(node.node_id for node in report.nodes) == sorted([HEAD_ID, WORKER_A, WORKER_B, NEW])  # not DEAD
    worker = {"cpu": {"total": 1, "free": 1}, "memory_mb": {"total": 1024, "free": 1024}}
    assert report.discovered.nodes == [
        {"count": 1, "attributes": {}, "resources": {
            "cpu": {"total": 2, "free": 2}, "memory_mb": {"total": 23298, "free": 23298},
            "tpu": {"total": 4, "free": 4}}},
        {"count": 2, "attributes": {"rack": ["r1"]}, "resources": worker},  # alike: counted together
        # Not in the resource report yet: nothing free until it is; its per-node label is not advertised.
        {"count": 1, "attributes": {"rack": ["r3"]}, "resources": {
            "cpu": {"total": 1, "free": 0}, "memory_mb": {"total": 1024, "free": 0}}},
    ]
    # The cluster's totals are its alive nodes' (the dead one's CPU is gone, the new one's
    # counts but offers nothing yet); its attributes are what they were.
    assert report.discovered.attributes == {"device_type": ["tpu"]}
    assert report.discovered.resources == {"cpu": (5.0, 4.0), "memory_mb": (23298.0 + 3 * 1024, 23298.0 + 2 * 1024),
                                           "tpu": (4.0, 4.0)}


def test_a_busy_node_is_a_group_of_its_own() -> None:
    groups = cluster(busy_b=True).discovered.nodes
    racks = [(g["count"], g["resources"]["cpu"]) for g in groups if g["attributes"] == {"rack": ["r1"]}]
    assert sorted(racks, key=lambda r: r[1]["free"]) == [(1, {"total": 1, "free": 0}), (1, {"total": 1, "free": 1})]


def test_labels_that_name_one_node_alone_are_not_attributes() -> None:
    assert capacity.node_attributes({"ray.io/node-id": "n1", "ray.io/tpu-worker-id": "3", "ray.io/tpu-slice-name": "s",
                                     "rack": "r1", "bad": 7}) == {"ray.io/tpu-slice-name": ["s"], "rack": ["r1"]}
    assert capacity.node_attributes(None) == {}


@pytest.mark.parametrize("payload", [{}, {"data": {"result": None}}, {"data": {"result": {"result": "x"}}}])
def test_a_node_list_that_is_not_one_is_an_error(payload: dict) -> None:
    with pytest.raises(ValueError, match="node list"):
        capacity.cluster_report(IDLE, payload)


# ------------------------------------------------------------------ gangs


def test_a_gang_needs_enough_nodes_that_each_hold_a_task_sharing_one_label_value() -> None:
    report = cluster(busy_b=True)  # by totals: what is busy now does not count
    assert gang_text.gang_problem({"cpu": 1}, 4, "", report) is None  # head, A, B and the new one
    assert gang_text.gang_problem({"cpu": 1}, 2, "rack", report) is None  # A and B
    assert gang_text.gang_problem({"cpu": 1}, 3, "rack", report) == (
        "the gang needs 3 Ray nodes sharing one rack that can each hold cpu=1; the cluster has 2: "
        "Ray would keep it waiting until its start timeout")
    assert "needs 2 Ray nodes that can each hold cpu=1, tpu=1; the cluster has 1" in gang_text.gang_problem(
        {"cpu": 1, "tpu": 1}, 2, "", report)
    assert "the cluster has 1" in gang_text.gang_problem({"cpu": 2}, 2, "", report)  # only the head has 2
    assert "sharing one zone" in gang_text.gang_problem({"cpu": 1}, 2, "zone", report)  # no node has that label
    flat = capacity.cluster_report(status_payload({"CPU": [0, 4]}))  # a head that reports no nodes: cannot tell
    assert gang_text.gang_problem({"cpu": 1}, 9, "", flat) is None


def test_a_task_is_a_bundle_in_rays_names() -> None:
    assert gang_text.gang_bundle({}) == {"CPU": 1}
    assert gang_text.gang_bundle({"cpu": 0.5, "gpu": 1, "memory_mb": 512, "tpu": 4, "fpga.xilinx": 1},
                                 {"fpga.xilinx": "FPGA.Xilinx"}) == {
        "CPU": 0.5, "GPU": 1, "memory": 512 * MIB, "TPU": 4, "FPGA.Xilinx": 1}
    with pytest.raises(ValueError, match="bundle cannot be empty"):
        gang_text.gang_bundle({"cpu": 0})


def test_a_gangs_run_travels_verbatim_beside_its_driver() -> None:
    import json

    env = {"HOSTILE": "$HOME ${HOME} 'q' `x`", "not-a-shell-name": "v"}
    payload = gang_text.driver_payload("print('driver')\n")
    env_vars = gang_text.gang_env(["sh", "-c", "echo $1", "sh", "$(x)"], env, "job-1", 3, 2, {"CPU": 1}, "rack",
                                  30.0, payload)
    assert set(env_vars) == {driver.SPEC_VARIABLE, gang_text.DRIVER_VARIABLE, "IRISFED_JOB_ID", "IRISFED_EPOCH"}
    assert "$" not in env_vars[driver.SPEC_VARIABLE]  # nothing for Ray to expand
    spec = json.loads(base64.b64decode(env_vars[driver.SPEC_VARIABLE]))
    assert spec == {"command": ["sh", "-c", "echo $1", "sh", "$(x)"], "replicas": 2, "bundle": {"CPU": 1},
                    "group_by": "rack", "start_timeout_s": 30.0,
                    "env": {**env, "IRISFED_JOB_ID": "job-1", "IRISFED_EPOCH": "3", "IRISFED_NUM_TASKS": "2"}}
    import zlib

    assert zlib.decompress(base64.b64decode(env_vars[gang_text.DRIVER_VARIABLE])) == b"print('driver')\n"
    with pytest.raises(ValueError, match="at most"):
        gang_text.gang_env(["true"], {"BIG": "x" * text.ENV_MAX_CHARS}, "j", 1, 2, {"CPU": 1}, "", 30.0, payload)
    with pytest.raises(ValueError, match="NUL"):
        gang_text.gang_env(["true"], {"A": "\0"}, "j", 1, 2, {"CPU": 1}, "", 30.0, payload)


def test_the_gang_entrypoint_runs_the_driver_from_its_variable_with_the_nodes_python() -> None:
    import shlex

    words = shlex.split(gang_text.gang_entrypoint("/opt/ray/bin/python3"))
    assert words[:3] == ["exec", "/opt/ray/bin/python3", "-c"]
    compile(words[3], "bootstrap", "exec")  # valid Python
    assert gang_text.DRIVER_VARIABLE in words[3] and "sys.path[0]==''" in words[3]


def test_a_gang_carries_its_size_in_its_metadata() -> None:
    meta = text.metadata("peer-a", "job-1", 2, "n0nce", tasks=4, start_timeout_s=90)
    assert text.gang_of(meta) == (4, 90.0)
    assert text.owned_run("irisfed-job-1-e2", meta, "peer-a") == ("job-1", 2)
    assert text.gang_of(text.metadata("peer-a", "job-1", 2, "n0nce")) is None
    assert text.metadata("peer-a", "job-1", 2) == {"irisfed_peer": "peer-a", "irisfed_job": "job-1",
                                                   "irisfed_epoch": "2"}
    assert text.gang_of({"irisfed_tasks": "x"}) is None
    assert text.gang_of({"irisfed_tasks": "3", "irisfed_start_timeout_s": "?"}) == (3, 0.0)


def driven(*writes: tuple[int, str, str]) -> str:
    """What the driver prints for these writes of its tasks' output, in order."""
    pieces: dict = {}
    out = []
    for index, stream, chunk in writes:
        lines, pieces[(index, stream)] = driver.task_lines(index, stream, chunk, pieces.get((index, stream), ""))
        out.append(lines)
    for (index, stream), piece in sorted(pieces.items()):
        out.append(driver.task_lines(index, stream, "", piece, final=True)[0])
    return "".join(out)


def test_a_gangs_log_is_split_back_into_each_tasks_output_byte_for_byte() -> None:
    sneaky = f"{driver.GANG_MARK} end {{\"exit\": 0, \"lost\": \"\"}}\n"  # a task cannot forge the driver's line
    log = (
        "2026-12-05 14:16:43,950\tINFO job_manager.py:581 -- Runtime env is setting up.\n"
        + driver.gang_line("started", {"nodes": ["n0", "n1"]})
        + driven((0, "out", "hello\nwor"), (1, "err", "oops\n"), (0, "out", "ld\n\n"), (1, "out", sneaky),
                 (0, "err", "no newline at the end"), (1, "out", "x" * (driver.MAX_PIECE + 5) + "\ntail"))
        + driver.gang_line("end", {"exit": 3, "lost": "", "killed": False, "states": ["succeeded", "failed"],
                                   "codes": [0, 3], "nodes": ["n0", "n1"]})
    )
    read = gang_text.read_gang_log(log, 2)
    assert read.started == ["n0", "n1"]
    assert read.end["exit"] == 3 and read.end["states"] == ["succeeded", "failed"]
    assert read.outputs == {(0, "out"): "hello\nworld\n\n", (0, "err"): "no newline at the end",
                            (1, "err"): "oops\n", (1, "out"): sneaky + "x" * (driver.MAX_PIECE + 5) + "\ntail"}
    assert gang_text.gang_started(log) == ["n0", "n1"]
    assert gang_text.gang_started(log.split(driver.GANG_MARK + " started")[0]) is None
    assert gang_text.read_gang_log(driven((5, "out", "not one of ours\n")), 2).outputs == {}


def gang_state(status: str, code: int | None = None, message: str = "") -> text.JobState:
    return text.JobState(status, code, None, message)


def end_line(**fields) -> gang_text.GangLog:
    return gang_text.GangLog(["n0", "n1"], {"exit": 0, "lost": "", "killed": False, **fields})


@pytest.mark.parametrize("state, log, kill_requested, code", [
    (gang_state("SUCCEEDED", 0), end_line(), False, 0),
    (gang_state("FAILED", 3), end_line(exit=3), False, 3),
    (gang_state("FAILED", 137), end_line(exit=-9), False, -9),  # the task's own code, not the driver's status
    (gang_state("STOPPED"), end_line(killed=True), True, KILLED_EXIT_CODE),
    (gang_state("STOPPED"), gang_text.GangLog(), True, KILLED_EXIT_CODE),  # stopped before the driver said anything
    (gang_state("STOPPED"), gang_text.GangLog(), False, KILLED_EXIT_CODE),  # whoever stopped it
    (gang_state("FAILED"), gang_text.GangLog(), True, KILLED_EXIT_CODE),
    (gang_state("FAILED", 3), None, False, 3),  # the log could not be read: the driver's status stands in
    (gang_state("SUCCEEDED", 0), None, False, 0),
])
def test_a_gangs_exit_code_is_its_drivers_word(state, log, kill_requested: bool, code: int) -> None:
    assert gang_text.gang_exit_code(state, log, kill_requested) == code


@pytest.mark.parametrize("state, log, start_timed_out, why", [
    (gang_state("FAILED", 1), end_line(lost="task 1 on node n1 failed in Ray (NodeDiedError: ...)"), "",
     "NodeDiedError"),
    (gang_state("FAILED", 1), end_line(lost="its 2 tasks did not all start within 30s"), "", "did not all start"),
    (gang_state("STOPPED"), gang_text.GangLog(), "its 2 tasks did not all start within 30s (the Ray job was PENDING)",
     "PENDING"),
    (gang_state("FAILED", 1, "Traceback ... ModuleNotFoundError: No module named 'ray'"), gang_text.GangLog(), "",
     "without saying how its tasks did: Traceback"),
    (gang_state("FAILED", None, "Job supervisor actor failed"), gang_text.GangLog(), "", "supervisor"),
])
def test_a_gang_lost_by_its_infrastructure_is_lost(state, log, start_timed_out: str, why: str) -> None:
    with pytest.raises(RunLost, match=why):
        gang_text.gang_exit_code(state, log, False, start_timed_out)


def test_the_driver_speaks_the_backends_task_states_and_exit_statuses() -> None:
    assert (driver.PENDING, driver.RUNNING, driver.SUCCEEDED, driver.FAILED, driver.KILLED, driver.LOST) == (
        backends.TASK_PENDING, backends.TASK_RUNNING, backends.TASK_SUCCEEDED, backends.TASK_FAILED,
        backends.TASK_KILLED, backends.TASK_LOST)
    assert [driver.driver_exit(code) for code in (0, 3, 255, 256, -9, -15)] == [0, 3, 255, 1, 137, 143]


def test_a_gang_drivers_end_calls_every_cancelled_task_still_marked_running_killed(capsys) -> None:
    """One task fails; a sibling's generator closes (or is given up) after its cancel
    without an exit item: at the end no task of an ended gang may still say running."""
    import queue

    gang = driver.Driver({"replicas": 3, "start_timeout_s": 60}, ray=None, events=queue.Queue())
    gang.states = [driver.RUNNING, driver.FAILED, driver.KILLED]
    gang.codes = [None, 3, None]
    gang.failed = 3
    gang.cancelled = {0: 0.0, 2: 0.0}
    gang.finished = {0, 1, 2}
    gang.end()
    said = gang_text.read_gang_log(capsys.readouterr().out, 3)
    assert said.end["states"] == ["killed", "failed", "killed"]
    assert said.end["exit"] == 3


# ------------------------------------------------------------------ stopping (docs/design.md §3.7)


@pytest.mark.parametrize("grace_s, gang, seconds", [
    (30, False, "30"),  # the default grace
    (10.5, False, "11"),  # whole seconds, up: Ray reads it with int()
    (0, False, "0"),
    (600, False, "600"),
    (30, True, "45"),  # a gang's driver: the grace, then its own forced cancels and its end line
])
def test_rays_stop_timeout_for_a_job_is_its_grace(grace_s: float, gang: bool, seconds: str) -> None:
    assert text.stop_env(grace_s, gang) == {"RAY_JOB_STOP_WAIT_TIME_S": seconds}
    assert text.stop_wait_s(grace_s, gang) == int(seconds)


def test_a_submission_sets_rays_stop_timeout_and_a_gangs_driver_gets_the_grace(tmp_path) -> None:
    import json

    from irisfed.services.peer_agent.backends import RunSpec
    from irisfed.services.peer_agent.backends.ray import RayBackend

    backend = SimpleNamespace(run_dir=lambda job_id, epoch: tmp_path / job_id / f"epoch-{epoch}", python="python3")
    report = capacity.ClusterReport(Discovered())
    single = RayBackend._submission(backend, RunSpec("j", 1, ["true"], grace_s=12), report)
    assert single["runtime_env"]["env_vars"][text.STOP_WAIT_VARIABLE] == "12"
    # The job's own variable of that name travels encoded: it cannot shorten its grace.
    forged = RayBackend._submission(backend, RunSpec("j", 1, ["true"], env={text.STOP_WAIT_VARIABLE: "1"}), report)
    assert forged["runtime_env"]["env_vars"][text.STOP_WAIT_VARIABLE] == "30"

    gang = RayBackend._submission(backend, RunSpec("g", 1, ["true"], replicas=2, grace_s=12), report)
    env_vars = gang["runtime_env"]["env_vars"]
    assert env_vars[text.STOP_WAIT_VARIABLE] == str(12 + int(text.GANG_STOP_MARGIN_S))
    assert json.loads(base64.b64decode(env_vars[driver.SPEC_VARIABLE]))["grace_s"] == 12


def test_a_gangs_driver_forces_a_tasks_cancel_only_once_its_grace_has_passed() -> None:
    import queue
    import time

    cancels: list[tuple[int, bool]] = []
    ray = SimpleNamespace(cancel=lambda generator, force: cancels.append((generator, force)))
    gang = driver.Driver({"replicas": 1, "start_timeout_s": 60, "grace_s": 20}, ray=ray, events=queue.Queue())
    gang.announced = True
    gang.generators = [0]
    gang.cancelled = {0: time.monotonic() - 20 - driver.FORCE_AFTER_S + 2}  # its command has its grace, and more
    gang.check_times()
    assert cancels == [] and gang.finished == set()
    gang.cancelled = {0: time.monotonic() - 20 - driver.FORCE_AFTER_S - 1}
    gang.check_times()
    assert cancels == [(0, True)]
    assert driver.Driver({"replicas": 1, "start_timeout_s": 60}, ray=None, events=queue.Queue()).grace_s == \
        driver.TERM_GRACE_S  # a run submitted without one
