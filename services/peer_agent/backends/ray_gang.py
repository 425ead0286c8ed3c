"""The driver of a gang's Ray job: N tasks in one placement group, one fate.

The ray backend submits one Ray job per gang run (docs/engines.md, "Gangs and nodes on
Ray"). Its entrypoint is this file's source, run by the Python on the node's PATH
(``exec python3 -c SOURCE``): the cluster needs Ray, never irisfed. So this module
imports only the standard library at its top and Ray inside ``main``, and what it hands
Ray travels by value (cloudpickle pickles what ``__main__`` defines).

Given the run in ``SPEC_VARIABLE`` (base64 of JSON: ``command``, ``env``, ``replicas``,
``bundle`` in Ray's resource names, ``group_by``, ``start_timeout_s`` and, when given,
``grace_s``), it:

1. makes a placement group of ``replicas`` bundles, each one task's resources, with
   ``STRICT_SPREAD`` (one task a node); with ``group_by`` KEY, the ``topology_strategy``
   ``{node: STRICT_SPREAD, KEY: STRICT_PACK}`` (Ray >= 2.60): Ray itself picks a value of
   the node label KEY whose nodes hold the whole gang;
2. waits for it until ``start_timeout_s`` after the driver started, then starts one
   task per bundle (a streaming generator: ``run_task``), which runs the command in a
   subprocess (its own session) with the task's environment and yields its node, its
   output as it comes and its exit status; ``started`` is printed once every task's
   command runs;
3. one fate: a task exiting non-zero → the others are cancelled (their commands get
   SIGTERM, SIGKILL after the run's ``grace_s``, ``TERM_GRACE_S`` without one:
   docs/design.md §3.7) and the driver ends with that exit code; a
   task that Ray failed (node died, worker crashed) or whose command could not start,
   or tasks not all running in time → the others are cancelled and the run is *lost*;
   SIGTERM (``stop_job``) → every task is cancelled (killed).

What it prints (the job's log, which the backend splits: ray_gang_text.read_gang_log):

- ``irisfed-task I out| TEXT``: a line of task I's stdout (``err``: stderr); ``~``
  instead of ``|``: no newline followed TEXT (a last line, or a piece of a long one);
- ``irisfed-gang started {"nodes": [...]}``: every task runs, on these Ray node ids;
- ``irisfed-gang end {"exit", "lost", "killed", "states", "codes", "nodes"}``: its last
  line. ``exit`` is the first failing task's code (negative: killed by that signal), 0
  when all succeeded; ``lost`` says why the run was lost ("" when it was not).

Task output is decoded as UTF-8 (invalid bytes replaced). Every line of a task's output
is prefixed, so nothing a task prints can pass for one of the driver's own lines.
"""

from __future__ import annotations

import base64
import json
import os
import queue
import signal
import sys
import threading
import time

SPEC_VARIABLE = "IRISFED_GANG_B64"
GANG_MARK = "irisfed-gang"
TASK_MARK = "irisfed-task"
LINE_END = "|"  # a whole line: a newline followed
PIECE_END = "~"  # no newline followed
# A task's state, as backends.TASK_* (the driver may not import irisfed; a unit test
# keeps them equal).
PENDING, RUNNING, SUCCEEDED, FAILED, KILLED, LOST = "pending", "running", "succeeded", "failed", "killed", "lost"
# A cancelled task's command gets SIGTERM, then SIGKILL this much later, when the run
# names no grace of its own (``grace_s``; the backend sets Ray's time between stop_job's
# SIGTERM to the driver and its SIGKILL to that grace and more: ray_text.stop_env).
TERM_GRACE_S = 1.0
# A task cancelled politely (KeyboardInterrupt in its worker) that has not ended this
# long after its grace is cancelled by force (its worker killed); one still not ended
# after as long again is given up.
FORCE_AFTER_S = 5.0
# How long a task's output may wait before it is sent: one yield (an object in Ray's
# store) per TEXT_FLUSH_S or per TEXT_CHUNK characters, not one per line.
TEXT_FLUSH_S = 0.2
TEXT_CHUNK = 64 * 1024
# Once a task's command exited, how long its pipes may stay open (held by something it
# left in the background) before that is killed and the task ends.
DRAIN_S = 2.0
# The longest piece of a line kept waiting for its newline.
MAX_PIECE = 64 * 1024
# Exit statuses of the driver itself (its ``end`` line says what happened exactly).
LOST_EXIT = 1
KILLED_EXIT = 128 + int(signal.SIGTERM)


# ------------------------------------------------------------------ the log's lines (pure)


def task_lines(index: int, stream: str, text: str, piece: str, final: bool = False) -> tuple[str, str]:
    """``text`` (more of task ``index``'s ``stream``, after ``piece``: what came since its
    last newline) as prefixed log lines, and what is left waiting for a newline. ``final``:
    the stream ended, so what is left is written as a piece."""
    pending = piece + text
    lines = pending.split("\n")
    rest = lines.pop()
    out = [f"{TASK_MARK} {index} {stream}{LINE_END} {line}\n" for line in lines]
    if rest and (final or len(rest) > MAX_PIECE):
        out.append(f"{TASK_MARK} {index} {stream}{PIECE_END} {rest}\n")
        rest = ""
    return "".join(out), rest


def gang_line(kind: str, fields: dict) -> str:
    return f"{GANG_MARK} {kind} {json.dumps(fields, sort_keys=True)}\n"


def driver_exit(code: int) -> int:
    """The driver's own exit status for a task's exit code (a status is 0-255)."""
    if code < 0:
        return 128 - code
    return code if 0 < code < 256 else (1 if code else 0)


# ------------------------------------------------------------------ on the workers


def pick_coordinator() -> str:
    """``ip:port`` free on this node now (task 0's): what every task gets as its coordinator."""
    import socket

    import ray

    with socket.socket() as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    return f"{ray.util.get_node_ip_address()}:{port}"


def run_task(index: int, command: list, env: dict, coordinator_box: list, grace_s: float = TERM_GRACE_S):
    """One task (a Ray streaming generator): yields ``{"node"}`` and ``{"pid"}`` once its
    command runs (``{"error"}`` when it cannot start), then ``{"out", "err"}`` pieces of
    its output, then ``{"exit"}``. Cancelled (KeyboardInterrupt), it stops its command:
    SIGTERM to its process group, SIGKILL ``grace_s`` later if it has not ended."""
    import codecs
    import os
    import queue
    import signal
    import subprocess
    import threading
    import time

    import ray

    node = ray.get_runtime_context().get_node_id()
    coordinator = ray.get(coordinator_box[0])  # a nested ref: resolved here, not before the task starts
    child_env = {name: value for name, value in os.environ.items() if name != SPEC_VARIABLE}
    child_env.update(env)
    child_env.update({"IRISFED_TASK_INDEX": str(index), "IRISFED_COORDINATOR": coordinator, "IRISFED_NODE": node})
    try:
        process = subprocess.Popen(command, env=child_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, start_new_session=True)
    except OSError as exc:
        yield {"node": node, "error": f"cannot start {command[0]!r}: {exc.strerror or exc}"}
        return

    def kill_group(sig: int) -> None:
        try:
            os.killpg(process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    chunks: queue.Queue = queue.Queue()

    def pump(stream, name: str) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        while True:
            data = os.read(stream.fileno(), 65536)
            text = decoder.decode(data, final=not data)
            if text:
                chunks.put((name, text))
            if not data:
                chunks.put((name, None))
                return

    for stream, name in ((process.stdout, "out"), (process.stderr, "err")):
        threading.Thread(target=pump, args=(stream, name), daemon=True).start()
    yield {"node": node, "pid": process.pid}
    try:
        open_streams, exited_at, flush_at = 2, None, None
        pending = {"out": [], "err": []}
        size = 0
        while open_streams:
            try:
                name, text = chunks.get(timeout=0.1)  # short: a cancel's KeyboardInterrupt lands between waits
                if text is None:
                    open_streams -= 1
                else:
                    pending[name].append(text)
                    size += len(text)
                    flush_at = flush_at or time.monotonic() + TEXT_FLUSH_S
            except queue.Empty:
                pass
            now = time.monotonic()
            if exited_at is None and process.poll() is not None:
                exited_at = now
            if exited_at is not None and open_streams and now - exited_at > DRAIN_S:
                kill_group(signal.SIGKILL)  # what it left behind holds its pipes open
            if size and (size >= TEXT_CHUNK or not open_streams or now >= flush_at):
                yield {"out": "".join(pending["out"]), "err": "".join(pending["err"])}
                pending, size, flush_at = {"out": [], "err": []}, 0, None
        yield {"exit": process.wait()}
    finally:
        if process.poll() is None:  # cancelled: its command goes with it
            kill_group(signal.SIGTERM)
            try:
                process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                kill_group(signal.SIGKILL)
                process.wait()


# ------------------------------------------------------------------ the driver


class Driver:
    """One gang run: its placement group, its tasks and what they said."""

    def __init__(self, spec: dict, ray, events: queue.Queue) -> None:
        self.spec = spec
        self.ray = ray
        self.events = events
        self.replicas = int(spec["replicas"])
        self.deadline = time.monotonic() + float(spec["start_timeout_s"])
        self.grace_s = max(0.0, float(spec.get("grace_s", TERM_GRACE_S)))
        self.states = [PENDING] * self.replicas
        self.codes: list = [None] * self.replicas
        self.nodes: list = [None] * self.replicas
        self.pieces: dict = {}
        self.generators: list = []
        self.cancelled: dict = {}  # task index → when its cancel was asked (monotonic)
        self.forced: set = set()
        self.finished: set = set()
        self.ran: set = set()  # tasks whose command started
        self.lost = ""
        self.failed = None  # the first failing task's exit code
        self.killed = False
        self.announced = False

    # ------------------------------------------------------------ output

    def write(self, text: str) -> None:
        if text:
            sys.stdout.write(text)
            sys.stdout.flush()

    def output(self, index: int, stream: str, text: str, final: bool = False) -> None:
        lines, self.pieces[(index, stream)] = task_lines(index, stream, text, self.pieces.get((index, stream), ""),
                                                         final)
        self.write(lines)

    # ------------------------------------------------------------ the run

    def run(self) -> int:
        from ray.util.placement_group import remove_placement_group

        group = self.reserve()
        try:
            if group is not None:
                self.start(group)
                self.follow()
        finally:
            if group is not None:
                remove_placement_group(group)
        for index in range(self.replicas):
            for stream in ("out", "err"):
                self.output(index, stream, "", final=True)
        return self.end()

    def reserve(self):
        """The placement group once it is ready; None when stopped or out of time."""
        from ray.util.placement_group import placement_group, remove_placement_group

        bundles = [dict(self.spec["bundle"]) for _ in range(self.replicas)]
        group_by = self.spec.get("group_by") or ""
        if group_by:
            try:
                group = placement_group(bundles, topology_strategy={"ray.io/node-id": "STRICT_SPREAD",
                                                                    group_by: "STRICT_PACK"})
            except TypeError:
                self.lost = (f"this Ray cluster cannot keep a gang on nodes sharing one {group_by} "
                             f"(Ray {self.ray.__version__}: group_by needs Ray 2.60 or later)")
                return None
        else:
            group = placement_group(bundles, strategy="STRICT_SPREAD")
        while True:
            left = self.deadline - time.monotonic()
            if self.stop_asked():
                remove_placement_group(group)
                return None
            if left <= 0:
                remove_placement_group(group)
                shared = f" sharing one {group_by}" if group_by else ""
                self.lost = (f"its {self.replicas} tasks did not all start within {self.spec['start_timeout_s']:g}s "
                             f"(Ray found no {self.replicas} nodes{shared} with room for {self.spec['bundle']})")
                return None
            if group.wait(timeout_seconds=min(1.0, left)):  # short: a SIGTERM is seen between waits
                return group

    def stop_asked(self) -> bool:
        """Whether SIGTERM came (its handler queued it); other events stay queued."""
        if self.killed:
            return True
        kept = []
        while True:
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                break
            if event[0] is None:
                self.killed = True
            else:
                kept.append(event)
        for event in kept:
            self.events.put(event)
        return self.killed

    def start(self, group) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self.ray
        bundle = dict(self.spec["bundle"])
        options = {"num_cpus": bundle.pop("CPU", 0), "num_gpus": bundle.pop("GPU", 0),
                   "memory": bundle.pop("memory", 0) or None, "resources": bundle}
        coordinator = ray.remote(pick_coordinator).options(
            num_cpus=0, max_retries=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)).remote()
        task = ray.remote(run_task)
        for index in range(self.replicas):
            self.generators.append(task.options(
                **options, max_retries=0, num_returns="streaming", name=f"irisfed-task-{index}",
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index),
            ).remote(index, list(self.spec["command"]), dict(self.spec["env"]), [coordinator], self.grace_s))
        for index, generator in enumerate(self.generators):
            threading.Thread(target=self.relay, args=(index, generator), daemon=True).start()

    def relay(self, index: int, generator) -> None:
        """Task ``index``'s items into the event queue, then ``"done"`` or what Ray raised."""
        try:
            for ref in generator:
                self.events.put((index, self.ray.get(ref)))
            self.events.put((index, "done"))
        except Exception as exc:  # noqa: BLE001 - any failure of Ray's is the task's infrastructure
            self.events.put((index, exc))

    def follow(self) -> None:
        """Until every task ended (or was given up after its cancel)."""
        while len(self.finished) < self.replicas:
            try:
                index, item = self.events.get(timeout=0.5)
            except queue.Empty:
                self.check_times()
                continue
            if index is None:
                self.killed = True
                self.cancel_all()
            elif isinstance(item, BaseException):
                self.task_raised(index, item)
            elif item == "done":
                self.task_done(index)
            else:
                self.task_said(index, item)
            self.check_times()

    def check_times(self) -> None:
        now = time.monotonic()
        if not self.announced and not self.lost and not self.killed and now >= self.deadline:
            self.lose(f"its {self.replicas} tasks did not all start within {self.spec['start_timeout_s']:g}s "
                      f"({len(self.ran)} ran)")
        for index, asked in list(self.cancelled.items()):
            if index in self.finished:
                continue
            if index not in self.forced and now - asked > self.grace_s + FORCE_AFTER_S:
                self.forced.add(index)
                self.cancel(index, force=True)
            elif now - asked > self.grace_s + 2 * FORCE_AFTER_S:
                self.finished.add(index)  # given up: Ray kills the job's workers when the driver exits

    def task_said(self, index: int, item: dict) -> None:
        if "node" in item:
            self.nodes[index] = item["node"]
        if "error" in item:
            self.states[index] = LOST
            self.lose(f"task {index} could not start: {item['error']}")
        elif "pid" in item:
            self.states[index] = RUNNING
            self.ran.add(index)
            if not self.announced and len(self.ran) == self.replicas:
                self.announced = True
                self.write(gang_line("started", {"nodes": self.nodes}))
        elif "exit" in item:
            code = int(item["exit"])
            self.codes[index] = code
            if code == 0:
                self.states[index] = SUCCEEDED
            elif index in self.cancelled:
                self.states[index] = KILLED
            else:
                self.states[index] = FAILED
                if self.failed is None and not self.lost and not self.killed:
                    self.failed = code  # one fate: the others go
                    self.cancel_all()
        else:
            for stream in ("out", "err"):
                if item.get(stream):
                    self.output(index, stream, item[stream])

    def task_done(self, index: int) -> None:
        self.finished.add(index)
        if self.codes[index] is None and self.states[index] != LOST and index not in self.cancelled:
            self.states[index] = LOST
            self.lose(f"task {index} ended without an exit status")

    def task_raised(self, index: int, error: BaseException) -> None:
        self.finished.add(index)
        if index in self.cancelled:
            if self.states[index] == RUNNING or self.killed:
                self.states[index] = KILLED
            return
        self.states[index] = LOST
        where = f" on node {self.nodes[index]}" if self.nodes[index] else ""
        reason = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
        self.lose(f"task {index}{where} failed in Ray ({type(error).__name__}: {reason})")

    def lose(self, why: str) -> None:
        if not self.lost and not self.killed and self.failed is None:
            self.lost = why
        self.cancel_all()

    def cancel_all(self) -> None:
        for index in range(len(self.generators)):
            if index not in self.finished and index not in self.cancelled:
                self.cancel(index, force=False)

    def cancel(self, index: int, force: bool) -> None:
        self.cancelled.setdefault(index, time.monotonic())
        try:
            self.ray.cancel(self.generators[index], force=force)
        except Exception as exc:  # noqa: BLE001 - it may have ended meanwhile
            sys.stderr.write(f"irisfed: cancelling task {index}: {exc!r}\n")

    def end(self) -> int:
        # Every task has ended here: one still "running" was cancelled (its generator
        # closed without an exit item, or given up after the forced cancel), so killed.
        self.states = [KILLED if state == RUNNING and (self.killed or index in self.cancelled) else state
                       for index, state in enumerate(self.states)]
        self.write(gang_line("end", {"exit": self.failed or 0, "lost": self.lost, "killed": self.killed,
                                     "states": self.states, "codes": self.codes, "nodes": self.nodes}))
        if self.killed:
            return KILLED_EXIT
        if self.lost:
            return LOST_EXIT
        return driver_exit(self.failed or 0)


def main() -> int:
    spec = json.loads(base64.b64decode(os.environ[SPEC_VARIABLE]))
    events: queue.Queue = queue.Queue()
    import logging

    import ray

    ray.init(log_to_driver=False, logging_level=logging.WARNING)  # the job's cluster (RAY_ADDRESS)
    # stop_job's SIGTERM: every task is cancelled and the driver ends (killed). Set after
    # ray.init, which sets a handler of its own.
    signal.signal(signal.SIGTERM, lambda *_: events.put((None, "stop")))
    code = Driver(spec, ray, events).run()
    sys.stdout.flush()
    os._exit(code)  # not sys.exit: Ray's exit hooks may wait on threads still relaying


if __name__ == "__main__":
    main()
