"""What the Slurm backend reads from and writes to Slurm (services/peer_agent/backends/:
``slurm_text.py``, ``slurm_nodes.py`` and ``slurm_script.py``).

Sample lines are real answers of the Slurm 22.05 test cluster (tooling/engines/slurm.py).
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

from irisfed.services.peer_agent.backends import KILLED_EXIT_CODE, TaskStatus
from irisfed.services.peer_agent.backends.slurm_nodes import (
    capacity,
    expand_hostlist,
    feature_attribute,
    gang_misfit,
    misfit,
    node_groups,
    node_usable,
    parse_features,
    parse_gres,
    parse_nodes,
    tres_gres,
)
from irisfed.services.peer_agent.backends.slurm_script import (
    GangFile,
    ScriptError,
    batch_script,
    gang_args,
    gang_batch_script,
    gang_file_text,
    group_constraint,
    output_path,
    parse_gang_file,
    resource_args,
    shell_word,
    slurm_request,
    task_script,
    term_commands,
    time_limit_args,
)
from irisfed.services.peer_agent.backends.slurm_text import (
    EXIT_STATUS_FILE,
    STARTED_MARKER,
    Outcome,
    SlurmJob,
    TaskRecord,
    choose_run,
    comment_for,
    default_partition,
    forgotten_outcome,
    gang_outcome,
    gang_tasks,
    job_name,
    outcome,
    parse_job_name,
    parse_scontrol_line,
    parse_scontrol_lines,
    parse_squeue,
    parse_squeue_line,
    sbatch_job_id,
)

NODE_IDLE = (
    "NodeName=vm Arch=x86_64 CoresPerSocket=2  CPUAlloc=0 CPUEfctv=2 CPUTot=2 CPULoad=1.12 "
    "AvailableFeatures=(null) ActiveFeatures=(null) Gres=gpu:h100:4 GresDrain=N/A "
    "GresUsed=gpu:h100:0(IDX:N/A) NodeAddr=127.0.0.1 NodeHostName=vm Version=22.05.8 "
    "OS=Linux 6.18.44-fc-v657 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=24105 AllocMem=0 FreeMem=23236 "
    "Sockets=1 Boards=1 State=IDLE ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A "
    "Partitions=debug  BootTime=2026-11-30T16:19:53 SlurmdStartTime=2026-11-30T19:12:19 "
    "LastBusyTime=2026-11-30T19:12:19 CfgTRES=cpu=2,mem=24105M,billing=2 AllocTRES= CapWatts=n/a "
    "CurrentWatts=0 AveWatts=0 ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s"
)
NODE_BUSY = (
    "NodeName=vm Arch=x86_64 CoresPerSocket=2  CPUAlloc=1 CPUEfctv=2 CPUTot=2 CPULoad=1.12 "
    "AvailableFeatures=(null) ActiveFeatures=(null) Gres=gpu:h100:4 GresDrain=N/A "
    "GresUsed=gpu:h100:2(IDX:0-1) NodeAddr=127.0.0.1 NodeHostName=vm Version=22.05.8 "
    "OS=Linux 6.18.44-fc-v657 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=24105 AllocMem=1000 FreeMem=23236 "
    "Sockets=1 Boards=1 State=MIXED ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A "
    "Partitions=debug  BootTime=2026-11-30T16:19:53 SlurmdStartTime=2026-11-30T19:12:19 "
    "LastBusyTime=2026-11-30T19:13:02 CfgTRES=cpu=2,mem=24105M,billing=2 AllocTRES=cpu=1,mem=1000M "
    "CapWatts=n/a CurrentWatts=0 AveWatts=0 ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s"
)
PARTITION = (
    "PartitionName=debug AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL AllocNodes=ALL Default=YES "
    "QoS=N/A DefaultTime=NONE DisableRootJobs=NO ExclusiveUser=NO GraceTime=0 Hidden=NO "
    "MaxNodes=UNLIMITED MaxTime=UNLIMITED MinNodes=0 LLN=NO MaxCPUsPerNode=UNLIMITED Nodes=vm "
    "PriorityJobFactor=1 PriorityTier=1 RootOnly=NO ReqResv=NO OverSubscribe=NO OverTimeLimit=NONE "
    "PreemptMode=OFF State=UP TotalCPUs=2 TotalNodes=1 SelectTypeParameters=NONE JobDefaults=(null) "
    "DefMemPerNode=UNLIMITED MaxMemPerNode=UNLIMITED TRES=cpu=2,mem=24105M,node=1,billing=2"
)
COMMENT = comment_for("p1")


def _node(name: str, state: str = "IDLE", gres: str = "(null)", used: str = "(null)",
          cpus: int = 8, alloc: int = 0, mem: int = 32000, alloc_mem: int = 0,
          partitions: str = "batch") -> str:
    return (f"NodeName={name} CPUAlloc={alloc} CPUTot={cpus} Gres={gres} GresUsed={used} "
            f"RealMemory={mem} AllocMem={alloc_mem} State={state} Partitions={partitions} Reason=Not responding")


# ---------------------------------------------------------------- scontrol lines


def test_scontrol_line_values_may_hold_spaces_and_are_stripped() -> None:
    fields = parse_scontrol_line(NODE_IDLE)
    assert fields["CoresPerSocket"] == "2"  # padded by scontrol: "CoresPerSocket=2  CPUAlloc=0"
    assert fields["OS"] == "Linux 6.18.44-fc-v657 #1 SMP PREEMPT_DYNAMIC @0"
    assert fields["AllocTRES"] == ""
    assert fields["CfgTRES"] == "cpu=2,mem=24105M,billing=2"
    assert parse_scontrol_line("") == {}


def test_default_partition() -> None:
    other = PARTITION.replace("PartitionName=debug", "PartitionName=gpu").replace("Default=YES", "Default=NO")
    assert default_partition(parse_scontrol_lines(f"{other}\n{PARTITION}\n")) == "debug"
    assert default_partition(parse_scontrol_lines(other)) is None


# ---------------------------------------------------------------- names


@pytest.mark.parametrize("job_id, epoch", [("abc", 1), ("a-e1", 12), ("x-e", 0), ("j.1_2-3", 7)])
def test_job_name_round_trip(job_id: str, epoch: int) -> None:
    assert parse_job_name(job_name(job_id, epoch)) == (job_id, epoch)


@pytest.mark.parametrize("name", ["wrap", "irisfed-", "irisfed-abc", "irisfed-abc-e", "irisfed--e1",
                                  "irisfed-abc-ex", "other-abc-e1", "irisfed-abc-e١"])
def test_other_names_are_no_runs(name: str) -> None:
    assert parse_job_name(name) is None


def test_sbatch_job_id() -> None:
    assert sbatch_job_id("42\n") == "42"
    assert sbatch_job_id("42;cluster\n") == "42"
    with pytest.raises(ValueError, match="not a job id"):
        sbatch_job_id("Submitted batch job 42\n")


def test_output_paths_escape_slurm_patterns() -> None:
    assert output_path("/w/100%/a/stdout") == "/w/100%%/a/stdout"


# ---------------------------------------------------------------- squeue lines


def test_squeue_lines_of_ours_only() -> None:
    text = (
        "4|CANCELLED|0||None|cancelme|(null)\n"
        "1|FAILED|768|vm|NonZeroExitCode|irisfed-a-e1|irisfed:p1\n"
        "3|FAILED|9|vm|None|irisfed-c-e2|irisfed:p2\n"  # another peer's
        "2|RUNNING|0|gn[1-2]|None|irisfed-b-e1|irisfed:p1\n"
        "5|PENDING|0||Resources|irisfed-g-e1|irisfed:p1\n"
        "7_1|RUNNING|0|vm|None|irisfed-arr-e1|irisfed:p1\n"  # an array task: none of ours
        "garbage\n"
    )
    assert parse_squeue(text, COMMENT) == [
        SlurmJob("1", "FAILED", 768, "a", 1, "vm", "NonZeroExitCode"),
        SlurmJob("2", "RUNNING", 0, "b", 1, "gn[1-2]", "None"),
        SlurmJob("5", "PENDING", 0, "g", 1, "", "Resources"),
    ]


def test_squeue_names_and_comments_may_hold_pipes() -> None:
    ours = comment_for("p|1")
    assert parse_squeue_line("5|PENDING|0||None|irisfed-j-e3|irisfed:p|1", ours) == SlurmJob(
        "5", "PENDING", 0, "j", 3, "", "None")
    # A name ending in our comment, with another comment, is not ours.
    assert parse_squeue_line("6|RUNNING|0|vm|None|irisfed-j-e3|irisfed:p|1|(null)", ours) is None
    assert parse_squeue_line("6|RUNNING|0|vm|None|irisfed-j-e3|irisfed:p1 extra", COMMENT) is None
    # The format of an agent before node lists: not ours (never polled with this parser).
    assert parse_squeue_line("5|PENDING|0|irisfed-j-e3|irisfed:p1", COMMENT) is None


def test_live_and_terminal() -> None:
    assert SlurmJob("1", "RUNNING", 0, "a", 1).live
    assert SlurmJob("1", "COMPLETING", 0, "a", 1).live
    assert SlurmJob("1", "SOME_NEW_STATE", 0, "a", 1).live
    assert not SlurmJob("1", "CANCELLED", 15, "a", 1).live


@pytest.mark.parametrize("state, started", [
    ("PENDING", False), ("CONFIGURING", False), ("REQUEUE_HOLD", False),
    ("RUNNING", True), ("COMPLETING", True), ("SUSPENDED", True), ("COMPLETED", True), ("FAILED", True),
])
def test_a_job_has_started_once_slurm_runs_it(state: str, started: bool) -> None:
    assert SlurmJob("1", state, 0, "a", 1).started is started


def test_choose_run_prefers_live_then_the_given_id_then_the_latest() -> None:
    old = SlurmJob("9", "COMPLETED", 0, "a", 1)
    older = SlurmJob("3", "FAILED", 256, "a", 1)
    live = SlurmJob("5", "RUNNING", 0, "a", 1)
    assert choose_run([old, live, older]) == live
    assert choose_run([old, older]) == old
    assert choose_run([old, older], "3") == older
    assert choose_run([]) is None


# ---------------------------------------------------------------- how a run ended


@pytest.mark.parametrize("state, wait_status, expected", [
    ("COMPLETED", 0, Outcome(0)),
    ("FAILED", 3 << 8, Outcome(3)),  # squeue exit_code 768, scontrol ExitCode=3:0
    ("FAILED", 9, Outcome(-9)),  # killed by SIGKILL (scontrol 0:9)
    ("FAILED", 0, Outcome(1)),  # failed without a status (could not start)
    ("OUT_OF_MEMORY", 9, Outcome(-9)),
    ("TIMEOUT", 15, Outcome(-15)),
    ("DEADLINE", 0, Outcome(1)),
    ("CANCELLED", 15, Outcome(KILLED_EXIT_CODE)),
    ("CANCELLED", 0, Outcome(KILLED_EXIT_CODE)),  # cancelled while pending
    ("RUNNING", 0, None),
    ("PENDING", 0, None),
    ("SOMETHING_NEW", 0, None),
])
def test_outcome(state: str, wait_status: int, expected: Outcome | None) -> None:
    assert outcome(state, wait_status, "12", KILLED_EXIT_CODE) == expected


@pytest.mark.parametrize("state", ["NODE_FAIL", "BOOT_FAIL", "PREEMPTED"])
def test_infrastructure_endings_are_lost(state: str) -> None:
    ended = outcome(state, 0, "12", KILLED_EXIT_CODE)
    assert ended is not None and ended.exit_code is None
    assert state in ended.lost and "12" in ended.lost


@pytest.mark.parametrize("exit_status, code", [
    ("0\n", 0), ("3\n", 3), ("255", 255), ("-15\n", -15), (" 7 \n", 7),
])
def test_a_forgotten_run_with_an_exit_status_ends_with_it(exit_status: str, code: int) -> None:
    assert forgotten_outcome("12", "12\n", exit_status, "/w/j/epoch-1") == Outcome(code)
    assert forgotten_outcome("12", None, exit_status, "/w/j/epoch-1") == Outcome(code)  # marker gone: still ended


def test_a_forgotten_run_that_started_without_an_exit_status_has_an_unknown_outcome() -> None:
    ended = forgotten_outcome("12", "12\n", None, "/w/j/epoch-1")
    assert ended == Outcome(None, unknown="Slurm forgot job 12 after it started; its outcome is unknown "
                                          "(no exit status in /w/j/epoch-1)")
    # Adopted with no Slurm id at hand: the started marker names the job.
    assert "Slurm forgot job 34 after it started" in forgotten_outcome("", "34\n", None, "/d").unknown
    assert "Slurm forgot the job after it started" in forgotten_outcome("", "", None, "/d").unknown
    assert "Slurm forgot the job" in forgotten_outcome("", "$(x)\n", None, "/d").unknown


@pytest.mark.parametrize("exit_status", ["", "ok", "1e3", "256", "-65", "12345", "0x1", "\u0661"])
def test_an_unreadable_exit_status_is_an_unknown_outcome_never_a_retry(exit_status: str) -> None:
    for started in ("12\n", None):
        ended = forgotten_outcome("12", started, exit_status, "/d")
        assert ended.exit_code is None and not ended.lost
        assert "outcome is unknown (unreadable exit status" in ended.unknown


def test_a_forgotten_run_that_never_started_is_lost() -> None:
    ended = forgotten_outcome("12", None, None, "/w/j/epoch-1")
    assert ended == Outcome(None, "Slurm no longer knows job 12, and it never started (nothing in /w/j/epoch-1)")


# ---------------------------------------------------------------- GRES and nodes


@pytest.mark.parametrize("text, counts, types", [
    ("gpu:h100:4", {"gpu": 4}, {"gpu": ["h100"]}),
    ("gpu:h100:2(IDX:0-1)", {"gpu": 2}, {"gpu": ["h100"]}),
    ("gpu:h100:0(IDX:N/A)", {"gpu": 0}, {"gpu": ["h100"]}),
    ("gpu:4", {"gpu": 4}, {}),
    ("gpu:a100:2(S:0-1),gpu:h100:4(S:0,1),fpga:2", {"gpu": 6, "fpga": 2}, {"gpu": ["a100", "h100"]}),
    ("gpu:a100_3g.20gb:7", {"gpu": 7}, {"gpu": ["a100_3g.20gb"]}),
    ("gpu:h100", {"gpu": 1}, {"gpu": ["h100"]}),
    ("mps:1K", {"mps": 1024}, {}),
    ("(null)", {}, {}),
    ("", {}, {}),
])
def test_parse_gres(text: str, counts: dict, types: dict) -> None:
    assert parse_gres(text) == (counts, types)


@pytest.mark.parametrize("state, usable", [
    ("IDLE", True), ("MIXED", True), ("ALLOCATED", True), ("IDLE+COMPLETING", True),
    ("IDLE+DRAIN", False), ("MIXED+DRAIN", False), ("DOWN", False), ("DOWN*", False),
    ("IDLE*", False), ("IDLE+NOT_RESPONDING", False), ("INVAL", False), ("FAIL", False), ("", False),
])
def test_node_usable(state: str, usable: bool) -> None:
    assert node_usable(state) is usable


def test_real_node_lines() -> None:
    [idle] = parse_nodes(NODE_IDLE)
    assert (idle.name, idle.partitions, idle.usable) == ("vm", ("debug",), True)
    assert idle.total == {"cpu": 2, "memory_mb": 24105, "gpu": 4}
    assert idle.used == {"cpu": 0, "memory_mb": 0, "gpu": 0}
    assert idle.gpu_types == ("h100",)
    found = capacity(parse_nodes(NODE_BUSY))
    assert found.resources == {"cpu": (2, 1), "memory_mb": (24105, 23105), "gpu": (4, 2)}
    assert found.attributes() == {"device_type": ["gpu"], "device_variant": ["h100"]}
    assert found.shapes == [{"cpu": 2, "memory_mb": 24105, "gpu": 4}]


def test_capacity_counts_unusable_nodes_in_total_only() -> None:
    text = "\n".join([
        _node("a", gres="gpu:a100:2,fpga:1", used="gpu:a100:1(IDX:0),fpga:0", alloc=2, alloc_mem=1000),
        _node("b", state="DOWN*", gres="gpu:h100:4"),
        _node("c", state="IDLE+DRAIN", cpus=4, mem=8000),
        _node("d", cpus=16, mem=64000),
        "No nodes in the system",
    ])
    found = capacity(parse_nodes(text))
    assert found.resources == {
        "cpu": (36, 6 + 16), "memory_mb": (136000, 31000 + 64000), "gpu": (6, 1), "fpga": (1, 1),
    }
    assert found.attributes() == {"device_type": ["gpu"], "device_variant": ["a100", "h100"]}


def test_cpu_only_nodes() -> None:
    found = capacity(parse_nodes(_node("a")))
    assert found.attributes() == {"device_type": ["cpu"]}
    assert "gpu" not in found.resources


# ---------------------------------------------------------------- what a run asks


def test_slurm_request_and_its_options() -> None:
    assert slurm_request({"cpu": 1}, 1024) == {"cpu": 1, "memory_mb": 1024}
    assert slurm_request({"cpu": 0.5}, 1024) == {"cpu": 1, "memory_mb": 1024}
    assert slurm_request({"cpu": 0}, 1024) == {"cpu": 1, "memory_mb": 1024}
    assert slurm_request({"cpu": 2.5, "gpu": 2}, 1024) == {"cpu": 3, "memory_mb": 3072, "gpu": 2}
    assert slurm_request({"cpu": 3, "memory_mb": 500, "tpu": 1}, 1024) == {"cpu": 3, "memory_mb": 500, "tpu": 1}
    assert slurm_request({}, 1024) == {"cpu": 1, "memory_mb": 1024}
    assert resource_args({"cpu": 1, "memory_mb": 1024}) == ["-c", "1", "--mem=1024"]
    assert resource_args({"cpu": 2, "memory_mb": 9, "fpga": 1, "gpu": 2}) == [
        "-c", "2", "--mem=9", "--gres=fpga:1,gpu:2"]


def test_misfit_names_the_resource_and_the_largest_node() -> None:
    shapes = [{"cpu": 64, "memory_mb": 256000}, {"cpu": 8, "memory_mb": 64000, "gpu": 4}]
    assert misfit({"cpu": 8, "memory_mb": 8192, "gpu": 4}, shapes, "p") is None
    why = misfit({"cpu": 1, "memory_mb": 1024, "gpu": 8}, shapes, "p")
    assert why == "the job does not fit one node of Slurm partition p: gpu: asked 8, the largest node has 4"
    why = misfit({"cpu": 16, "memory_mb": 1024, "gpu": 1}, shapes, "p")
    assert why is not None and "no single node" in why and "cpu=16" in why and "gpu=1" in why
    assert "tpu: asked 1, the largest node has 0" in misfit({"cpu": 1, "tpu": 1}, shapes, "p")
    assert misfit({"cpu": 1}, [], "p") == "Slurm partition p has no nodes"


# ---------------------------------------------------------------- the batch script
# Its text; run by a real shell it is tests/integration/test_slurm_batch_script.py.


def test_script_has_no_carriage_return_and_no_directive_before_its_first_command() -> None:
    text = batch_script(["echo", "#SBATCH\r\n"], {"A": "\n#SBATCH --gres=gpu:4\r\n"}, "/w/j/epoch-1")
    assert "\r" not in text
    lines = text.splitlines()
    assert lines[0] == "#!/bin/sh" and lines[1].startswith("# Written by")
    assert lines[2].startswith(f"printf '%s\\n' \"${{SLURM_JOB_ID-}}\" > /w/j/epoch-1/{STARTED_MARKER} ||")
    assert lines[3].startswith("export A=")


def _command_line(text: str) -> str:
    lines = text.splitlines()
    return lines[lines.index("trap 'irisfed_signal=15' TERM") + 1]


def test_script_uses_env_only_for_names_sh_cannot_export() -> None:
    plain = batch_script(["prog", "x"], {"A": "1"}, "/d")
    assert _command_line(plain) == "(exec prog x)"
    odd = batch_script(["prog"], {"A": "1", "b-c": "2"}, "/d")
    assert _command_line(odd) == "(exec /usr/bin/env -- b-c=2 prog)"
    assert _command_line(batch_script(["-dash"], {}, "/d")) == "(exec /usr/bin/env -- -dash)"


@pytest.mark.parametrize("command, env, message", [
    ([], {}, "no command"),
    (["a=b"], {"b-c": "1"}, "holds '='"),
    (["-a=b"], {}, "holds '='"),
    (["echo"], {"A=B": "1"}, "holds '='"),
    (["echo"], {"": "1"}, "empty"),
    (["echo", "a\0b"], {}, "NUL"),
    (["echo"], {"A": "a\0b"}, "NUL"),
])
def test_script_refuses_what_cannot_be_passed(command: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(ScriptError, match=message):
        batch_script(command, env, "/d")


def test_program_with_equals_is_fine_without_odd_names() -> None:
    assert _command_line(batch_script(["./a=b"], {"A": "1"}, "/d")) == "(exec ./a=b)"


def test_shell_word() -> None:
    assert shell_word("plain") == "plain"
    assert shell_word("") == "''"
    assert shell_word("a\rb") == "a\"$(printf '\\r')\"b"


def test_slurm_commands_and_so_jobs_get_only_passed_through_and_slurm_settings():
    from irisfed.services.peer_agent.backends.slurm import client_env

    env = client_env({"PATH": "/bin", "HOME": "/root", "SLURM_CONF": "/etc/slurm.conf", "SBATCH_ACCOUNT": "a",
                      "IRISFED_DATABASE_URL": "postgres://agent:secret@db", "AWS_SECRET_ACCESS_KEY": "k",
                      "PYENV_SHELL": "bash"})
    assert env == {"PATH": "/bin", "HOME": "/root", "SLURM_CONF": "/etc/slurm.conf", "SBATCH_ACCOUNT": "a"}


# ---------------------------------------------------------------- nodes as node groups (gangs)
# Lines of the test cluster's gang partition (`scontrol show node -o -d`): gn1 and gn2
# alike (rack:a), gn3 with `rack=b,ssd`; gn1 runs a task holding 1 CPU, 1 GB and 1 GPU.

def _gang_node(name: str, features: str, alloc: int = 0, alloc_mem: int = 0, gpus_used: int = 0,
               state: str = "IDLE") -> str:
    return (f"NodeName={name} Arch=x86_64 CoresPerSocket=2  CPUAlloc={alloc} CPUEfctv=2 CPUTot=2 CPULoad=2.80 "
            f"AvailableFeatures={features} ActiveFeatures={features} Gres=gpu:h100:2 GresDrain=N/A "
            f"GresUsed=gpu:h100:{gpus_used}(IDX:{'0' if gpus_used else 'N/A'}) NodeAddr=127.0.0.1 "
            f"NodeHostName={name} Port=49979 Version=22.05.8 OS=Linux 6.18.44-fc-v1252 #1 SMP PREEMPT_DYNAMIC @0  "
            f"RealMemory=4096 AllocMem={alloc_mem} FreeMem=19872 Sockets=1 Boards=1 State={state} ThreadsPerCore=1 "
            f"TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A Partitions=gang  CfgTRES=cpu=2,mem=4G,billing=2 AllocTRES=")


GANG_NODES = "\n".join([_gang_node("gn1", "rack:a", alloc=1, alloc_mem=1024, gpus_used=1, state="MIXED"),
                        _gang_node("gn2", "rack:a"), _gang_node("gn3", "rack=b,ssd")])


def test_node_features_are_attributes() -> None:
    gn1, gn2, gn3 = parse_nodes(GANG_NODES)
    assert gn1.features == ("rack:a",) and gn3.features == ("rack=b", "ssd")
    assert gn1.attributes() == {"rack": ["a"]}
    assert gn3.attributes() == {"rack": ["b"], "feature": ["ssd"]}
    assert parse_nodes(NODE_IDLE)[0].attributes() == {}  # AvailableFeatures=(null)


@pytest.mark.parametrize("feature, attribute", [
    ("rack:a", ("rack", "a")), ("zone=us-east1", ("zone", "us-east1")), ("ssd", ("feature", "ssd")),
    ("slice:v5e:a", ("slice", "v5e:a")), ("k=v:w", ("k", "v:w")), (":a", ("feature", ":a")),
    ("a:", ("feature", "a:")),
])
def test_feature_attribute(feature: str, attribute: tuple[str, str]) -> None:
    assert feature_attribute(feature) == attribute


def test_features_a_constraint_could_not_name_are_left_out() -> None:
    assert parse_features("rack:a,x|y,a&b,[c],ok,(null)") == ("rack:a", "ok")
    assert parse_features("(null)") == ()


def test_node_groups_count_identical_nodes_together() -> None:
    idle = GANG_NODES.replace("MIXED", "IDLE").replace("CPUAlloc=1", "CPUAlloc=0").replace(
        "AllocMem=1024", "AllocMem=0").replace("gpu:h100:1(IDX:0)", "gpu:h100:0(IDX:N/A)")
    whole = {"cpu": {"total": 2, "free": 2}, "gpu": {"total": 2, "free": 2},
             "memory_mb": {"total": 4096, "free": 4096}}
    assert node_groups(parse_nodes(idle)) == [
        {"count": 1, "attributes": {"feature": ["ssd"], "rack": ["b"]}, "resources": whole},
        {"count": 2, "attributes": {"rack": ["a"]}, "resources": whole}]
    # gn1 runs a task: no longer like gn2, what it holds is not free.
    busy = Counter()
    for group in node_groups(parse_nodes(GANG_NODES)):
        busy[json.dumps(group["resources"], sort_keys=True)] += group["count"]
    assert busy == {json.dumps(whole, sort_keys=True): 2, json.dumps(
        {"cpu": {"total": 2, "free": 1}, "gpu": {"total": 2, "free": 1}, "memory_mb": {"total": 4096, "free": 3072}},
        sort_keys=True): 1}


def test_node_groups_of_a_thousand_nodes_in_two_shapes_are_two_entries() -> None:
    lines = [_node(f"n{i}", cpus=64, partitions="p") for i in range(990)]
    lines += [_node(f"g{i}", gres="gpu:h100:8", used="gpu:h100:0", partitions="p") for i in range(10)]
    groups = node_groups(parse_nodes("\n".join(lines)))
    assert sorted(g["count"] for g in groups) == [10, 990]
    assert len(json.dumps(groups)) < 1024


def test_unusable_nodes_offer_nothing_free_in_their_group() -> None:
    [down] = node_groups(parse_nodes(_node("a", state="DOWN*")))
    assert down["resources"]["cpu"] == {"total": 8, "free": 0}


def test_gres_used_from_alloc_tres_when_gres_used_is_missing() -> None:
    assert tres_gres("cpu=1,mem=1G,gres/gpu=2,gres/gpu:h100=2,gres/fpga=1") == {"gpu": 2, "fpga": 1}
    assert tres_gres("") == {}
    [node] = parse_nodes("NodeName=a CPUTot=4 CPUAlloc=1 RealMemory=100 AllocMem=0 Gres=gpu:2 "
                         "AllocTRES=cpu=1,gres/gpu=1 State=MIXED Partitions=p")
    assert node.used["gpu"] == 1


@pytest.mark.parametrize("text, names", [
    ("gn[1-2]", ["gn1", "gn2"]),
    ("gn[1-3,5],vm", ["gn1", "gn2", "gn3", "gn5", "vm"]),
    ("n[08-10]", ["n08", "n09", "n10"]),
    ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
    ("vm", ["vm"]),
    ("", []), ("(null)", []), ("None", []),
])
def test_expand_hostlist(text: str, names: list[str]) -> None:
    assert expand_hostlist(text) == names


# ---------------------------------------------------------------- what a gang asks


def test_gang_args_are_one_task_a_node_with_each_task_s_resources() -> None:
    request = {"cpu": 2, "memory_mb": 2048, "gpu": 1}
    assert gang_args(4, request) == ["--nodes=4", "--ntasks=4", "--ntasks-per-node=1", "-c", "2", "--mem=2048",
                                     "--gres=gpu:1"]
    assert gang_args(2, {"cpu": 1, "memory_mb": 1024}, "[rack:a|rack=b]")[-1] == "--constraint=[rack:a|rack=b]"


# ---------------------------------------------------------------- time limit and stop (docs/design.md §3.7)


@pytest.mark.parametrize("time_limit_s, grace_s, args", [
    (None, 30, []),  # no limit: none in Slurm either (a partition's own may still apply)
    (90, 30, ["--time=3"]),  # ceil(120 / 60) + 1
    (1800, 30, ["--time=32"]),  # ceil(1830 / 60) + 1
    (7200, 600, ["--time=131"]),  # ceil(7800 / 60) + 1
    (60, 0, ["--time=2"]),  # exactly a minute: no minute more for float noise
    (1, 0, ["--time=2"]),
])
def test_a_time_limit_is_a_slurm_time_a_little_past_the_agent_s_own_stop(
        time_limit_s: float | None, grace_s: float, args: list[str]) -> None:
    assert time_limit_args(time_limit_s, grace_s) == args


def test_a_stop_sends_sigterm_alone_to_the_batch_shell_and_its_children_or_to_a_gang_s_shell_and_tasks() -> None:
    # A single run: the shell and the command under it (a single run has no job steps).
    assert term_commands("12", gang=False) == [["scancel", "--signal=TERM", "--full", "12"]]
    # A gang: its shell, then its steps (its tasks); never --full, which reaches srun, and
    # srun turns a SIGTERM into SIGKILL for every task.
    assert term_commands("12", gang=True) == [["scancel", "--signal=TERM", "--batch", "12"],
                                              ["scancel", "--signal=TERM", "12"]]
    assert not any("--full" in command for command in term_commands("12", gang=True))


def test_a_run_slurm_timed_out_is_the_job_s_failure_not_a_loss() -> None:
    ended = outcome("TIMEOUT", 15, "12", KILLED_EXIT_CODE)  # squeue exit_code 15: ExitCode=0:15
    assert ended == Outcome(-15) and not ended.lost and not ended.unknown
    # Stopped by the agent within its grace, the batch shell ends by SIGTERM itself:
    # FAILED 0:15, killed like a cancel.
    assert outcome("FAILED", 15, "12", KILLED_EXIT_CODE) == outcome("CANCELLED", 9, "12", KILLED_EXIT_CODE) == \
        Outcome(KILLED_EXIT_CODE)


def test_group_constraint_is_a_matching_or_of_the_key_s_features() -> None:
    nodes = parse_nodes(GANG_NODES)
    assert group_constraint("rack", nodes) == "[rack:a|rack=b]"
    assert group_constraint("feature", nodes) == "[ssd]"
    assert group_constraint("slice", nodes) is None


def test_gang_misfit_counts_nodes_that_fit_one_task_and_share_a_value() -> None:
    nodes = parse_nodes(GANG_NODES)
    one_cpu = {"cpu": 1, "memory_mb": 1024}
    assert gang_misfit(one_cpu, 3, "", nodes, "gang") is None
    assert gang_misfit(one_cpu, 2, "rack", nodes, "gang") is None
    assert gang_misfit(one_cpu, 3, "rack", nodes, "gang") == (
        "the gang needs 3 nodes of Slurm partition gang with cpu=1, memory_mb=1024 sharing one rack "
        "(its node features rack:VALUE): it has at most 2")
    assert "at most 0" in gang_misfit(one_cpu, 2, "slice", nodes, "gang")
    assert "at most 3" in gang_misfit(one_cpu, 4, "", nodes, "gang")
    assert "at most 0" in gang_misfit({"cpu": 4, "memory_mb": 1}, 2, "", nodes, "gang")  # by totals, not free


# ---------------------------------------------------------------- a gang's scripts
# Run by srun on a real cluster: tests/engines/test_slurm_gangs.py.


def test_gang_batch_script_runs_one_srun_step_that_kills_on_a_bad_exit() -> None:
    text = gang_batch_script("/w/j/epoch-1", 3, 2)
    lines = text.splitlines()
    assert lines[0] == "#!/bin/sh" and lines[1].startswith("# Written by")
    assert lines[2].startswith(f"printf '%s\\n' \"${{SLURM_JOB_ID-}}\" > /w/j/epoch-1/{STARTED_MARKER} ||")
    assert _command_line(text) == ("(exec srun --kill-on-bad-exit=1 --nodes=3 --ntasks=3 --ntasks-per-node=1 "
                                   "--cpus-per-task=2 /bin/sh /w/j/epoch-1/task.sh)")
    assert "export" not in text  # the job's environment is the task wrapper's, never srun's


def test_task_script_sets_the_task_s_variables_before_the_job_s_own() -> None:
    env = {"A": "1", "IRISFED_JOB_ID": "j", "IRISFED_TASK_INDEX": "forged", "IRISFED_COORDINATOR": "x:1",
           "IRISFED_OUTPUT_DIR": "/forged"}
    text = task_script(["prog", "x y"], env, "/w/j/epoch-1")
    lines = text.splitlines()
    assert lines[3] == ('cd /w/j/epoch-1 && command -p mkdir -p "task-${SLURM_PROCID-}" && cd "task-${SLURM_PROCID-}" '
                        "|| { printf 'irisfed: cannot enter %s: the task was not run\\n' \"task-${SLURM_PROCID-}\" "
                        ">&2; exit 1; }")
    assert lines[4] == "exec >stdout 2>stderr"
    assert lines[5].startswith(f"printf '%s\\n' \"${{SLURMD_NODENAME-}}\" > {STARTED_MARKER} ||")
    task_vars = lines.index('export IRISFED_COORDINATOR="${SLURM_LAUNCH_NODE_IPADDR-}:'
                            '$((20000 + ${SLURM_JOB_ID:-0} % 10000))"')
    assert lines[task_vars - 1].startswith('export IRISFED_TASK_INDEX="${SLURM_PROCID-}"')
    assert lines[task_vars + 1] == 'command -p mkdir -p outputs && export IRISFED_OUTPUT_DIR="$PWD/outputs"'
    assert lines[task_vars + 2:task_vars + 4] == ["export A=1", "export IRISFED_JOB_ID=j"]
    assert "forged" not in text and "x:1" not in text
    assert _command_line(text) == "(exec prog 'x y')"
    in_workspace = task_script(["prog", "x y"], env, "/w/j/epoch-1", workspace=True)
    assert _command_line(in_workspace) == "(cd -- workspace && exec prog 'x y')"
    assert (f"printf '%s\\n' \"$irisfed_code\" > {EXIT_STATUS_FILE}.tmp && command -p mv -f "
            f"{EXIT_STATUS_FILE}.tmp {EXIT_STATUS_FILE}") in lines
    # Ended by Slurm (a sibling failed): srun hears 0, so its exit code stays the sibling's.
    assert lines[-2:] == ['[ -z "$irisfed_signal" ] || exit 0', 'exit "$irisfed_status"']


def test_task_script_refuses_what_cannot_be_passed() -> None:
    with pytest.raises(ScriptError, match="no command"):
        task_script([], {}, "/d")


def test_the_single_run_script_is_unchanged_by_gangs() -> None:
    assert batch_script(["prog", "x"], {"A": "1"}, "/d") == (
        "#!/bin/sh\n"
        "# Written by the irisfed peer agent: a start marker, the job's environment, its command, its exit.\n"
        "printf '%s\\n' \"${SLURM_JOB_ID-}\" > /d/irisfed-started || { printf 'irisfed: cannot write %s: "
        "the command was not run\\n' /d/irisfed-started >&2; exit 1; }\n"
        "export A=1\n"
        "irisfed_signal=\n"
        "trap 'irisfed_signal=15' TERM\n"
        "(exec prog x)\n"
        "irisfed_status=$?\n"
        '[ "$irisfed_status" != 143 ] || irisfed_signal=15\n'
        "irisfed_code=$irisfed_status\n"
        '[ -z "$irisfed_signal" ] || irisfed_code=-$irisfed_signal\n'
        "printf '%s\\n' \"$irisfed_code\" > /d/irisfed-exit-status.tmp && command -p mv -f "
        "/d/irisfed-exit-status.tmp /d/irisfed-exit-status\n"
        '[ -z "$irisfed_signal" ] || { trap - TERM; kill -s TERM "$$"; }\n'
        'exit "$irisfed_status"\n')


@pytest.mark.parametrize("text, gang", [
    ("2 300 1733412345.125\n", GangFile(2, 300.0, 1733412345.125)),
    ("4096 2.5 1733412345\n", GangFile(4096, 2.5, 1733412345.0)),
    (None, None), ("", None), ("0 1 1\n", None), ("4097 1 1\n", None), ("2 1\n", None), ("two 1 1\n", None),
    ("2 1 1e9\n", None), ("2 -1 1\n", None),
])
def test_gang_file(text: str | None, gang: GangFile | None) -> None:
    assert parse_gang_file(text) == gang


def test_gang_file_round_trip() -> None:
    gang = GangFile(3, 300.0, 1733412345.5)
    assert gang_file_text(gang) == "3 300.000 1733412345.500\n"
    assert parse_gang_file(gang_file_text(gang)) == gang


# ---------------------------------------------------------------- a gang's outcome and tasks


def _ran(code: int | None, node: str = "gn1", at: int = 0) -> TaskRecord:
    return TaskRecord(f"{node}\n", None if code is None else f"{code}\n", at)


def test_a_gang_fails_with_its_first_failing_task_s_exit_code() -> None:
    records = [_ran(-15, "gn1", 300), _ran(3, "gn2", 200), _ran(5, "gn3", 250)]
    assert gang_outcome(Outcome(143), False, records, "12") == Outcome(3)  # srun's own status aside
    assert gang_outcome(Outcome(-15), False, records, "12") == Outcome(3)  # the batch shell ended by TERM


def test_a_gang_s_success_cancel_loss_and_unknown_outcome_are_the_job_s() -> None:
    records = [_ran(0), _ran(3, "gn2")]
    assert gang_outcome(Outcome(0), False, records, "12") == Outcome(0)
    assert gang_outcome(Outcome(KILLED_EXIT_CODE), True, records, "12") == Outcome(KILLED_EXIT_CODE)
    lost = Outcome(None, "Slurm job 12 ended NODE_FAIL: not the job's fault")
    assert gang_outcome(lost, False, records, "12") == lost
    unknown = Outcome(None, unknown="Slurm forgot job 12 ...")
    assert gang_outcome(unknown, False, records, "12") == unknown


def test_a_gang_whose_tasks_did_not_all_start_is_lost_unless_one_failed() -> None:
    never = [_ran(-15), TaskRecord()]
    assert gang_outcome(Outcome(1), False, never, "12") == Outcome(
        None, "Slurm job 12 ended with 1 of its 2 tasks never started (task 1 first): not the job's fault")
    assert gang_outcome(Outcome(1), False, [_ran(7), TaskRecord()], "12") == Outcome(7)
    # Every task ran and was ended by SIGTERM (the time limit): the job's own outcome.
    assert gang_outcome(Outcome(-15), False, [_ran(-15), _ran(-15)], "12") == Outcome(-15)
    assert gang_outcome(Outcome(2), False, [], "12") == Outcome(2)  # task folders unreadable


def test_gang_tasks_while_pending_running_and_once_ended() -> None:
    pending = gang_tasks(2, False, None, (), [], "/w/j/epoch-1")
    assert pending == [TaskStatus(0, None, "pending", None, "/w/j/epoch-1/task-0"),
                       TaskStatus(1, None, "pending", None, "/w/j/epoch-1/task-1")]
    running = gang_tasks(2, True, None, (), ["gn1", "gn2"], "/w/j/epoch-1")
    assert [(t.node, t.state) for t in running] == [("gn1", "running"), ("gn2", "running")]
    records = [_ran(-15, "gn1"), _ran(1, "gn2")]
    ended = gang_tasks(2, True, Outcome(1), records, ["gn1", "gn2"], "/w/j/epoch-1")
    assert [(t.index, t.node, t.state, t.exit_code) for t in ended] == [
        (0, "gn1", "killed", -15), (1, "gn2", "failed", 1)]


def test_gang_tasks_without_an_exit_status_take_the_gang_s_fate() -> None:
    def states(ended: Outcome) -> list[tuple[str, int | None]]:
        tasks = gang_tasks(2, True, ended, [_ran(None), TaskRecord()], ["gn1", "gn2"], "/d")
        return [(t.state, t.exit_code) for t in tasks]
    assert states(Outcome(0)) == [("succeeded", 0), ("succeeded", 0)]
    assert states(Outcome(None, "lost")) == [("lost", None), ("lost", None)]
    assert states(Outcome(None, unknown="unknown")) == [("failed", None), ("failed", None)]
    assert states(Outcome(KILLED_EXIT_CODE)) == [("killed", None), ("killed", None)]


def test_a_task_s_node_is_what_it_recorded_if_it_is_a_node_name() -> None:
    records = [TaskRecord("gn9\n"), TaskRecord("$(x)\n"), TaskRecord("")]
    tasks = gang_tasks(3, True, None, records, ["gn1", "gn2"], "/d")
    assert [t.node for t in tasks] == ["gn9", "gn2", None]


def test_a_batch_script_runs_its_command_in_its_workspace_copy_and_records_beside_it() -> None:
    text = batch_script(["python3", "train.py"], {"A": "1"}, "/w/j/epoch-1", "/w/j/epoch-1/work space")
    assert _command_line(text) == "(cd -- '/w/j/epoch-1/work space' && exec python3 train.py)"
    assert f"/w/j/epoch-1/{EXIT_STATUS_FILE}" in text  # the shell's own files stay in the run folder
    with pytest.raises(ScriptError, match="NUL"):
        batch_script(["true"], {}, "/w", "/w/\0x")
