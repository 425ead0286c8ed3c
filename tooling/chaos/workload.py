"""What the chaos producers submit: short real jobs that log when they start and end.

Each job is some user's (world.SUBMITTERS): its ``chaos.user`` label names the user
whose subject it was sent on, so the checks can tell a spec that reached another
user's job. bob's jobs ask resources his quota counts; now and then one asks more cpu
than his whole quota, which the router must reject naming the quota.

Bands (§3.3): most jobs are ``batch``, some ``interactive`` (half of them leave the
field out: it is the default), and a few ``production``, from the users whose
``max_band`` allows it (world.MAX_BAND); so waiting work of a higher band finds
lower-band work to preempt. Some batch jobs allow few preemptions
(``max_preemptions`` 0 to 2), so a preemption also ends jobs ``failed``.

Gangs (§3.4): some jobs are gangs of 2 or 3 tasks on the peers with nodes (gpu-b runs
them as real processes, tpu simulates them), a two-task one sharing a ``slice`` half
the time; each task runs the same script (logging its job and epoch), so the run
watcher sees every task.

The run contract (§3.7): a few jobs have a time limit, some a grace of their own, and
half the failing ones failure retries.

Pipelines (§3.8): some submits are one user's chain of 2-4 jobs, each ``after`` the one
before (now and then also after the chain's first, or the first after an earlier job
of that user, most likely ended: settled at submit), on a condition drawn from
``ok``/``any``/``failed`` (``pipeline_edges``). The chain's first job fails (exits 1)
half the time, so dependents on ``ok`` end ``unschedulable`` (their own dependents with
them) while those on ``failed`` run; cancels, preemptions and rejections of chain jobs
settle their dependents too.

Arrays (§3.8): now and then a submit is one user's array of 3-6 jobs, at most 1-3 live
at once (``array_body``), of work that runs (no kind rejected by every peer); each
element's command reads ``IRISFED_ARRAY_INDEX`` to pick its own exit code, so on the
real peers some elements fail and others succeed (the simulated peers read one
``sim.exit_code`` label for all: there, an array with a failing element fails whole).
Some arrays wait for a job sent just before them (a held element's slot and its
dependencies then count together), some have a job ``after`` the array's base id (one
edge per element), and some are cancelled by their base id while they run.
"""

from __future__ import annotations

import random
from pathlib import Path

from irisfed.shared.bands import BATCH, INTERACTIVE, PRODUCTION, band_rank
from irisfed.shared.users import DEFAULT_USER
from irisfed.tooling.chaos.world import MAX_BAND, MAX_JOB_S, NODES, PEERS

# What every job runs on the subprocess peers ($1 seconds, exit $2, log to $3).
# The simulated peers read the same duration and exit code from the labels.
# The start line ends with the token of the workspace the run started in (its cwd's
# WORKSPACE_TOKEN file; "-" without one): invariant 14 compares it with the job's.
WORKSPACE_TOKEN = "ws-token"
# Its stdout (two lines, shipped into the federation) is read back by invariant 15's check.
JOB_SCRIPT = ('echo "start $IRISFED_JOB_ID $IRISFED_EPOCH $$ $PWD $(cat ' + WORKSPACE_TOKEN +
              ' 2>/dev/null || echo -)" >> "$3"; echo "out $IRISFED_JOB_ID $IRISFED_EPOCH"; sleep "$1"; '
              'echo "end $IRISFED_JOB_ID $IRISFED_EPOCH $$" >> "$3"; echo "done $IRISFED_JOB_ID $IRISFED_EPOCH"; '
              'exit "$2"')
WORKSPACE_P = 0.25  # of jobs run in their user's workspace (docs/design.md §3.5)

# Constraints only that peer satisfies (home has none: its work is LOCAL, placed by the router).
ONLY_ON = {
    "gpu-a": [{"key": "device_variant", "op": "eq", "value": "h100"}],
    "gpu-b": [{"key": "device_variant", "op": "eq", "value": "a100"}],
    "tpu": [{"key": "device_type", "op": "eq", "value": "tpu"}],
}
SENT_BY_LABEL = "chaos.user"  # the user whose subject the job was sent on
# bob's cpu asks (his quota: 2 cores), and how often he asks more than the whole quota.
BOB_CPU = (0.5, 1, 1.5)
OVER_QUOTA_CPU = 3
OVER_QUOTA_P = 0.05
# How often a job asks each band above batch (production only where its user may).
PRODUCTION_P = 0.12
INTERACTIVE_P = 0.28
# A batch job's max_preemptions, drawn from these (None: left out, the default 100).
MAX_PREEMPTIONS = (0, 1, 2, None, None, None)
# Where gangs go (the peers with nodes) and how many tasks they have.
GANG_PEERS = tuple(sorted(NODES))
GANG_TASKS = (2, 2, 3)
GROUP_BY_P = 0.5  # a two-task gang's nodes share one slice
# The run contract (§3.7): some jobs have a time limit (at times shorter than they run),
# a grace of their own, or failure retries (a failing job fails the same way each run).
TIME_LIMIT_P = 0.08
GRACE_P = 0.25
GRACES_S = (0, 0.5, 1.0)
FAILURE_RETRIES_P = 0.5  # of the failing jobs
# Pipelines (§3.8): how long a chain is, the conditions its edges draw from, how often
# its first job fails, a later job fails, a job also waits for the chain's first one,
# and the first waits for an earlier job of its user.
PIPELINE_LENGTHS = (2, 3, 3, 4)
WHENS = ("ok", "ok", "any", "failed")
PIPELINE_HEAD_FAILS_P = 0.5
PIPELINE_FAILS_P = 0.15
FAN_IN_P = 0.3
EARLIER_P = 0.25
# Arrays (§3.8): their sizes and limits (array_parallel), how often an element fails,
# the kinds of work they are (each runs somewhere), and how long each element lasts at
# least (so elements overlap, and a limit has something to hold back).
ARRAY_SIZES = (3, 4, 5, 6)
ARRAY_PARALLEL = (1, 2, 2, 3)
ARRAY_FAILS_P = 0.25
ARRAY_KINDS = ("gpu", "gpu", "variant", "only:gpu-a", "only:gpu-b", "local", "tpu", "gang")
ARRAY_MIN_S = 0.3
# An array's command: JOB_SCRIPT, its exit code ($2) picked by the element's index from a
# comma-separated list (one code per element).
ARRAY_SCRIPT = 'set -- "$1" "$(printf %s "$2" | cut -d, -f"$((IRISFED_ARRAY_INDEX + 1))")" "$3"; ' + JOB_SCRIPT


def draw_band(rng: random.Random, user: str) -> str:
    """A band ``user`` may ask for: mostly batch, some interactive, a few production."""
    draw = rng.random()
    if draw < PRODUCTION_P and band_rank(MAX_BAND[user]) >= band_rank(PRODUCTION):
        return PRODUCTION
    if draw < PRODUCTION_P + INTERACTIVE_P:
        return INTERACTIVE
    return BATCH


def job_body(rng: random.Random, job_id: str, run_log: Path, kind: str | None = None,
             pin: str | None = None, min_s: float = 0.0, user: str = DEFAULT_USER, band: str | None = None,
             fails: bool | None = None) -> dict:
    """A random job of ``user``; ``kind`` forces its kind (``only:PEER``: constrained to
    that peer alone); ``band``: its band (None: none asked, the default); ``fails``:
    whether it exits 1 (None: drawn)."""
    kind = kind or rng.choice(["local", "gpu", "gpu", "tpu", "pinned", "impossible", "variant", "gang", "gang"])
    if kind == "gang":
        kind = f"gang:{rng.choice(GANG_PEERS)}"
    duration = f"{rng.uniform(min_s, MAX_JOB_S):.2f}"
    drawn = rng.random() < 0.1
    exit_code = "1" if (drawn if fails is None else fails) else "0"
    body: dict = {
        "job_id": job_id,
        # Real on the subprocess peers; the simulated ones read the labels instead.
        "command": ["sh", "-c", JOB_SCRIPT, "chaos-job", duration, exit_code, str(run_log)],
        "max_retries": rng.randint(0, 2),
        "labels": {"sim.duration_s": duration, "sim.exit_code": exit_code, SENT_BY_LABEL: user},
        "priority": rng.randint(0, 3),
    }
    if kind in ("gpu", "tpu"):
        body["constraints"] = [{"key": "device_type", "op": "eq", "value": kind}]
    elif kind == "variant":
        body["constraints"] = [{"key": "device_variant", "op": "in", "value": ["h100", "a100"]}]
    elif kind == "pinned":
        body["cluster_pin"] = pin or rng.choice(sorted(PEERS))
    elif kind == "impossible":
        body["constraints"] = [{"key": "device_type", "op": "eq", "value": "fpga"}]
    elif kind.startswith("only:"):
        body["constraints"] = ONLY_ON[kind.split(":", 1)[1]]
    elif kind.startswith("gang:"):
        body["constraints"] = ONLY_ON[kind.split(":", 1)[1]]
        body["replicas"] = rng.choice(GANG_TASKS)
        if body["replicas"] == 2 and rng.random() < GROUP_BY_P:
            body["coschedule"] = {"group_by": "slice"}
    if user == "bob":
        resources: dict = {"cpu": rng.choice(BOB_CPU)}
        if kind in ("gpu", "variant", "only:gpu-a", "only:gpu-b"):
            resources["gpu"] = 1  # (not a gang's tasks: two would take bob past his quota of one)
        if rng.random() < OVER_QUOTA_P:
            resources["cpu"] = OVER_QUOTA_CPU
        body["resources"] = resources
    if rng.random() < TIME_LIMIT_P:
        body["time_limit_s"] = round(rng.uniform(0.5, MAX_JOB_S), 2)
    if rng.random() < GRACE_P:
        body["grace_s"] = rng.choice(GRACES_S)
    if exit_code != "0" and rng.random() < FAILURE_RETRIES_P:
        body["max_failure_retries"] = rng.randint(1, 2)
    if band is not None and (band != INTERACTIVE or rng.random() < 0.5):
        body["band"] = band
    if band == BATCH:
        most = rng.choice(MAX_PREEMPTIONS)
        if most is not None:
            body["max_preemptions"] = most
    return body


def pipeline_edges(rng: random.Random, length: int) -> list[list[tuple[int, str]]]:
    """A chain of ``length`` jobs: for each, the earlier ones it waits for, as (index in
    the chain, ``when``); every job after the first waits for the one before it, and
    now and then for the first one too."""
    chain: list[list[tuple[int, str]]] = [[]]
    for i in range(1, length):
        needs = [(i - 1, rng.choice(WHENS))]
        if i > 1 and rng.random() < FAN_IN_P:
            needs.append((0, rng.choice(WHENS)))
        chain.append(needs)
    return chain


def array_exit_codes(rng: random.Random, size: int) -> list[str]:
    """Each element's exit code: ``1`` now and then (ARRAY_FAILS_P), else ``0``."""
    return ["1" if rng.random() < ARRAY_FAILS_P else "0" for _ in range(size)]


def array_body(body: dict, codes: list[str], parallel: int | None) -> dict:
    """``body`` (a job_body) as an array of ``len(codes)`` jobs, at most ``parallel`` live
    at once (None: no limit), element ``i`` exiting ``codes[i]`` where it really runs
    (ARRAY_SCRIPT); the simulated peers' label says ``1`` when any element fails."""
    command = list(body["command"])
    command[2], command[5] = ARRAY_SCRIPT, ",".join(codes)
    failing = "1" if "1" in codes else "0"
    array = {**body, "command": command, "labels": {**body["labels"], "sim.exit_code": failing},
             "array": len(codes)}
    if parallel is not None:
        array["array_parallel"] = parallel
    return array
