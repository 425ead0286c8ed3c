"""What the Slurm backend reads from and writes to Slurm (services/peer_agent/backends/slurm_text.py).

Sample lines are real answers of the Slurm 22.05 test cluster (tooling/engines/slurm.py).
"""

from __future__ import annotations

import pytest

from irisfed.services.peer_agent.backends import KILLED_EXIT_CODE
from irisfed.services.peer_agent.backends.slurm_text import (
    STARTED_MARKER,
    Outcome,
    ScriptError,
    SlurmJob,
    batch_script,
    capacity,
    choose_run,
    comment_for,
    default_partition,
    forgotten_outcome,
    job_name,
    misfit,
    node_usable,
    outcome,
    output_path,
    parse_gres,
    parse_job_name,
    parse_nodes,
    parse_scontrol_line,
    parse_scontrol_lines,
    parse_squeue,
    parse_squeue_line,
    resource_args,
    sbatch_job_id,
    shell_word,
    slurm_request,
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
        "4|CANCELLED|0|cancelme|(null)\n"
        "1|FAILED|768|irisfed-a-e1|irisfed:p1\n"
        "3|FAILED|9|irisfed-c-e2|irisfed:p2\n"  # another peer's
        "2|RUNNING|0|irisfed-b-e1|irisfed:p1\n"
        "7_1|RUNNING|0|irisfed-arr-e1|irisfed:p1\n"  # an array task: none of ours
        "garbage\n"
    )
    assert parse_squeue(text, COMMENT) == [
        SlurmJob("1", "FAILED", 768, "a", 1),
        SlurmJob("2", "RUNNING", 0, "b", 1),
    ]


def test_squeue_names_and_comments_may_hold_pipes() -> None:
    ours = comment_for("p|1")
    assert parse_squeue_line("5|PENDING|0|irisfed-j-e3|irisfed:p|1", ours) == SlurmJob("5", "PENDING", 0, "j", 3)
    # A name ending in our comment, with another comment, is not ours.
    assert parse_squeue_line("6|RUNNING|0|irisfed-j-e3|irisfed:p|1|(null)", ours) is None
    assert parse_squeue_line("6|RUNNING|0|irisfed-j-e3|irisfed:p1 extra", COMMENT) is None


def test_live_and_terminal() -> None:
    assert SlurmJob("1", "RUNNING", 0, "a", 1).live
    assert SlurmJob("1", "COMPLETING", 0, "a", 1).live
    assert SlurmJob("1", "SOME_NEW_STATE", 0, "a", 1).live
    assert not SlurmJob("1", "CANCELLED", 15, "a", 1).live


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
