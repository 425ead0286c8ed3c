"""Preemption end to end (docs/design.md §3.3; invariant 11): router, tick and real peer
agents as processes, subprocess runs, real Postgres and NATS.

A federation full of ``batch`` work; an ``interactive`` job that fits only if one batch
job goes. The tick moves the victim back to ``queued`` under a new epoch and assigns
the new job in its place in one transaction, then tells the victim's owner
(``cancel.<owner>``, the new epoch); the agent kills the stale run at once and starts
the new job in the slot it frees. The victim runs again later, once, and its first
run's exit (even 0) is never reported. When the owner is down at that moment (SIGSTOP
while the tick decides, then SIGKILL), its return kills the run it left behind; when
it never returns, the tick takes the new job back (its hold on the room released) and
it runs elsewhere.

Runs record each start in a ledger file (``job epoch`` per line) and wait for a
release file only in their first epoch, so every later copy ends at once.
"""

from __future__ import annotations

import os
import shlex
import signal
from pathlib import Path

import pytest

from irisfed.shared.lifecycle import TERMINAL_STATES
from tests.infra.configs import make_peer
from tests.infra.probes import alive, kill_group, returns
from tests.infra.waiting import wait_for

pytestmark = pytest.mark.e2e

GPU = [{"key": "device_type", "op": "eq", "value": "gpu"}]
SLOTS = 2  # and as many CPUs: each job asks the default, one
# Long enough that the tick still sees a frozen (SIGSTOPped) gpu-west as reachable
# when it decides: a bound on a slow machine's tick pass, not an expectation.
LONG_TTL_S = 20.0


def configure(federation, ttl_s: float = 1.5, grace_s: float = 1.0) -> None:
    """home (CPU), gpu-west and gpu-east (GPU), each 2 slots; short heartbeats unless
    ``ttl_s`` says otherwise (a peer stays reachable that long after its last one)."""
    federation.configure([make_peer("home", "cpu", SLOTS), make_peer("gpu-west", "gpu", SLOTS, device_variant="h100"),
                          make_peer("gpu-east", "gpu", SLOTS, device_variant="a100")], ttl_s=ttl_s, grace_s=grace_s)


AGENT_ARGS = ("--resource", f"cpu={SLOTS}")


class Runs:
    """The commands of a test: each start appends ``job epoch`` to a ledger; a batch
    job's first epoch waits for ``release`` (or a file of its own), any later one ends at once."""

    def __init__(self, folder: Path) -> None:
        self.ledger = folder / "ledger"
        self.release = folder / "release"
        self.ledger.touch()

    def _note(self) -> str:
        return f'echo "$IRISFED_JOB_ID $IRISFED_EPOCH" >> {shlex.quote(str(self.ledger))}'

    def batch(self, release: Path | None = None, exit_on_term: bool = False) -> list[str]:
        gate = shlex.quote(str(release or self.release))
        trap = "trap 'exit 0' TERM; " if exit_on_term else ""
        return ["sh", "-c", f'{trap}{self._note()}; if [ "$IRISFED_EPOCH" = 1 ]; then '
                            f"while [ ! -e {gate} ]; do sleep 0.1; done; fi; echo done"]

    def quick(self) -> list[str]:
        return ["sh", "-c", f"{self._note()}; echo ran"]

    def starts(self) -> list[tuple[str, int]]:
        return [(job, int(epoch)) for job, epoch in (line.split() for line in self.ledger.read_text().splitlines())]

    def epochs_of(self, job_id: str) -> list[int]:
        return [epoch for job, epoch in self.starts() if job == job_id]


async def submit_batch(federation, runs: Runs, job_ids: list[str], **extra) -> dict[str, int]:
    """Submit ``job_ids`` as ``batch`` GPU work and wait until all run; their pids."""
    for job_id in job_ids:
        reply = await federation.submit({"job_id": job_id, "command": runs.batch(**extra), "constraints": GPU,
                                         "band": "batch", "max_retries": 1})
        assert reply["disposition"] == "queue", reply
    return {job_id: await federation.run_pid(job_id) for job_id in job_ids}


async def preempted_by(federation, job_id: str) -> list[str]:
    rows = await federation.store.db.fetch(
        "SELECT job_id FROM federation_changelog WHERE detail = $1 ORDER BY seq", f"preempted by {job_id}")
    return [r["job_id"] for r in rows]


async def wait_preemption(federation, job_id: str) -> str:
    """The one job ``job_id`` preempted, once the tick committed it."""
    async def committed():
        return await preempted_by(federation, job_id)
    victims = await wait_for(committed, f"{job_id} to preempt a batch job")
    assert len(victims) == 1, victims
    return victims[0]


async def history(federation, job_id: str):
    return await federation.store.changelog_list_for_job(job_id)


async def run_peers(federation, job_id: str) -> list[tuple[int, str]]:
    """(epoch, peer) of every ``running`` row of the job, in order."""
    return [(row.epoch, row.peer_id) for row in await history(federation, job_id) if row.to_state == "running"]


async def succeeded_once(federation, job_id: str):
    """The job's row once it ended: it succeeded, reported once, under its last epoch."""
    done = await federation.wait_state(job_id, *TERMINAL_STATES, timeout=120)
    assert done.state == "succeeded", done
    terminal = [row for row in await history(federation, job_id) if row.to_state in TERMINAL_STATES]
    assert [(row.to_state, row.epoch) for row in terminal] == [("succeeded", done.epoch)], terminal
    return done


async def nothing_live(federation) -> None:
    async def settled():
        count = await federation.store.db.fetchval("SELECT count(*) FROM jobs WHERE state IN ('assigned', 'running')")
        return count == 0
    await wait_for(settled, "no job to be left assigned or running")


async def fill(federation, runs: Runs, peer_id: str, tmp: Path, name: str) -> None:
    """``peer_id``'s whole capacity is usable: SLOTS pinned jobs run there at once, then end."""
    gate = tmp / f"{name}-release"
    job_ids = [f"{name}-{i}" for i in range(SLOTS)]
    for job_id in job_ids:
        await federation.submit({"job_id": job_id, "command": runs.batch(release=gate), "cluster_pin": peer_id,
                                 "band": "batch"})

    async def all_running():
        jobs = [await federation.job(j) for j in job_ids]
        return all(j.state == "running" and j.owner_peer_id == peer_id for j in jobs)
    await wait_for(all_running, f"{SLOTS} jobs to run on {peer_id} at once", timeout=120)
    gate.touch()
    for job_id in job_ids:
        await succeeded_once(federation, job_id)


async def start_gpu_west(federation, tmp_path: Path, **configured) -> Runs:
    """Router, tick, home and gpu-west, as ``configure(**configured)`` says; the runs' ledger."""
    configure(federation, **configured)
    runs = Runs(tmp_path)
    await federation.start_federation()
    federation.start("gpu-west", *AGENT_ARGS)
    await federation.wait_agent("gpu-west")
    return runs


async def test_an_interactive_job_preempts_one_batch_job_which_runs_again_once(federation, tmp_path):
    """Both GPU peers full of batch work: one batch job (the newest) goes, on the peer
    where the interactive job then runs; its run is killed at once on the tick's notice
    (a reconcile interval too long to do it); it runs again later and succeeds once."""
    configure(federation)
    runs = Runs(tmp_path)
    federation.start("router")
    federation.start("tick")
    for peer in ("gpu-west", "gpu-east"):
        federation.start(peer, *AGENT_ARGS, "--reconcile-interval", "600")
    await federation.wait_router()
    for peer in ("gpu-west", "gpu-east"):
        await federation.wait_agent(peer)

    batch = [f"batch-{i}" for i in range(2 * SLOTS)]
    pids = await submit_batch(federation, runs, batch)
    try:
        placed = {job_id: (await federation.job(job_id)).owner_peer_id for job_id in batch}
        assert sorted(placed.values()) == ["gpu-east"] * SLOTS + ["gpu-west"] * SLOTS, placed

        reply = await federation.submit({"job_id": "urgent", "command": runs.quick(), "constraints": GPU})
        assert reply["disposition"] == "queue", reply
        victim = await wait_preemption(federation, "urgent")
        peer = placed[victim]

        # The run is killed on the notice, not by a reconcile (600 s apart here).
        try:
            await wait_for(lambda: returns(not alive(pids[victim])), f"{victim}'s run to be killed")
        except AssertionError as exc:
            refused = [line for line in federation.log("tick").splitlines() if "nats_error" in line]
            raise AssertionError(f"{exc}; the tick's NATS errors: {refused}") from None
        done = await succeeded_once(federation, "urgent")
        assert (done.owner_peer_id, done.epoch) == (peer, 1), done
        assert await run_peers(federation, "urgent") == [(1, peer)]
        urgent_history = [(r.from_state, r.to_state, r.detail) for r in await history(federation, "urgent")]
        assert ("queued", "assigned", f"placed; preempted {victim}") in urgent_history, urgent_history

        moved = [r for r in await history(federation, victim) if r.detail == "preempted by urgent"]
        assert [(r.from_state, r.to_state, r.epoch) for r in moved] == [("running", "queued", 2)], moved
        log = federation.log(peer)
        assert "fencing_local_copy" in log and "its epoch moved on to 2" in log, log[-3000:]

        # Nothing else was touched: the other batch jobs still run their first copy.
        for job_id in batch:
            if job_id != victim:
                job = await federation.job(job_id)
                assert (job.state, job.epoch, job.preemptions) == ("running", 1, 0), job
                assert alive(pids[job_id])
        assert await preempted_by(federation, "urgent") == [victim]

        runs.release.touch()
        for job_id in batch:
            job = await succeeded_once(federation, job_id)
            if job_id == victim:
                assert (job.preemptions, job.max_retries, job.attempts) == (1, 1, 2), job
                assert job.epoch > 2 and runs.epochs_of(job_id) == [1, job.epoch], runs.starts()
            else:
                assert (job.preemptions, job.attempts, job.epoch) == (0, 1, 1), job
                assert runs.epochs_of(job_id) == [1]
        assert runs.epochs_of("urgent") == [1]
        await nothing_live(federation)
    finally:
        for pid in pids.values():
            kill_group(pid)


async def test_a_preempted_run_that_exits_0_when_killed_is_never_reported(federation, tmp_path):
    """Invariant 11's fencing: the victim's first run traps the kill and exits 0 (a
    success, were it reported); nothing of its epoch 1 is ever written as an end.

    The urgent job holds the slot until the note is read: the victim's next start on
    gpu-west (in that slot) begins a new sync of the job, which clears the note."""
    runs = await start_gpu_west(federation, tmp_path)
    pids = await submit_batch(federation, runs, ["batch-0", "batch-1"], exit_on_term=True)
    urgent_release = tmp_path / "urgent-release"
    try:
        await federation.submit({"job_id": "urgent", "command": runs.batch(release=urgent_release),
                                 "constraints": GPU})
        victim = await wait_preemption(federation, "urgent")
        await wait_for(lambda: returns(not alive(pids[victim])), f"{victim}'s run to end")

        async def recorded():
            rows = await federation.store.sync_state_get(victim)
            notes = [r["note"] or "" for r in rows if r["peer_id"] == "gpu-west"]
            return next((n for n in notes if "stale copy killed" in n), None)
        note = await wait_for(recorded, "gpu-west to record that it killed its stale copy")
        assert "epoch 1" in note, note
        urgent_release.touch()
        await succeeded_once(federation, "urgent")

        runs.release.touch()
        for job_id in ("batch-0", "batch-1"):
            await succeeded_once(federation, job_id)  # one terminal row, at its last epoch
        ends_at_1 = [r for r in await history(federation, victim) if r.epoch == 1 and r.to_state in TERMINAL_STATES]
        assert ends_at_1 == [], ends_at_1
        assert (await federation.job(victim)).epoch > 2
        await nothing_live(federation)
    finally:
        for pid in pids.values():
            kill_group(pid)


async def _preempt_while_owner_frozen(federation, runs: Runs) -> tuple[str, str, dict[str, int]]:
    """gpu-west runs two batch jobs; it is frozen (SIGSTOP: it neither heartbeats nor
    hears anything, yet stays reachable for the long TTL), an interactive job preempts
    one of its jobs, and only then is it SIGKILLed: it never learned of the preemption.
    (victim, the other batch job, their pids.)"""
    pids = await submit_batch(federation, runs, ["batch-0", "batch-1"])
    agent = federation.processes["gpu-west"]
    os.kill(agent.pid, signal.SIGSTOP)
    try:
        try:
            await federation.submit({"job_id": "urgent", "command": runs.quick(), "constraints": GPU})
            victim = await wait_preemption(federation, "urgent")
        finally:
            federation.kill("gpu-west")  # SIGKILL ends a stopped process too
        job = await federation.job("urgent")
        assert (job.state, job.owner_peer_id) == ("assigned", "gpu-west"), job
        other = next(j for j in pids if j != victim)
        # The runs have their own sessions: the victim's stale copy lives on, unwatched.
        assert alive(pids[victim]) and alive(pids[other])
        return victim, other, pids
    except BaseException:
        for pid in pids.values():
            kill_group(pid)
        raise


async def test_an_owner_killed_before_it_heard_of_the_preemption_kills_the_stale_run_when_it_returns(
        federation, tmp_path):
    runs = await start_gpu_west(federation, tmp_path, ttl_s=LONG_TTL_S)
    victim, other, pids = await _preempt_while_owner_frozen(federation, runs)
    try:
        federation.start("gpu-west", *AGENT_ARGS)
        await wait_for(lambda: returns(not alive(pids[victim])), f"the returning agent to kill {victim}'s stale run")
        await wait_for(lambda: returns("leftover_run_killed" in federation.log("gpu-west")), "the kill to be logged")

        done = await succeeded_once(federation, "urgent")
        assert (done.owner_peer_id, done.epoch) == ("gpu-west", 1), done
        assert await run_peers(federation, "urgent") == [(1, "gpu-west")]
        assert runs.epochs_of("urgent") == [1]

        # The other job's run was started by the agent's previous life: killed and handed
        # back (a retry), never adopted (a subprocess is not the new agent's child).
        await wait_for(lambda: returns(not alive(pids[other])), f"{other}'s orphaned run to be killed")

        runs.release.touch()
        job = await succeeded_once(federation, victim)
        assert (job.preemptions, job.max_retries, job.attempts) == (1, 1, 2), job
        assert runs.epochs_of(victim) == [1, job.epoch] and job.epoch > 2, runs.starts()
        assert [e for e, _ in await run_peers(federation, victim)] == [1, job.epoch]
        job = await succeeded_once(federation, other)
        assert job.preemptions == 0 and runs.epochs_of(other) == [1, job.epoch], runs.starts()
        assert await preempted_by(federation, "urgent") == [victim]

        # No hold leaked: nothing live, and the peer's whole capacity runs new work at once.
        await nothing_live(federation)
        await fill(federation, runs, "gpu-west", tmp_path, "after")
        await nothing_live(federation)
    finally:
        for pid in pids.values():
            kill_group(pid)


async def test_a_victim_whose_owner_is_down_is_not_run_elsewhere_until_its_old_run_is_gone(federation, tmp_path):
    """gpu-west dies (frozen, then SIGKILLed) with the victim's run alive and unwatched,
    while it still counts as reachable. Room frees on gpu-east: a later job takes it,
    the victim does not (it would run under two epochs at once). gpu-west returns,
    kills the stale run and says so: the victim then runs, once. (A TTL long enough
    that gpu-west is never judged lost here: then the tick would let the victim go.)"""
    runs = await start_gpu_west(federation, tmp_path, ttl_s=2 * LONG_TTL_S)
    east_gate = tmp_path / "east-release"
    east = [f"east-{i}" for i in range(SLOTS)]
    federation.start("gpu-east", *AGENT_ARGS)
    await federation.wait_agent("gpu-east")
    for job_id in east:  # interactive: the urgent job cannot preempt them, it must go west
        await federation.submit({"job_id": job_id, "command": runs.batch(release=east_gate),
                                 "cluster_pin": "gpu-east"})
    east_pids = {job_id: await federation.run_pid(job_id) for job_id in east}
    victim, other, pids = await _preempt_while_owner_frozen(federation, runs)
    pids.update(east_pids)
    try:
        assert (await federation.job(victim)).stopping_on == "gpu-west"
        east_gate.touch()
        for job_id in east:
            await succeeded_once(federation, job_id)
        # gpu-east is empty; a later batch job of the same user gets it, the victim waits.
        await federation.submit({"job_id": "later", "command": runs.quick(), "constraints": GPU, "band": "batch"})
        await succeeded_once(federation, "later")
        job = await federation.job(victim)
        assert (job.state, job.stopping_on) == ("queued", "gpu-west"), job
        assert runs.epochs_of(victim) == [1] and alive(pids[victim])

        federation.start("gpu-west", *AGENT_ARGS)
        await wait_for(lambda: returns(not alive(pids[victim])), f"the returning agent to kill {victim}'s stale run")
        runs.release.touch()
        job = await succeeded_once(federation, victim)
        assert runs.epochs_of(victim) == [1, job.epoch] and job.stopping_on is None, runs.starts()
        await succeeded_once(federation, "urgent")
        await succeeded_once(federation, other)
        await nothing_live(federation)
    finally:
        for pid in pids.values():
            kill_group(pid)


async def test_an_owner_that_never_returns_has_the_preempting_job_taken_back_and_run_elsewhere(
        federation, tmp_path):
    runs = await start_gpu_west(federation, tmp_path, ttl_s=LONG_TTL_S)
    victim, other, pids = await _preempt_while_owner_frozen(federation, runs)
    try:
        # Lost past the grace: the tick takes the preempting job back (its hold released),
        # and the other job too (a retry); the victim is queued already.
        async def taken_back():
            rows = await history(federation, "urgent")
            return [r for r in rows if (r.from_state, r.to_state, r.actor) == ("assigned", "queued", "tick")]
        await wait_for(taken_back, "the tick to take the job back from the lost peer", timeout=120)
        for job_id in ("urgent", victim, other):
            job = await federation.wait_state(job_id, "queued", timeout=120)
            assert job.owner_peer_id is None, job

        federation.start("gpu-east", *AGENT_ARGS)
        done = await succeeded_once(federation, "urgent")
        assert done.owner_peer_id == "gpu-east", done
        assert [p for _, p in await run_peers(federation, "urgent")] == ["gpu-east"]
        for job_id in (victim, other):  # their later copies end at once
            job = await succeeded_once(federation, job_id)
            assert job.owner_peer_id == "gpu-east", job
        assert (await federation.job(victim)).preemptions == 1
        assert (await federation.job(other)).preemptions == 0
        assert await preempted_by(federation, "urgent") == [victim]

        # The lost peer returns: it kills both copies it left behind, and its whole
        # capacity is free (nothing held there for the job that moved on).
        assert alive(pids[victim]) and alive(pids[other])
        federation.start("gpu-west", *AGENT_ARGS)
        for job_id in (victim, other):
            await wait_for(lambda job_id=job_id: returns(not alive(pids[job_id])),
                           f"the returning agent to kill {job_id}'s stale run")
        await nothing_live(federation)
        await fill(federation, runs, "gpu-west", tmp_path, "after")
        await nothing_live(federation)
        assert runs.epochs_of("urgent") == [(await federation.job("urgent")).epoch]
    finally:
        for pid in pids.values():
            kill_group(pid)
