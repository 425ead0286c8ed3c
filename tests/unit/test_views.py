from services.cli.views import print_explain
from shared.explain import explanation
from shared.federation.router import PeerVerdict
from tests.infra.rows import job_row


def test_explain_lists_the_first_peers_and_counts_the_rest(capsys):
    verdicts = [PeerVerdict(f"g{i}", "match") for i in range(25)] + [PeerVerdict("home", "value_mismatch", "cpu")]
    job = job_row(reason="rule 3", explanation=explanation("router", "rule 3: reachable peers can host it", verdicts))
    print_explain(job, [])
    out = capsys.readouterr().out
    assert "g0" in out and "g9" in out and "g10" not in out
    assert "and 16 more peers: 15 can take it, 1 attribute value does not match" in out
