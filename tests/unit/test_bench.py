"""The benchmark's own arithmetic and command line (its runs are CI's `irisfed bench --quick`)."""

from bench.load import Run, spread
from services.cli import main


def test_percentiles_and_rate():
    run = Run(done=100, seconds=2.0, latencies=[i / 1000 for i in range(100, 0, -1)])
    assert run.rate == 50.0
    assert run.pct(0.5) == 0.051 and run.pct(0.99) == 0.1 and run.pct(0.0) == 0.001


def test_spread_says_how_many_runs():
    assert spread([5.0]) == "1 run"
    assert spread([3.0, 1000.0, 7.0]) == "3 runs, 3–1,000"


def test_unknown_section_is_a_clear_error(capsys):
    assert main(["bench", "--sections", "submit,warp"]) == 2
    assert "unknown bench section(s): warp" in capsys.readouterr().err


def test_quick_leaves_engines_out_unless_asked():
    from bench.run import SECTIONS, chosen_sections

    everything = set(SECTIONS)
    assert "engines" in everything
    assert chosen_sections(True, everything) == everything - {"engines"}
    assert chosen_sections(True, {"engines"}) == {"engines"}
    assert chosen_sections(False, everything) == everything


def test_multi_resource_jobs_are_valid_and_every_peer_holds_twice_its_share():
    from bench.sections import KINDS, _bench_job, _job_resources, _node_shape, _peer_nodes
    from shared.messages import SubmitRequest

    jobs, peers = 3000, 20
    nodes = _peer_nodes(jobs, peers)
    demand: dict[str, dict[str, int]] = {kind: {} for kind in KINDS}
    for i in range(jobs):
        asked = _job_resources(i)
        kind = KINDS[i % 3]
        assert set(asked) == {"cpu", "memory_mb"} | ({kind} if kind != "cpu" else set())
        for name, amount in asked.items():
            demand[kind][name] = demand[kind].get(name, 0) + amount
    SubmitRequest(command=["true"], resources=_job_resources(1))  # validated like a submit
    assert '"gpu"' in _bench_job(1, resources=True).resources_json
    for kind in KINDS:
        mine = [p for p in range(peers) if KINDS[p % 3] == kind]
        for name, total in demand[kind].items():
            share = total / len(mine)
            assert all(nodes[p] * _node_shape(p)[name] >= 2 * share for p in mine)


def test_engines_section_says_why_it_skips(monkeypatch, capsys, tmp_path):
    import asyncio

    import tooling.engines.ray as ray
    import tooling.engines.slurm as slurm
    from bench.engines import engines_section
    from bench.report import Bench, Profile
    from tooling.engines.procs import Availability

    monkeypatch.setattr(slurm, "slurm_available", lambda: Availability(False, "no slurmd here"))
    monkeypatch.setattr(ray, "ray_available", lambda: Availability(False, "no ray here"))
    bench = Bench(Profile(True), tmp_path)
    asyncio.run(engines_section(bench, "postgresql://unused/x", "nats://unused:1"))
    out = capsys.readouterr().out
    assert "skipped the Slurm figures: no slurmd here" in out and "skipped the Ray figures: no ray here" in out
    assert bench.figures == []
