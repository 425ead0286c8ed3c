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


def draw_band(rng: random.Random, user: str) -> str:
    """A band ``user`` may ask for: mostly batch, some interactive, a few production."""
    draw = rng.random()
    if draw < PRODUCTION_P and band_rank(MAX_BAND[user]) >= band_rank(PRODUCTION):
        return PRODUCTION
    if draw < PRODUCTION_P + INTERACTIVE_P:
        return INTERACTIVE
    return BATCH


def job_body(rng: random.Random, job_id: str, run_log: Path, kind: str | None = None,
             pin: str | None = None, min_s: float = 0.0, user: str = DEFAULT_USER, band: str | None = None) -> dict:
    """A random job of ``user``; ``kind`` forces its kind (``only:PEER``: constrained to
    that peer alone); ``band``: its band (None: none asked, the default)."""
    kind = kind or rng.choice(["local", "gpu", "gpu", "tpu", "pinned", "impossible", "variant", "gang", "gang"])
    if kind == "gang":
        kind = f"gang:{rng.choice(GANG_PEERS)}"
    duration = f"{rng.uniform(min_s, MAX_JOB_S):.2f}"
    exit_code = "1" if rng.random() < 0.1 else "0"
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
    if band is not None and (band != INTERACTIVE or rng.random() < 0.5):
        body["band"] = band
    if band == BATCH:
        most = rng.choice(MAX_PREEMPTIONS)
        if most is not None:
            body["max_preemptions"] = most
    return body
