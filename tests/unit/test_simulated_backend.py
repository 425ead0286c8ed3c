"""The simulated backend's runs live in its agent's memory and die with it: it lists
no run a later agent could find again, adopt or kill, even while one of its own is
running (the real processes of the subprocess backend are
tests/integration/test_subprocess_backend_runs.py)."""

from __future__ import annotations

from irisfed.services.peer_agent.backends import RunSpec, SimulatedBackend


async def test_simulated_runs_die_with_their_agent():
    backend = SimulatedBackend()
    await backend.launch(RunSpec("job", 1, ["true"], labels={"sim.duration_s": "30"}))
    assert await backend.list_runs() == []
