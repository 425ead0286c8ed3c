from irisfed.cli.views import print_explain
from irisfed.shared.explain import explanation
from irisfed.shared.federation.router import PeerVerdict
from tests.infra.rows import job_row


def test_explain_lists_the_first_peers_and_counts_the_rest(capsys):
    verdicts = [PeerVerdict(f"g{i}", "match") for i in range(25)] + [PeerVerdict("home", "value_mismatch", "cpu")]
    job = job_row(reason="rule 3", explanation=explanation("router", "rule 3: reachable peers can host it", verdicts))
    print_explain(job, [])
    out = capsys.readouterr().out
    assert "g0" in out and "g9" in out and "g10" not in out
    assert "and 16 more peers: 15 can take it, 1 attribute value does not match" in out


def test_peers_table_shows_each_backends_resources_free_over_total():
    from irisfed.cli.views import backend_resources

    one = [{"name": "main", "attributes": {}, "capacity": {"total": 4, "free": 2},
            "resources": {"gpu": {"total": 4, "free": 2}, "cpu": {"total": 8, "free": 5.5}}}]
    assert backend_resources(one) == "cpu 5.5/8, gpu 2/4"
    two = one + [{"name": "old", "attributes": {}, "capacity": {"total": 1, "free": 1}}]
    assert backend_resources(two) == "main: cpu 5.5/8, gpu 2/4; old: -"
    hostile = [{"name": "x", "resources": {"BAD[red]": {"total": 1, "free": 1}, "gpu": "nonsense"}}]
    assert backend_resources(hostile) == "-"
