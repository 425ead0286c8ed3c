"""The benchmark's own arithmetic and command line (its runs are CI's `irisfed bench --quick`)."""

import asyncio

from irisfed.bench.load import Run, spread
from irisfed.cli import main


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


def test_a_missing_bench_dependency_is_named_with_the_extra_that_brings_it(capsys, monkeypatch):
    import sys

    for name in [m for m in sys.modules if m.startswith("irisfed.bench")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "httpx", None)  # as if not installed
    assert main(["bench", "--sections", "submit"]) == 2
    assert capsys.readouterr().err.strip() == (
        "irisfed: irisfed bench needs httpx, which is not installed: pip install 'irisfed[bench]'")


def test_quick_leaves_engines_out_unless_asked():
    from irisfed.bench.run import SECTIONS, chosen_sections

    everything = set(SECTIONS)
    assert {"engines", "ha"} <= everything
    assert chosen_sections(True, everything) == everything - {"engines", "ha"}
    assert chosen_sections(True, {"engines"}) == {"engines"}
    assert chosen_sections(True, {"ha"}) == {"ha"}
    assert chosen_sections(False, everything) == everything


def test_multi_resource_jobs_are_valid_and_every_peer_holds_twice_its_share():
    from irisfed.bench.sections import KINDS, _bench_job, _job_resources, _node_shape, _peer_nodes
    from irisfed.shared.messages import SubmitRequest

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

    import irisfed.tooling.engines.ray as ray
    import irisfed.tooling.engines.slurm as slurm
    from irisfed.bench.engines import engines_section
    from irisfed.bench.report import Bench, Profile
    from irisfed.tooling.engines.procs import Availability

    monkeypatch.setattr(slurm, "slurm_available", lambda: Availability(False, "no slurmd here"))
    monkeypatch.setattr(ray, "ray_available", lambda: Availability(False, "no ray here"))
    bench = Bench(Profile(True), tmp_path)
    asyncio.run(engines_section(bench, "postgresql://unused/x", "nats://unused:1"))
    out = capsys.readouterr().out
    assert "skipped the Slurm figures: no slurmd here" in out and "skipped the Ray figures: no ray here" in out
    assert bench.figures == []


def test_web_rows_are_valid_jobs_newest_last_with_a_realistic_mix():
    import json
    import re
    from collections import Counter
    from datetime import UTC, datetime

    import msgspec

    from irisfed.bench.web import COPY_COLUMNS, LABEL_FILTER, STATE_FILTER, live_window, web_jobs
    from irisfed.shared.lifecycle import JobState
    from irisfed.shared.messages import JOB_ID_PATTERN, SubmitRequest

    total, newest = 20_000, datetime(2026, 12, 1, tzinfo=UTC)
    rows = [dict(zip(COPY_COLUMNS, row, strict=True)) for row in web_jobs(total, newest)]
    assert len({r["job_id"] for r in rows}) == total
    assert all(re.fullmatch(JOB_ID_PATTERN, r["job_id"]) for r in rows)
    assert rows[-1]["submitted_at"] == newest
    assert all(a["submitted_at"] <= b["submitted_at"] for a, b in zip(rows, rows[1:], strict=False))
    assert len({r["submitted_at"] for r in rows}) < total  # some share an instant: the cursor's tiebreak matters
    states = Counter(r["state"] for r in rows)
    assert set(states) == {s.value for s in JobState}
    live = {JobState.QUEUED, JobState.ASSIGNED, JobState.RUNNING}
    assert all(r["state"] in live for r in rows[-live_window(total):])
    assert not any(r["state"] in live for r in rows[:-live_window(total)])
    assert 0.05 < states[STATE_FILTER] / total < 0.15
    for r in rows[:500]:
        spec = msgspec.json.decode(r["spec"], type=SubmitRequest)  # what a submit would have stored
        assert json.loads(r["submit_reply"])["job_id"] == r["job_id"]
        assert (r["owner_peer_id"] is None) == (r["state"] in ("queued", "rejected", "unschedulable"))
        assert (r["exit_code"] == 0) == (r["state"] == "succeeded")
        assert spec.name and set(spec.labels) == {"team", "project", "env"}
    share = sum(1 for r in rows if json.loads(r["spec"])["labels"][LABEL_FILTER[0]] == LABEL_FILTER[1]) / total
    assert share == 1 / 8


def test_server_timing_header_is_read_back():
    from irisfed.bench.web import server_time_ms

    assert server_time_ms("app;dur=4.25") == 4.25
    assert server_time_ms("db;dur=1, app;desc=\"page\";dur=12") == 12.0
    assert server_time_ms("db;dur=1") is None
    assert server_time_ms(None) is None and server_time_ms("") is None


def test_event_counter_counts_events_however_the_stream_is_cut():
    from irisfed.bench.viewers import EventCounter
    from irisfed.services.web.live import RETRY_MS, Batch, sse_event, sse_lines

    stream = (f"retry: {RETRY_MS}\n\n" + sse_event("mode", {"live": True}) + ": keepalive\n\n"
              + sse_lines(Batch(jobs=("a", "b"), peers=True)) + sse_lines(Batch(all_jobs=True, resync=True))).encode()
    for cut in range(1, 24):
        counter = EventCounter()
        for i in range(0, len(stream), cut):
            counter.feed(stream[i:i + cut])
        assert counter.events == {"mode": 1, "jobs": 2, "peers": 1, "resync": 1}, cut
        assert counter.total == 5


def test_web_page_cases_read_one_page_newest_first():
    from irisfed.bench.web import PAGE, PageCase
    from irisfed.services.web.filters import JobFilter

    case = PageCase("state=failed", "j.state = $1", ("failed",), JobFilter(state="failed"), via_listing=False)
    assert case.bare_sql.endswith(
        f"FROM jobs j WHERE j.state = $1 ORDER BY j.submitted_at DESC, j.job_id DESC LIMIT {PAGE}")
    first = PageCase("first page", "", (), JobFilter()).bare_sql
    assert "WHERE" not in first
    # As the store reads it (migration 0011): newest first from job_listing, each job by key.
    assert first.endswith("FROM job_listing l JOIN jobs j ON j.job_id = l.job_id "
                          f"ORDER BY l.submitted_at DESC, l.job_id DESC LIMIT {PAGE}")


def test_web_section_is_registered_and_in_quick_runs():
    from irisfed.bench.run import SECTIONS, chosen_sections

    assert "web" in SECTIONS and "web" in chosen_sections(True, set(SECTIONS))


def test_stops_section_runs_after_logs_in_quick_runs_and_judges_only_what_it_timed():
    from irisfed.bench.run import SECTIONS, chosen_sections
    from irisfed.bench.stops import device_figure, stop_figures

    names = list(SECTIONS)
    assert names.index("stops") == names.index("logs") + 1
    assert "stops" in chosen_sections(True, set(SECTIONS))
    killed, term = stop_figures([0.012] * 8, [0.010] * 8, 8)
    assert (killed.value, killed.ratio, term.ratio, term.met) == (10.0, None, 1.2, True)
    assert stop_figures([0.030] * 3, [0.010] * 8, 8)[1].met is None  # most rounds untimed: not judged
    assert stop_figures([0.030] * 8, [0.010] * 8, 8)[1].met is False
    row = device_figure([1.02, 1.04], [1.0, 1.0], 300, "")
    assert round(row.value, 6) == 3.0 and row.met is True
    assert device_figure([1.2], [1.0], 300, "").met is False
    assert device_figure([1.0], [1.0], 300, "batch g0: 3 submits refused").met is None


def test_dashboard_responses_say_their_server_time():
    """The header the web section reads (services.web.app._Timed)."""

    from irisfed.bench.web import server_time_ms
    from irisfed.services.web.app import _Timed

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})

    sent = []

    async def send(message):
        sent.append(message)

    asyncio.run(_Timed(app)({"type": "http", "path": "/jobs"}, None, send))
    headers = dict(sent[0]["headers"])
    assert headers[b"content-type"] == b"text/plain"
    assert server_time_ms(headers[b"server-timing"].decode()) >= 0


def test_bench_filler_jobs_take_the_state_asked_for():
    """The scale section fills `jobs` with finished rows (a NewJob is a msgspec Struct)."""
    from irisfed.bench.sections import _bench_job
    from irisfed.shared.lifecycle import JobState

    queued, done = _bench_job(7), _bench_job(7, JobState.SUCCEEDED)
    assert (queued.state, done.state) == (JobState.QUEUED, JobState.SUCCEEDED)
    assert done.job_id != queued.job_id and done.priority == queued.priority


def test_tick_users_have_valid_config_and_every_tenth_a_quota_it_hits():
    """The fair-share tick figure's users: a config the services accept, every
    QUOTA_EVERY-th user capped at half of what its jobs ask, the others uncapped."""
    from irisfed.bench.sections import KINDS, QUOTA_EVERY, _tick_users
    from irisfed.tooling.federation import Peer, render_config

    jobs, count = 2000, 20
    users = _tick_users(count, jobs)
    assert [u["id"] for u in users] == [f"u{n}" for n in range(count)]
    capped = [u for u in users if "quota" in u]
    assert [u["id"] for u in capped] == [f"u{n}" for n in range(0, count, QUOTA_EVERY)]
    assert all(u["quota"] == {"cpu": jobs // count // 2} for u in capped)  # each job asks one cpu
    assert {u["weight"] for u in users} == {1.0, 2.0, 3.0, 4.0}
    render_config([Peer(f"p{i}", {"device_type": KINDS[i % 3]}, 10, "simulated") for i in range(3)],
                  users=users, local_cluster="p0")  # raises if the services would refuse it


def test_bench_jobs_belong_to_the_user_asked_for():
    """Rows inserted directly are stored as the router stores a user's submit."""
    from irisfed.bench.sections import _bench_job

    mine, theirs = _bench_job(7, user="u3"), _bench_job(7)
    assert (mine.user_id, mine.job_id) == ("u3", f"u3:{theirs.job_id}")
    assert theirs.user_id == "default" and ":" not in theirs.job_id
    assert mine.spec_hash == theirs.spec_hash and mine.priority == theirs.priority


class _EchoNats:
    """Just enough of a nats-py client for the load generator: a publish with a reply
    subject is answered at once on that subject, if someone subscribed to it."""

    def __init__(self) -> None:
        self.subs: dict[str, object] = {}
        self.published: list[tuple[str, str]] = []

    async def subscribe(self, subject, cb, **_):
        self.subs[subject.removesuffix("*")] = cb
        parent = self

        class Sub:
            async def unsubscribe(self):
                parent.subs.pop(subject.removesuffix("*"))
        return Sub()

    async def flush(self):
        pass

    async def publish(self, subject, body, reply=""):
        self.published.append((subject, reply))
        prefix = reply[:reply.rindex(".") + 1]

        class Msg:
            data, headers = b'{"disposition": "queue"}', None
        Msg.subject = reply
        asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(self.subs[prefix](Msg)))


def test_closed_loops_split_the_load_and_reply_to_each_clients_own_inbox():
    from irisfed.bench.deployment import is_ack
    from irisfed.bench.load import Client, closed_loops

    clients = [Client(_EchoNats(), f"p.submit.u{n}", f"_INBOX_user-u{n}") for n in range(4)]
    bodies = []

    def body(n, i):
        bodies.append((n, i))
        return b"{}"

    run = asyncio.run(closed_loops(clients, body, concurrency=8, total=40, check=is_ack))
    assert (run.done, run.errors, len(run.latencies)) == (40, 0, 40)
    assert sorted(bodies) == [(n, i) for n in range(4) for i in range(10)]
    for n, client in enumerate(clients):
        assert {subject for subject, _ in client.nc.published} == {f"p.submit.u{n}"}
        assert all(reply.startswith(f"_INBOX_user-u{n}.") for _, reply in client.nc.published)
