"""What the pages show: bars, ages, peers, a job's spec, timeline and verdicts — read
defensively, with secrets left out."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from markupsafe import Markup

from irisfed.services.web import present
from irisfed.shared.federation.peer import Backend, FederationPeer
from irisfed.shared.resources import Amount
from tests.infra.rows import changelog_entry


@pytest.mark.parametrize("used, total, step", [
    (0, 8, 0), (1, 1000, 5), (4, 8, 50), (6, 8, 75), (999, 1000, 95), (8, 8, 100), (9, 8, 100), (3, 0, 0),
    (-1, 8, 0), (float("nan"), 8, 0),
])
def test_bars_come_in_five_percent_steps(used, total, step):
    assert present.bar_step(used, total) == step


def test_printed_strings_show_control_characters_as_escapes():
    assert present.visible("a\x1b[31mb\u202ec\x00") == "a\\x1b[31mb\\u202ec\\x00"
    assert present.visible("line\n\ttab") == "line\n\ttab"
    assert present.visible(Markup("<b>\x1b</b>")) == Markup("<b>\x1b</b>")  # ours, already safe
    assert present.visible(3) == 3


@pytest.mark.parametrize("seconds, shown", [(None, "-"), (4.6, "4s"), (119, "119s"), (600, "10m"),
                                            (3600 * 3 + 300, "3h 5m"), (86400 * 2 + 3600 * 4, "2d 4h"), (-3, "0s")])
def test_ages(seconds, shown):
    assert present.fmt_age(seconds) == shown


def test_peer_cards_show_slots_and_resources_used_free_and_total():
    peer = FederationPeer("gpu-west", (Backend("main", {"zone": ("a", "b")}, 8, 2,
                                               {"cpu": Amount(16, 4.5), "gpu": Amount(4, 4), "BAD NAME": Amount(1, 0)}),),
                          last_heartbeat_at=100.0, ttl_s=6)
    [card] = present.peer_cards([peer], now=102.0)
    assert card.reachable and card.heard and card.age == "2s"
    backend = card.backends[0]
    assert backend.attributes == [("zone", "a|b")]
    assert (backend.slots.used, backend.slots.free, backend.slots.total, backend.slots.step) == ("6", "2", "8", 75)
    assert [(b.name, b.used, b.free, b.total, b.step) for b in backend.resources] == [
        ("cpu", "11.5", "4.5", "16", 70), ("gpu", "0", "4", "4", 0)]  # an invalid resource name is left out
    [never] = present.peer_cards([FederationPeer("never", ttl_s=6)], now=102.0)
    assert not never.reachable and not never.heard and never.age == "-"


def test_a_spec_shows_env_names_never_values_and_redacts_urls():
    spec = {"command": ["psql", "postgresql://u:pw@db/x", 7], "env": {"B_TOKEN": "s3cret", "A": "x"},
            "labels": {"team": "ml"}, "constraints": [{"key": "zone", "op": "in", "value": ["a", "b"]},
                                                       {"key": "gpu", "op": "exists"}, "junk"],
            "resources": {"cpu": 2}, "priority": 5}
    view = present.spec_view(spec)
    assert view.env_names == ["A", "B_TOKEN"] and "s3cret" not in repr(view)
    assert view.command == ["psql", "postgresql://u:***@db/x", "7"]
    assert view.constraints == ["zone in a|b", "gpu exists", "junk"]
    assert view.labels == [("team", "ml")] and view.resources == [("cpu", "2")] and view.priority == "5"
    assert present.spec_view("not a mapping").command == []
    assert present.spec_view({"command": "oops", "env": ["x"], "labels": 3}).env_names == []


def test_the_timeline_has_one_step_per_changelog_entry():
    at = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
    steps = present.timeline([
        changelog_entry(seq=1, at=at, detail="submitted"),
        changelog_entry(seq=2, from_state="queued", to_state="assigned", peer_id="gpu", epoch=1, actor="tick",
                        at=at + timedelta(seconds=1.5), detail="placed"),
        changelog_entry(seq=3, from_state="assigned", to_state="running", peer_id="gpu", epoch=1, actor="gpu",
                        at=at + timedelta(minutes=5), detail="token=nats://u:pw@h:4222"),
    ])
    assert [(s.from_state, s.to_state, s.peer, s.offset) for s in steps] == [
        ("new", "queued", "-", "+0.000s"), ("queued", "assigned", "gpu", "+1.500s"), ("assigned", "running", "gpu", "+5m")]
    assert steps[2].detail == "token=nats://u:***@h:4222"
    assert present.timeline([]) == []


def test_explanations_are_read_defensively():
    why = present.explained({"by": "tick", "rule": "r", "peers": [
        {"peer_id": "a", "code": "match", "detail": ""},
        {"peer_id": "b", "code": "insufficient_resources", "detail": "d",
         "short": [{"resource": "gpu", "asked": 8, "available": 4, "backend": "main"}, "junk"]},
        "junk", {"code": "made_up"}], "more": {"unreachable": 2, "bad": "x"}})
    assert [(v.peer_id, v.meaning, v.match) for v in why.verdicts] == [
        ("a", "can take it", True), ("b", "too small for it, even when empty", False), ("", "made_up", False)]
    assert why.verdicts[1].short == ["gpu: asked 8, 4 available on main"]
    assert why.more == [("unreachable", 2)]
    assert present.explained(None) == present.Explained("", "", [], [], "")
    assert present.explained({"peers": "x", "more": []}).verdicts == []


def test_list_cells():
    assert present.command_line(["echo", "x" * 200], 20) == "echo " + "x" * 14 + "…"
    assert present.command_line(None) == "" and present.command_line({"a": 1}) == "{'a': 1}"
    assert present.label_pairs({"b": 1, "a": "x"}) == [("a", "x"), ("b", "1")] and present.label_pairs([]) == []
    assert present.path_part("a/b?c") == "a%2Fb%3Fc"
