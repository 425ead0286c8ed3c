"""A Slurm cluster in a folder, for backend tests (docs/design.md §7): one node in
partition ``debug``, and with ``gang_nodes`` that many more, each its own slurmd on
this host, in partition ``gang`` (multi-node jobs: gangs).

The config it writes, how its daemons start and stop, and the reference output of
the commands a backend parses live together: a change to one shows in the others.

``start_slurm(folder)`` writes ``slurm.conf`` and ``gres.conf`` into ``folder``
(its own ports, state, spool, logs, munge key and socket: nothing from /etc), then
starts munged, slurmctld and a slurmd per node as root, each in its own process
group, and returns a ``SlurmCluster`` once every node is idle (under a second on an
idle machine; ~1 s with three gang nodes). ``SlurmCluster.stop()`` cancels every
job and stops the daemons by their process groups. ``slurm_available()`` says why
it cannot (packages, root).

Several slurmd on one host (Debian's 22.05.8 build, measured): ``slurmd -N NAME``
runs the daemon as node NAME; each node's line names its own ``Port=`` (slurmd
listens on 0.0.0.0 there, so every node keeps ``NodeAddr=127.0.0.1``: distinct
loopback addresses are not needed); one ``slurm.conf`` serves all of them, as
``SlurmdSpoolDir``, ``SlurmdPidFile`` and ``SlurmdLogFile`` expand ``%n`` to the
node's name (a copy per node, differing in those, also works but makes slurmctld
log that each node's config differs from its own). ``SlurmdParameters=
config_overrides`` lets every node declare CPUs and memory of its own (all share
the host's 2 cores). Multi-node steps work across them: ``srun`` in a 2-node batch
job ran task 0 on gn1 and task 1 on gn2 (``SLURMD_NODENAME``), ``--constraint=
[rack:a|rack=b]`` kept both nodes on one rack, and ``--kill-on-bad-exit=1`` ended
the sibling of a task that exited 3 (SIGTERM; the job FAILED, ``ExitCode=3:0``).
Features may be ``KEY:VALUE`` or ``KEY=VALUE`` (``Features=rack=b`` is accepted).

Measured here (Slurm 22.05.8 and munge 0.5.15 from Debian 12, 2 cores):
``apt-get install -y slurm-wlm munge`` ~18 s (43 packages, ~10 MB, 46 MB on disk);
start to idle node 0.4-0.7 s; ``sbatch --wrap true`` to COMPLETED 2.7-3.3 s.

The cluster: one node (``slurmd -C``'s name, CPUs and memory; with ``spare_cpus``,
that many CPUs more than the machine has, declared one core each on one socket with
``SlurmdParameters=config_overrides``) in partition ``debug``; with ``gang_nodes``,
nodes ``gn1``... (``GANG_NODE`` each: 2 CPUs, 4096 MB, ``gpu:h100:2``; features
``rack:a`` on all but the last, which has ``rack=b,ssd``) in partition ``gang``;
``Gres=gpu:h100:4``
backed by ``gpus/gpuN`` symlinks to /dev/null (slurmd wants character devices:
with plain files it logs an error per GPU and jobs get no CUDA_VISIBLE_DEVICES),
``select/cons_tres`` with CR_Core_Memory, ``proctrack/linuxproc`` and ``task/none``
(no cgroups), no slurmdbd, ``DefMemPerCPU=256``, ``MinJobAge=3600``, ``KillWait=5``,
``EnforcePartLimits=ALL``.

What a backend runs and parses (with ``SLURM_CONF`` in the environment; the
config names munged's socket in ``AuthInfo``, so clients need nothing else):

Submit
    ``sbatch --parsable -J NAME -D WORKDIR -o OUT -e ERR -c CPUS --mem MB
    --gres=gpu:h100:N [-t MINUTES] [--comment TEXT] [--export=NONE|ALL,K=V] --wrap CMD``
    (or a script file). stdout ``<jobid>\\n`` (``<jobid>;<cluster>`` on a
    multi-cluster setup: split on ``;``), exit 0. Refused: exit 1 and
    ``sbatch: error: Batch job submission failed: <why>`` on stderr, e.g.
    ``Requested node configuration is not available`` (unknown GRES type or too
    many GPUs), ``More processors requested than permitted``, ``Memory
    specification can not be satisfied``. A refused submission still uses a job
    id: ``squeue -t all`` then lists it as FAILED, Reason ``BadConstraints``.
    Always pass ``--mem``: without ``DefMemPerCPU`` (real clusters vary) a job
    takes the whole node's memory. Jobs inherit the submitter's environment
    unless ``--export`` says otherwise; they see ``CUDA_VISIBLE_DEVICES`` and
    ``SLURM_JOB_GPUS`` (``0,1``), ``SLURM_JOB_ID``, ``SLURM_CLUSTER_NAME``.

List and poll
    ``squeue -h -t all -o '%i|%T|%r|%k|%j'`` → ``5|RUNNING|None|irisfed:abc|wrap``:
    id, state, reason, comment, name, one job a line; ``-t all`` keeps finished
    jobs (for MinJobAge). Names and comments may hold ``|``: keep free text last,
    or choose them yourself (``-J irisfed-<job>-e<epoch>`` makes ``list_runs``
    easy). ``squeue -h -j ID`` exits 1 with ``slurm_load_jobs error: Invalid job
    id specified`` once Slurm forgot the job. ``squeue --json`` exists (OpenAPI
    v0.0.38 here, key names change with the version) but ignores ``-j``/``-t`` in
    22.05: it always dumps every job.

One job
    ``scontrol show job -o ID``: one line of ``KEY=VALUE`` (values may hold
    spaces: ``parse_scontrol_line``). The keys that matter: ``JobState``,
    ``Reason``, ``ExitCode=<status>:<signal>`` (``3:0`` exited 3; ``0:9`` killed
    by SIGKILL; ``0:15`` cancelled while running or timed out), ``RunTime``,
    ``StartTime``, ``EndTime``, ``StdOut``, ``StdErr``, ``NodeList``,
    ``TRES=cpu=1,mem=100M,node=1,billing=1`` and ``TresPerNode=gres:gpu:h100:1``
    (the GPU request: without slurmdbd, GRES are not part of TRES, and
    ``AccountingStorageTRES=gres/gpu`` is refused). With ``-d`` while allocated:
    ``GRES=gpu:h100:2(IDX:0-1)``. Unknown or forgotten id: exit 1, stderr
    ``slurm_load_jobs error: Invalid job id specified``. Finished jobs stay
    MinJobAge seconds (3600 here, 300 by default).

Terminal state
    There is no ``sacct`` without slurmdbd (it prints ``Slurm accounting storage
    is disabled``), so read ``scontrol show job -o ID`` (above) before MinJobAge
    ends. This cluster also appends a line per finished job to
    ``log/jobcomp.log`` (``jobcomp/filetxt``: ``JobId=5 ... JobState=FAILED ...
    ExitCode=3:0``). On a real cluster with accounting:
    ``sacct -X -n -P -j ID -o JobID,State,ExitCode`` (State may read
    ``CANCELLED by 0``).

States (``JobState``)
    PENDING, RUNNING, SUSPENDED, COMPLETING (finishing; not terminal yet) are
    live. Terminal: COMPLETED (exit 0); FAILED (non-zero exit: Reason
    NonZeroExitCode, ``ExitCode=3:0``; a batch script killed by a signal showed
    Reason JobLaunchFailure, ``ExitCode=0:9``; refused at submit:
    BadConstraints); CANCELLED (``scancel``: ``ExitCode=0:15`` if it ran,
    ``0:0`` if it was pending); TIMEOUT (Reason TimeLimit, ``ExitCode=0:15``;
    limits are checked about every 30 s, so it ends up to ~30 s late); and, not
    produced by this cluster: NODE_FAIL, BOOT_FAIL, PREEMPTED, OUT_OF_MEMORY
    (needs cgroup memory enforcement), DEADLINE, and REQUEUED/REQUEUE_HOLD,
    RESIZING, REVOKED, SPECIAL_EXIT. A backend's exit code: ``-signal`` when
    the signal part is non-zero, else the status part (so a cancel gives -15,
    irisfed's ``KILLED_EXIT_CODE``); NODE_FAIL, BOOT_FAIL and PREEMPTED are the
    infrastructure's fault (retry), not the job's.

Cancel
    ``scancel ID``: SIGTERM, SIGKILL KillWait seconds later (5 here, 30 by
    default). Exits 0 even for an unknown or finished job, printing nothing.

Node capacity
    ``scontrol show node -o NAME``: ``CPUTot``, ``CPUAlloc``, ``RealMemory``,
    ``AllocMem``, ``FreeMem``, ``Gres=gpu:h100:4``, ``State`` (IDLE, MIXED,
    ALLOCATED, with ``+DRAIN`` etc.; INVAL when the config does not match the
    node), ``CfgTRES=cpu=2,mem=24105M,billing=2`` and ``AllocTRES=cpu=1,mem=100M``
    (no GPUs there, see above); with ``-d`` also ``GresUsed=gpu:h100:2(IDX:0-1)``.
    ``sinfo -h -N -o '%N|%T|%c|%m|%G|%C'`` → ``vm|mixed|2|24105|gpu:h100:4|1/1/0/2``
    (``%C``: allocated/idle/other/total CPUs).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from irisfed.services.peer_agent.backends.slurm_text import parse_scontrol_line
from irisfed.tooling.engines.procs import (
    Availability,
    EngineError,
    GroupProcess,
    kill_tagged,
    log_tail,
    spawn,
    wait_until,
)

# Debian's `slurm-wlm` (slurmctld, slurmd, the clients) and `munge` provide these.
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("munge", "sbatch", "squeue", "scontrol", "scancel", "sinfo")
INSTALL_HINT = "apt-get install -y slurm-wlm munge"

# A generous bound on a hang of a slow shared machine, not an expectation: the node
# is idle well under a second after start here.
START_TIMEOUT_S = 90.0
# Finished jobs stay in `scontrol show job` this long: without slurmdbd there is no
# `sacct`, so this is where a backend reads a terminal state and exit code.
MIN_JOB_AGE_S = 3600
# Seconds between SIGTERM and SIGKILL on `scancel` and at the time limit (Slurm's
# default is 30; short here so cancellation tests end quickly).
KILL_WAIT_S = 5
# Memory of a job that asks for none (Slurm's default is all of the node's).
DEF_MEM_PER_CPU_MB = 256
# Unix socket paths are limited to 108 bytes (sun_path) including the final NUL.
MAX_SOCKET_PATH = 107
# Each gang node: what it declares (config_overrides: every node shares the host's
# cores, and jobs here mostly sleep). Two GPUs each, backed by the same fake devices.
GANG_NODE = {"CPUs": "2", "Boards": "1", "SocketsPerBoard": "1", "CoresPerSocket": "2", "ThreadsPerCore": "1",
             "RealMemory": "4096"}
GANG_NODE_GPUS = 2
GANG_PARTITION = "gang"


# JobState values (`scontrol show job`, `squeue %T`). Live: may still change.
LIVE_STATES = frozenset({
    "PENDING", "CONFIGURING", "RUNNING", "SUSPENDED", "COMPLETING", "REQUEUED",
    "REQUEUE_FED", "REQUEUE_HOLD", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED",
})
# Terminal: the job is over. NODE_FAIL, BOOT_FAIL and PREEMPTED are the
# infrastructure's fault, not the job's.
TERMINAL_STATES = frozenset({
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL",
    "OUT_OF_MEMORY", "DEADLINE", "REVOKED", "SPECIAL_EXIT",
})


def slurm_available() -> Availability:
    """Can ``start_slurm`` work here? (the packages are installed, and we are root)."""
    missing = [name for name in DAEMONS + CLIENTS if _which(name) is None]
    if missing:
        return Availability(
            False, f"Slurm/munge not installed (missing {', '.join(missing)}): {INSTALL_HINT}"
        )
    if os.geteuid() != 0:
        return Availability(False, "starting slurmd/slurmctld/munged needs root")
    return Availability(True)


def _which(name: str) -> str | None:
    # The daemons live in /usr/sbin, which a non-login PATH may lack.
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


@dataclass
class SlurmCluster:
    """A running (or given) Slurm cluster and how to reach it.

    ``env`` is what a client needs on top of the caller's environment: ``SLURM_CONF``
    (the config names munged's socket in ``AuthInfo``, so clients need nothing else).
    ``processes`` is empty for a cluster we did not start; ``stop`` then does nothing.
    """

    conf_path: Path
    node_name: str
    partition: str
    cpus: int
    memory_mb: int
    gres: str  # as configured, e.g. "gpu:h100:4"
    folder: Path | None = None
    cluster_name: str = ""
    processes: list[GroupProcess] = field(default_factory=list)
    # A partition of several nodes (gangs: one task a node) and its nodes; "" / []: none.
    gang_partition: str = ""
    gang_nodes: list[str] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf_path)}

    def client_env(self) -> dict[str, str]:
        """The caller's environment plus ``env``: pass to subprocesses running clients."""
        return {**os.environ, **self.env}

    def run(self, *args: str, check: bool = True, timeout: float = 30.0) -> str:
        """Run a Slurm client (``sbatch``, ``squeue`` ...) against this cluster; its stdout."""
        done = subprocess.run(
            list(args), env=self.client_env(), capture_output=True, text=True,
            timeout=timeout, check=False,
        )
        if check and done.returncode != 0:
            raise EngineError(
                f"{' '.join(args)} exited {done.returncode}: {done.stderr.strip()}"
            )
        return done.stdout

    def node(self, name: str = "") -> dict[str, str]:
        """``scontrol show node -o`` of the node (or of node ``name``), as KEY -> VALUE."""
        return parse_scontrol_line(self.run("scontrol", "show", "node", "-o", name or self.node_name))

    def job(self, job_id: str) -> dict[str, str] | None:
        """``scontrol show job -o ID`` as KEY -> VALUE; None once Slurm forgot the job."""
        done = subprocess.run(
            ["scontrol", "show", "job", "-o", job_id], env=self.client_env(),
            capture_output=True, text=True, timeout=30, check=False,
        )
        if done.returncode != 0:
            if "Invalid job id" in done.stderr:
                return None
            raise EngineError(f"scontrol show job {job_id}: {done.stderr.strip()}")
        return parse_scontrol_line(done.stdout)

    def stop(self) -> None:
        """Cancel every job, then stop slurmd, slurmctld and munged by their process groups."""
        if not self.processes:
            return
        try:
            if all(p.running() for p in self.processes):
                self._cancel_all_jobs()
        finally:
            for process in reversed(self.processes):  # slurmd, slurmctld, munged
                process.stop(signal.SIGTERM)
            # What outlived slurmd (it crashed, or the cancel timed out): batch scripts
            # carry SLURM_CLUSTER_NAME; slurmstepd (in a session of its own, with an
            # empty environment) keeps our slurmd.log open.
            if self.cluster_name:
                kill_tagged("SLURM_CLUSTER_NAME", self.cluster_name)
            if self.folder is not None:
                _kill_stepds(self.folder)
            self.processes.clear()

    def _cancel_all_jobs(self) -> None:
        for partition in filter(None, (self.partition, self.gang_partition)):
            self.run("scancel", f"--partition={partition}", check=False)
        try:
            wait_until(
                lambda: not self.run("squeue", "-h", "-o", "%i", check=False).strip(),
                "every job to leave the queue", timeout=KILL_WAIT_S + 30,
            )
        except EngineError:
            pass  # stopping slurmd and the leftover sweep end them anyway


def connect_slurm(conf_path: Path) -> SlurmCluster:
    """An existing cluster (``SLURM_CONF``): its default partition and that partition's
    first node, as ``scontrol`` reports them. ``stop`` leaves it alone."""
    probe = SlurmCluster(conf_path=conf_path, node_name="", partition="", cpus=0,
                         memory_mb=0, gres="")
    partitions = [
        parse_scontrol_line(line)
        for line in probe.run("scontrol", "show", "partition", "-o").splitlines() if line.strip()
    ]
    if not partitions:
        raise EngineError(f"the Slurm cluster of {conf_path} has no partition")
    partition = next((p for p in partitions if p.get("Default") == "YES"), partitions[0])
    hosts = probe.run("scontrol", "show", "hostnames", partition["Nodes"]).split()
    probe.partition, probe.node_name = partition["PartitionName"], hosts[0]
    # Gangs: the default partition if it has several nodes, else the first that has.
    for candidate in sorted(partitions, key=lambda p: p is not partition):
        nodes = probe.run("scontrol", "show", "hostnames", candidate.get("Nodes", "")).split()
        if len(nodes) >= 2:
            probe.gang_partition, probe.gang_nodes = candidate["PartitionName"], nodes
            break
    node = probe.node()
    probe.cpus, probe.memory_mb = int(node["CPUTot"]), int(node["RealMemory"])
    probe.gres = "" if node.get("Gres") in (None, "(null)") else node["Gres"]
    return probe


def start_slurm(
    folder: Path, *, gpus: int = 4, gpu_type: str = "h100", partition: str = "debug",
    spare_cpus: int = 0, gang_nodes: int = 0, timeout: float = START_TIMEOUT_S,
) -> SlurmCluster:
    """Start munged, slurmctld and a slurmd per node (as root, each in its own process
    group) with config, state, logs and sockets all in ``folder``, on free ports; return
    once every node is idle. The node has this machine's CPUs and memory and ``gpus``
    fake GPUs of type ``gpu_type`` (GRES backed by symlinks to /dev/null), plus
    ``spare_cpus`` CPUs the machine lacks: room for a long idle job (the tests'
    time-limit run) that leaves the machine's CPUs to the rest. ``gang_nodes`` more
    nodes (``GANG_NODE``, each its own ``slurmd -N gnI`` on its own port) make partition
    ``GANG_PARTITION``, apart from ``partition`` so that its one node stays what
    single-node tests measure.
    """
    available = slurm_available()
    if not available:
        raise EngineError(available.reason)
    folder = folder.resolve()  # slurmctld/slurmd want an absolute -f
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o755)
    hardware = _declared(_hardware(), spare_cpus)
    node_name = hardware["NodeName"]
    gang_names = [f"gn{i + 1}" for i in range(gang_nodes)]
    cluster_name = "irisfed" + uuid.uuid4().hex[:8]  # also tags job processes, for stop()
    munge_dir = folder / "munge"
    socket_path = munge_dir / "munge.socket"
    if len(str(socket_path)) > MAX_SOCKET_PATH:
        raise EngineError(f"folder path too long for a unix socket: {socket_path}")
    for sub in ("state", "spool", "log", "gpus"):
        (folder / sub).mkdir(exist_ok=True)
    for name in [node_name, *gang_names]:  # slurmd wants its spool there before it makes its socket in it
        (folder / "spool" / name).mkdir(exist_ok=True)
    munge_dir.mkdir(exist_ok=True)
    os.chmod(munge_dir, 0o755)  # munged wants its socket folder reachable by all
    key = munge_dir / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    os.chmod(key, 0o600)
    gpu_files = []
    for i in range(max(gpus, GANG_NODE_GPUS if gang_names else 0)):
        gpu_file = folder / "gpus" / f"gpu{i}"
        _make_fake_device(gpu_file)
        gpu_files.append(gpu_file)

    conf = folder / "slurm.conf"
    ctld_port, slurmd_port, *gang_ports = _free_ports(2 + len(gang_names))
    conf.write_text(_slurm_conf(
        folder=folder, cluster_name=cluster_name, node_name=node_name, hardware=hardware,
        socket_path=socket_path, ctld_port=ctld_port, slurmd_port=slurmd_port,
        gres=f"gpu:{gpu_type}:{gpus}" if gpus else "", partition=partition, spare_cpus=spare_cpus,
        gang_nodes=_gang_node_lines(gang_names, gang_ports, gpu_type),
    ))
    gres_lines = [f"NodeName={node_name} Name=gpu Type={gpu_type} File={f}" for f in gpu_files[:gpus]]
    gres_lines += [f"NodeName={name} Name=gpu Type={gpu_type} File={f}"
                   for name in gang_names for f in gpu_files[:GANG_NODE_GPUS]]
    (folder / "gres.conf").write_text("AutoDetect=off\n" + "".join(f"{g}\n" for g in gres_lines))
    (folder / "plugstack.conf").write_text("")

    cluster = SlurmCluster(
        conf_path=conf, node_name=node_name, partition=partition,
        cpus=int(hardware["CPUs"]), memory_mb=int(hardware["RealMemory"]),
        gres=f"gpu:{gpu_type}:{gpus}" if gpus else "", folder=folder, cluster_name=cluster_name,
        gang_partition=GANG_PARTITION if gang_names else "", gang_nodes=gang_names,
    )
    try:
        munged = spawn("munged", [
            _which("munged"), "--foreground", "--force", f"--socket={socket_path}",
            f"--key-file={key}", f"--pid-file={munge_dir / 'munged.pid'}",
            f"--seed-file={munge_dir / 'munged.seed'}",
        ], folder / "log" / "munged.out")
        cluster.processes.append(munged)
        wait_until(lambda: _munge_answers(socket_path), "munged to answer", timeout, [munged])

        env = {**os.environ, "SLURM_CONF": str(conf)}
        slurmctld = spawn(
            "slurmctld", [_which("slurmctld"), "-D", "-f", str(conf)],
            folder / "log" / "slurmctld.out", env=env,
        )
        cluster.processes.append(slurmctld)
        wait_until(lambda: _ctld_up(cluster), "slurmctld to answer", timeout, [slurmctld])

        # One slurmd per node, each told its name (-N): they share the host name.
        slurmds = []
        for name in [node_name, *gang_names]:
            slurmd = spawn(
                f"slurmd {name}", [_which("slurmd"), "-D", "-N", name, "-f", str(conf)],
                folder / "log" / f"slurmd-{name}.out", env=env,
            )
            cluster.processes.append(slurmd)
            slurmds.append(slurmd)
        for name in [node_name, *gang_names]:
            wait_until(
                lambda name=name: _node_idle(cluster, name), f"node {name} to be idle", timeout,
                [munged, slurmctld, *slurmds],
            )
        return cluster
    except BaseException:
        cluster.stop()
        raise


def _hardware() -> dict[str, str]:
    """``slurmd -C``: this machine's node line (name, CPUs, sockets, cores, memory)."""
    done = subprocess.run([_which("slurmd"), "-C"], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise EngineError(f"slurmd -C failed: {done.stderr.strip()}")
    return dict(re.findall(r"(\w+)=(\S+)", done.stdout.splitlines()[0]))


def _declared(hardware: dict[str, str], spare_cpus: int) -> dict[str, str]:
    """The node line to declare: the machine's, or with ``spare_cpus`` more CPUs, laid
    out one core each on one socket (the machine's layout cannot grow by one CPU)."""
    if spare_cpus <= 0:
        return hardware
    cpus = str(int(hardware["CPUs"]) + spare_cpus)
    return {**hardware, "CPUs": cpus, "Boards": "1", "SocketsPerBoard": "1", "CoresPerSocket": cpus,
            "ThreadsPerCore": "1"}


def _free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 now: held open together while they
    are chosen (one ``free_port`` after another may hand out a port just released)."""
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


def _gang_node_lines(names: list[str], ports: list[int], gpu_type: str) -> list[str]:
    """The NodeName lines of the gang nodes: each on a port of its own; features
    ``rack:a`` on all but the last, ``rack=b,ssd`` on the last (so ``group_by rack``
    has a choice, and both spellings of KEY/VALUE features are read)."""
    shape = " ".join(f"{key}={value}" for key, value in GANG_NODE.items())
    return [f"NodeName={name} NodeAddr=127.0.0.1 Port={port} {shape} Gres=gpu:{gpu_type}:{GANG_NODE_GPUS} "
            f"Features={'rack=b,ssd' if i == len(names) - 1 else 'rack:a'} State=UNKNOWN"
            for i, (name, port) in enumerate(zip(names, ports, strict=True))]


def _slurm_conf(
    *, folder: Path, cluster_name: str, node_name: str, hardware: dict[str, str],
    socket_path: Path, ctld_port: int, slurmd_port: int, gres: str, partition: str,
    spare_cpus: int = 0, gang_nodes: list[str] | None = None,
) -> str:
    log = folder / "log"
    gang_nodes = gang_nodes or []
    # With spare CPUs (or gang nodes, which share the host's), slurmd must take the
    # node line as written instead of draining a node that does not have what it declares.
    overrides = (f"# {spare_cpus} CPU(s) more than the machine has: room for a long idle test job.\n"
                 if spare_cpus > 0 else "")
    if spare_cpus > 0 or gang_nodes:
        overrides += "SlurmdParameters=config_overrides\n"
    gang = "".join(f"{line}\n" for line in gang_nodes)
    if gang_nodes:
        names = ",".join(line.split()[0].removeprefix("NodeName=") for line in gang_nodes)
        gang += f"PartitionName={GANG_PARTITION} Nodes={names} Default=NO MaxTime=INFINITE State=UP\n"
    node = " ".join(
        f"{key}={hardware[key]}"
        for key in ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore",
                    "RealMemory")
        if key in hardware
    )
    return f"""\
# Written by tooling/engines/slurm.py: a throwaway cluster, every node on this host.
ClusterName={cluster_name}
SlurmctldHost={node_name}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={socket_path}
StateSaveLocation={folder / "state"}
# %n: the node's name, so that each slurmd of this host has its own.
SlurmdSpoolDir={folder / "spool" / "%n"}
SlurmctldPidFile={folder / "slurmctld.pid"}
SlurmdPidFile={folder / "slurmd-%n.pid"}
SlurmctldLogFile={log / "slurmctld.log"}
SlurmdLogFile={log / "slurmd-%n.log"}
PlugStackConfig={folder / "plugstack.conf"}
# No cgroups: processes are tracked through their parents.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
GresTypes=gpu
# No slurmdbd, so no sacct: finished jobs stay in `scontrol show job` for MinJobAge
# seconds, and each end is appended to the jobcomp file.
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={log / "jobcomp.log"}
MinJobAge={MIN_JOB_AGE_S}
KillWait={KILL_WAIT_S}
# A job without --mem would otherwise take the whole node's memory.
DefMemPerCPU={DEF_MEM_PER_CPU_MB}
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
# Reject at submit what the partition can never run (e.g. more CPUs than the node
# has), instead of leaving it PENDING (Reason=PartitionConfig) forever.
EnforcePartLimits=ALL
SchedulerType=sched/backfill
{overrides}NodeName={node_name} NodeAddr=127.0.0.1 {node}{f" Gres={gres}" if gres else ""} State=UNKNOWN
PartitionName={partition} Nodes={node_name} Default=YES MaxTime=INFINITE State=UP
{gang}"""


def _make_fake_device(path: Path) -> None:
    """A GPU "device" file: a symlink to /dev/null, a character device as slurmd wants
    (a plain file works too, but slurmd then logs an error per GPU and jobs get no
    CUDA_VISIBLE_DEVICES)."""
    path.unlink(missing_ok=True)
    path.symlink_to("/dev/null")


def _munge_answers(socket_path: Path) -> bool:
    if not socket_path.exists():
        return False
    done = subprocess.run(
        [_which("munge"), "-n", f"--socket={socket_path}"], capture_output=True, check=False,
    )
    return done.returncode == 0


def _ctld_up(cluster: SlurmCluster) -> bool:
    return "UP" in cluster.run("scontrol", "ping", check=False)


def _node_idle(cluster: SlurmCluster, name: str) -> bool:
    node = cluster.node(name)
    state = node.get("State", "")
    if "INVAL" in state or "DRAIN" in state:
        raise EngineError(
            f"node {name} is {state} ({node.get('Reason', 'no reason')}); "
            f"slurmd log:\n{log_tail(cluster.folder / 'log' / f'slurmd-{name}.log')}"
        )
    return state == "IDLE"


def _kill_stepds(folder: Path) -> None:
    """SIGKILL, by PID, every slurmstepd holding a file under ``folder`` open."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() != "slurmstepd":
                continue
            holds = any(
                Path(os.readlink(fd)).is_relative_to(folder) for fd in (entry / "fd").iterdir()
            )
        except OSError:
            continue
        if holds:
            try:
                os.kill(int(entry.name), signal.SIGKILL)
            except ProcessLookupError:
                pass
